"""The vLLM engine on a real pretrained model (SmolLM2-135M-Instruct) on this CPU: it starts with
limits derived from the model and the host (never a KV cache larger than the host), serves a LoRA
adapter, and its greedy chat answer equals the hf engine's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Run in a child process: vLLM edits the process environment (threads, LD_PRELOAD, spawn method).
SCRIPT = r"""
import json, sys, torch
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from marlaas.adapters import blob_from_peft
from marlaas.generate.factory import make_engine
from marlaas.generate.vllm import _engine_limits
from marlaas.generate.limits import host_available_bytes
from marlaas.types import AdapterRef, GenRequest

base = Path(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
with torch.no_grad():
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.02)
blob = blob_from_peft(peft)
del peft, model
tok = AutoTokenizer.from_pretrained(base)
prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                 add_generation_prompt=True)
ref = AdapterRef("j1", 1)
reqs = [GenRequest(key="base", prompt=prompt, adapter=None, greedy=True, max_new_tokens=24),
        GenRequest(key="lora", prompt=prompt, adapter=ref, greedy=True, max_new_tokens=24)]
out = {"limits": _engine_limits(base, 8, 256), "host": host_available_bytes()}
for kind in ("hf", "vllm"):
    kw = {"max_num_seqs": 8, "max_model_len": 256} if kind == "vllm" else {}
    eng = make_engine(kind, base, lambda r: blob, threads=1, **kw)
    res = eng.generate(reqs)
    out[kind] = {r.key: {"text": r.completions[0].text, "finished": r.completions[0].finished,
                         "n": len(r.completions[0].token_ids)} for r in res}
    out[kind + "_serves"] = eng.serves(ref)
    eng.close()
print("RESULT " + json.dumps(out))
"""


def test_vllm_engine_runs_smollm2_like_the_hf_engine(smollm2_base):
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(smollm2_base)], capture_output=True, text=True,
                          timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    lim = out["limits"]
    assert lim["max_model_len"] == 256 and lim["kv_cache_bytes"] <= out["host"] // 4
    assert out["vllm_serves"] and out["hf_serves"]
    for key in ("base", "lora"):
        assert out["vllm"][key]["text"] == out["hf"][key]["text"], (key, out)
    assert "Paris" in out["hf"]["base"]["text"] and out["hf"]["base"]["finished"]  # stopped at <|im_end|>
