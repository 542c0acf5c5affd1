"""Cluster simulation: the real scheduler policy over simulated time, 32..1,000 tenants on 8..256 GPUs.

    .venv/bin/python bench/simulate.py --out results/simulate.json
    .venv/bin/python bench/simulate.py --measure-tick --out results/simulate.json   # re-measure the tick

Cost parameters: bench/costmodel.py `h200_params` (published figures or results/gpu_check.json).
A cluster of `gpus` GPUs runs `lanes` trainer lanes (one GPU each) and gpus - lanes generate workers
(one GPU each, no sharing), verify on 4 host cores per GPU, batches of up to 2,048 rows.
- marlaas: every tenant at once, staleness 2, the real `scheduler.plan` (bench/sim_engine.py).
- sequential synchronous: one tenant at a time, staleness 0, its step's rows split evenly over the
  generate workers (batch_rows = P*G / workers, so the baseline uses the whole cluster). Tenants are
  identical and each starts from an empty system, so sequential makespan = n x one tenant's
  (simulated once).
Saturation: the trainer lane is saturated when its busy fraction >= 0.95 (then speedup grows with
tenants no more). Capacities in steps/s, from the same cost functions:
    lane_capacity = 1 / train_s
    generate_capacity = gen_workers / (generate_s(batch of 2,048 rows) / (2048 / (P*G)))
    lanes_needed = ceil(generate_capacity / lane_capacity)
The scheduler tick at 1,000 tenants (`tick_ms_1000_tenants`) is read from results/tick.json
(bench/tick.py), or measured with an embedded Redis when --measure-tick is given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.costmodel import RESULTS, h200_params, h200_workload  # noqa: E402
from bench.sim_engine import Cluster, simulate  # noqa: E402

BATCH_ROWS = 2048
SATURATED = 0.95


def cluster(gpus: int, lanes: int, batch_rows: int = BATCH_ROWS) -> Cluster:
    if gpus <= lanes:
        raise ValueError(f"{gpus} GPUs leave no generate worker beside {lanes} trainer lanes")
    return Cluster(gen_workers=gpus - lanes, verify_slots=4 * gpus, train_lanes=lanes, batch_rows=batch_rows)


def capacities(p, w, gpus: int, lanes: int) -> dict:
    rows_step = w.groups_per_step * w.group_size
    per_batch = BATCH_ROWS // rows_step
    gen_s = p.generate_s(w, BATCH_ROWS, w.groups_per_step * per_batch, per_batch, per_batch)
    gen_cap = (gpus - lanes) * per_batch / gen_s
    lane_cap = 1.0 / p.train_s(w)
    return {"generate_steps_per_s": round(gen_cap, 3), "lane_steps_per_s": round(lane_cap, 3),
            "lanes_needed": math.ceil(gen_cap / lane_cap)}


def run_cell(p, w, n: int, gpus: int, lanes: int, seq_one: float) -> dict:
    r = simulate(p, w, n, cluster(gpus, lanes), "marlaas")
    assert r.violations == 0
    seq = n * seq_one
    return {"tenants": n, "gpus": gpus, "lanes": lanes, "makespan_s": round(r.makespan_s, 2),
            "sequential_makespan_s": round(seq, 2), "speedup": round(seq / r.makespan_s, 3),
            "steps_per_s": round(r.steps_trained / r.makespan_s, 3),
            "train_busy": round(r.task_s["train"] / (lanes * r.makespan_s), 4),  # mean over lanes
            "generate_utilization": round(r.task_s["generate"] / ((gpus - lanes) * r.makespan_s), 4),
            "max_staleness": r.max_staleness, "ticks": r.ticks}


def tick_figure(measure: bool) -> dict:
    if measure:
        from bench.tick import measure_tick
        from marlaas.ops.embedded import Stack

        stack = Stack()
        stack.start("redis")
        try:  # a running service's tick, its messages published through Celery
            m = measure_tick(1000, stack.url, case="steady", publish=True)
        finally:
            stack.stop()
        return {"tick_ms_1000_tenants": m["tick_ms_median"], "tick_case": "steady",
                "source": "measured now (bench/tick.measure_tick, messages published)"}
    path = RESULTS / "tick.json"
    if not path.exists():
        return {"tick_ms_1000_tenants": None, "source": "results/tick.json missing: run bench/tick.py"}
    data = json.loads(path.read_text())
    if data.get("tick_ms_1000_tenants") is not None:  # the headline figure bench/tick.py wrote
        src = data.get("tick_ms_1000_tenants_from", "")
        return {"tick_ms_1000_tenants": data["tick_ms_1000_tenants"], "source": f"results/tick.json [{src}]",
                "tick_case": data.get("tick_ms_1000_tenants_case", "expired"),
                "tick_ms_1000_tenants_all_leases_expired": data.get("tick_ms_1000_tenants_all_leases_expired"),
                "tick_command": data.get(src, {}).get("command")}
    sections = [(k, v) for k, v in data.items() if isinstance(v, dict) and "results" in v]
    sections.sort(key=lambda kv: kv[0] == "before")  # the latest code first, 'before' last
    for name, sec in sections:
        for r in sec["results"]:
            if r.get("n_tenants") == 1000:
                return {"tick_ms_1000_tenants": r["tick_ms_median"], "source": f"results/tick.json [{name}]",
                        "command": sec.get("command")}
    return {"tick_ms_1000_tenants": None, "source": "results/tick.json has no 1,000-tenant row"}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cells = out["cells"]
    for gpus in out["gpus"]:
        for lanes, style in ((1, "o-"), (2, "s--")):
            pts = [(c["tenants"], c["speedup"], c["train_busy"]) for c in cells
                   if c["gpus"] == gpus and c["lanes"] == lanes]
            if pts:
                a.plot([x for x, _, _ in pts], [y for _, y, _ in pts], style, label=f"{gpus} GPUs, {lanes} lane(s)")
                b.plot([x for x, _, _ in pts], [z for _, _, z in pts], style, label=f"{gpus} GPUs, {lanes} lane(s)")
    for ax, lab in ((a, "speedup vs sequential synchronous"), (b, "trainer lane busy fraction")):
        ax.set_xscale("log")
        ax.set_xlabel("tenants")
        ax.set_ylabel(lab)
    a.legend(fontsize=7)
    b.axhline(SATURATED, color="red", lw=0.8)
    fig.suptitle(f"cluster simulation ({out['params']['name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="32,100,320,1000")
    ap.add_argument("--gpus", default="8,32,128,256")
    ap.add_argument("--lanes", default="1,2")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--measure-tick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "simulate.json")
    a = ap.parse_args()
    t0 = time.time()
    p, w = h200_params(), h200_workload(a.steps)
    tenants = [int(x) for x in a.tenants.split(",")]
    gpus_l = [int(x) for x in a.gpus.split(",")]
    lanes_l = [int(x) for x in a.lanes.split(",")]
    cells, sat = [], []
    for gpus in gpus_l:
        for lanes in lanes_l:
            rows_step = w.groups_per_step * w.group_size
            per_worker = max(w.group_size, math.ceil(rows_step / (gpus - lanes) / w.group_size) * w.group_size)
            one = simulate(p, w, 1, cluster(gpus, lanes, per_worker), "sequential").makespan_s
            for n in tenants:
                c = run_cell(p, w, n, gpus, lanes, one)
                cells.append(c)
                print(json.dumps(c), flush=True)
            first = next((c["tenants"] for c in cells if c["gpus"] == gpus and c["lanes"] == lanes
                          and c["train_busy"] >= SATURATED), None)
            sat.append({"gpus": gpus, "lanes": lanes, "saturated_from_tenants": first} | capacities(p, w, gpus, lanes))
    out = {"command": f"bench/simulate.py --tenants {a.tenants} --gpus {a.gpus} --lanes {a.lanes} --steps {a.steps}",
           "date": time.strftime("%Y-%m-%d"), "params": p.as_dict(), "workload": w.__dict__,
           "gpus": gpus_l, "cells": cells, "saturation": sat, **tick_figure(a.measure_tick)}
    out["tick_within_10ms"] = (out["tick_ms_1000_tenants"] is not None and out["tick_ms_1000_tenants"] <= 10)
    out["wall_s"] = round(time.time() - t0, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    plot(out, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
