"""Does our sampler explore like transformers' own? Sampled success rate on a task's training prompts.

    .venv/bin/python bench/sampler_check.py --task lcm --seed 4 --prompts 64 --n 8 \\
        --out results/sampler_check_lcm.json

On SmolLM2-135M-Instruct (bench/real.py's base, its chat template and task configs; seed 4 is the lcm
job's seed in `bench/real.py --seed 1`), the first `--prompts` training rows of the job, `--n` samples
each at temperature 1 (no top-k, no top-p), `--max-new` tokens: once through the generate engine
(`HFEngine`, each row on its own seeded stream, `marlaas.generate.sampling.RowSampler`) and once through
transformers' `generate(do_sample=True)`, scored by the task's own verifier. Writes the share of
samples with full reward and the mean reward of each. A rare reward (lcm's base: about 1 in 100) is
where a biased sampler would show: a job learns only from the groups that hold one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="lcm")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch

    from bench.real import TASK_CONFIGS, prepare_base
    from marlaas.api.datasets_io import render_chat
    from marlaas.api.rows import job_rows
    from marlaas.generate.engine import eos_token_ids
    from marlaas.generate.hf import HFEngine
    from marlaas.spec import JobSpec
    from marlaas.types import GenRequest
    from marlaas.verify.verifiers import score_groups

    base, _ = prepare_base(argparse.Namespace(base=None, base_dir=None))
    spec = JobSpec(tenant="check", task=f"reasoning_gym:{a.task}", task_config=TASK_CONFIGS[a.task], steps=30,
                   group_size=4, prompts_per_step=4, max_new_tokens=a.max_new, eval_size=200, seed=a.seed,
                   chat_template=True)
    eng = HFEngine(base, lambda ref: None, threads=a.threads)
    tok = eng.tokenizer
    rows = render_chat(job_rows(spec)[0], tok)[:a.prompts]

    def scored(texts: list[list[str]]) -> dict:
        rewards = [x for s in score_groups(spec.verifier_name(), list(zip(rows, texts))) for x in s.rewards]
        return {"samples": len(rewards), "full_reward": sum(r >= 1 for r in rewards),
                "full_share": round(sum(r >= 1 for r in rewards) / len(rewards), 4),
                "mean_reward": round(sum(rewards) / len(rewards), 4)}

    t = time.time()
    got = eng.generate([GenRequest(key=str(i), prompt=r["prompt"], adapter=None, n=a.n, greedy=False, temperature=1.0,
                                   seed=1000 + i, max_new_tokens=a.max_new) for i, r in enumerate(rows)])
    ours = {**scored([[c.text for c in g.completions] for g in got]), "seconds": round(time.time() - t, 1)}
    print("ours", ours, flush=True)
    eos = eos_token_ids(tok, eng.model.generation_config)
    tok.padding_side = "left"
    torch.manual_seed(0)
    texts, t = [], time.time()
    for r in rows:
        enc = tok([r["prompt"]] * a.n, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = eng.model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=a.max_new, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        group = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            cut = next((k for k, x in enumerate(row) if x in eos), len(row))
            group.append(tok.decode(row[:cut], skip_special_tokens=True))
        texts.append(group)
    theirs = {**scored(texts), "seconds": round(time.time() - t, 1)}
    print("transformers", theirs, flush=True)
    res = {"command": f"bench/sampler_check.py --task {a.task} --seed {a.seed} --prompts {a.prompts} --n {a.n}"
                      f" --max-new {a.max_new}" + (f" --out {a.out}" if a.out else ""),
           "date": time.strftime("%Y-%m-%d"), "base": base.name, "temperature": 1.0,
           "ours": ours, "transformers": theirs}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
