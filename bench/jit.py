"""Just-in-time generation (MARLAAS_GEN_JIT_JOBS) in the cluster simulator: where it helps, where not.

    .venv/bin/python bench/jit.py --out results/jit_sim.json

The real scheduler policy (`scheduler.plan`) over simulated time (bench/sim_engine.py), n identical
tenants at max_staleness 2, with groups generated ahead as far as the bound allows (jit 0, the
default) and just in time from 2 jobs training on (jit 2), on three deployments of the cost models:
- `h200_separate`: 8 or 128 H200s, one trainer lane, the rest generate workers (bench/simulate.py);
- `h200_one_device`: generate and train sharing one H200 with MARLAAS_GEN_MIN_FILL 0.9
  (bench/project_gpu.py);
- `cpu_tiny`: the CPU machine's Procfile on the tiny model (fitted to results/throughput.json).
Per cell: the makespan, the speedup over sequential synchronous (one tenant after another at
staleness 0; the same for both settings) and the histogram of trained staleness.
The real-model measurement of the same setting is bench/real.py (`--jit-jobs 2`, results/real_2026-12-04.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.costmodel import cpu_workload, fit_cpu, h200_params, h200_workload, load_throughput  # noqa: E402
from bench.project_gpu import cpu_cluster, h200_cluster  # noqa: E402
from bench.sim_engine import Cluster, simulate  # noqa: E402


def cell(p, w, n: int, c: Cluster) -> dict:
    seq = simulate(p, w, n, c, "sequential").makespan_s
    out = {"tenants": n}
    for jit in (0, 2, "auto"):
        r = simulate(p, w, n, replace(c, jit_jobs=jit), "marlaas")
        assert r.violations == 0, "a simulated step trained on a too-stale rollout"
        out[f"jit_{jit}"] = {"makespan_s": round(r.makespan_s, 3), "speedup": round(seq / r.makespan_s, 3),
                             "staleness_hist": {str(k): v for k, v in r.staleness_hist.items()}}
        if jit == "auto":
            out[f"jit_{jit}"]["on_share"] = round(r.jit_on_s / r.makespan_s, 3)
    out["jit_gain"] = round(out["jit_0"]["makespan_s"] / out["jit_2"]["makespan_s"], 3)
    # the automatic choice against the better of the two fixed settings (1.0: as good as hand-tuning)
    best = min(out["jit_0"]["makespan_s"], out["jit_2"]["makespan_s"])
    out["auto_vs_best"] = round(best / out["jit_auto"]["makespan_s"], 3)
    h = out["jit_auto"]["staleness_hist"]
    out["auto_fresh_share"] = round(h.get("0", 0) / max(1, sum(h.values())), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("results/jit_sim.json"))
    a = ap.parse_args()
    t0 = time.time()
    hp, hw = h200_params(), h200_workload(a.steps)
    tp = load_throughput()
    cp, cw = fit_cpu(tp), cpu_workload(tp)
    deployments = {
        "h200_separate_8": (hp, hw, Cluster(gen_workers=7, verify_slots=32, train_lanes=1, batch_rows=2048),
                            (2, 8, 32)),
        "h200_separate_128": (hp, hw, Cluster(gen_workers=127, verify_slots=512, train_lanes=1, batch_rows=2048),
                              (32, 320)),
        "h200_one_device": (hp, hw, h200_cluster(), (2, 8, 32)),
        "cpu_tiny": (cp, cw, cpu_cluster(tp["machine"]["cores"]), (2, 8, 32)),
    }
    out = {"command": f".venv/bin/python bench/jit.py --steps {a.steps} --out {a.out}", "cells": {}}
    for name, (p, w, c, ns) in deployments.items():
        out["cells"][name] = [cell(p, w, n, c) for n in ns]
        for r in out["cells"][name]:
            print(name, json.dumps({k: r[k] for k in ("tenants", "jit_gain", "auto_vs_best", "auto_fresh_share")}),
                  flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
