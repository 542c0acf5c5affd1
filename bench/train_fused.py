"""Fused vs sequential multi-tenant training steps on the deployment's base model (CPU).

For n = 1, 2, 4, 8 jobs (LoRA r=16 on all linear layers, AdamW, each job `--prompts` x `--group`
samples of `--tokens` completion tokens, advantages +-1), one round of steps is timed two ways on
the same `TrainingEngine`:

- sequential: `step(engine, job)` for each job, one after another (what the trainer lane does now);
- fused: one `step_fused(engine, jobs)` (one forward/backward, per-row adapter routing,
  `marlaas.train.step`).

Every job is warmed up first (its adapter is created by a version-0 step), the two ways alternate,
and each figure is the median of `--reps` rounds. Reported per n: seconds per round, samples/s, and
`fused_speedup` = sequential_s / fused_s (> 1: fusing is faster). The base is the settings' base
(`MARLAAS_BASE`, else `$MARLAAS_HOME/base`, built with the default preset if missing).

    python bench/train_fused.py --out results/train_fused.json [--jobs 1,2,4,8] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path


def _samples(rnd: random.Random, n: int, tokens: int):
    from marlaas.train.engine import TrainSample

    out = []
    for i in range(n):
        prompt = "sort: " + " ".join(str(rnd.randint(0, 9)) for _ in range(rnd.randint(3, 6))) + " ="
        comp = [rnd.randint(4, 30) for _ in range(tokens)]
        out.append(TrainSample(prompt, comp, [-2.0] * tokens, advantage=1.0 if i % 2 else -1.0))
    return out


def run(args) -> dict:
    import torch

    from marlaas.base.pretrain import ensure_base
    from marlaas.settings import get_settings
    from marlaas.spec import JobSpec, LoraSpec, RLSpec
    from marlaas.train.engine import TrainingEngine
    from marlaas.train.step import step, step_fused

    settings = get_settings()
    base = ensure_base(settings.base_path, preset=settings.base_preset, progress=False, threads=args.threads)
    ns = [int(x) for x in args.jobs.split(",")]
    engine = TrainingEngine(base, threads=args.threads, cache_size=max(ns))
    rnd = random.Random(0)
    per_job = args.prompts * args.group
    specs = {
        f"job{i}": JobSpec.model_construct(task="sort", lora=LoraSpec(rank=16), rl=RLSpec(), seed=i,
                                           learning_rate=1e-3, temperature=1.0)
        for i in range(max(ns))
    }  # fmt: skip
    version = {j: 0 for j in specs}
    for j, spec in specs.items():  # warm-up: creates every adapter and optimiser state
        step(engine, j, 0, spec, _samples(rnd, per_job, args.tokens), None)
        version[j] = 1
    rows = []
    for n in ns:
        jobs = list(specs)[:n]
        seq, fus = [], []
        for _ in range(args.reps):
            batch = {j: _samples(rnd, per_job, args.tokens) for j in jobs}
            t0 = time.perf_counter()
            for j in jobs:
                step(engine, j, version[j], specs[j], batch[j], None)
                version[j] += 1
            seq.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs = step_fused(engine, [(j, version[j], specs[j], batch[j], None) for j in jobs])
            fus.append(time.perf_counter() - t0)
            assert n == 1 or all(o.metrics.get("fused_jobs") == n for o in outs)
            for j in jobs:
                version[j] += 1
        s, f = statistics.median(seq), statistics.median(fus)
        row = {
            "jobs": n, "samples_per_job": per_job, "completion_tokens": args.tokens,
            "sequential_s": round(s, 4), "fused_s": round(f, 4),
            "sequential_samples_per_s": round(n * per_job / s, 1), "fused_samples_per_s": round(n * per_job / f, 1),
            "fused_speedup": round(s / f, 3), "sequential_all_s": [round(x, 4) for x in seq],
            "fused_all_s": [round(x, 4) for x in fus],
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    n_params = sum(p.numel() for p in engine.base.parameters())
    return {
        "benchmark": "train_fused",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "base_params": n_params,
        "threads": args.threads,
        "reps": args.reps,
        "note": "n=1 'fused' is the solo step (step_fused falls back); speedup > 1 means fusing is faster",
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/train_fused.json")
    ap.add_argument("--jobs", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
