"""What a control process remembers between its scheduler ticks (the tick itself: dispatch.py).

Per store URL: a decoded copy of the scheduling table (each active job's status, version, dispatched,
pass, created: store/tick.py), refreshed from the table's change log, so a tick decodes only the rows
changed since its last read; the evaluations known to be stored (permanent once stored); the
watchdog's clock of each job's progress. Invariant: a job is keyed by (url, id, created), so an id
reused after a flushed DB is another job.
"""

from __future__ import annotations

from operator import attrgetter

from marlaas.control import scheduler
from marlaas.control.jit import JitGauge
from marlaas.store import Store
from marlaas.types import ACTIVE_STATUSES


class TableJob:
    """One row of the scheduling table, decoded: its JobState (ready False, no evals needed), the
    evaluations still to look up, and the lines the tick's details script takes."""

    __slots__ = ("id", "num", "key", "state", "evals", "ready_line", "eval_line", "rows", "order")

    def __init__(self, f: list[str], spec, url: str, evals_done: set):
        jid, _, t, d, pv, created = f
        t, d, p = int(t), int(d), spec.prompts_per_step
        steps, staleness = spec.steps, spec.max_staleness
        if spec.preflight:  # one step of preflight_prompts groups at version 0, never trained (scheduler.py)
            steps, staleness, p = 1, 0, spec.preflight_prompts
        self.id, self.num, self.key = jid, scheduler.id_number(jid), (url, jid, created)
        self.state = scheduler.JobState(
            id=jid, version=t, steps=steps, staleness=staleness, groups_per_step=p,
            group_size=spec.group_size, dispatched=d, weight=spec.weight, pass_value=float(pv or 0.0),
            eval_rows=spec.eval_size * (1 + spec.eval_k),  # greedy + sampled completions
            tenant=spec.tenant, preflight=spec.preflight,
        )
        self.rows = max(spec.group_size, self.state.eval_rows)
        self.order = scheduler.trainer_order(self.state)  # the trainer's order (the tick's script keeps it)
        # a candidate for the trainer while its training is not over: are step t's groups all verified?
        self.ready_line = f"{jid} {t * p} {p}" if t < steps and not spec.preflight else None
        evs = [] if spec.preflight else scheduler.evals_to_check(t, spec.steps, spec.eval_every)
        self.set_evals([v for v in evs if (*self.key, v) not in evals_done])

    def set_evals(self, evals: list[int]) -> None:
        self.evals = evals
        self.eval_line = f"{self.id} {self.state.eval_rows} {' '.join(map(str, evals))}" if evals else None


class TableView:
    """This process's copy of one store's scheduling table: the decoded jobs, the epoch and change
    sequence number read last (store.tick_state sends only the rows changed since), id order."""

    def __init__(self):
        self.epoch, self.seq = "", "0"
        self.jobs: dict[str, TableJob] = {}
        self.order: list[TableJob] = []  # by id number
        self.pos: dict[str, int] = {}  # job id -> its index in order

    def update(self, store: Store, state: dict, evals_done: set) -> list[TableJob]:
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
                self.jobs[jid] = e = TableJob([jid, *f], specs[jid], store.url, evals_done)
                if not reorder:
                    self.order[self.pos[jid]] = e
        if reorder:
            self.order = sorted(self.jobs.values(), key=attrgetter("num"))
            self.pos = {e.id: i for i, e in enumerate(self.order)}
        self.epoch, self.seq = state["epoch"], state["seq"]
        return self.order


class TickMemory:
    """What a process remembers between its ticks: per store URL its copy of the scheduling table,
    the stations' time-averaged busy shares (control/jit.py), and the evaluations known to be stored
    (permanent once stored). One per process (`MEMORY`); a benchmark or test that wants a cold tick
    calls `forget(url)`."""

    def __init__(self) -> None:
        self.views: dict[str, TableView] = {}  # store url -> its view
        # (url, job id, created, version): evaluations known to be stored
        self.evals_done: set[tuple[str, str, str, int]] = set()
        # store url -> job key -> ((version, dispatched), when first seen so): the watchdog's clock
        self.progress: dict[str, dict[tuple, tuple[tuple[int, int], float]]] = {}
        self.last_gc: dict[str, float] = {}  # store url -> when this process last collected garbage
        self.gauges: dict[str, JitGauge] = {}  # store url -> its stations' busy shares (automatic just in time)

    def view(self, url: str) -> TableView:
        return self.views.setdefault(url, TableView())

    def gauge(self, url: str) -> JitGauge:
        return self.gauges.setdefault(url, JitGauge())

    def forget(self, url: str) -> None:
        """Drop the table copy of one store: the next tick reads every row again."""
        self.views.pop(url, None)

    def stalled(self, url: str, jobs: list, now: float, limit_s: float) -> list[str]:
        """Jobs whose (version, dispatched) has not moved for `limit_s` seconds of this process's
        ticks (a restarted control worker starts the clock again)."""
        seen = self.progress.setdefault(url, {})
        out = []
        for j in jobs:  # keyed by (url, id, created): an id reused after a flushed DB is another job
            mark = _mark(j)
            prev = seen.get(j.key)
            if prev is None or prev[0] != mark:
                seen[j.key] = (mark, now)
            elif now - prev[1] > limit_s:
                out.append(j.id)
        if len(seen) > 2 * len(jobs) + 1000:  # forget ended jobs
            live = {j.key for j in jobs}
            self.progress[url] = {k: v for k, v in seen.items() if k in live}
        return out

    def stepping(self, url: str, jobs: list, now: float, within_s: float) -> set[str]:
        """Jobs whose (version, dispatched) moved within `within_s` seconds (or first seen now), by
        the watchdog's clock; reads only."""
        seen = self.progress.get(url, {})
        out = set()
        for j in jobs:
            prev = seen.get(j.key)
            if prev is None or prev[0] != _mark(j) or now - prev[1] < within_s:
                out.add(j.id)
        return out

    def restart_clock(self, url: str, jobs: list, now: float) -> None:
        seen = self.progress.setdefault(url, {})
        for j in jobs:
            seen[j.key] = (_mark(j), now)

    def remember_evals(self, keys) -> None:
        if len(self.evals_done) >= 1_000_000:
            self.evals_done.clear()
        self.evals_done.update(keys)


def _mark(j) -> tuple[int, int]:
    """A job's progress as the watchdog's clock sees it: (version, dispatched)."""
    return j.state.version, j.state.dispatched


MEMORY = TickMemory()
