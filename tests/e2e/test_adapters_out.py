"""An exported adapter works outside marlaas: plain PEFT and plain vLLM reproduce the service's outputs.

One small job runs through the real worker stack; its final adapter is downloaded as a PEFT directory.
The service keeps its own held-out greedy outputs with every evaluation (`metrics()["evals"][v]
["outputs"]`). Loading the directory with nothing but `PeftModel.from_pretrained` (and, in a
separate process, with a plain `vllm.LLM(enable_lora=True)` + `LoRARequest`) and generating greedily
from the same prompts must give the same texts.

Only the tokenizer comes from marlaas (`basemodel.load_tokenizer`): the tiny base's character
tokenizer must be loaded from its tokenizer.json as saved (AutoTokenizer builds Qwen2Tokenizer for it
and drops spaces), so vLLM gets prompt token ids and its output ids are decoded here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlaas import JobSpec
from marlaas.api.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3

# Part (b) runs in its own interpreter: vLLM edits the process environment (LD_PRELOAD, thread
# variables) and only one in-process engine should live in a process.
VLLM_SCRIPT = r"""
import json, sys
from pathlib import Path

base, adapter, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.loads(sys.stdin.read())

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from marlaas.base.tiny import load_tokenizer

tok = load_tokenizer(base)
cfg = json.loads((Path(base) / "config.json").read_text())
gen_cfg = json.loads((Path(base) / "generation_config.json").read_text())
eos = gen_cfg.get("eos_token_id", tok.eos_token_id)
eos = sorted({*([eos] if isinstance(eos, int) else eos), tok.eos_token_id})
llm = LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=1,
          max_num_seqs=16, max_model_len=cfg["max_position_embeddings"], kv_cache_memory_bytes=64 << 20,
          enforce_eager=True, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=eos, detokenize=False)
outs = llm.generate([{"prompt_token_ids": ids} for ids in tok(prompts)["input_ids"]], params,
                    lora_request=LoRARequest("x", 1, adapter), use_tqdm=False)
texts = []
for out in outs:
    ids = list(out.outputs[0].token_ids)
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    texts.append(tok.decode(ids, skip_special_tokens=True))
print("RESULT " + json.dumps(texts))
"""


@pytest.fixture(scope="module")
def exported(worker_stack, tmp_path_factory):
    """(spec, the service's held-out outputs of the final version, the downloaded adapter dir)."""
    # 8 groups of 8 a step: on the test base some group of `max` gets mixed rewards (4 x 4 could see
    # none in 3 steps: every step a noop, the adapter untrained, the comparisons below vacuous)
    spec = JobSpec(tenant="export", task="max", steps=STEPS, prompts_per_step=8, group_size=8, eval_size=8,
                   learning_rate=1e-2, seed=3)
    t0 = time.time()
    job = Client(worker_stack.url).submit(spec)
    st = job.wait(timeout=300)
    print(f"job {job.id}: {time.time() - t0:.1f} s")
    assert st["status"] == "done", st
    assert any(not m["noop"] for m in job.metrics()["steps"]), "no step had a group with mixed rewards"
    outputs = job.metrics()["evals"][STEPS]["outputs"]
    assert len(outputs) == spec.eval_size
    out_dir = job.download_adapter(tmp_path_factory.mktemp("adapter") / "export-max")
    return spec, outputs, out_dir


def test_adapter_dir_is_a_trained_peft_adapter(exported, tiny_base):
    from safetensors.torch import load_file

    _, _, out_dir = exported
    cfg = json.loads((out_dir / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert Path(cfg["base_model_name_or_path"]) == tiny_base
    weights = load_file(out_dir / "adapter_model.safetensors")
    # LoRA B starts at zero: a trained adapter has moved it, else the comparison below is vacuous.
    assert any(float(w.abs().max()) > 0 for k, w in weights.items() if "lora_B" in k)


def test_plain_peft_reproduces_service_outputs(exported, tiny_base):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marlaas.base.tiny import load_tokenizer

    spec, outputs, out_dir = exported
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32),
                                      str(out_dir))
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = sorted({*([eos] if isinstance(eos, int) else (eos or [])), tok.eos_token_id})
    texts = []
    with torch.inference_mode():
        for row in outputs:
            enc = tok(row["prompt"], return_tensors="pt")
            seq = model.generate(**enc, do_sample=False, max_new_tokens=spec.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
            if seq and seq[-1] in eos:
                seq = seq[:-1]
            texts.append(tok.decode(seq, skip_special_tokens=True))
    assert texts == [r["text"] for r in outputs], _diff(outputs, texts)


def test_plain_vllm_reproduces_service_outputs(exported, tiny_base):
    pytest.importorskip("vllm")
    spec, outputs, out_dir = exported
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(tiny_base), str(out_dir), str(spec.max_new_tokens)],
        input=json.dumps([r["prompt"] for r in outputs]), capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    texts = json.loads(lines[-1][len("RESULT "):])
    assert texts == [r["text"] for r in outputs], _diff(outputs, texts)


def _diff(outputs: list[dict], texts: list[str]) -> str:
    return "\n".join(f"{r['prompt']!r}: service {r['text']!r} != here {t!r}"
                     for r, t in zip(outputs, texts) if r["text"] != t)
