"""The scheduler tick's impure half: read a Snapshot from the store, run the policy, carry it out.

`tick(store, send)` is called by the Celery `marlaas.tick` task (every second from beat, and after
every task completes). It holds the store's scheduler lock, so ticks never interleave. `send(name,
args)` enqueues a Celery task; it is passed in because this library never imports celery.
Leases are written before messages are sent: a crash between the two leaves work that the lease
expiry dispatches again, never work that is lost.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from marlaas import scheduler
from marlaas.settings import get_settings
from marlaas.store import (
    LEASES,
    Store,
    evals_key,
    item_name,
    job_key,
    parse_item,
    spec_from_json,
    verified_key,
)

Send = Callable[[str, list], None]


def snapshot(store: Store, now: float) -> scheduler.Snapshot:
    """Read everything the policy needs in a few pipelined round trips."""
    s = get_settings()
    ids = store.active_job_ids()
    p = store.r.pipeline(transaction=False)
    for jid in ids:
        p.hmget(job_key(jid), ["spec", "version", "dispatched", "pass", "status"])
    raw = p.execute()
    jobs = []
    p = store.r.pipeline(transaction=False)
    for jid, vals in zip(ids, raw):
        if vals[0] is None or vals[4] is None or vals[4].decode() not in ("running", "evaluating"):
            continue
        spec = spec_from_json(vals[0].decode())
        t = int(vals[1])
        groups = scheduler.step_groups(t, spec.prompts_per_step) if t < spec.steps else []
        evs = [0, spec.steps] if t >= spec.steps else [0]
        jobs.append((jid, spec, t, int(vals[2]), float(vals[3] or 0.0), groups, evs))
        p.smismember(verified_key(jid), groups or ["-1"])
        p.hmget(evals_key(jid), [str(v) for v in evs])
        p.zmscore(LEASES, [item_name(k, jid, v) for v in evs for k in ("eval", "evalver")])
    raw = p.execute()
    states = []
    for i, (jid, spec, t, d, pv, groups, evs) in enumerate(jobs):
        verified, evals_done, leased = raw[3 * i], raw[3 * i + 1], raw[3 * i + 2]
        need = tuple(
            v for k, v in enumerate(evs)
            if evals_done[k] is None and leased[2 * k] is None and leased[2 * k + 1] is None
        )
        states.append(
            scheduler.JobState(
                id=jid,
                version=t,
                steps=spec.steps,
                staleness=spec.max_staleness,
                groups_per_step=spec.prompts_per_step,
                group_size=spec.group_size,
                dispatched=d,
                weight=spec.weight,
                pass_value=pv,
                ready=bool(groups) and all(verified),
                eval_rows=spec.eval_size,
                need_eval=need,
            )
        )
    n_gen = sum(1 for w in store.workers().values() if w.get("station") == "generate")
    return scheduler.Snapshot(
        jobs=tuple(states),
        gen_inflight=store.gen_inflight(now),
        gen_capacity=2 * max(1, n_gen),
        batch_rows=s.gen_batch_rows,
        trainer_free=_trainer_free(store),
        expired=tuple(parse_item(x) for x in store.expired_leases(now)),
    )


def _trainer_free(store: Store) -> bool:
    """The lane is free when no lease exists, or when the worker holding it has stopped beating
    (killed mid-step): then the lease is broken at once instead of waiting for its TTL."""
    lease = store.trainer_lease()
    if lease is None:
        return True
    worker = lease.get("worker")
    if worker and worker not in store.workers():
        store.release_trainer(lease["token"])
        return True
    return False


def tick(store: Store, send: Send, now: float | None = None) -> scheduler.Plan | None:
    """One scheduling round; returns the plan carried out, or None if another tick holds the lock."""
    token = store.acquire_lock()
    if token is None:
        return None
    try:
        store.clear_kick()
        now = time.time() if now is None else now
        snap = snapshot(store, now)
        plan = scheduler.plan(snap)
        apply(store, plan, send, snap)
        return plan
    finally:
        store.release_lock(token)


def apply(store: Store, plan: scheduler.Plan, send: Send, snap: scheduler.Snapshot) -> None:
    s = get_settings()
    for batch in plan.gen_batches:
        batch_id = uuid.uuid4().hex[:12]
        store.lease([item_name(k, j, i) for k, j, i in batch], s.lease_s)
        store.add_gen_batch(batch_id, s.lease_s)
        send("marlaas.generate", [batch_id, [list(it) for it in batch]])
    for jid, total in plan.dispatched.items():
        store.advance_dispatched(jid, total)
    for kind, jid, idx in plan.verify:
        store.lease([item_name(kind, jid, idx)], s.lease_s)
        send("marlaas.verify", [jid, "train" if kind == "ver" else "eval", [idx]])
    if plan.train is not None:
        jid, t = plan.train
        token = store.take_trainer(jid, t, s.train_lease_s)
        if token is not None:
            weight = next(j.weight for j in snap.jobs if j.id == jid)
            store.advance_pass(jid, weight)
            send("marlaas.train", [jid, t, token])
