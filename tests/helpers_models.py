"""Small real-architecture models made in the tests: a random-weight Llama with a trained byte-level
BPE tokenizer, a chat template and EOS <|im_end|> (what a user's Hugging Face model looks like)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENTENCES = [
    "What is 64 + 57? Reply with only the number.",
    "The quick brown fox jumps over the lazy dog.",
    "To find the sum we add the two numbers together: 64 + 57 = 121.",
    "Count the letters in the word strawberry.",
] * 20


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def make_tiny_llama(src: Path) -> Path:
    """Save a tiny random LlamaForCausalLM (hidden 64, 2 layers) with its BPE tokenizer at `src`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id)
    model.save_pretrained(src)
    fast.save_pretrained(src)
    return src
