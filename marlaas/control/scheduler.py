"""Scheduling policy: pure functions of a state snapshot (no Redis, no Celery, no clock).

The Celery `tick` task (tasks/scheduler.py) reads a `Snapshot` from the store under a lock, calls
`plan()`, and carries the `Plan` out. Keeping the policy pure makes it unit-testable and lets the
simulator in bench/ run the very same code over simulated time.

Staleness by admission control (AReaL / SkyRL style). Job j with P groups per step, at published
version t, may have dispatched at most  min((t + S + 1) * P, steps * P)  groups. Step k trains on
exactly the groups [kP, (k+1)P). Group g (step k = g // P) can only be dispatched once
g < (t_d + S + 1) P, i.e. at some version t_d >= k - S, and it is sampled with the version current
when the generate task runs, v >= t_d. It trains at version t = k, so t - v <= k - t_d <= S.
Nothing is discarded in normal operation; the train task still checks the bound and regenerates
(never trains on) any group that would break it.

The bound is a limit, not a target. Groups of a job's next step are sampled at the version they
train at (staleness 0); only groups ahead (for later steps) are sampled older. They buy overlap of
generation and training within one job, which is worth it with few jobs. With `jit_jobs` set and at
least that many jobs training, the trainer always has other jobs' steps to take while one job's next
step is generated, so groups ahead are not generated at all (just in time): samples stay fresh and
the off-policy gap between sampler and learner stays 0 while the trainer is the busy station.

Trainer lane: weighted round-robin by stride scheduling. Each job has a pass value; among jobs
whose next step's groups are all verified, the one with the lowest pass trains next and its pass
grows by 1 / weight. Over any window a job with weight w gets a share w / sum(w) of the steps
(among jobs that are ready), within one step. Tinker models with queued training ops
(`Snapshot.tinker`) compete for the same lane under the same rule: `choose_trainer` takes the first
of the ready jobs and models in `trainer_order`, and the plan says which (`Plan.train` or
`Plan.tinker`, never both) with the lane weight to charge. A model's grant is charged one step when
granted and, when it ends, its time beyond one job step (`grant_extra_charge`), so a model's long ops
cost it turns in proportion to the lane time they took. A plan is frozen: the tick carries it out
as decided.

Station pools per tenant (`pool_share`, `may_take_slot`): the verify pool's processes are shared
the same way. While another tenant has verify work waiting, a tenant holds at most its plan-weighted
share of the pool (at least one process); alone it may use the whole pool. The verify task asks
before it runs (tasks/verify.py, over `marlaas.store.slots`) and a task past its tenant's share goes
back to the queue, so a slow grader delays only its own tenant. Generate batches are mixed across
tenants by rows: `_interleave` keys a job's k-th group by the rows it has been given over its
tenant's weight split over the tenant's training jobs (`lane_weights`), so a tenant with many jobs or
large groups gets no more generated rows per round than its share.

Preflights (`JobState.preflight`, a learnability check: marlaas.verify.preflight): a preflight job
is one step of N groups at version 0 with staleness 0, so admission lets exactly its N groups out;
it never gets the trainer lane, never an evaluation, and counts for neither the per-tenant lane
shares nor `jit_jobs`. The tick ends it once its N groups are verified (control/dispatch.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

from marlaas.types import ItemKind, WorkItem, eval_versions

Item = WorkItem  # (kind, job id, group index or version)


@dataclass(frozen=True)
class JobState:
    """What the policy needs to know about one active job."""

    id: str
    version: int
    steps: int
    staleness: int
    groups_per_step: int
    group_size: int
    dispatched: int
    weight: float = 1.0
    pass_value: float = 0.0
    ready: bool = False
    eval_rows: int = 0
    need_eval: tuple[int, ...] = ()
    tenant: str = ""
    preflight: bool = False  # a learnability check: its groups at version 0 only, never trained or evaluated
    stepping: bool = False  # published or dispatched within the last ANTICIPATE_S: its next step is near

    @property
    def done_training(self) -> bool:
        return self.version >= self.steps

    @property
    def training(self) -> bool:
        """Still wants the trainer lane: a job (not a preflight) whose training is not over."""
        return not self.preflight and not self.done_training


@dataclass(frozen=True)
class Snapshot:
    """The state the scheduler decides on."""

    jobs: tuple[JobState, ...]
    gen_inflight: int = 0
    gen_capacity: int = 2
    batch_rows: int = 256
    trainer_free: bool = True
    expired: tuple[Item, ...] = ()
    min_batch_rows: int = 0  # a batch of groups ahead only (none urgent) waits until this full
    jit_jobs: int = 0  # from this many jobs training on, no groups ahead are generated (0: never just in time)
    tinker: tuple[JobState, ...] = ()  # Tinker models wanting the trainer lane (ready), read while it is free
    gen_workers: int = 0  # generate workers alive (0: unknown, batches are never spread)


@dataclass(frozen=True)
class Plan:
    """What to dispatch now. `train` (a job's next step: id, version) and `tinker` (a Tinker model's
    id) are the trainer lane's pick, at most one of them; `lane_weight` is what the pick is charged
    by (stride 1 / weight). Frozen: no field is reassigned, and its lists are not changed once `plan`
returns it."""

    gen_batches: list[list[Item]] = field(default_factory=list)
    dispatched: dict[str, int] = field(default_factory=dict)
    verify: list[Item] = field(default_factory=list)
    train: tuple[str, int] | None = None
    relet: int = 0  # the first `relet` items of gen_batches are expired work dispatched again
    tinker: str | None = None
    lane_weight: float = 0.0


def admission_limit(version: int, staleness: int, groups_per_step: int, steps: int) -> int:
    """Most groups a job may have dispatched at this version."""
    return min((version + staleness + 1) * groups_per_step, steps * groups_per_step)


def due_evals(version: int, steps: int, every: int) -> list[int]:
    """The evaluated versions already published at `version` (their adapters exist): the ones an
    evaluation may be dispatched for now. Evaluations ride in generation batches and never gate
    a train step; the job is done once every version of `eval_versions` has its evaluation."""
    return [v for v in eval_versions(steps, every) if v <= version]


def evals_to_check(version: int, steps: int, every: int, window: int = 64) -> list[int]:
    """The due evaluations a tick looks up (done? leased?): while training, version 0 and the
    newest `window` due ones (bounds the per-tick reads of a long job with a small K; an older one
    was seen by the ticks right after its publish, and a lost dispatch comes back by lease expiry);
    once training is over, all of them, so a missed one is still found before the job is done."""
    due = due_evals(version, steps, every)
    if version >= steps or len(due) <= window + 1:
        return due
    return [0, *due[-window:]]


def step_of(group: int, groups_per_step: int) -> int:
    return group // groups_per_step


def step_groups(step: int, groups_per_step: int) -> list[int]:
    """The groups step `step` trains on."""
    return list(range(step * groups_per_step, (step + 1) * groups_per_step))


def within_staleness(train_version: int, sample_version: int, staleness: int) -> bool:
    """Invariant 1: a rollout sampled at v may train at t only if 0 <= t - v <= S."""
    return 0 <= train_version - sample_version <= staleness


def trainer_order(j: JobState) -> tuple[float, tuple[int, str]]:
    """THE trainer order, the one rule of weighted round-robin: lowest pass first, ties by id number.
    Used by `choose_trainer`, by the order in which groups a next step lacks are generated
    (`_groups_in_order`), and by the tick, which hands the trainer candidates to the store's script in
    this order (the script takes the first one whose next step is fully verified)."""
    return (j.pass_value, id_number(j.id))


def lane_weights(jobs: tuple[JobState, ...] | list[JobState]) -> dict[str, float]:
    """Each job's weight on the trainer lane: its tenant's weight split evenly over the tenant's jobs
    still training, so that shares are fair per tenant (a tenant with 8 jobs gets what a tenant of
    equal weight with 1 job gets). Stride scheduling charges a job 1 / this per step."""
    count: dict[str, int] = {}
    for j in jobs:
        if j.training:
            count[j.tenant] = count.get(j.tenant, 0) + 1
    return {j.id: j.weight / max(1, count.get(j.tenant, 0)) for j in jobs}


ANTICIPATE_S = 2.0
"""A job that published or dispatched work this recently is `stepping`: its next step is near."""


def choose_trainer(jobs: tuple[JobState, ...] | list[JobState],
                   tinker: tuple[JobState, ...] | list[JobState] = ()) -> JobState | None:
    """Weighted round-robin: the ready job or Tinker model first in `trainer_order` (a model is one
    of `tinker`, a candidate like a job whose step is ready: see `Snapshot.tinker`).

    A job is ready only between its steps' generation and its training; a Tinker model with queued
    ops is ready all the time, and its grant holds the lane for seconds. So a model is not given
    the lane while a job before it in `trainer_order` is `stepping` (its next step due within moments):
    the lane waits for that job, as it would have been ready a moment later. Otherwise a model
    would take the lane in every gap between a fast job's steps, whatever its pass, and the job would
    get far less than its share. A job that stops stepping (stuck in a slow grader, say) never holds
    the lane: after ANTICIPATE_S the model goes on."""
    ready = [j for j in (*jobs, *tinker) if j.ready and j.training]  # a preflight never trains
    if not ready:
        return None
    best = min(ready, key=trainer_order)
    if any(best is m for m in tinker) and any(
            j.stepping and j.training and not j.ready and trainer_order(j) < trainer_order(best) for j in jobs):
        return None  # a Tinker grant is long: the lane waits for the job before it whose step is near
    return best


def grant_extra_charge(seconds: float, step_seconds: float | None, weight: float) -> float:
    """The pass a Tinker grant owes beyond the one step the tick charged when it granted the lane:
    grants are charged by time in units of a job step (`step_seconds`, what the trainer's job steps
    take lately), so a model whose ops hold the lane for 10 steps' time pays 10 steps. Nothing extra
    without a measure of a job step (no job trains: nobody to be fair to) or for a grant shorter than
    one step."""
    if not step_seconds or step_seconds <= 0 or weight <= 0:
        return 0.0
    return max(0.0, seconds / step_seconds - 1.0) / weight


@lru_cache(maxsize=65536)
def id_number(jid: str) -> tuple[int, str]:
    """A job id's sort key: 'j12' -> (12, 'j12') (ids are 'j' + a sequence number)."""
    digits = "".join(c for c in jid if c.isdigit())
    return (int(digits) if digits else 0, jid)


def pool_share(tenant: str, capacity: int, weights: Mapping[str, float], competing: Iterable[str]) -> int:
    """A tenant's share of a station pool of `capacity` processes among the `competing` tenants (those
    holding or wanting a process; the tenant itself always counts): its weight's fraction of the
    pool, rounded down, at least one process. Unknown tenants weigh 1."""
    names = {*competing, tenant}
    total = sum(max(weights.get(t, 1.0), 1e-9) for t in names)
    return max(1, int(capacity * max(weights.get(tenant, 1.0), 1e-9) / total + 1e-9))


def may_take_slot(tenant: str, capacity: int, weights: Mapping[str, float], running: Mapping[str, int],
                  waiting: Iterable[str]) -> bool:
    """Whether the tenant's next task may take a process of the pool now. `running`: processes each
    tenant holds; `waiting`: tenants with work waiting for the pool (recently asked or refused). Alone
    (no other tenant waiting) a tenant may use the whole pool; otherwise at most `pool_share` of it,
    where the tenants competing are the others waiting and the others holding processes."""
    others = {t for t in waiting if t != tenant}
    if not others:
        return True
    competing = others | {t for t, n in running.items() if n > 0 and t != tenant}
    return running.get(tenant, 0) < pool_share(tenant, capacity, weights, competing)


def _interleave(jobs: tuple[JobState, ...]) -> list[Item]:
    """Admissible new groups of all jobs, merged so that a batch mixes tenants in proportion to their
    weights, in rows: the k-th group of a job gets the key (k + 1) * group_size / w, with w its
    tenant's weight split over the tenant's training jobs (`lane_weights`); equal keys go to the job
    whose next step is blocked on generation, then to the lower pass."""
    return list(_interleave_iter(jobs))


def _next_step_limit(j: JobState) -> int:
    """Groups the job's next step trains on, all of them: [0, (version + 1) P)."""
    return min((j.version + 1) * j.groups_per_step, j.steps * j.groups_per_step)


def _interleave_iter(jobs: tuple[JobState, ...]):
    """`_interleave` lazily: a heap holds each admissible job's next key, so taking m items costs
    O(J log J + m log J) instead of materialising and sorting every admissible group of every job."""
    def urgency(j: JobState):
        blocked = j.dispatched < _next_step_limit(j)  # its next step lacks groups
        return (0 if blocked else 1, *trainer_order(j))

    open_jobs = [(j, admission_limit(j.version, j.staleness, j.groups_per_step, j.steps)) for j in jobs]
    open_jobs = sorted(((j, lim) for j, lim in open_jobs if lim > j.dispatched), key=lambda x: urgency(x[0]))
    split = lane_weights(jobs)  # per tenant: a tenant's many jobs share its weight
    stride = [max(1, j.group_size) / max(split[j.id], 1e-9) for j, _ in open_jobs]
    heap = [(stride[rank], rank, 0) for rank in range(len(open_jobs))]
    heapq.heapify(heap)
    while heap:
        _, rank, k = heap[0]
        j, limit = open_jobs[rank]
        yield WorkItem(ItemKind.GEN, j.id, j.dispatched + k)
        if j.dispatched + k + 1 < limit:
            heapq.heapreplace(heap, ((k + 2) * stride[rank], rank, k + 1))
        else:
            heapq.heappop(heap)


def just_in_time(jobs: tuple[JobState, ...], jit_jobs: int) -> bool:
    """Whether groups ahead are left out: `jit_jobs` > 0 and at least that many jobs still training."""
    return jit_jobs > 0 and sum(1 for j in jobs if j.training) >= jit_jobs


def _groups_in_order(jobs: tuple[JobState, ...], evals: list[Item], ahead: bool = True):
    """The groups the jobs' next steps still lack, job by job in the order the trainer takes them
    (choose_trainer's: lowest pass, then id), so that each batch completes whole steps; then
    `evals`; then (if `ahead`) the other admissible groups interleaved across jobs by weight
    (starting where the first pass stopped for each job)."""
    taken: dict[str, int] = {}
    for j in sorted((j for j in jobs if j.dispatched < _next_step_limit(j)), key=trainer_order):
        for g in range(j.dispatched, min(_next_step_limit(j),
                                         admission_limit(j.version, j.staleness, j.groups_per_step, j.steps))):
            taken[j.id] = g + 1
            yield WorkItem(ItemKind.GEN, j.id, g)
    yield from evals
    if not ahead:
        return
    if taken:
        jobs = tuple(replace(j, dispatched=taken[j.id]) if j.id in taken else j for j in jobs)
    yield from _interleave_iter(jobs)


def _urgent(item: Item, by_id: dict[str, JobState]) -> bool:
    """Lost work, evaluations, tool turns and the groups a job's next train step lacks."""
    return item[0] != ItemKind.GEN or item[2] < _next_step_limit(by_id[item[1]])


def _hold_back(batches: list[list[Item]], by_id: dict[str, JobState], min_rows: int) -> list[list[Item]]:
    """Keep the batches that hold an urgent item or at least `min_rows` rows. Items come in priority
    order (every urgent item before every group ahead), so the first batch that fails has only groups
    ahead, and so have the batches after it: they wait for a later tick (nothing is dispatched, so
    `dispatched` does not move and the same groups come back, with more of them, next time)."""
    kept = []
    for batch in batches:
        if sum(_rows(it, by_id) for it in batch) < min_rows and not any(_urgent(it, by_id) for it in batch):
            break
        kept.append(batch)
    return kept


def idle_workers(s: Snapshot) -> int:
    """Generate workers with nothing to do: the workers alive less the batches in flight (each
    worker runs one batch at a time)."""
    return max(0, s.gen_workers - s.gen_inflight)


def _spread(batches: list[list[Item]], k: int, by_id: dict[str, JobState]) -> list[list[Item]]:
    """The same items, in the same order, as k batches (when there are fewer, and at least k items)
    of about equal rows: contiguous runs, so every urgent item stays in a batch before the items
    after it. A lone job's step (which fits one batch) goes to every idle worker at once."""
    items = [it for b in batches for it in b]
    k = min(k, len(items))
    if k <= len(batches):
        return batches
    rows = [_rows(it, by_id) for it in items]
    total, out, acc = sum(rows), [[]], 0
    for i, (it, r) in enumerate(zip(items, rows)):
        left_items, left_batches = len(items) - i, k - len(out)
        # close the batch at its share of the rows, or when each later batch needs an item of its own
        if out[-1] and left_batches > 0 and (acc >= total * len(out) / k or left_items <= left_batches):
            out.append([])
        out[-1].append(it)
        acc += r
    return out


def _rows(item: Item, by_id: dict[str, JobState]) -> int:
    j = by_id[item[1]]
    return j.eval_rows if item[0] == ItemKind.EVAL else j.group_size


def plan(s: Snapshot) -> Plan:
    """Decide what to dispatch: generation batches, re-verifications and the trainer's next job or
    Tinker model."""
    by_id = {j.id: j for j in s.jobs}
    expired = [it for it in s.expired if it[1] in by_id]
    verify = [it for it in expired if it[0] in (ItemKind.VER, ItemKind.EVALVER)]

    # Work for the generate station, in priority order: lost work first, then the groups each job's
    # next train step still lacks (the trainer waits on them), then evaluations, then the other
    # admissible groups; groups interleaved across jobs (one group per job per round) so that a batch
    # mixes tenants. "cont" items (a tool episode's next model turn) arrive as leases due at once.
    first = [it for it in expired if it[0] in (ItemKind.GEN, ItemKind.CONT, ItemKind.EVAL)]
    expired_evals = {(it[1], it[2]) for it in first if it[0] == ItemKind.EVAL}
    evals = [WorkItem(ItemKind.EVAL, j.id, v) for j in s.jobs if not j.preflight
             for v in j.need_eval if (j.id, v) not in expired_evals]
    ahead = not just_in_time(s.jobs, s.jit_jobs)
    todo = itertools.chain(first, _groups_in_order(s.jobs, evals, ahead))  # lazy: read only what fits

    free = max(0, s.gen_capacity - s.gen_inflight)
    batches: list[list[Item]] = []
    it = next(todo, None) if free else None
    while it is not None and len(batches) < free:
        batch, rows = [], 0
        while it is not None and (not batch or rows + _rows(it, by_id) <= s.batch_rows):
            batch.append(it)
            rows += _rows(it, by_id)
            it = next(todo, None)
        batches.append(batch)
    if s.min_batch_rows > 0:
        batches = _hold_back(batches, by_id, s.min_batch_rows)
    if batches:  # work that fits fewer batches than there are idle workers goes to all of them
        batches = _spread(batches, min(free, idle_workers(s)), by_id)
    dispatched: dict[str, int] = {}
    for batch in batches:
        for kind, jid, g in batch:
            if kind == ItemKind.GEN and g >= by_id[jid].dispatched:
                dispatched[jid] = max(dispatched.get(jid, 0), g + 1)

    train, tinker, weight = None, None, 0.0
    if s.trainer_free:
        pick = choose_trainer(s.jobs, s.tinker)
        if pick is not None:
            weight = lane_weights((*s.jobs, *s.tinker))[pick.id]  # fair per tenant, jobs and models alike
            if pick.id in by_id:
                train = (pick.id, pick.version)
            else:
                tinker = pick.id
    return Plan(gen_batches=batches, dispatched=dispatched, verify=verify,
                train=train, relet=min(len(first), sum(len(b) for b in batches)), tinker=tinker,
                lane_weight=weight)
