"""The scheduler tick's impure half: read a Snapshot from the store, run the policy, carry it out.

`tick(store, send)` is called by the Celery `marlaas.tick` task (every second from beat, and after
every task completes). It holds the store's scheduler lock, so ticks never interleave.
`send(messages)` enqueues a tick's Celery tasks, a list of (task name, args), all at once (the
service's sender pushes them to the broker in one pipelined round trip: tasks/common.py); it is
passed in because this library never imports celery.
Leases are written before messages are sent: a crash between the two leaves work that the lease
expiry dispatches again, never work that is lost.

Cost at N active jobs (bench/tick.py): five round trips (lock, state, details, write, unlock), each
one script call whose reply or argument is a single string. The process keeps a copy of the
scheduling table (each active job's status, version, dispatched, pass, created: store_tick.py)
decoded into JobStates; each tick reads and decodes only the rows changed since its last read (the
table's change log), so the Python side is O(N) list building plus O(changed jobs) decoding. A spec
never changes, and an evaluation once stored stays stored: both are remembered per process.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter

from marlaas.control import scheduler
from marlaas.settings import get_settings
from marlaas.store import Store, item_name, parse_item
from marlaas.types import ACTIVE_STATUSES, ItemKind

log = logging.getLogger("marlaas.control")
GC_EVERY_S = 30.0
Send = Callable[[list[tuple[str, list]]], None]  # [(task name, args), ...] sent together


class _Job:
    """One row of the scheduling table, decoded: its JobState (ready False, no evals needed), the
    evaluations still to look up, and the lines the tick's details script takes."""

    __slots__ = ("id", "num", "key", "state", "evals", "ready_line", "eval_line", "rows", "order")

    def __init__(self, f: list[str], spec, url: str, evals_done: set):
        jid, _, t, d, pv, created = f
        t, d, p = int(t), int(d), spec.prompts_per_step
        self.id, self.num, self.key = jid, scheduler.id_number(jid), (url, jid, created)
        self.state = scheduler.JobState(
            id=jid, version=t, steps=spec.steps, staleness=spec.max_staleness, groups_per_step=p,
            group_size=spec.group_size, dispatched=d, weight=spec.weight, pass_value=float(pv or 0.0),
            eval_rows=spec.eval_size * (1 + spec.eval_k),  # greedy + sampled completions
            tenant=spec.tenant,
        )
        self.rows = max(spec.group_size, self.state.eval_rows)
        self.order = scheduler.trainer_order(self.state)  # the trainer's order (the tick's script keeps it)
        # a candidate for the trainer while its training is not over: are step t's groups all verified?
        self.ready_line = f"{jid} {t * p} {p}" if t < spec.steps else None
        evs = scheduler.evals_to_check(t, spec.steps, spec.eval_every)
        self.set_evals([v for v in evs if (*self.key, v) not in evals_done])

    def set_evals(self, evals: list[int]) -> None:
        self.evals = evals
        self.eval_line = f"{self.id} {self.state.eval_rows} {' '.join(map(str, evals))}" if evals else None


class _View:
    """This process's copy of one store's scheduling table: the decoded jobs, the epoch and change
    sequence number read last (store.tick_state sends only the rows changed since), id order."""

    def __init__(self):
        self.epoch, self.seq = "", "0"
        self.jobs: dict[str, _Job] = {}
        self.order: list[_Job] = []  # by id number
        self.pos: dict[str, int] = {}  # job id -> its index in order

    def update(self, store: Store, state: dict, evals_done: set) -> list[_Job]:
        """Apply tick_state's rows; returns the active jobs by id number. Only changed rows are
        decoded (specs read once per process: store.job_specs)."""
        if state["full"]:
            self.jobs = {}
        reorder, decode = state["full"], []
        for line in state["rows"]:
            jid, _, row = line.partition("\t")
            f = row.split("\t")
            if len(f) == 5 and f[0] in ACTIVE_STATUSES and f[1] and f[2]:
                decode.append((jid, f))
            elif self.jobs.pop(jid, None) is not None:
                reorder = True
        if decode:
            specs = store.job_specs([(jid, f[4]) for jid, f in decode])
            for jid, f in decode:
                if jid not in specs:  # deleted between the two reads
                    reorder |= self.jobs.pop(jid, None) is not None
                    continue
                reorder |= jid not in self.jobs
                self.jobs[jid] = e = _Job([jid, *f], specs[jid], store.url, evals_done)
                if not reorder:
                    self.order[self.pos[jid]] = e
        if reorder:
            self.order = sorted(self.jobs.values(), key=attrgetter("num"))
            self.pos = {e.id: i for i, e in enumerate(self.order)}
        self.epoch, self.seq = state["epoch"], state["seq"]
        return self.order


class TickMemory:
    """What a process remembers between its ticks: per store URL its copy of the scheduling table,
    and the evaluations known to be stored (permanent once stored). One per process (`MEMORY`); a
    benchmark or test that wants a cold tick calls `forget(url)`."""

    def __init__(self) -> None:
        self.views: dict[str, _View] = {}  # store url -> its view
        # (url, job id, created, version): evaluations known to be stored
        self.evals_done: set[tuple[str, str, str, int]] = set()
        # store url -> job key -> ((version, dispatched), when first seen so): the watchdog's clock
        self.progress: dict[str, dict[tuple, tuple[tuple[int, int], float]]] = {}
        self.last_gc: dict[str, float] = {}  # store url -> when this process last collected garbage

    def view(self, url: str) -> _View:
        return self.views.setdefault(url, _View())

    def forget(self, url: str) -> None:
        """Drop the table copy of one store: the next tick reads every row again."""
        self.views.pop(url, None)

    def stalled(self, url: str, jobs: list, now: float, limit_s: float) -> list[str]:
        """Jobs whose (version, dispatched) has not moved for `limit_s` seconds of this process's
        ticks (a restarted control worker starts the clock again)."""
        seen = self.progress.setdefault(url, {})
        out = []
        for j in jobs:  # keyed by (url, id, created): an id reused after a flushed DB is another job
            mark = (j.state.version, j.state.dispatched)
            prev = seen.get(j.key)
            if prev is None or prev[0] != mark:
                seen[j.key] = (mark, now)
            elif now - prev[1] > limit_s:
                out.append(j.id)
        if len(seen) > 2 * len(jobs) + 1000:  # forget ended jobs
            live = {j.key for j in jobs}
            self.progress[url] = {k: v for k, v in seen.items() if k in live}
        return out

    def restart_clock(self, url: str, jobs: list, now: float) -> None:
        seen = self.progress.setdefault(url, {})
        for j in jobs:
            seen[j.key] = ((j.state.version, j.state.dispatched), now)

    def remember_evals(self, keys) -> None:
        if len(self.evals_done) >= 1_000_000:
            self.evals_done.clear()
        self.evals_done.update(keys)


MEMORY = TickMemory()


def snapshot(store: Store, now: float, memory: TickMemory = MEMORY) -> scheduler.Snapshot:
    """Read everything the policy needs (and clear the kick flag): store.tick_state, then at most one
    store.tick_details call. Cost O(active jobs + expired leases + workers); no keyspace scan.

    Per-job details are read only where the plan can use them. `ready` is True for one job at most:
    the trainer's pick (the ready job with the lowest (pass, id), what scheduler.choose_trainer
    takes), and only while the lane is free. `need_eval` is read only while the generate station
    has free batches, and only for a prefix of the jobs (in id order) that the plan can reach: once
    the expired work and the needed evaluations found so far exceed  free * max(batch_rows, largest
    item)  rows, no later item fits in this tick's batches (a batch holds at most batch_rows rows,
    or one larger item), so later jobs are not asked and show no evaluation needed."""
    s = get_settings()
    view = memory.view(store.url)
    state = store.tick_state(now, view.epoch, view.seq)
    workers = state["workers"]
    n_gen = sum(1 for w in workers.values() if w.get("station") == "generate")
    gen_capacity = 2 * max(1, n_gen)
    trainer_free = _trainer_free(store, state["trainer"], workers)
    jobs = view.update(store, state, memory.evals_done)
    stalled = memory.stalled(store.url, jobs, now, s.stall_s)
    if stalled:  # a job whose pass is past the trainer's virtual time is waiting its turn, not stalled
        vt = store.virtual_time()
        waiting = {j.id for j in jobs if j.id in stalled and j.state.pass_value > vt}
        memory.restart_clock(store.url, [j for j in jobs if j.id in waiting], now)
        stalled = [jid for jid in stalled if jid not in waiting]
    if stalled:  # the watchdog: a job that makes no progress is failed with the reason, never left hanging
        for jid in stalled:
            log.error("job %s made no progress for %.0f s: failing it", jid, s.stall_s)
            store.set_status(jid, "failed", f"no progress for {s.stall_s:.0f} s (no step published, no work "
                                            "dispatched): see the job's events and the workers' logs")
        jobs = view.update(store, store.tick_state(now, view.epoch, view.seq), memory.evals_done)
    expired = _parse_leases(store, state["expired"])
    free = max(0, gen_capacity - state["gen_inflight"])

    trainer_lines = []
    if trainer_free:
        trainer_lines = [j.ready_line for j in sorted((j for j in jobs if j.ready_line), key=attrgetter("order"))]
    eval_lines, budget, asked = [], 0, []
    if free and jobs:
        by_id = {j.id: j for j in jobs}
        cap = free * max(s.gen_batch_rows, max(j.rows for j in jobs))
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
    states = [j.state for j in jobs]
    if pick is not None or need:
        for i, j in enumerate(jobs):
            if j.id == pick or j.id in need:
                states[i] = replace(j.state, ready=j.id == pick, need_eval=need.get(j.id, ()))
    return scheduler.Snapshot(
        jobs=tuple(states),
        gen_inflight=state["gen_inflight"],
        gen_capacity=gen_capacity,
        batch_rows=s.gen_batch_rows,
        trainer_free=trainer_free,
        expired=expired,
        min_batch_rows=int(s.gen_min_fill * s.gen_batch_rows),
        jit_jobs=s.gen_jit_jobs,
    )


def _parse_leases(store: Store, names: list) -> tuple[scheduler.Item, ...]:
    """Expired lease names as items; a malformed one (written past the store) is dropped and logged,
    never fatal to scheduling."""
    out = []
    for name in names:
        try:
            kind, jid, idx = parse_item(name)
            out.append((ItemKind(kind).value, jid, idx))
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


def tick(store: Store, send: Send, now: float | None = None, memory: TickMemory = MEMORY) -> scheduler.Plan | None:
    """One scheduling round; returns the plan carried out, or None if another tick holds the lock.
    Every GC_EVERY_S it also collects the bulk data of a few jobs past their retention period (of any
    ended job, oldest first, while the store is over its admission share)."""
    token = store.acquire_lock()
    if token is None:
        return None
    try:
        now = time.time() if now is None else now
        snap = snapshot(store, now, memory)  # clears the kick flag first
        plan = scheduler.plan(snap)
        lane = _lane_candidates(store, snap, plan)
        apply(store, plan, send, snap, lane)
        if now - memory.last_gc.get(store.url, 0.0) > GC_EVERY_S:  # ended jobs' bulk data, a few at a time
            memory.last_gc[store.url] = now
            cfg = get_settings()
            # Over the admission share, ended jobs' leftovers go before their retention period (oldest
            # first): the room belongs to running jobs, which fail on a write past the cap.
            retention = 0.0 if store.over_share(cfg.admission_memory_fraction)[0] else cfg.retention_s
            gone = store.collect_garbage(now, retention)
            if gone:
                log.info("collected the bulk data of %d ended jobs: %s", len(gone), ", ".join(gone))
        return plan
    finally:
        store.release_lock(token)


def _lane_candidates(store: Store, snap: scheduler.Snapshot, plan: scheduler.Plan) -> list[scheduler.JobState]:
    """Tinker models with queued training ops, as trainer candidates next to the jobs (the same
    weighted round-robin, the same per-tenant shares): each with its tenant's plan weight and its own
    pass (a new model starts at the virtual time, like a new job). Read only while the lane is free."""
    if not snap.trainer_free:
        return []
    from marlaas.api.tenancy import plan_of
    from marlaas.store.tinker import TinkerStore

    models = TinkerStore(store).lane_candidates()
    if not models:
        return []
    passes = store.lane_passes([m for m, _ in models])
    return [scheduler.JobState(id=m, version=0, steps=1 << 30, staleness=0, groups_per_step=1, group_size=1,
                               dispatched=0, weight=plan_of(store, tenant or None).weight, pass_value=passes[m],
                               ready=True, tenant=tenant) for m, tenant in models]


def apply(store: Store, plan: scheduler.Plan, send: Send, snap: scheduler.Snapshot,
          lane: list[scheduler.JobState] | None = None) -> None:
    """Write every lease, in-flight batch, dispatch counter and the trainer lane in one atomic script
    call (store.tick_write), then send the messages in one call (a crash in between, or a send that
    fails, leaves leases that expire and are dispatched again, and a trainer lease that expires).
    `lane`: Tinker models wanting the trainer; the lane goes to whichever of them and the job the
    plan picked comes first in `scheduler.trainer_order`."""
    s = get_settings()
    batch_ids = [uuid.uuid4().hex[:12] for _ in plan.gen_batches]
    items = [it for batch in plan.gen_batches for it in batch]
    relet = [item_name(k, j, i) for k, j, i in items[:plan.relet]]
    relet += [item_name(k, j, i) for k, j, i in plan.verify]
    new = [item_name(k, j, i) for k, j, i in items[plan.relet:]]
    train, tinker = None, None
    everyone = [*snap.jobs, *(lane or [])]
    picks = [j for j in snap.jobs if plan.train is not None and j.id == plan.train[0]] + list(lane or [])
    if picks:
        first = min(picks, key=scheduler.trainer_order)
        weight = scheduler.lane_weights(everyone)[first.id]  # fair per tenant, jobs and Tinker models alike
        train = (first.id, first.version, weight, s.train_lease_s)
        if plan.train is None or first.id != plan.train[0]:
            tinker, plan.train = first.id, None
    token = store.tick_write(relet, new, s.lease_s, batch_ids, plan.dispatched, train)
    messages = [("marlaas.generate", [batch_id, [list(it) for it in batch]])
                for batch_id, batch in zip(batch_ids, plan.gen_batches)]
    verify: dict[tuple[str, str], list[int]] = {}  # one message per job and kind, as generate sends them
    for kind, jid, idx in plan.verify:
        verify.setdefault((jid, "train" if kind == ItemKind.VER else "eval"), []).append(idx)
    messages += [("marlaas.verify", [jid, kind, idxs]) for (jid, kind), idxs in verify.items()]
    if token is not None and tinker is not None:
        from marlaas.store.tinker import TinkerStore

        TinkerStore(store).take_model(tinker)  # back among the candidates when its task ends with ops left
        messages.append(("marlaas.tinker_train", [tinker, token]))
    elif token is not None:
        messages.append(("marlaas.train", [plan.train[0], plan.train[1], token]))
    if messages:
        send(messages)
