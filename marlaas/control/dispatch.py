"""The scheduler tick's impure half: read a Snapshot from the store, run the policy, carry it out.

`tick(store, send, config)` is called by the Celery `marlaas.tick` task (every second from beat, and
after every task completes). It holds the store's scheduler lock, so ticks never interleave. One
tick is four steps, in this order: `snapshot` (reads only), `watchdog` (fails the jobs that made no
progress for `stall_s`; they are left out of this tick's plan), `scheduler.plan` (pure: which
generation batches, re-verifications, and which job or Tinker model gets the trainer lane), `apply`
(writes, then sends); after them the preflights whose groups are all verified are ended with their
summary (`finish_preflights`). `send(messages)` enqueues a tick's Celery tasks, a list of (task name, args),
all at once (the service's sender pushes them to the broker in one pipelined round trip:
tasks/common.py); it is passed in because this library never imports celery. Settings are read at
the process edge: the caller passes a `TickConfig`.
Leases are written before messages are sent: a crash between the two leaves work that the lease
expiry dispatches again, never work that is lost.

Cost at N active jobs (bench/tick.py): five round trips (lock, state, details, write, unlock), each
one script call whose reply or argument is a single string. The process keeps a copy of the
scheduling table decoded into JobStates (memory.py); each tick reads and decodes only the rows
changed since its last read (the table's change log), so the Python side is O(N) list building plus
O(changed jobs) decoding. A spec never changes, and an evaluation once stored stays stored: both are
remembered per process.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import attrgetter

from marlaas.control import jit, scheduler
from marlaas.control.memory import MEMORY, TableJob, TickMemory
from marlaas.settings import Settings
from marlaas.store import Store
from marlaas.store.tinker import TinkerStore
from marlaas.types import ItemKind, WorkItem
from marlaas.verify import preflight

__all__ = ["GC_EVERY_S", "MEMORY", "Send", "TickConfig", "TickMemory", "apply", "finish_preflights", "snapshot",
           "tick", "watchdog"]

log = logging.getLogger("marlaas.control")
GC_EVERY_S = 30.0
Send = Callable[[list[tuple[str, list]]], None]  # [(task name, args), ...] sent together


def _default(name: str):
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class TickConfig:
    """The settings a tick uses (marlaas.settings.Settings' fields of the same names). The defaults
    are Settings' defaults; a process edge passes `TickConfig.from_settings(get_settings())`."""

    lease_s: float = _default("lease_s")
    train_lease_s: float = _default("train_lease_s")
    stall_s: float = _default("stall_s")
    gen_batch_rows: int = _default("gen_batch_rows")
    gen_min_fill: float = _default("gen_min_fill")
    gen_jit_jobs: int | str = _default("gen_jit_jobs")  # a number, or 'auto' (control/jit.py)
    admission_memory_fraction: float = _default("admission_memory_fraction")
    retention_s: float = _default("retention_s")

    @classmethod
    def from_settings(cls, s: Settings) -> TickConfig:
        return cls(**{name: getattr(s, name) for name in cls.__dataclass_fields__})


def snapshot(store: Store, now: float, config: TickConfig = TickConfig(),
             memory: TickMemory = MEMORY) -> scheduler.Snapshot:
    """Read everything the policy needs (and clear the kick flag): store.tick_state, then at most one
    store.tick_details call, and while the trainer lane is free the Tinker models wanting it. Reads
    only (the one exception: a trainer lease held by a dead worker is broken, `_trainer_free`). Cost
    O(active jobs + expired leases + workers); no keyspace scan.

    Per-job details are read only where the plan can use them. `ready` is True for one job at most:
    the trainer's pick (the ready job with the lowest (pass, id), what scheduler.choose_trainer
    takes), and only while the lane is free. `need_eval` is read only while the generate station
    has free batches, and only for a prefix of the jobs (in id order) that the plan can reach: once
    the expired work and the needed evaluations found so far exceed  free * max(batch_rows, largest
    item)  rows, no later item fits in this tick's batches (a batch holds at most batch_rows rows,
    or one larger item), so later jobs are not asked and show no evaluation needed."""
    view = memory.view(store.url)
    state = store.tick_state(now, view.epoch, view.seq)
    workers = state["workers"]
    n_gen = sum(1 for w in workers.values() if w.get("station") == "generate")
    gen_capacity = 2 * max(1, n_gen)
    trainer_free = _trainer_free(store, state["trainer"], workers)
    jobs = view.update(store, state, memory.evals_done)
    expired = _parse_leases(store, state["expired"])
    free = max(0, gen_capacity - state["gen_inflight"])

    trainer_lines = []
    if trainer_free:
        trainer_lines = [j.ready_line for j in sorted((j for j in jobs if j.ready_line), key=attrgetter("order"))]
    eval_lines, budget, asked = [], 0, []
    if free and jobs:
        by_id = {j.id: j for j in jobs}
        cap = free * max(config.gen_batch_rows, max(j.rows for j in jobs))
        used = 0
        for kind, jid, _ in expired:  # the plan's first items: expired generate work
            j = by_id.get(jid)
            if j is not None and kind in (ItemKind.GEN, ItemKind.CONT, ItemKind.EVAL):
                used += j.state.eval_rows if kind == ItemKind.EVAL else j.state.group_size
                if used > cap:
                    break
        if used <= cap:
            asked = [j for j in jobs if j.eval_line]
            eval_lines, budget = [j.eval_line for j in asked], cap - used
    pick, words = store.tick_details(trainer_lines, budget, eval_lines)
    need = _needed_evals(asked, words, memory)
    states = [j.state for j in jobs]
    if pick is not None or need:
        for i, j in enumerate(jobs):
            if j.id == pick or j.id in need:
                states[i] = replace(j.state, ready=j.id == pick, need_eval=need.get(j.id, ()))
    gauge = memory.gauge(store.url)
    was = gauge.jit
    jit_jobs = jit.jit_jobs(config.gen_jit_jobs, config.gen_min_fill, gauge, now,
                            jit.gen_busy_share(state["gen_inflight"], n_gen), 0.0 if trainer_free else 1.0,
                            sum(1 for st in states if st.training))
    if gauge.jit != was and config.gen_jit_jobs == jit.AUTO:
        log.info("just in time generation %s: generate station busy %.2f, trainer %.2f of the time (averages)",
                 "on" if gauge.jit else "off", gauge.gen, gauge.train)
    tinker = _tinker_candidates(store) if trainer_free else ()
    if tinker:  # which jobs are between steps matters only when a Tinker model wants the lane
        stepping = memory.stepping(store.url, jobs, now, scheduler.ANTICIPATE_S)
        states = [replace(st, stepping=True) if st.id in stepping else st for st in states]
    return scheduler.Snapshot(
        jobs=tuple(states),
        gen_inflight=state["gen_inflight"],
        gen_capacity=gen_capacity,
        batch_rows=config.gen_batch_rows,
        trainer_free=trainer_free,
        expired=expired,
        min_batch_rows=int(config.gen_min_fill * config.gen_batch_rows),
        jit_jobs=jit_jobs,
        tinker=tinker,
        gen_workers=n_gen,
    )


def _needed_evals(asked: list[TableJob], words: list[str], memory: TickMemory) -> dict[str, tuple[int, ...]]:
    """tick_details' answer per asked job ('d' stored, '1' needed, per evaluation looked up) as the
    evaluations each job needs; the stored ones are remembered and not looked up again."""
    need: dict[str, tuple[int, ...]] = {}
    for j, word in zip(asked, words):
        if "d" in word:
            done = {v for v, f in zip(j.evals, word) if f == "d"}
            memory.remember_evals((*j.key, v) for v in done)
        else:
            done = ()
        needed = tuple(v for v, f in zip(j.evals, word) if f == "1")
        if needed:
            need[j.id] = needed
        if done:
            j.set_evals([v for v in j.evals if v not in done])
    return need


def _tinker_candidates(store: Store) -> tuple[scheduler.JobState, ...]:
    """Tinker models with queued training ops, as trainer candidates next to the jobs (the same
    weighted round-robin, the same per-tenant shares): each with its tenant's plan weight and its own
    pass (a new model starts at the virtual time, like a new job)."""
    models = TinkerStore(store).lane_candidates()
    if not models:
        return ()
    passes = store.lane_passes([m for m, _ in models])
    return tuple(scheduler.JobState(id=m, version=0, steps=1 << 30, staleness=0, groups_per_step=1, group_size=1,
                                    dispatched=0, weight=store.tenant_weight(tenant or None),
                                    pass_value=passes[m], ready=True, tenant=tenant) for m, tenant in models)


def _parse_leases(store: Store, names: list) -> tuple[WorkItem, ...]:
    """Expired lease names as items; a malformed one (written past the store) is dropped and logged,
    never fatal to scheduling."""
    out = []
    for name in names:
        try:
            out.append(WorkItem.parse(name))
        except ValueError:
            log.error("dropping a malformed lease %r", name[:200] if isinstance(name, str) else name)
            store.drop_lease(name)
    return tuple(out)


def _trainer_free(store: Store, lease: dict | None, workers: dict[str, dict]) -> bool:
    """The lane is free when no lease exists, or when the worker holding it has stopped beating
    (killed mid-step): then the lease is broken at once instead of waiting for its TTL."""
    if lease is None:
        return True
    worker = lease.get("worker")
    if worker and worker not in workers:
        store.release_trainer(lease["token"])
        return True
    return False


def watchdog(store: Store, now: float, stall_s: float, memory: TickMemory = MEMORY) -> list[str]:
    """Fail every job whose (version, dispatched) has not moved for `stall_s` seconds of this
    process's ticks, with the reason, never leaving it hanging; returns their ids. A job whose pass
    is past the trainer's virtual time is waiting its turn, not stalled: its clock starts again.
    Works on the jobs the last `snapshot` read (this process's table copy)."""
    jobs = memory.view(store.url).order
    stalled = memory.stalled(store.url, jobs, now, stall_s)
    if not stalled:
        return []
    vt = store.virtual_time()
    waiting = {j.id for j in jobs if j.id in stalled and j.state.pass_value > vt}
    memory.restart_clock(store.url, [j for j in jobs if j.id in waiting], now)
    stalled = [jid for jid in stalled if jid not in waiting]
    for jid in stalled:
        log.error("job %s made no progress for %.0f s: failing it", jid, stall_s)
        store.set_status(jid, "failed", f"no progress for {stall_s:.0f} s (no step published, no work "
                                        "dispatched): see the job's events and the workers' logs")
    return stalled


def tick(store: Store, send: Send, config: TickConfig = TickConfig(), now: float | None = None,
         memory: TickMemory = MEMORY) -> scheduler.Plan | None:
    """One scheduling round (snapshot, watchdog, plan, apply, finish_preflights); returns the plan carried out, or None
    if another tick holds the lock. Every GC_EVERY_S it also collects the bulk data of a few jobs
    past their retention period (of any ended job, oldest first, while the store is over its
    admission share)."""
    token = store.acquire_lock()
    if token is None:
        return None
    try:
        now = time.time() if now is None else now
        snap = snapshot(store, now, config, memory)  # clears the kick flag first
        failed = set(watchdog(store, now, config.stall_s, memory))
        if failed:  # their work is dropped with their status: plan without them
            snap = replace(snap, jobs=tuple(j for j in snap.jobs if j.id not in failed))
        plan = scheduler.plan(snap)
        apply(store, plan, send, config)
        finish_preflights(store, snap.jobs)
        if now - memory.last_gc.get(store.url, 0.0) > GC_EVERY_S:  # ended jobs' bulk data, a few at a time
            memory.last_gc[store.url] = now
            # Over the admission share, ended jobs' leftovers go before their retention period (oldest
            # first): the room belongs to running jobs, which fail on a write past the cap.
            over = store.over_share(config.admission_memory_fraction)[0]
            gone = store.collect_garbage(now, 0.0 if over else config.retention_s)
            if gone:
                log.info("collected the bulk data of %d ended jobs: %s", len(gone), ", ".join(gone))
        return plan
    finally:
        store.release_lock(token)


def finish_preflights(store: Store, jobs: tuple[scheduler.JobState, ...]) -> list[str]:
    """End every preflight whose groups are all dispatched and verified: its summary
    (`marlaas.verify.preflight.summarize` of the groups' rewards) is stored and the job is done.
    One round trip while a preflight is in flight, two more when it ends; returns the ended ids."""
    pending = [j for j in jobs if j.preflight and j.dispatched >= j.groups_per_step]
    if not pending:
        return []
    ended = []
    for j, n in zip(pending, store.groups_verified_counts([j.id for j in pending])):
        if n < j.groups_per_step:
            continue
        groups, errors = store.group_rewards(j.id, j.groups_per_step)
        if len(groups) < j.groups_per_step:  # a group regenerated meanwhile: the next tick sees it verified
            continue
        result = preflight.summarize(groups, errors)
        if store.end_preflight(j.id, result):
            log.info("preflight %s: %s", j.id, result["verdict"])
            ended.append(j.id)
    return ended


def _verify_messages(items: list[WorkItem] | tuple[WorkItem, ...]) -> list[tuple[str, list]]:
    """`marlaas.verify` messages for re-let VER / EVALVER items: one per job and kind, [job, kind,
    idxs] (the kind as the lease names it), the message the verify station takes."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for kind, jid, idx in items:
        grouped.setdefault((jid, ItemKind(kind).value), []).append(idx)
    return [("marlaas.verify", [jid, kind, idxs]) for (jid, kind), idxs in grouped.items()]


def apply(store: Store, plan: scheduler.Plan, send: Send, config: TickConfig = TickConfig()) -> None:
    """Write every lease, in-flight batch, dispatch counter and the trainer lane in one atomic script
    call (store.tick_write), then send the messages in one call (a crash in between, or a send that
    fails, leaves leases that expire and are dispatched again, and a trainer lease that expires).
    The trainer lane goes to the plan's pick, a job's step (`plan.train`) or a Tinker model
    (`plan.tinker`), charged by `plan.lane_weight`."""
    batch_ids = [uuid.uuid4().hex[:12] for _ in plan.gen_batches]
    items = [it for batch in plan.gen_batches for it in batch]
    relet = [WorkItem(*it).name for it in items[:plan.relet]] + [WorkItem(*it).name for it in plan.verify]
    new = [WorkItem(*it).name for it in items[plan.relet:]]
    train = None
    if plan.train is not None:
        train = (plan.train[0], plan.train[1], plan.lane_weight, config.train_lease_s)
    elif plan.tinker is not None:
        train = (plan.tinker, 0, plan.lane_weight, config.train_lease_s, True)
    token = store.tick_write(relet, new, config.lease_s, batch_ids, plan.dispatched, train)
    messages = [("marlaas.generate", [batch_id, [[ItemKind(k).value, j, i] for k, j, i in batch]])
                for batch_id, batch in zip(batch_ids, plan.gen_batches)]
    messages += _verify_messages(plan.verify)
    if token is not None and plan.tinker is not None:
        TinkerStore(store).take_model(plan.tinker)  # back among the candidates when its task ends with ops left
        messages.append(("marlaas.tinker_train", [plan.tinker, token, plan.lane_weight]))
    elif token is not None and plan.train is not None:
        messages.append(("marlaas.train", [plan.train[0], plan.train[1], token]))
    if messages:
        send(messages)
