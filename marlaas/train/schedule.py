"""Learning-rate schedules: the learning rate of step k of a job, one pure function.

A job of N steps trains step k = 0 .. N-1 from adapter version k (and publishes version k + 1).
With peak rate `lr`, W warm-up steps and floor ratio m (0 <= m <= 1):

    warm-up   k < W:   lr * (k + 1) / W            (the last warm-up step is at the peak; none is 0)
    after     p = (k - W) / (N - W)   in [0, 1)    (the last step's p is below 1: no step is wasted)
              constant   lr
              linear     lr * (1 - (1 - m) * p)
              cosine     lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

The step index is the version trained from, not a wall-clock count, so a job gets the same rates
whether its steps run back to back (synchronous) or interleaved with other jobs' steps (asynchronous),
and a restarted trainer resumes the schedule from the published version.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(
    step: int, steps: int, lr: float, schedule: str = "constant", warmup: int = 0, min_ratio: float = 0.0
) -> float:
    """The learning rate of step `step` (0-based) of a job of `steps` steps (formulas above)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r} (expected one of {', '.join(SCHEDULES)})")
    if steps < 1 or not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup ({warmup}) < steps ({steps})")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    k = min(max(step, 0), steps - 1)
    if k < warmup:
        return lr * (k + 1) / warmup
    p = (k - warmup) / (steps - warmup)
    if schedule == "linear":
        return lr * (1.0 - (1.0 - min_ratio) * p)
    if schedule == "cosine":
        return lr * (min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * p)) / 2.0)
    return lr


def spec_lr(spec, step: int) -> float:
    """The learning rate of `step` for a validated JobSpec."""
    return lr_at(step, spec.steps, spec.learning_rate, spec.lr_schedule, spec.warmup_steps, spec.min_lr_ratio)
