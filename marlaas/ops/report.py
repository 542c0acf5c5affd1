"""Run reports: one PNG and one self-contained HTML page for a set of jobs.

The PNG has four panels: mean reward per step (one curve per job, labelled with its tenant),
held-out `exact` (solid: share of prompts whose greedy completion gets full reward), `mean_reward`
(dotted: the mean greedy reward, partial credit included) and sampled pass@k on full-reward samples
(dashed) per evaluated version, a staleness histogram of every trained group
(grouped bars per tenant), and the station timeline (a Gantt chart, one row per station, bars from
the event log, each station's busy fraction over the shown window in its label). The HTML page embeds
that PNG as a base64 data URI (no other file is needed to view it) and has one table per tenant:
job, task, status, steps, base and final exact and mean reward, regenerated groups, grader errors
(training / evaluation), final pass@k.

The timeline window runs from the first job's creation to the last recorded activity of the chosen
jobs; it shows every station event in that window, including other tenants' work sharing the stations.
Reads only; matplotlib runs headless (Agg canvas, no pyplot state).
"""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

from marlaas.errors import MarlaasError
from marlaas.ops.timeline import STATIONS, busy_fractions
from marlaas.verify.evaluation import figures

STATION_COLORS = {"generate": "#4c78a8", "verify": "#f58518", "train": "#54a24b", "control": "#9d755d"}


# ------------------------------------------------------------------ gather (reads the store)
def gather(store, job_ids: list[str]) -> dict:
    """Everything the report draws, as plain data: per-job records, events and busy fractions."""
    if not job_ids:
        raise MarlaasError("no jobs to report")
    jobs = []
    for jid in job_ids:
        rec = store.job(jid)  # NotFound is the user's one-line error
        evals = store.evals(jid)
        steps = store.metrics(jid)
        last_at = [float(rec.extra.get("updated") or rec.created)]
        last_at += [m["at"] for m in steps if m.get("at")] + [e["at"] for e in evals.values() if e.get("at")]
        jobs.append({
            "job": jid,
            "tenant": rec.tenant,
            "task": rec.spec.task or "dataset",
            "status": rec.status,
            "version": rec.version,
            "steps_total": rec.spec.steps,
            "max_staleness": rec.spec.max_staleness,
            "created": rec.created,
            "last": max(last_at),
            "metrics": steps,
            "evals": {v: figures(e)[0] for v, e in sorted(evals.items())},
            "mean_reward": {v: figures(e)[1] for v, e in sorted(evals.items())},
            "pass_k": {v: (e.get("k", 0), e.get("pass_at_k")) for v, e in sorted(evals.items())},
            "regenerated": int(rec.extra.get("regenerated") or 0),
            "verify_errors": int(rec.extra.get("verify_errors") or 0),
            "eval_verify_errors": int(rec.extra.get("eval_verify_errors") or 0),
        })
    t0 = min(j["created"] for j in jobs)
    events = store.events_since(t0)
    mine = set(job_ids)
    t1 = max([j["last"] for j in jobs] + [e["end"] for e in events if mine & set(e.get("jobs", []))])
    events = [e for e in events if e["start"] <= t1]
    return {
        "generated": time.time(),
        "jobs": jobs,
        "t0": t0,
        "t1": t1,
        "events": events,
        "busy": busy_fractions(events, t0, t1),
    }


# ------------------------------------------------------------------ the figure
def _label(j: dict) -> str:
    return f"{j['tenant']} · {j['job']} ({j['task']})"


def plot_png(data: dict) -> bytes:
    """The four-panel figure as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(14, 9.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_a, ax_s, ax_t = fig.subplots(2, 2).ravel()
    colors = [f"C{i % 10}" for i in range(len(data["jobs"]))]

    for j, c in zip(data["jobs"], colors):
        pts = [(m["step"], m["reward_mean"]) for m in j["metrics"] if m.get("reward_mean") is not None]
        if pts:
            ax_r.plot(*zip(*pts), marker=".", color=c, label=_label(j))
    _finish(ax_r, "Mean reward per step", "step (published version)", "mean reward")

    for j, c in zip(data["jobs"], colors):
        pts = [(v, a) for v, a in j["evals"].items() if a is not None]
        if pts:
            ax_a.plot(*zip(*pts), marker="o", color=c, label=f"{_label(j)} exact")
        mr = [(v, a) for v, a in j.get("mean_reward", {}).items() if a is not None]
        if mr:
            ax_a.plot(*zip(*mr), marker=".", linestyle=":", color=c, label=f"{_label(j)} mean reward")
        pk = [(v, p, k) for v, (k, p) in j.get("pass_k", {}).items() if p is not None]
        if pk:
            ax_a.plot([v for v, _, _ in pk], [p for _, p, _ in pk], marker="x", linestyle="--", color=c,
                      label=f"{_label(j)} pass@{pk[-1][2]}")
    ax_a.set_ylim(-0.03, 1.03)
    _finish(ax_a, "Held-out exact (solid), mean reward (dotted), sampled pass@k (dashed)", "adapter version",
            "share of prompts / reward")

    for ax in (ax_r, ax_a):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _staleness_hist(ax_s, data)
    _gantt(ax_t, data)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")


def staleness_counts(jobs: list[dict]) -> dict[str, dict[int, int]]:
    """Per tenant: how many trained groups had each staleness value (all steps of its jobs)."""
    out: dict[str, dict[int, int]] = {}
    for j in jobs:
        per = out.setdefault(j["tenant"], {})
        for m in j["metrics"]:
            for s in m.get("staleness") or []:
                per[int(s)] = per.get(int(s), 0) + 1
    return out


def _staleness_hist(ax, data: dict) -> None:
    counts = staleness_counts(data["jobs"])
    tenants = [t for t, c in counts.items() if c]
    if tenants:
        hi = max(max(c) for c in counts.values() if c)
        width = 0.8 / len(tenants)
        for i, t in enumerate(tenants):
            xs = [s + (i - (len(tenants) - 1) / 2) * width for s in range(hi + 1)]
            ax.bar(xs, [counts[t].get(s, 0) for s in range(hi + 1)], width=width, label=t, color=f"C{i % 10}")
        ax.set_xticks(range(hi + 1))
    _finish(ax, "Staleness of trained groups", "staleness (trained version − sampling version)", "groups")


def _gantt(ax, data: dict) -> None:
    events, t0, busy = data["events"], data["t0"], data["busy"]
    stations = list(STATIONS) + sorted({e["station"] for e in events} - set(STATIONS))
    for row, st in enumerate(stations):
        bars = [(e["start"] - t0, e["end"] - e["start"]) for e in events if e["station"] == st]
        if bars:
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=STATION_COLORS.get(st, "gray"), alpha=0.75)
    ax.set_yticks(range(len(stations)))
    ax.set_yticklabels([f"{st}\nbusy {busy.get(st, 0.0):.0%}" if st in busy else st for st in stations])
    ax.set_ylim(-0.6, len(stations) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, max(data["t1"] - t0, 1e-3))
    ax.set_title("Station timeline")
    ax.set_xlabel("seconds since the first job was created")
    ax.grid(axis="x", alpha=0.3)
    if not events:
        ax.text(0.5, 0.5, "no station events recorded", ha="center", va="center", transform=ax.transAxes,
                color="gray")


# ------------------------------------------------------------------ the page
def _f(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _pk(j: dict, v: int) -> str:
    """Sampled pass@k of version v as 'pass@k value' ('–' when not evaluated or greedy only)."""
    k, p = j.get("pass_k", {}).get(v, (0, None))
    return "–" if p is None else f"pass@{k} {p:.2f}"


def html_page(data: dict, png: bytes) -> str:
    """A self-contained HTML page: the figure as a data URI plus one table per tenant."""
    e = html.escape
    by_tenant: dict[str, list[dict]] = {}
    for j in data["jobs"]:
        by_tenant.setdefault(j["tenant"], []).append(j)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["generated"]))
    busy = ", ".join(f"{st} {v:.0%}" for st, v in data["busy"].items())
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>marlaas report: {e(', '.join(j['job'] for j in data['jobs']))}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}"
        "th:first-child,td:first-child,td.l{text-align:left}img{max-width:100%}</style>",
        "</head><body>",
        "<h1>marlaas run report</h1>",
        f"<p>{len(data['jobs'])} job(s) of {len(by_tenant)} tenant(s); generated {e(when)}; "
        f"window {data['t1'] - data['t0']:.1f} s; station busy fractions: {e(busy)}.</p>",
        f'<img alt="reward, exact and mean reward, staleness and station timeline" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">',
    ]
    for tenant, jobs in by_tenant.items():
        parts.append(f"<h2>tenant {e(tenant)}</h2>")
        parts.append("<table><tr><th>job</th><th>task</th><th>status</th><th>steps</th><th>base exact</th>"
                     "<th>final exact</th><th>base mean reward</th><th>final mean reward</th><th>regenerated</th>"
                     "<th>grader errors (train / eval)</th><th>final pass@k</th></tr>")
        for j in jobs:
            mean, last = j.get("mean_reward", {}), j["steps_total"]
            parts.append(
                f"<tr><td>{e(j['job'])}</td><td class=l>{e(j['task'])}</td><td class=l>{e(j['status'])}</td>"
                f"<td>{j['version']}/{last}</td><td>{_f(j['evals'].get(0))}</td>"
                f"<td>{_f(j['evals'].get(last))}</td><td>{_f(mean.get(0))}</td><td>{_f(mean.get(last))}</td>"
                f"<td>{j['regenerated']}</td><td>{j['verify_errors']} / {j.get('eval_verify_errors', 0)}</td>"
                f"<td>{_pk(j, last)}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def default_name(job_ids: list[str]) -> str:
    return "report-" + ("-".join(job_ids) if len(job_ids) <= 4 else f"{job_ids[0]}-to-{job_ids[-1]}")


def write_report(store, job_ids: list[str], out_dir, name: str | None = None) -> tuple[Path, Path]:
    """Write `<name>.png` and `<name>.html` under out_dir; returns (png_path, html_path)."""
    data = gather(store, list(job_ids))
    png = plot_png(data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = name or default_name(list(job_ids))
    png_path, html_path = out / f"{stem}.png", out / f"{stem}.html"
    png_path.write_bytes(png)
    html_path.write_text(html_page(data, png), encoding="utf-8")
    return png_path, html_path
