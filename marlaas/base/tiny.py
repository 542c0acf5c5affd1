"""The tiny local base model: a character tokenizer and a Qwen2-architecture causal LM.

No model can be downloaded on the machines this project targets, so the project builds its own
base: a character-level tokenizer (WordLevel over single characters, left padding) and a small
Qwen2ForCausalLM, saved as an ordinary Hugging Face directory that transformers, PEFT and vLLM all
load. Pretraining on the built-in task families lives in `marlaas.base.pretrain`.

Invariant: the build is deterministic for a given preset and seed.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
# Every character a prompt or answer of the built-in families (and typical user data) uses.
CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " :=+-*/<>()[],.?!_'\"#%&|^~;{}\n"


@dataclass(frozen=True)
class ModelPreset:
    """Size of a tiny Qwen2 model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    positions: int


PRESETS: dict[str, ModelPreset] = {
    # ~1M parameters: the CPU default.
    "default": ModelPreset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512, positions=128),
    # ~0.1M parameters: tests.
    # head size 32: vLLM's CPU attention supports no smaller head.
    "test": ModelPreset(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, positions=64),
}


def build_tokenizer():
    """A character-level fast tokenizer with left padding and an EOS token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, BOS, UNK, *CHARSET])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
    )
    return fast


def build_config(preset: str = "default", vocab_size: int | None = None):
    """A Qwen2 config for the named preset."""
    from transformers import Qwen2Config

    p = PRESETS[preset]
    tok_vocab = vocab_size if vocab_size is not None else 4 + len(CHARSET)
    return Qwen2Config(
        vocab_size=tok_vocab,
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        torch_dtype="float32",
    )


def init_model(preset: str = "default", seed: int = 0):
    """A freshly initialised (untrained) tiny model and its tokenizer, deterministic for the seed."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = build_config(preset, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def save(model, tokenizer, out_dir: Path) -> Path:
    """Save as an ordinary HF directory (safetensors weights, tokenizer files)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(base_path: str | Path):
    """The tokenizer a model directory was saved with.

    A directory whose tokenizer_config.json names a generic fast tokenizer ("TokenizersBackend",
    "PreTrainedTokenizerFast", or nothing) is loaded from tokenizer.json exactly as saved; anything
    else goes through AutoTokenizer. Left padding; pad falls back to EOS.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(base_path)
    cfg_file = path / "tokenizer_config.json"
    cls = json.loads(cfg_file.read_text()).get("tokenizer_class") if cfg_file.exists() else None
    generic = cls is None or cls.removesuffix("Fast") in ("TokenizersBackend", "PreTrainedTokenizer")
    if generic and (path / "tokenizer.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
