"""Side by side: the same jobs run one after another synchronously, then all at once asynchronously.

    .venv/bin/python bench/throughput.py --tenants 1,2,4,8 --steps 8 --out results/throughput.json

Both runs go through the same code and the same warm worker processes (one private stack started from
the Procfile lines): *sequential* submits job i+1 when job i is done, each with max_staleness 0 (no
stage overlap inside a job either); *marlaas* submits every job at once with max_staleness S.
Per N: makespans, speedup, samples/s, each station's busy fraction from the event log, and the
*ceiling*: the best makespan this machine allows for the sequential run's measured work, given that
each station is one process and the machine has `cores` cores:
    ceiling_makespan = max(busy_generate, busy_verify, busy_train, (sum of busy) / cores)
    ceiling_speedup  = sequential_makespan / ceiling_makespan
(the arithmetic is written into the JSON). Compute-only workload (built-in single-turn tasks).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from marlaas.client import Client
from marlaas.embedded import Stack, wait_for_workers
from marlaas.pretrain import ensure_base
from marlaas.settings import get_settings
from marlaas.spec import JobSpec
from marlaas.store import Store
from marlaas.timeline import STATIONS, busy_fractions, union_length

TASKS = ("sort", "reverse", "max", "code", "min", "add")


def specs(n: int, steps: int, staleness: int, tag: str) -> list[JobSpec]:
    return [JobSpec(tenant=f"{tag}{i}", task=TASKS[i % len(TASKS)], steps=steps, group_size=8, prompts_per_step=8,
                    max_staleness=staleness, seed=i, eval_size=32) for i in range(n)]


def measure(store: Store, t0: float, t1: float) -> dict:
    ev = store.events(since=t0)
    busy_s = {s: round(union_length([(e["start"], e["end"]) for e in ev if e["station"] == s], t0, t1), 2)
              for s in STATIONS}
    return {"makespan_s": round(t1 - t0, 2), "busy_s": busy_s, "busy_fraction": busy_fractions(ev, t0, t1)}


def run_sequential(client: Client, n: int, steps: int) -> dict:
    t0 = time.time()
    for s in specs(n, steps, 0, "seq"):
        st = client.submit(s).wait(timeout=3600)
        assert st["status"] == "done", st
    return measure(client.store, t0, time.time())


def run_marlaas(client: Client, n: int, steps: int, staleness: int) -> dict:
    t0 = time.time()
    jobs = [client.submit(s) for s in specs(n, steps, staleness, "async")]
    finals = [j.wait(timeout=3600) for j in jobs]
    assert all(f["status"] == "done" for f in finals), finals
    out = measure(client.store, t0, time.time())
    out["final_acc"] = [f["final_acc"] for f in finals]
    out["base_acc"] = [f["base_acc"] for f in finals]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/throughput.json"))
    a = ap.parse_args()
    home = get_settings().home
    base = a.base or ensure_base(home / "base", preset="default", seed=0, progress=True)
    cores = os.cpu_count() or 1
    stack = Stack(env={"MARLAAS_BASE": str(base)}, log_dir=home / "bench-logs")
    rows = []
    try:
        stack.start("redis", "control", "generate", "verify", "train", "beat")
        wait_for_workers(Store(stack.url), timeout=300)
        client = Client(stack.url)
        client.submit(specs(1, 2, 0, "warmup")[0]).wait(timeout=600)  # engines warm before timing
        for n in [int(x) for x in a.tenants.split(",")]:
            seq = run_sequential(client, n, a.steps)
            asy = run_marlaas(client, n, a.steps, a.staleness)
            b = seq["busy_s"]
            ceiling_makespan = max(*b.values(), sum(b.values()) / cores)
            samples = n * a.steps * 8 * 8
            row = {
                "tenants": n,
                "sequential": seq,
                "marlaas": asy,
                "speedup": round(seq["makespan_s"] / asy["makespan_s"], 3),
                "samples_per_s": {"sequential": round(samples / seq["makespan_s"], 1),
                                  "marlaas": round(samples / asy["makespan_s"], 1)},
                "ceiling": {
                    "formula": "max(busy_generate, busy_verify, busy_train, sum(busy) / cores) of the sequential run",
                    "cores": cores,
                    "ceiling_makespan_s": round(ceiling_makespan, 2),
                    "ceiling_speedup": round(seq["makespan_s"] / ceiling_makespan, 3),
                },
            }
            row["fraction_of_ceiling"] = round(row["speedup"] / row["ceiling"]["ceiling_speedup"], 3)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("tenants", "speedup", "fraction_of_ceiling")}
                             | {"ceiling_speedup": row["ceiling"]["ceiling_speedup"],
                                "makespans": (seq["makespan_s"], asy["makespan_s"])}), flush=True)
    finally:
        stack.stop()
    out = {
        "command": f"bench/throughput.py --tenants {a.tenants} --steps {a.steps} --staleness {a.staleness}",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": cores},
        "workload": {"kind": "compute-only", "group_size": 8, "prompts_per_step": 8, "max_new_tokens": 8,
                     "eval_size": 32, "engine": get_settings().engine},
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
