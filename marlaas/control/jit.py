"""Automatic just-in-time generation: groups ahead only where the stations have room for them.

Groups ahead (for a job's later steps, within its staleness bound) buy overlap: the generate station
works on a job's next step while the trainer takes its current one. They cost freshness: a group
ahead trains up to S versions after it was sampled, and on a real model a step trained on samples
two versions old gains less (the policy has moved from the one that sampled them). With at least two
jobs training and one station busy nearly all the time, that station sets the pace: a busy trainer
always has another job's step to take, and a busy generate station has the next steps' groups to
work on, so groups ahead add little throughput and cost accuracy. Then generation is just in time
(no groups ahead, staleness 0: `scheduler.just_in_time`). Where neither station is near saturation
(few jobs, slow graders, latency-bound steps), groups ahead fill the gaps and are generated.
(On a CPU where both stations share the cores, groups ahead can still use cores a waiting trainer
leaves idle: the choice there is freshness over that throughput, as a hand-tuned setting chose.)

`JitGauge` measures this from what each tick sees (pure: the caller passes the time): the share of
generate workers with a batch in flight and whether the trainer lane is held, each averaged over
time (an exponential moving average, every observation weighted by how long it held, with a time
constant of `steps_per_tau` trainer steps as measured). It starts just in time and changes its
choice only after `min_spells` trainer steps: to groups ahead when the busier station's average is
below `off`, back to just in time when it reaches `on` (hysteresis), and it holds a new choice for
one time constant, so it never flaps from tick to tick. It observes only while at least AUTO_JOBS
jobs are training (the only times the choice applies): a lone job's idle stations say nothing about
the next crowd, so the choice a crowd made (or the first one, just in time) carries over the lone
stretches between crowds, and the clock restarts when a crowd does. A number in
`MARLAAS_GEN_JIT_JOBS` overrides it; with `MARLAAS_GEN_MIN_FILL` set (one device for both
stations, whose large batches need the groups ahead) the automatic choice is never just in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"
AUTO_JOBS = 2  # just in time from this many jobs training: with one, groups ahead are its only overlap


@dataclass
class JitGauge:
    """Time-averaged busy shares of the generate station and the trainer, and the choice they make.
    The averages' time constant follows the trainer's step: `steps_per_tau` steps (the average length
    of the lane's busy spells), within [tau_min_s, tau_max_s], so a tiny model's 50 ms steps and a
    real model's 10 s steps are judged over as many steps."""

    on: float = 0.85
    off: float = 0.6
    steps_per_tau: float = 10.0
    tau_min_s: float = 0.5
    tau_max_s: float = 300.0
    gen: float = 1.0  # average share of generate workers busy (starts as busy: the choice starts just in time)
    train: float = 1.0  # average share of time the trainer lane was held
    step_s: float | None = None  # average length of the trainer's busy spells (None: none seen yet)
    last: float | None = None  # when the previous observation was made
    held: tuple[float, float] = (0.0, 0.0)  # the previous observation: it held from `last` until now
    busy_since: float | None = None  # when the current busy spell of the lane began
    min_spells: int = 10  # trainer steps seen before the first switch
    spells: int = 0  # trainer busy spells seen
    since: float = 0.0  # when the choice last switched (it is held for one time constant)
    jit: bool = True

    @property
    def tau_s(self) -> float:
        if self.step_s is None:
            return self.tau_max_s
        return min(self.tau_max_s, max(self.tau_min_s, self.steps_per_tau * self.step_s))

    def observe(self, now: float, gen_busy: float, train_busy: float, crowd: bool = True) -> bool:
        """Fold in the interval since the last observation (at the values seen then), remember this
        one, and return the choice: True for just in time. Time going backwards counts as no time.
        Without a `crowd` (fewer than AUTO_JOBS jobs training) nothing is observed: the averages, the
        step length and the choice stay as they were, and the next crowd starts a fresh interval."""
        if not crowd:
            self.last, self.busy_since = None, None
            return self.jit
        gen_busy, train_busy = min(1.0, max(0.0, gen_busy)), min(1.0, max(0.0, train_busy))
        if self.last is not None:
            dt = max(0.0, now - self.last)
            a = 1.0 - math.exp(-dt / self.tau_s)
            self.gen += a * (self.held[0] - self.gen)
            self.train += a * (self.held[1] - self.train)
        if train_busy > 0 and self.busy_since is None:
            self.busy_since = now
        elif train_busy == 0 and self.busy_since is not None:
            spell = max(0.0, now - self.busy_since)
            self.step_s = spell if self.step_s is None else self.step_s + 0.2 * (spell - self.step_s)
            self.spells += 1
            self.busy_since = None
        self.last, self.held = now, (gen_busy, train_busy)
        if self.spells < self.min_spells or now - self.since < self.tau_s:
            return self.jit  # too little seen yet, or the last switch too recent to judge
        busiest = max(self.gen, self.train)
        choice = True if busiest >= self.on else False if busiest < self.off else self.jit
        if choice != self.jit:
            self.jit, self.since = choice, now
        return self.jit


def jit_jobs(setting: int | str, min_fill: float, gauge: JitGauge, now: float, gen_busy: float,
             train_busy: float, training: int = AUTO_JOBS) -> int:
    """The `Snapshot.jit_jobs` a tick plans with: a number setting as it is; `auto` observes the
    gauge (while `training`, the jobs still training, makes a crowd) and gives AUTO_JOBS while it
    chooses just in time (never with a minimum fill), else 0."""
    if setting != AUTO:
        return int(setting)
    choice = gauge.observe(now, gen_busy, train_busy, crowd=training >= AUTO_JOBS)
    return AUTO_JOBS if choice and not min_fill else 0


def gen_busy_share(gen_inflight: int, gen_workers: int) -> float:
    """Share of generate workers with a batch: in-flight batches over workers alive (a worker runs
    one batch at a time; batches beyond that wait in its queue), 0 with no worker known."""
    return min(gen_inflight, gen_workers) / gen_workers if gen_workers > 0 else 0.0
