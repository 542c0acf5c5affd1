"""Discrete-event simulator that drives the real `marlaas.control.scheduler.plan` over simulated time.

    from bench.sim_engine import Cluster, simulate
    simulate(params, workload, n_tenants, Cluster(...), mode="marlaas")

What is simulated, mirroring marlaas/control/dispatch.py and tasks/:
- A tick builds a `scheduler.Snapshot` from the simulator's state exactly as `dispatch.snapshot`
  does (version, dispatched, pass, ready = all groups of the next step verified, need_eval,
  gen_inflight, gen_capacity = inflight_per_worker * generate workers, batch_rows, trainer_free)
  and carries out the `Plan`: generate batches are queued, `dispatched` advances, the chosen job's
  pass grows by 1/weight when its train task is dispatched. A tick runs after any completion (the
  kick); ticks that could not dispatch anything (generate capacity full and every lane busy) are
  skipped, which changes no decision.
- Stations: `gen_workers` generate workers (FIFO queue, each keeps the adapter versions it loaded),
  `verify_slots` verify processes, `train_lanes` trainer lanes. A generate task samples every group
  with the job's version when the task starts (as run_generate reads it) and sends one verify task
  per (job, kind) itself; a train task publishes version t+1 and checks Invariant 1 on every group.
- Several trainer lanes: the policy has one `trainer_free` flag. For L > 1 the simulator asks the
  same `plan()` again, once per further free lane, on a snapshot with no generate capacity and the
  jobs already training marked not ready (pass values updated), so each lane gets the stride-WRR
  choice among the rest. The one-trainer-lane invariant holds for L = 1 only.
- Every task starts `dispatch_s` after the decision (broker round trip + tick); with
  `Cluster.control_slots` that is CPU work of a control process sharing the machine's cores.
- Shared resources by processor sharing: stations mapped to a resource of capacity c run at rate
  min(1, c / n) when n tasks run on it (2 CPU cores for the CPU calibration; one GPU shared by
  generate and train on a single accelerator). Unmapped stations have their own hardware.
- mode "sequential": one job at a time (the next is submitted `submit_gap_s` after the previous is
  done), each with staleness 0; mode "marlaas": all jobs at time 0 with the workload's staleness.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field, replace

from marlaas.control import jit, scheduler
from marlaas.control.jit import JitGauge
from marlaas.ops.timeline import union_length

try:  # run as `python bench/x.py` or imported as `bench.x`
    from bench.costmodel import CostParams, Workload
except ImportError:  # pragma: no cover
    from costmodel import CostParams, Workload  # type: ignore[no-redef]

STATIONS = ("generate", "verify", "train")


@dataclass(frozen=True)
class Cluster:
    """Where the stations run."""

    gen_workers: int = 1
    verify_slots: int = 2
    train_lanes: int = 1
    batch_rows: int = 256
    inflight_per_worker: int = 2
    jit_jobs: int | str = 0  # MARLAAS_GEN_JIT_JOBS: a number, or 'auto' (marlaas.control.jit)
    shared: dict[str, float] = field(default_factory=dict)
    """resource name -> capacity (processor sharing)"""
    placement: dict[str, str] = field(default_factory=dict)
    """station -> resource name in `shared` (a station absent here has its own hardware)"""
    lane_speedup: float = 1.0
    """train time divides by this (a lane spread over several GPUs, data parallel)"""
    min_fill: float = 0.0
    """MARLAAS_GEN_MIN_FILL: batches of groups ahead only wait until min_fill * batch_rows rows"""
    control_slots: int = 0
    """0: a dispatch is a pure delay of dispatch_s. > 0: each dispatch is a "control" task of
    dispatch_s work (the tick, the broker round trip, the worker's message handling) run by this
    many control processes on placement["control"]'s resource, so on a shared CPU it competes
    with the stations for the cores; the task joins its station's queue when it is done."""


@dataclass
class _Job:
    id: str
    w: Workload
    staleness: int
    version: int = 0
    dispatched: int = 0
    pass_value: float = 0.0
    verified: set = field(default_factory=set)
    sampled_at: dict = field(default_factory=dict)
    evals_done: set = field(default_factory=set)
    evals_inflight: set = field(default_factory=set)
    training: bool = False
    submitted: float = 0.0
    done_at: float | None = None
    st: scheduler.JobState | None = None  # cached; set to None whenever a field above changes

    def state(self) -> scheduler.JobState:
        if self.st is None:
            self.st = self._state()
        return self.st

    def _state(self) -> scheduler.JobState:
        t, P, steps = self.version, self.w.groups_per_step, self.w.steps
        groups = scheduler.step_groups(t, P) if t < steps else []
        evs = [0, steps] if t >= steps else [0]
        return scheduler.JobState(
            id=self.id, version=t, steps=steps, staleness=self.staleness, groups_per_step=P,
            group_size=self.w.group_size, dispatched=self.dispatched, pass_value=self.pass_value,
            ready=bool(groups) and not self.training and all(g in self.verified for g in groups),
            eval_rows=self.w.eval_rows,
            need_eval=tuple(v for v in evs if v not in self.evals_done and v not in self.evals_inflight),
        )


@dataclass
class _Task:
    station: str
    work: float
    payload: tuple
    start: float = 0.0
    worker: int = -1


@dataclass
class SimResult:
    mode: str
    tenants: int
    makespan_s: float
    busy_s: dict[str, float]
    task_s: dict[str, float]
    steps_trained: int
    max_staleness: int
    staleness_hist: dict[int, int]
    violations: int
    ticks: int
    plans: int
    job_done_s: list[float]
    trace: list[tuple] = field(default_factory=list)
    jit_on_s: float = 0.0  # simulated seconds with just in time on

    def summary(self) -> dict:
        return {"makespan_s": round(self.makespan_s, 3),
                "busy_fraction": {k: round(v / max(self.makespan_s, 1e-12), 4) for k, v in self.busy_s.items()},
                "busy_s": {k: round(v, 3) for k, v in self.busy_s.items()},
                "task_s": {k: round(v, 3) for k, v in self.task_s.items()},
                "steps_trained": self.steps_trained, "max_staleness": self.max_staleness,
                "violations": self.violations, "ticks": self.ticks}


class Sim:
    def __init__(self, params: CostParams, w: Workload, n: int, cluster: Cluster, mode: str, trace: bool):
        if mode not in ("sequential", "marlaas"):
            raise ValueError(f"mode must be 'sequential' or 'marlaas', not {mode!r}")
        self.p, self.w, self.c, self.mode, self.keep_trace = params, w, cluster, mode, trace
        s = 0 if mode == "sequential" else w.staleness
        self.pending = deque(_Job(f"j{i}", w, s) for i in range(n))
        self.active: dict[str, _Job] = {}
        self.finished: list[_Job] = []
        self.now = 0.0
        self.arrivals: list = []  # (time, seq, task) entering a station queue
        self.seq = itertools.count()
        self.kinds = STATIONS + (("control",) if cluster.control_slots else ())
        self.queues = {st: deque() for st in self.kinds}
        self.running: list[_Task] = []
        self.free_gen = list(range(cluster.gen_workers))
        self.caches = [set() for _ in range(cluster.gen_workers)]
        self.slots = {"generate": cluster.gen_workers, "verify": cluster.verify_slots, "train": cluster.train_lanes,
                      "control": cluster.control_slots}
        self.busy_n = dict.fromkeys(self.kinds, 0)
        self.gen_inflight = 0
        self.lanes_taken = 0
        self.intervals = {st: [] for st in STATIONS}
        self.hist: dict[int, int] = {}
        self.violations = self.ticks = self.plans = self.steps_trained = 0
        self.trace: list[tuple] = []
        self.gen_work = self.lane_work = True
        self.gauge, self.jit_jobs, self.jit_on_s = JitGauge(), 0, 0.0  # automatic just in time, as a tick runs it
        self.jit_t: float | None = None  # the previous tick's time (jit_on_s adds up the ticks' intervals)

    # -- state -> Snapshot -> Plan -> state ------------------------------------------------------

    def snapshot(self, jobs: tuple[scheduler.JobState, ...]) -> scheduler.Snapshot:
        return scheduler.Snapshot(jobs=jobs, gen_inflight=self.gen_inflight,
                                  gen_capacity=self.c.inflight_per_worker * self.c.gen_workers,
                                  batch_rows=self.c.batch_rows, trainer_free=self.lanes_taken < self.c.train_lanes,
                                  min_batch_rows=int(self.c.min_fill * self.c.batch_rows), jit_jobs=self.jit_jobs)

    def tick(self) -> None:
        gen_free = self.gen_inflight < self.c.inflight_per_worker * self.c.gen_workers
        lane_free = self.lanes_taken < self.c.train_lanes
        # Every state change reaches here, so the gauge sees each station's state over all of time
        # (a real tick samples it every second and after every task).
        if self.jit_jobs and self.jit_t is not None:
            self.jit_on_s += self.now - self.jit_t
        self.jit_t = self.now
        self.jit_jobs = jit.jit_jobs(self.c.jit_jobs, self.c.min_fill, self.gauge, self.now,
                                     jit.gen_busy_share(self.gen_inflight, self.c.gen_workers),
                                     self.lanes_taken / self.c.train_lanes,
                                     sum(1 for j in self.active.values() if j.version < j.w.steps))
        # Skip ticks that cannot dispatch anything: plan() would return an empty Plan. New generate
        # work only appears when a version is published, an evaluation finishes or a job arrives
        # (self.gen_work); a free lane only matters if something could have become ready.
        if not (gen_free and self.gen_work) and not (lane_free and self.lane_work):
            return
        self.gen_work = self.lane_work = False
        self.ticks += 1
        jobs = tuple(j.state() for j in self.active.values())
        plan = scheduler.plan(self.snapshot(jobs))
        self.plans += 1
        for batch in plan.gen_batches:
            for kind, jid, idx in batch:
                if kind == "eval":
                    self.active[jid].evals_inflight.add(idx)
                    self.active[jid].st = None
            self.gen_inflight += 1
            self._send("generate", 0.0, (batch,))
        for jid, total in plan.dispatched.items():
            self.active[jid].dispatched = max(self.active[jid].dispatched, total)
            self.active[jid].st = None
        if self.gen_inflight >= self.c.inflight_per_worker * self.c.gen_workers:
            self.gen_work = True  # capacity ran out first: work may be left for the next free slot
        while plan.train is not None:
            jid, t = plan.train
            job = self.active[jid]
            job.training = True
            job.st = None
            job.pass_value += 1.0 / 1.0  # weight 1 for every simulated tenant (dispatch.advance_pass)
            self.lanes_taken += 1
            self._send("train", self.p.train_s(self.w) / self.c.lane_speedup, (jid, t))
            if self.lanes_taken >= self.c.train_lanes:
                break
            # A further free lane: the same policy on what is left (no generate capacity).
            rest = tuple(j.state() for j in self.active.values())
            plan = scheduler.plan(replace(self.snapshot(rest), gen_capacity=0))
            self.plans += 1

    def _send(self, station: str, work: float, payload: tuple) -> None:
        if self.c.control_slots:
            self.queues["control"].append(_Task("control", self.p.dispatch_s, (station, work, payload)))
            return
        heapq.heappush(self.arrivals, (self.now + self.p.dispatch_s, next(self.seq), _Task(station, work, payload)))

    # -- stations ---------------------------------------------------------------------------------

    def _start_ready(self) -> None:
        for st in self.kinds:
            q = self.queues[st]
            while q and self.busy_n[st] < self.slots[st]:
                task = q.popleft()
                task.start = self.now
                if st == "generate":
                    self._begin_generate(task)
                self.busy_n[st] += 1
                self.running.append(task)

    def _begin_generate(self, task: _Task) -> None:
        """Sample with the version current now; cost follows rows, distinct adapters, new loads."""
        task.worker = self.free_gen.pop()
        cache = self.caches[task.worker]
        rows = prompts = 0
        refs, sampled = set(), []
        for kind, jid, idx in task.payload[0]:
            job = self.active.get(jid)
            if job is None:
                continue
            v = job.version if kind == "gen" else idx
            refs.add((jid, v) if v > 0 else ("base", 0))
            if kind == "gen":
                rows += self.w.group_size
                prompts += 1
                sampled.append((jid, idx, v))
            else:
                rows += self.w.eval_rows
                prompts += self.w.eval_rows
        new = {r for r in refs if r[0] != "base" and r not in cache}
        cache |= new
        task.work = self.p.generate_s(self.w, rows, prompts, len(refs), len(new))
        task.payload = (task.payload[0], sampled)

    def _rates(self) -> list[float]:
        load: dict[str, int] = {}
        for t in self.running:
            r = self.c.placement.get(t.station)
            if r is not None:
                load[r] = load.get(r, 0) + 1
        out = []
        for t in self.running:
            r = self.c.placement.get(t.station)
            out.append(1.0 if r is None else min(1.0, self.c.shared[r] / load[r]))
        return out

    def _complete(self, task: _Task) -> None:
        st = task.station
        if st == "control":  # dispatched: the task joins its station's queue
            self.busy_n[st] -= 1
            self.queues[task.payload[0]].append(_Task(*task.payload))
            return
        self.busy_n[st] -= 1
        self.intervals[st].append((task.start, self.now))
        if self.keep_trace:
            self.trace.append((task.start, self.now, st, task.payload if st != "generate" else task.payload[1]))
        if st == "generate":
            self.free_gen.append(task.worker)
            self.gen_inflight -= 1
            batch, sampled = task.payload
            for jid, g, v in sampled:
                self.active[jid].sampled_at[g] = v
            groups: dict[tuple, list[int]] = {}
            for kind, jid, idx in batch:
                if jid in self.active:
                    groups.setdefault((jid, "train" if kind == "gen" else "eval"), []).append(idx)
            self.gen_work = True  # capacity freed (work may be waiting)
            for (jid, kind), idxs in groups.items():
                rows = len(idxs) * (self.w.group_size if kind == "train" else self.w.eval_rows)
                self._send("verify", self.p.verify_s(rows), (jid, kind, idxs))
        elif st == "verify":
            jid, kind, idxs = task.payload
            job = self.active[jid]
            job.st = None
            self.lane_work = True
            if kind == "train":
                job.verified.update(idxs)
            else:
                self.gen_work = True
                job.evals_done.update(idxs)
                job.evals_inflight.difference_update(idxs)
                if job.version >= job.w.steps and {0, job.w.steps} <= job.evals_done:
                    self._finish(job)
        else:
            jid, t = task.payload
            job = self.active[jid]
            for g in scheduler.step_groups(t, job.w.groups_per_step):
                lag = t - job.sampled_at[g]
                self.hist[lag] = self.hist.get(lag, 0) + 1
                if not scheduler.within_staleness(t, job.sampled_at[g], job.staleness):
                    self.violations += 1
            job.st = None
            job.version = t + 1
            job.training = False
            self.gen_work = self.lane_work = True
            self.lanes_taken -= 1
            self.steps_trained += 1

    def _finish(self, job: _Job) -> None:
        job.done_at = self.now
        del self.active[job.id]
        self.finished.append(job)
        if self.mode == "sequential" and self.pending:
            self._submit_at(self.now + self.p.submit_gap_s)

    def _submit_at(self, t: float) -> None:
        heapq.heappush(self.arrivals, (t, next(self.seq), _Task("submit", 0.0, ())))

    # -- main loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        if self.mode == "sequential":
            self._submit_at(0.0)
        else:
            for job in self.pending:
                self.active[job.id] = job
            self.pending.clear()
            self.tick()
            self._start_ready()
        while self.active or self.pending or self.arrivals or self.running:
            rates = self._rates()
            dt = min((t.work / r for t, r in zip(self.running, rates)), default=float("inf"))
            if self.arrivals:
                dt = min(dt, self.arrivals[0][0] - self.now)
            if dt == float("inf"):
                raise RuntimeError(f"simulation stalled at t={self.now:.3f}: {len(self.active)} jobs active")
            dt = max(dt, 0.0)
            for t, r in zip(self.running, rates):
                t.work -= r * dt
            self.now += dt
            changed = False
            done = [t for t in self.running if t.work <= 1e-12]
            self.running = [t for t in self.running if t.work > 1e-12]
            for t in done:
                self._complete(t)
                changed = True
            while self.arrivals and self.arrivals[0][0] <= self.now + 1e-12:
                _, _, task = heapq.heappop(self.arrivals)
                if task.station == "submit":
                    job = self.pending.popleft()
                    job.submitted = self.now
                    self.active[job.id] = job
                    self.gen_work = self.lane_work = True
                    changed = True
                else:
                    self.queues[task.station].append(task)
            self._start_ready()
            if changed:
                self.tick()
                self._start_ready()
        busy = {st: union_length(iv, 0.0, self.now) for st, iv in self.intervals.items()}
        task_s = {st: sum(e - s for s, e in iv) for st, iv in self.intervals.items()}
        # The client notices the last job submit_gap_s later, in both modes.
        return SimResult(self.mode, len(self.finished), self.now + self.p.submit_gap_s, busy, task_s,
                         self.steps_trained, max(self.hist, default=0), dict(sorted(self.hist.items())),
                         self.violations,
                         self.ticks, self.plans, [j.done_at for j in self.finished], self.trace, self.jit_on_s)


def simulate(params: CostParams, w: Workload, n: int, cluster: Cluster | None = None, mode: str = "marlaas",
             trace: bool = False) -> SimResult:
    """Run n identical tenants through the scheduler in simulated time."""
    return Sim(params, w, n, cluster or Cluster(), mode, trace).run()
