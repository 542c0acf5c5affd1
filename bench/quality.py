"""Quality parity: every built-in task trained alone and synchronously vs all at once asynchronously.

    .venv/bin/python bench/quality.py --out results/quality.json

Settings (same seeds, steps, sizes and held-out set for each task in every setting):
  (a) sync:    each task's job alone, max_staleness 0, one after another;
  (b) async-S: every task's job submitted at once, max_staleness S, for S in --staleness (1,2,4).
Per task and setting the JSON holds the base and final held-out accuracy (greedy pass@1 over
`--eval-size` held-out prompts, plus sampled pass@k where the job's evaluation reports it), the
reward curve (mean reward of each step's batch) and the observed staleness histogram (version trained
at minus version sampled with, one count per trained group). The summary gives, per async setting,
the mean over tasks of |(a) - (b)| in points and each task's rise over its base under (a) and (b).
A PNG (`--png`) draws every task's reward curve per setting.

All jobs run through one warm private stack started from the Procfile lines (the same worker
processes and engines as the service), on the default base model.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from marlaas import families
from marlaas.api.client import Client
from marlaas.base.pretrain import ensure_base
from marlaas.ops.embedded import Stack, wait_for_workers
from marlaas.settings import get_settings
from marlaas.spec import JobSpec
from marlaas.store import Store


def task_spec(task: str, i: int, a, staleness: int, tag: str) -> JobSpec:
    """The job of task `task` (index i): identical in every setting except max_staleness."""
    return JobSpec(tenant=f"{tag}-{task}", task=task, steps=a.steps, group_size=a.group_size,
                   prompts_per_step=a.prompts, max_staleness=staleness, seed=a.seed + i,
                   eval_size=a.eval_size, eval_k=a.eval_k, learning_rate=a.lr)


def _step_means(steps: list[dict]) -> dict:
    """Off-policy gauges averaged over the steps that trained (a no-op step has no ratios)."""
    trained = [r for r in steps if not r.get("noop")]
    out = {}
    for k in ("lr", "tis_mean", "tis_trunc_frac", "prox_minus_behav", "n_samples"):
        vals = [float(r[k]) for r in trained if r.get(k) is not None]
        out[k] = round(sum(vals) / len(vals), 5) if vals else None
    return out


def job_record(job, spec: JobSpec, wall_s: float) -> dict:
    """What the parity table needs from one finished job."""
    st = job.status()
    m = job.metrics()
    steps, evals = m["steps"], m["evals"]
    hist = Counter(s for row in steps for s in row.get("staleness", []))
    rec = {
        "job": job.id,
        "status": st["status"],
        "max_staleness": spec.max_staleness,
        "base_acc": st["base_acc"],
        "final_acc": st["final_acc"],
        "rise_points": None if st["final_acc"] is None else round(100 * (st["final_acc"] - st["base_acc"]), 2),
        "reward_curve": [round(float(r.get("reward_mean", 0.0)), 4) for r in steps],
        "staleness_histogram": {str(k): hist[k] for k in sorted(hist)},
        "staleness_max": max(hist) if hist else 0,
        "within_bound": all(k <= spec.max_staleness for k in hist),
        "regenerated": st["regenerated"],
        "wall_s": round(wall_s, 1),
        "step_means": _step_means(steps),
    }
    for v in (0, spec.steps):  # any extra evaluation fields (sampled pass@k) the job reports
        extra = {k: val for k, val in evals.get(v, {}).items() if k not in ("outputs", "at", "acc")}
        if extra:
            rec[f"eval_v{v}"] = extra
    return rec


def run_sync(client: Client, tasks: list[str], a) -> dict:
    out = {}
    for i, task in enumerate(tasks):
        spec = task_spec(task, i, a, 0, "sync")
        t0 = time.time()
        job = client.submit(spec)
        job.wait(timeout=3600)
        out[task] = job_record(job, spec, time.time() - t0)
        print(f"sync {task}: {out[task]['base_acc']:.3f} -> {out[task]['final_acc']:.3f} "
              f"({out[task]['wall_s']} s)", flush=True)
    return out


def run_async(client: Client, tasks: list[str], a, staleness: int) -> dict:
    specs = [task_spec(task, i, a, staleness, f"async{staleness}") for i, task in enumerate(tasks)]
    t0 = time.time()
    jobs = [client.submit(s) for s in specs]
    for j in jobs:
        j.wait(timeout=7200)
    wall = time.time() - t0
    out = {task: job_record(j, s, wall) for task, j, s in zip(tasks, jobs, specs)}
    for task, r in out.items():
        print(f"async S={staleness} {task}: {r['base_acc']:.3f} -> {r['final_acc']:.3f} "
              f"staleness {r['staleness_histogram']}", flush=True)
    return out


def summarise(results: dict, tasks: list[str]) -> dict:
    """Per async setting: mean |sync - async| over tasks (points) and which tasks rose >= 20 points."""
    sync = results["sync"]
    summary = {"sync": {"mean_final_acc": _mean([sync[t]["final_acc"] for t in tasks]),
                        "tasks_rising_20": [t for t in tasks if (sync[t]["rise_points"] or 0) >= 20]}}
    for name, res in results.items():
        if name == "sync":
            continue
        diffs = {t: round(100 * abs(sync[t]["final_acc"] - res[t]["final_acc"]), 2) for t in tasks}
        summary[name] = {
            "abs_diff_points": diffs,
            "mean_abs_diff_points": round(sum(diffs.values()) / len(diffs), 2),
            "mean_final_acc": _mean([res[t]["final_acc"] for t in tasks]),
            "tasks_rising_20": [t for t in tasks if (res[t]["rise_points"] or 0) >= 20],
            "all_within_bound": all(res[t]["within_bound"] for t in tasks),
        }
    return summary


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / max(len(xs), 1), 4)


def plot(results: dict, tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for name, res in results.items():
            r = res[task]
            ax.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"],
                    label=f"{name} ({100 * r['base_acc']:.0f}->{100 * r['final_acc']:.0f})")
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.suptitle("reward curves: sync single-tenant vs async multi-tenant (held-out acc base->final)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(out: dict) -> str:
    """The parity table of a results file: held-out greedy accuracy base -> final per task and setting."""
    res, summ = out["results"], out["summary"]
    names = list(res)
    tasks = list(res[names[0]])
    lines = ["| task | base | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for t in tasks:
        cells = []
        for n in names:
            r = res[n].get(t)
            cells.append("-" if r is None or r["final_acc"] is None else
                         f"{100 * r['final_acc']:.1f} (max staleness {r['staleness_max']})")
        lines.append(f"| {t} | {100 * res['sync'][t]['base_acc']:.1f} | " + " | ".join(cells) + " |")
    diffs = ["-"] + [f"{summ[n]['mean_abs_diff_points']:.2f}" for n in names[1:] if n in summ]
    lines.append("| mean abs. diff. to sync (points) | | " + " | ".join(diffs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, help="only print the markdown table of this results file")
    ap.add_argument("--tasks", default=",".join(sorted(families.FAMILIES)))
    ap.add_argument("--staleness", default="1,2,4")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-k", type=int, default=4, help="sampled completions per held-out prompt (pass@k)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/quality.json"))
    ap.add_argument("--png", type=Path, default=Path("results/quality.png"))
    a = ap.parse_args()
    if a.table:
        print(markdown_table(json.loads(a.table.read_text())))
        return
    tasks = [t for t in a.tasks.split(",") if t]
    home = get_settings().home
    base = a.base or ensure_base(home / "base", preset="default", seed=0, progress=True)
    stack = Stack(env={"MARLAAS_BASE": str(base)}, log_dir=home / "bench-logs")
    t_start = time.time()
    results: dict[str, dict] = {}

    def save() -> dict:  # after every setting, so an interrupted run keeps what it measured
        out = {
            "command": "bench/quality.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out", "png", "base", "table")),
            "date": time.strftime("%Y-%m-%d"),
            "wall_s": round(time.time() - t_start, 1),
            "sizes": {"steps": a.steps, "group_size": a.group_size, "prompts_per_step": a.prompts,
                      "eval_size": a.eval_size, "eval_k": a.eval_k, "learning_rate": a.lr,
                      "engine": get_settings().engine},
            "summary": summarise(results, tasks),
            "results": results,
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))
        plot(results, tasks, a.png)
        return out

    try:
        stack.start(*[n for n in ("redis", "tool", "control", "generate", "verify", "train", "beat")
                      if n in stack.lines])
        wait_for_workers(Store(stack.url), timeout=300)
        client = Client(stack.url)
        results["sync"] = run_sync(client, tasks, a)
        out = save()
        for s in [int(x) for x in a.staleness.split(",") if x]:
            results[f"async_S{s}"] = run_async(client, tasks, a, s)
            out = save()
    finally:
        stack.stop()
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
