"""`marlaas demo`: several tenants' RL jobs at once on the embedded stack, with a live view.

Starts the stack if needed (building the base model the first time), submits one job per tenant on
different task families, shows a live line per tenant (step, mean reward, staleness), then prints
held-out `exact` (share of prompts answered with full reward) and `mean_reward` before and after,
each station's busy fraction over the run, and where the adapters were written. `--json PATH` writes the same summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from marlaas.spec import JobSpec

# Families in the order tenants get them (the first four: an exact-string task, the multi-turn tool
# task, a math-verify task and the sandboxed code task), and steps that move each past its base in minutes.
DEMO_TASKS = ("sort", "calc", "add", "code", "reverse", "max", "min")
DEMO_STEPS = 40


def demo_specs(tenants: int, steps: int | None, max_staleness: int) -> list[JobSpec]:
    return [
        JobSpec(
            tenant=f"tenant{i + 1}",
            task=DEMO_TASKS[i % len(DEMO_TASKS)],
            steps=steps or DEMO_STEPS,
            group_size=8,
            prompts_per_step=8,
            max_staleness=max_staleness,
            seed=i,
            eval_size=64,
        )
        for i in range(tenants)
    ]


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table(statuses: list[dict], final: bool = False) -> Table:
    """Exact = share of held-out prompts answered with full reward; mean reward counts partial credit."""
    t = Table("tenant", "job", "task", "status", "step", "train reward", "staleness", "exact base",
              "exact final", "mean reward base", "mean reward final",
              title="marlaas demo" + (" (done)" if final else ""))
    for s in statuses:
        t.add_row(
            s["tenant"], s["id"], s["task"], s["status"], f"{s['version']}/{s['steps']}",
            _f(s["reward_mean"]), f"{s['staleness']}/{s['max_staleness']}",
            _f(s["base_exact"]), _f(s["final_exact"]), _f(s["base_mean_reward"]), _f(s["final_mean_reward"]),
        )
    return t


def run_demo(tenants: int = 4, steps: int | None = None, max_staleness: int = 2,
             json_out: Path | None = None, console: Console | None = None) -> dict:
    from marlaas.api.http_client import Client
    from marlaas.ops.embedded import ensure_up
    from marlaas.ops.timeline import busy_fractions, overlap_fraction
    from marlaas.settings import get_settings
    from marlaas.store import Store
    from marlaas.types import TERMINAL_STATUSES

    console = console or Console()
    ensure_up()
    client = Client()
    t0 = time.time()
    jobs = [client.submit(s) for s in demo_specs(tenants, steps, max_staleness)]
    console.print(f"submitted {len(jobs)} jobs: {', '.join(j.id for j in jobs)}")
    with Live(_table([j.status() for j in jobs]), console=console, refresh_per_second=2, transient=True) as live:
        while True:
            sts = [j.status() for j in jobs]
            live.update(_table(sts))
            if all(s["status"] in TERMINAL_STATUSES for s in sts):
                break
            time.sleep(0.5)
    wall = time.time() - t0
    console.print(_table(sts, final=True))

    events = Store().events(since=t0)  # the operator's view of the stations (this host)
    busy = busy_fractions(events, t0, t0 + wall)
    overlap = overlap_fraction(events, "generate", "train", t0, t0 + wall)
    adapters_dir = get_settings().home / "adapters"
    summary = {"wall_s": round(wall, 1), "tenants": [], "busy": busy, "generate_train_overlap": overlap}
    for j, s in zip(jobs, sts):
        path = None
        if s["status"] == "done":
            path = str(j.download_adapter(adapters_dir / f"{s['tenant']}-{s['task']}-{j.id}"))
        summary["tenants"].append({
            "job": j.id, "tenant": s["tenant"], "task": s["task"], "status": s["status"],
            "base_exact": s["base_exact"], "final_exact": s["final_exact"],
            "base_mean_reward": s["base_mean_reward"], "final_mean_reward": s["final_mean_reward"],
            "steps": s["steps"],
            "versions": s["version"] + 1,
            "adapter": path and str(Path(path).relative_to(get_settings().home)),  # under MARLAAS_HOME
        })
    console.print(
        f"wall {wall:.0f} s; station busy fractions: "
        + ", ".join(f"{k} {v:.0%}" for k, v in busy.items())
        + f"; generate busy while train busy: {overlap:.0%}"
    )
    console.print(f"adapters written under {adapters_dir}")
    if json_out:
        Path(json_out).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {json_out}")
    return summary
