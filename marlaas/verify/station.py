"""The verify station's task: score groups and held-out evaluations, accept rewards per attempt.

Idempotent and Celery-free (tasks/verify.py wraps it): a duplicate verify rewrites the same rewards,
and rewards are accepted only for the rollout attempt they were computed on. Work comes in the kinds
the leases name (marlaas.types.ItemKind): VER (groups) and EVALVER (evaluations, idx = version).
Settings come in as arguments (`tool_url`), read by the process edge. Grader errors are counted
and shown to the tenant by `job_scoring.report_train` / `report_eval` (which may fail the job). Each
written evaluation moves the job's `@best` (in the same store script) and runs the reward-hacking
alarm (`check_reward_hacking`: a warning notice, and a pause if the spec asks).
"""

from __future__ import annotations

import logging
import time

from marlaas import families
from marlaas.store import Store
from marlaas.tools import agentic
from marlaas.types import ACTIVE_STATUSES, ItemKind, JobStatus, eval_versions
from marlaas.verify import evaluation
from marlaas.verify.alarm import reward_hacking

log = logging.getLogger("marlaas.verify")


def run_verify_many(store: Store, items: list[tuple[str, str, list[int]]],
                    tool_url: str = agentic.DEFAULT_TOOL_URL) -> int:
    """Several jobs' (job, kind, idxs) in one task: the tool calls of all the tool jobs' groups go
    out in one concurrent round (agentic.advance_many), then each item is scored as run_verify does.
    A verify task then waits one tool latency for a whole generate batch, not one per job."""
    tool_jobs = []
    for jid, kind, idxs in items:
        if ItemKind(kind) == ItemKind.VER and store.job_fields(jid, "status")[0] in ACTIVE_STATUSES \
                and families.tool_of(store.spec(jid)):
            tool_jobs.append((jid, [(g, r) for g in idxs if (r := store.rollout(jid, g)) is not None]))
    advanced = agentic.advance_many(store, tool_jobs, tool_url) if tool_jobs else {}
    return sum(run_verify(store, jid, kind, idxs, tool_url,
                          advanced=advanced.get(jid) if ItemKind(kind) == ItemKind.VER else None)
               for jid, kind, idxs in items)


def run_verify(store: Store, jid: str, kind: str, idxs: list[int], tool_url: str = agentic.DEFAULT_TOOL_URL,
               advanced: list | None = None) -> int:
    """Score groups (kind VER: idxs are group indices) or held-out evaluations (kind EVALVER: idxs
    are versions); returns items accepted. ValueError for any other kind. `tool_url`: the tool
    server of tool episodes; `advanced`: a tool job's groups already through their tool calls
    (run_verify_many)."""
    from marlaas.verify.job_scoring import report_eval, report_train, score_job

    kind = ItemKind(kind)
    if kind not in (ItemKind.VER, ItemKind.EVALVER):
        raise ValueError(f"verify takes {ItemKind.VER.value!r} or {ItemKind.EVALVER.value!r} items, not {kind.value!r}")
    status = store.job_fields(jid, "status")[0]
    if status not in ACTIVE_STATUSES:
        return 0
    spec = store.spec(jid)
    accepted = 0
    if kind == ItemKind.VER:
        if advanced is not None:
            rolls = advanced
        else:
            rolls = [(g, r) for g in idxs if (r := store.rollout(jid, g)) is not None]
            if families.tool_of(spec):  # groups with pending tool calls go back to generate (agentic)
                rolls = agentic.advance_groups(store, jid, rolls, tool_url)
        # the grader's errors are counted and shown to the tenant with its row, then the policy runs
        scores = score_job(store, jid, spec, [(r["row"], [c["text"] for c in r["completions"]]) for _, r in rolls],
                           report=lambda sc: report_train(store, jid, rolls, sc),
                           key=min((g for g, _ in rolls), default=0) // spec.prompts_per_step)
        if scores is None:  # the job's grader cannot load or kept failing: the job was failed
            return 0
        for (g, roll), res in zip(rolls, scores):
            accepted += store.accept_rewards(jid, g, roll["attempt"], {"rewards": res.rewards, "errors": res.errors})
        return accepted
    for v in idxs:
        ev = store.eval_rollout(jid, v)
        if ev is None:
            continue
        # One scoring call per row: the greedy completion first, then its sampled ones (if any).
        scores = score_job(store, jid, spec, [(r["row"], [r["text"], *r.get("samples", [])]) for r in ev["rows"]],
                           ItemKind.EVALVER, key=v)
        if scores is None:
            return accepted
        sampled = [s.rewards[1:] for s in scores] if all(r.get("samples") for r in ev["rows"]) else None
        result = evaluation.summarize([s.rewards[0] for s in scores], sampled, sum(1 for s in scores if s.errors))
        # The greedy outputs are kept with the score: an exported adapter must reproduce them.
        result.update(at=time.time(), outputs=[
            {"prompt": r["row"]["prompt"], "text": r["text"], "reward": s.rewards[0],
             "samples_correct": sum(1 for x in s.rewards[1:] if x >= evaluation.FULL)}
            for r, s in zip(ev["rows"], scores)])
        store.put_eval_result(jid, v, result)  # moves the job's @best too (marlaas.store.serving)
        accepted += 1
        check_reward_hacking(store, jid, spec, v)
        if not report_eval(store, jid, spec, v, ev["rows"], scores):  # too many rows erred: the job failed
            return accepted
        if all(store.has_evals(jid, eval_versions(spec.steps, spec.eval_every))):
            store.set_status(jid, "done")
    return accepted


def check_reward_hacking(store: Store, jid: str, spec, v: int) -> bool:
    """After the evaluation of version v is stored: the reward-hacking alarm (`marlaas.verify.alarm`)
    for the interval ending at v and, since evaluations finish out of order, for the one ending at the
    next evaluated version above v (whose own check ran before v's result existed: an evaluation of
    version 0 finishing after version 6's would otherwise leave (0, 6] unchecked). Each evaluation
    checks after its own write, so whichever of two writes comes second sees both. A warning notice,
    once per version; with `pause_on_reward_hacking`, a job still training is paused (resumable). One
    whose training is over (evaluating its last versions) is not: there is nothing left to stop. The
    notice's `paused` says which. True when it fired."""
    exact, rewards = store.best(jid)["exact"], evaluation.train_rewards(store.metrics(jid))
    later = min((u for u in exact if u > v), default=None)
    fired = False
    for u in (v,) if later is None else (v, later):
        alarm = reward_hacking(exact, rewards, u, spec.reward_hacking_drop, spec.reward_hacking_rise)
        if alarm is None or not store.claim_notice(jid, f"hacking:{u}", 1):
            continue
        paused = (spec.pause_on_reward_hacking and u < spec.steps
                  and store.transition_status(jid, (JobStatus.RUNNING.value,), JobStatus.PAUSED.value)
                  == JobStatus.RUNNING.value)
        store.add_notice(jid, "warning", {**alarm.data(), "paused": paused})
        log.warning("job %s: %s%s", jid, alarm.message(), " (paused)" if paused else "")
        fired = True
    return fired
