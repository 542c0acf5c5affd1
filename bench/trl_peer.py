"""Peer baseline: TRL's GRPOTrainer, the same jobs one after another (issue 4, item 2).

    .venv/bin/pip install -e '.[bench]'         # pins trl
    .venv/bin/python bench/trl_peer.py --tenants 1,2,4,8 --steps 8 --out results/trl_peer.json

For each N, the N jobs of `bench/throughput.py` (same tasks `TASKS[i % 6]`, seeds, training rows via
`marlaas.api.rows.job_rows`, 8 prompts x 8 completions per step, 8 new tokens, temperature 1, LoRA rank 16
alpha 32 on all linear layers, AdamW lr 1e-3, no KL) are trained by `trl.GRPOTrainer` on the same
base model, on the CPU, one job after another in one warm process (the base is loaded once, as our
warm workers have it loaded; each job gets a fresh LoRA). Rewards are our verifiers
(`marlaas.verify.verifiers.score_groups`), so the work per step is the same. The makespan is the sum of the
jobs' `trainer.train()` wall times; TRL runs no held-out evaluation, while our runs include one at
versions 0 and `steps` (32 prompts): that favours TRL slightly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from marlaas.settings import get_settings
from marlaas.spec import JobSpec

TASKS = ("sort", "reverse", "max", "code", "min", "add")


def job_spec(i: int, steps: int) -> JobSpec:
    return JobSpec(tenant=f"trl{i}", task=TASKS[i % len(TASKS)], steps=steps, group_size=8, prompts_per_step=8,
                   max_staleness=0, seed=i, eval_size=32)


def reward_fn(spec: JobSpec):
    """A TRL reward function scoring completions with the job's own verifier."""
    from marlaas.verify.verifiers import score_groups

    verifier = spec.verifier_name()

    def rewards(prompts, completions, row_idx, **_):
        items = [(ROWS[spec.tenant][i], [c]) for i, c in zip(row_idx, completions)]
        return [s.rewards[0] for s in score_groups(verifier, items)]

    rewards.__name__ = f"{verifier}_reward"
    return rewards


ROWS: dict[str, list[dict]] = {}


def skip_steps_without_signal(optimizer):
    """Make `optimizer.step()` do nothing while every gradient is zero or absent, as a marlaas step
    whose samples carry no advantage publishes the same weights and optimiser state (a `noop`).
    TRL's GRPOTrainer steps AdamW anyway: with beta 0 a step where every group's rewards are equal has
    an all-zero gradient, and Adam's first moment keeps moving the weights along its last direction
    for tens of steps. Returns the optimizer; its `skipped_steps` counts the steps skipped."""
    import torch

    inner = optimizer.step
    params = [p for g in optimizer.param_groups for p in g["params"]]
    optimizer.skipped_steps = 0

    def step(*args, **kwargs):
        with torch.no_grad():
            if not any(p.grad is not None and bool(p.grad.any()) for p in params):
                optimizer.skipped_steps += 1
                return None
        return inner(*args, **kwargs)

    optimizer.step = step
    return optimizer


def grpo_trainer(model, tokenizer, spec: JobSpec, ds, reward, out_dir: Path, callbacks=(),
                 skip_no_signal: bool = False, **overrides):
    """TRL's GRPOTrainer set up as our job `spec` trains: prompts_per_step x group_size completions per
    step, max_new_tokens, temperature (top_p 1, top_k off), constant lr, no KL, a fresh LoRA of the
    spec's rank and alpha on every linear layer, the dataset in its order. `skip_no_signal`: its
    optimiser skips steps whose gradient is all zero (`skip_steps_without_signal`)."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    class SkipNoSignal(GRPOTrainer):
        def create_optimizer(self, *args, **kwargs):
            self.skipping = skip_steps_without_signal(super().create_optimizer(*args, **kwargs))
            return self.skipping

    cfg = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        per_device_train_batch_size=spec.prompts_per_step * spec.group_size, gradient_accumulation_steps=1,
        num_generations=spec.group_size, max_completion_length=spec.max_new_tokens, max_steps=spec.steps,
        learning_rate=spec.learning_rate, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        temperature=spec.temperature, top_p=1.0, top_k=0, seed=spec.seed, shuffle_dataset=False,
        dataloader_num_workers=0, disable_dropout=True, bf16=False, fp16=False, **overrides,
    )
    lora = LoraConfig(r=spec.lora.rank, lora_alpha=spec.lora.alpha, target_modules="all-linear",
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    cls = SkipNoSignal if skip_no_signal else GRPOTrainer
    return cls(model=model, reward_funcs=[reward], args=cfg, train_dataset=ds,
               processing_class=tokenizer, peft_config=lora, callbacks=list(callbacks))


def job_setup(model_path: Path, spec: JobSpec, train: list[dict]):
    """(dataset, fresh float32 model) of one job: its rows registered for its reward function,
    the seed set before the model loads."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    ROWS[spec.tenant] = train
    ds = Dataset.from_list([{"prompt": r["prompt"], "row_idx": i} for i, r in enumerate(train)])
    torch.manual_seed(spec.seed)
    return ds, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def train_one(model_path: Path, tokenizer, spec: JobSpec, out_dir: Path) -> dict:
    from marlaas.api.rows import job_rows

    train, _ = job_rows(spec)
    ds, model = job_setup(model_path, spec, train)
    trainer = grpo_trainer(model, tokenizer, spec, ds, reward_fn(spec), out_dir)
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"task": spec.task, "wall_s": round(wall, 2), "reward_curve": [round(r, 4) for r in rewards]}


def greedy_eval(model, tokenizer, spec: JobSpec, held: list[dict], eos_ids: list[int], batch: int = 25) -> dict:
    """Held-out greedy evaluation as ours counts it (`marlaas.verify.evaluation.summarize`: exact = the
    share of prompts whose greedy completion earns the full reward, mean_reward): each completion cut
    at its first EOS and decoded without special tokens, scored by the task's own verifier."""
    import torch

    from marlaas.verify.evaluation import summarize
    from marlaas.verify.verifiers import score_groups

    tokenizer.padding_side = "left"
    texts: list[str] = []
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(held), batch):
            enc = tokenizer([r["prompt"] for r in held[i:i + batch]], return_tensors="pt", padding=True)
            out = model.generate(**enc, do_sample=False, max_new_tokens=spec.max_new_tokens, eos_token_id=eos_ids,
                                 pad_token_id=tokenizer.pad_token_id)
            for row in out[:, enc["input_ids"].shape[1]:].tolist():
                cut = next((k for k, t in enumerate(row) if t in eos_ids), len(row))
                texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    scores = score_groups(spec.verifier_name(), [(r, [t]) for r, t in zip(held, texts)])
    return summarize([s.rewards[0] for s in scores], None)


def train_rows(model_path: Path, tokenizer, spec: JobSpec, train: list[dict], held: list[dict],
               out_dir: Path, skip_no_signal: bool = False, **overrides) -> dict:
    """One job of `spec` on given (already rendered) rows: held-out greedy accuracy of the base, GRPO
    training, held-out accuracy of the trained adapter. wall_s = training + both evaluations (as a
    marlaas job's wall includes its evaluations at version 0 and the last); the per-step latency is
    each step's time from the previous step's end (the first one's from the start of training)."""
    from transformers import TrainerCallback

    from marlaas.generate.engine import eos_token_ids

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.time())

    ds, model = job_setup(model_path, spec, train)
    eos_ids = eos_token_ids(tokenizer, model.generation_config)
    model.generation_config.eos_token_id = eos_ids  # stop where our engine stops
    t0 = time.time()
    ev0 = greedy_eval(model, tokenizer, spec, held, eos_ids)
    eval0_s = time.time() - t0
    clock = StepClock()
    trainer = grpo_trainer(model, tokenizer, spec, ds, reward_fn(spec), out_dir, [clock], skip_no_signal,
                           **overrides)
    t1 = time.time()
    trainer.train()
    train_s = time.time() - t1
    t2 = time.time()
    ev1 = greedy_eval(trainer.model, tokenizer, spec, held, eos_ids)
    eval1_s = time.time() - t2
    gaps = [b - a for a, b in zip([t1] + clock.ends, clock.ends)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    skipped = trainer.skipping.skipped_steps if skip_no_signal else None
    base_acc, final_acc = ev0["exact"], ev1["exact"]
    return {"status": "done", "base_acc": base_acc, "final_acc": final_acc,
            "rise_points": round(100 * (final_acc - base_acc), 2),
            "mean_reward": [round(ev0["mean_reward"], 4), round(ev1["mean_reward"], 4)],
            "reward_curve": [round(r, 4) for r in rewards], "wall_s": round(eval0_s + train_s + eval1_s, 1),
            "train_s": round(train_s, 1), "eval_s": [round(eval0_s, 1), round(eval1_s, 1)],
            "step_latency_s": percentiles(gaps), "skipped_steps": skipped}


def percentiles(xs: list[float]) -> dict:
    """{"p50", "p95", "n"} of a list of seconds (nearest rank; None when empty)."""
    if not xs:
        return {"p50": None, "p95": None, "n": 0}
    s = sorted(xs)

    def rank(q: float) -> float:
        return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 2)

    return {"p50": rank(0.50), "p95": rank(0.95), "n": len(s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: MARLAAS_THREADS)")
    ap.add_argument("--out", type=Path, default=Path("results/trl_peer.json"))
    a = ap.parse_args()
    import torch
    import trl

    from marlaas.base.pretrain import ensure_base
    from marlaas.base.tiny import load_tokenizer

    settings = get_settings()
    torch.set_num_threads(a.threads or settings.threads)
    base = a.base or ensure_base(settings.home / "base", preset="default", seed=0, progress=True)
    tok = load_tokenizer(base)
    tok.padding_side = "left"
    work = settings.home / "trl-peer"
    rows = []
    train_one(base, tok, job_spec(99, 1), work)  # warm-up: imports, kernels (not timed)
    for n in [int(x) for x in a.tenants.split(",")]:
        jobs = [train_one(base, tok, job_spec(i, a.steps), work) for i in range(n)]
        rows.append({"tenants": n, "makespan_s": round(sum(j["wall_s"] for j in jobs), 2), "jobs": jobs})
        print(json.dumps({"tenants": n, "makespan_s": rows[-1]["makespan_s"]}), flush=True)
    out = {
        "command": f"bench/trl_peer.py --tenants {a.tenants} --steps {a.steps}",
        "date": time.strftime("%Y-%m-%d"),
        "trl_version": trl.__version__,
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
