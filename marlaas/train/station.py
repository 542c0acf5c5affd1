"""The train station's task: one policy-gradient step of one job, then publish version t+1 once.

Idempotent and Celery-free (tasks/train.py wraps it): a duplicate train is a no-op because publishing
is a compare-and-set on the version. A group missing, unverified or past the job's staleness bound is
regenerated, never trained on. A job whose first `no_signal_steps` steps have no signal (every
group's rewards equal) is warned, and stopped if its spec says so (`no_signal_check`). The trainer
lane is not this module's: the caller holds and releases it (`tasks.train.trainer_lane`); a skip
returns its reason, and the publish script frees the lease it names as part of the atomic publish.
A job leaves the trainer's cache (adapter and optimiser) once its last version is published or it
has ended, so a long-lived trainer holds only live jobs' state; a job that comes back is loaded from
the state published with its version, as after a restart.
"""

from __future__ import annotations

import time

from marlaas import families
from marlaas.control import scheduler
from marlaas.store import Store
from marlaas.types import TERMINAL_STATUSES, AdapterRef, JobStatus
from marlaas.verify import preflight


def train_batch(spec, t: int, rolls: list[dict]) -> tuple[list, list[float], list[int]]:
    """(samples, all rewards, staleness per group) of one step: group-relative advantages per group."""
    import torch

    from marlaas.train import rl
    from marlaas.train.engine import TrainSample

    samples, rewards_all, staleness = [], [], []
    for r in rolls:
        rewards = r["rewards"]["rewards"]
        rewards_all += rewards
        staleness.append(t - r["version"])
        adv = rl.group_advantages(torch.tensor(rewards, dtype=torch.float32), mode=spec.rl.advantage)
        if spec.rl.drop_zero_advantage and bool((adv == 0).all()):
            continue
        for c, a in zip(r["completions"], adv.tolist()):
            samples.append(TrainSample(prompt=r["row"]["prompt"], completion_ids=c["ids"],
                                       behav_logprobs=c["logprobs"], advantage=float(a),
                                       loss_mask=c.get("mask")))  # tool episodes: 0 on tool tokens
    return samples, rewards_all, staleness


def no_signal_check(store: Store, jid: str, spec, t: int, groups: list[list[float]]) -> str | None:
    """The first `spec.no_signal_steps` (K) steps' signal: a step with a group whose rewards differ is
    counted (job field `signal_steps`); at step K (t = K - 1) with none so far, the job gets the
    preflight's verdict as a warning event (once), and with `stop_without_signal` it fails with it:
    returns that reason, else None."""
    k = min(spec.no_signal_steps, spec.steps)
    if not k or t >= k:
        return None
    if any(preflight.has_signal(g) for g in groups):
        store.incr_field(jid, "signal_steps")
        return None
    if t < k - 1 or int(store.job_fields(jid, "signal_steps")[0] or 0) > 0:
        return None
    msg = f"no signal in the first {k} steps: {preflight.summarize(groups)['verdict']}"
    if store.incr_field(jid, "no_signal_warned") == 1:
        store.add_notice(jid, "warning", {"message": msg, "step": t + 1})
    if spec.stop_without_signal:
        reason = msg + " (stop_without_signal)"
        store.set_status(jid, "failed", reason)
        return reason
    return None


def _load(store: Store, engine, jid: str, t: int, spec) -> None:
    """Load job `jid` at version `t` into the trainer's cache from the state published with that version
    (if there is one). Its bytes (the LoRA and two Adam moments) are dropped on return, before the step's
    activations are: they never add to the trainer's peak."""
    from marlaas.train.engine import TrainState
    from marlaas.train.step import ensure_job

    opt = store.optimizer_state(jid)
    if opt is not None and opt[0] == t:
        ensure_job(engine, jid, t, spec, TrainState(version=t, adapter=store.adapter(AdapterRef(jid, t)),
                                                    optimizer=opt[1]))


def run_train(store: Store, engine, jid: str, t: int, token: str) -> dict:
    """One policy-gradient step of job `jid` at version t on `engine`; publishes t+1 exactly once (under
    the trainer lease `token`). Returns the step's metrics, or {"skipped": why}."""
    from marlaas.train.step import step

    status, version = store.job_fields(jid, "status", "version")
    if status not in ("running",) or version is None or int(version) != t:
        if status in TERMINAL_STATUSES:
            engine.evict(jid)
        return {"skipped": "not at this version (already published or job stopped)"}
    spec = store.spec(jid)
    groups = scheduler.step_groups(t, spec.prompts_per_step)
    rolls = [store.rollout(jid, g) for g in groups]
    bad = [g for g, r in zip(groups, rolls)
           if r is None or "rewards" not in r or not scheduler.within_staleness(t, r["version"], spec.max_staleness)]
    if bad:
        for g in bad:
            store.invalidate_group(jid, g)
        return {"skipped": f"groups {bad} missing, unverified or too stale: regenerating"}

    if spec.preflight:
        return {"skipped": "a preflight is never trained"}
    stop = no_signal_check(store, jid, spec, t, [r["rewards"]["rewards"] for r in rolls])
    if stop is not None:
        engine.evict(jid)
        return {"skipped": stop}
    samples, rewards_all, staleness = train_batch(spec, t, rolls)
    t0 = time.time()
    if t > 0 and engine.cached().get(jid) != t:
        _load(store, engine, jid, t, spec)
    out = step(engine, jid, t, spec, samples, None)  # from the cache (else: "no state for version t")
    metrics = dict(out.metrics)
    metrics.update(
        step=t + 1,
        reward_mean=sum(rewards_all) / max(len(rewards_all), 1),
        staleness=staleness,
        train_s=time.time() - t0,
        at=time.time(),
    )
    if families.tool_of(spec):  # tool-result tokens in this step's episodes: context, masked out of the loss
        metrics["tool_tokens"] = sum(len(c["mask"]) - sum(c["mask"]) for r in rolls for c in r["completions"])
    ok = store.publish(jid, t, out.adapter, out.optimizer, metrics, token, groups, spec.steps, spec.eval_every)
    if ok and t + 1 >= spec.steps:
        store.transition_status(jid, (JobStatus.RUNNING,), JobStatus.EVALUATING)  # not over a pause
        engine.evict(jid)  # trained out: its adapter and Adam moments (3x the LoRA's bytes) leave the cache
    if not ok:
        return {"skipped": "version moved during the step (published elsewhere): no-op"}
    return metrics
