"""Side by side: the same jobs run one after another synchronously, then all at once asynchronously.

    .venv/bin/python bench/throughput.py --tenants 1,2,4,8,16,32 --steps 8 --workloads compute,agentic \
        --trl --out results/throughput.json

Both runs go through the same code and the same warm worker processes (one private stack started from
the Procfile lines, with `--generate-workers` generate workers): *sequential* submits job i+1 when job
i is done, each with max_staleness 0 (no stage overlap inside a job either), and gives that lone job
the whole machine: its steps' groups spread over every idle generate worker and the trainer runs with
`--sync-train-threads` torch threads (default: the cores, what a single-process user would set);
*marlaas* submits every job at once with max_staleness S, one torch thread per process (the stations
share the cores). Every sequential row runs first, then every marlaas row (one trainer restart each
way, warmed by a short job); `lines` in the JSON says what each line had.
Workloads: *compute* (built-in single-turn tasks, cycling through `TASKS`) and *agentic* (the
multi-turn `calc` tool task; its calculator is the stack's `tool` process, a real local HTTP service
with the per-call latency `--tool-latency-ms` standing for a remote tool, the same in both runs).
Per N: makespans, speedup, samples/s, each station's busy time and fraction from the event log, the
trainer's idle gaps, and the *ceiling*: the best makespan this machine allows for the measured work.
Each station is one process, so a run cannot end before its busiest station has done its work, nor
before the machine's `cores` have done all stations' work together:
    ceiling_makespan(run) = max(busy_generate, busy_verify, busy_train, sum(busy) / cores)
The marlaas run's own busy times are the work it had to do (mixed batches make its generate work
smaller than the sequential run's), so
    ceiling_speedup    = sequential_makespan / ceiling_makespan(marlaas run)
    fraction_of_ceiling = speedup / ceiling_speedup = ceiling_makespan(marlaas) / marlaas_makespan
and `makespan_over_busiest` = marlaas makespan / its busiest station's busy time (target <= 1.15).
`train_busy_steady` is the trainer's busy fraction in the steady state (marlaas.ops.timeline.steady_window:
from the first train step to the end of the first job's last step, while every tenant still feeds it).
The arithmetic is written into the JSON. With `--trl`, `bench/trl_peer.py` runs TRL's GRPOTrainer on
the same compute-only jobs one after another (in a subprocess, after the stack is stopped) and the
JSON gains its makespans and our speedup over it. PNGs: the station timeline (Gantt) of the marlaas
run at N=8 and the speedup and ceiling against N (`--png-prefix`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from marlaas.api.client import Client
from marlaas.base.pretrain import ensure_base
from marlaas.ops.embedded import Stack, wait_for_workers
from marlaas.ops.timeline import STATIONS, busy_fractions, idle_gaps, steady_busy, steady_window, union_length
from marlaas.settings import get_settings
from marlaas.spec import JobSpec
from marlaas.store import Store

TASKS = ("sort", "reverse", "max", "code", "min", "add")
WORKLOAD_TASKS = {"compute": TASKS, "agentic": ("calc",)}


def specs(n: int, steps: int, staleness: int, tag: str, workload: str = "compute") -> list[JobSpec]:
    tasks = WORKLOAD_TASKS[workload]
    return [JobSpec(tenant=f"{tag}{i}", task=tasks[i % len(tasks)], steps=steps, group_size=8, prompts_per_step=8,
                    max_staleness=staleness, seed=i, eval_size=32, eval_k=0) for i in range(n)]


def measure(store: Store, t0: float, t1: float) -> dict:
    ev = store.events(since=t0)
    busy_s = {s: round(union_length([(e["start"], e["end"]) for e in ev if e["station"] == s], t0, t1), 2)
              for s in STATIONS}
    ev = [e for e in ev if t0 <= e["start"] <= t1]
    gaps = idle_gaps(ev, "train", t0, t1)
    window = steady_window(ev, "train")
    return {"makespan_s": round(t1 - t0, 2), "busy_s": busy_s, "busy_fraction": busy_fractions(ev, t0, t1),
            "train_busy_steady": steady_busy(ev, "train"),
            "train_steady_window_s": [round(w - t0, 2) for w in window] if window else None,
            "train_idle_gaps": {"count": len(gaps), "total_s": round(sum(gaps), 2),
                                "max_s": round(max(gaps, default=0.0), 3),
                                "median_s": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else 0.0},
            "events": [{k: e[k] for k in ("station", "start", "end")} | {"jobs": e.get("jobs", [])}
                       for e in ev]}


def trainer(stack: Stack, client: Client, threads: int, workloads: list[str]) -> None:
    """(Re)start the trainer with `threads` torch threads and warm every workload's code paths with a
    short job, so no timed run holds a model load."""
    stack.restart("train", env={"MARLAAS_THREADS": str(threads)})
    for wl in workloads:
        client.submit(specs(1, 2, 0, f"warmup{threads}-{wl}-", wl)[0]).wait(timeout=600)


def run_sequential(client: Client, n: int, steps: int, workload: str) -> dict:
    t0 = time.time()
    for s in specs(n, steps, 0, f"seq-{workload}-", workload):
        st = client.submit(s).wait(timeout=3600)
        assert st["status"] == "done", st
    return measure(client.store, t0, time.time())


def run_marlaas(client: Client, n: int, steps: int, staleness: int, workload: str) -> dict:
    t0 = time.time()
    jobs = [client.submit(s) for s in specs(n, steps, staleness, f"async-{workload}-", workload)]
    finals = [j.wait(timeout=3600) for j in jobs]
    assert all(f["status"] == "done" for f in finals), finals
    out = measure(client.store, t0, time.time())
    out["final_acc"] = [f["final_acc"] for f in finals]
    out["base_acc"] = [f["base_acc"] for f in finals]
    return out


def ceiling(run: dict, cores: int) -> tuple[float, str]:
    b = run["busy_s"]
    total = sum(b.values())
    value = max(*b.values(), total / cores)
    arithmetic = (f"max(generate {b['generate']}, verify {b['verify']}, train {b['train']}, "
                  f"sum {total:.2f} / {cores} cores) = {value:.2f} s")
    return value, arithmetic


def row_for(n: int, steps: int, seq: dict, asy: dict, cores: int) -> dict:
    if n != 8:  # the Gantt picture is drawn at N=8 only; elsewhere the events would just bloat the JSON
        seq.pop("events", None)
        asy.pop("events", None)
    c_makespan, arithmetic = ceiling(asy, cores)
    busiest = max(asy["busy_s"].values())
    samples = n * steps * 8 * 8
    row = {
        "tenants": n,
        "sequential": seq,
        "marlaas": asy,
        "speedup": round(seq["makespan_s"] / asy["makespan_s"], 3),
        "samples_per_s": {"sequential": round(samples / seq["makespan_s"], 1),
                          "marlaas": round(samples / asy["makespan_s"], 1)},
        "ceiling": {
            "formula": "max(busy_generate, busy_verify, busy_train, sum(busy) / cores) of the marlaas run",
            "arithmetic": arithmetic,
            "cores": cores,
            "ceiling_makespan_s": round(c_makespan, 2),
            "ceiling_speedup": round(seq["makespan_s"] / c_makespan, 3),
            "sequential_work_ceiling_speedup": round(seq["makespan_s"] / ceiling(seq, cores)[0], 3),
        },
        "makespan_over_busiest": round(asy["makespan_s"] / max(busiest, 1e-9), 3),
    }
    row["fraction_of_ceiling"] = round(row["speedup"] / row["ceiling"]["ceiling_speedup"], 3)
    return row


def save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def run_trl(tenants: str, steps: int, base: Path) -> dict:
    """bench/trl_peer.py in a subprocess (its own process, like any job-after-job trainer)."""
    out = get_settings().home / "trl_peer.json"
    cmd = [sys.executable, str(Path(__file__).with_name("trl_peer.py")), "--tenants", tenants, "--steps", str(steps),
           "--base", str(base), "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def plot(report: dict, prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for wl, rows in report["workloads"].items():
        ns = [r["tenants"] for r in rows]
        ax.plot(ns, [r["speedup"] for r in rows], "o-", label=f"{wl}: measured speedup")
        ax.plot(ns, [r["ceiling"]["ceiling_speedup"] for r in rows], "s--", label=f"{wl}: ceiling")
    if report.get("trl"):
        ns = [r["tenants"] for r in report["trl"]["rows"]]
        ax.plot(ns, [r["speedup_marlaas_over_trl"] for r in report["trl"]["rows"]], "^:",
                label="compute: marlaas over TRL job after job")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tenants (concurrent jobs)")
    ax.set_ylabel("speedup over sequential synchronous")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    ax.set_title(f"marlaas vs job after job ({report['machine']['cores']} CPU cores)")
    fig.tight_layout()
    path = Path(f"{prefix}_speedup.png")
    fig.savefig(path, dpi=110)
    written.append(str(path))
    for wl, rows in report["workloads"].items():
        r8 = next((r for r in rows if r["tenants"] == 8), None)
        if r8 is None:
            continue
        fig, axes = plt.subplots(2, 1, figsize=(10, 4), sharex=False)
        for ax, name in zip(axes, ("sequential", "marlaas")):
            ev = r8[name]["events"]
            t0 = min((e["start"] for e in ev), default=0.0)
            for y, st in enumerate(STATIONS):
                spans = [(e["start"] - t0, e["end"] - e["start"]) for e in ev if e["station"] == st]
                ax.broken_barh(spans, (y - 0.4, 0.8), color=f"C{y}")
            ax.set_yticks(range(len(STATIONS)), STATIONS)
            ax.set_title(f"{wl}, N=8, {name}: makespan {r8[name]['makespan_s']} s", fontsize=9)
        axes[-1].set_xlabel("seconds")
        fig.tight_layout()
        path = Path(f"{prefix}_gantt_{wl}_n8.png")
        fig.savefig(path, dpi=110)
        written.append(str(path))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--workloads", default="compute")
    ap.add_argument("--tool-latency-ms", type=int, default=200)
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer job after job (bench extra)")
    ap.add_argument("--generate-workers", type=int, default=2, help="generate workers of the stack (both lines)")
    ap.add_argument("--sync-train-threads", type=int, default=os.cpu_count() or 1,
                    help="the trainer's torch threads in the sequential line (the marlaas line: 1)")
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/throughput.json"))
    ap.add_argument("--png-prefix", type=Path, default=Path("results/throughput"))
    a = ap.parse_args()
    home = get_settings().home
    base = a.base or ensure_base(home / "base", preset="default", seed=0, progress=True)
    cores = os.cpu_count() or 1
    workloads = [w for w in a.workloads.split(",") if w]
    env = {"MARLAAS_BASE": str(base), "MARLAAS_TOOL_LATENCY_MS": str(a.tool_latency_ms)}
    stack = Stack(env=env, log_dir=home / "bench-logs")
    report = {
        "command": f"bench/throughput.py --tenants {a.tenants} --steps {a.steps} --staleness {a.staleness} "
                   f"--workloads {a.workloads} --tool-latency-ms {a.tool_latency_ms} --generate-workers "
                   f"{a.generate_workers} --sync-train-threads {a.sync_train_threads}" + (" --trl" if a.trl else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": cores, "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
        "workload": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 8, "eval_size": 32, "eval_k": 0,
                     "steps": a.steps, "engine": get_settings().engine, "tool_latency_ms": a.tool_latency_ms,
                     "tasks": {w: list(WORKLOAD_TASKS[w]) for w in workloads}},
        "lines": {"sequential": {"generate_workers": a.generate_workers, "train_threads": a.sync_train_threads,
                                 "threads_other_processes": 1, "max_staleness": 0},
                  "marlaas": {"generate_workers": a.generate_workers, "train_threads": 1,
                              "threads_other_processes": 1, "max_staleness": a.staleness}},
        "workloads": {},
    }
    try:
        stack.start(*[n for n in ("redis", "tool", "control", "generate", "verify", "beat") if n in stack.lines],
                    *stack.copies("generate", a.generate_workers))
        wait_for_workers(Store(stack.url), stations=("generate", "verify", "control"), timeout=300)
        client = Client(stack.url)
        ns = [int(x) for x in a.tenants.split(",")]
        trainer(stack, client, a.sync_train_threads, workloads)  # engines warm before timing
        seqs = {(wl, n): run_sequential(client, n, a.steps, wl) for wl in workloads for n in ns}
        trainer(stack, client, 1, workloads)
        for wl in workloads:
            rows = report["workloads"][wl] = []
            for n in ns:
                seq = seqs[wl, n]
                asy = run_marlaas(client, n, a.steps, a.staleness, wl)
                rows.append(row_for(n, a.steps, seq, asy, cores))
                save(report, a.out)  # after every row, so an interrupted run keeps what it measured
                r = rows[-1]
                print(json.dumps({"workload": wl, "tenants": n, "speedup": r["speedup"],
                                  "ceiling_speedup": r["ceiling"]["ceiling_speedup"],
                                  "fraction_of_ceiling": r["fraction_of_ceiling"],
                                  "makespans": (seq["makespan_s"], asy["makespan_s"]),
                                  "busy_fraction_marlaas": asy["busy_fraction"],
                                  "train_busy_steady": asy["train_busy_steady"]}), flush=True)
    finally:
        stack.stop()
    if a.trl and "compute" in report["workloads"]:
        try:
            trl = run_trl(a.tenants, a.steps, base)
        except (subprocess.CalledProcessError, OSError, ValueError) as e:
            print(f"TRL peer failed ({e}); is the bench extra installed? pip install -e '.[bench]'", file=sys.stderr)
            trl = {"error": str(e), "rows": []}
        ours = {r["tenants"]: r for r in report["workloads"]["compute"]}
        for r in trl["rows"]:
            mine = ours[r["tenants"]]
            r["speedup_marlaas_over_trl"] = round(r["makespan_s"] / mine["marlaas"]["makespan_s"], 3)
            r["speedup_sequential_marlaas_over_trl"] = round(r["makespan_s"] / mine["sequential"]["makespan_s"], 3)
            r.pop("jobs", None)
        report["trl"] = trl
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    save(report, a.out)
    report["pngs"] = plot(report, a.png_prefix)
    save(report, a.out)
    print("wrote", a.out, *report["pngs"])


if __name__ == "__main__":
    main()
