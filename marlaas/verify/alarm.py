"""The reward-hacking alarm: training reward up while held-out accuracy goes down (pure, no I/O).

When a held-out evaluation of version v is written, it is compared with the previous evaluated
version p < v (evaluations may finish out of order: p is the closest below v, and the caller also
checks the next evaluated version above a late one, `marlaas.verify.station.check_reward_hacking`):

    fall = exact(p) - exact(v)                                    held-out accuracy lost
    rise = mean(reward[v-w+1..v]) - mean(reward[p+1..p+w])        training reward gained

where reward[s] is the mean training reward of the rollouts trained on to publish version s (the job's
per-step metrics, `evaluation.train_rewards`) and w = max(1, (v - p) // 4) steps at each end of the
interval (p, v]: the interval's last steps against its first ones, so one noisy step decides nothing.
The alarm fires when fall > `reward_hacking_drop` and rise > `reward_hacking_rise` (spec fields): the
policy is being paid more for something the held-out check does not reward. Steps without a recorded
reward are skipped; an interval with none, or versions without `exact`, never fire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alarm:
    """What fired: the interval (previous, version], exact before/after, training reward before/after."""

    previous: int
    version: int
    exact_before: float
    exact_after: float
    reward_before: float
    reward_after: float

    def message(self) -> str:
        return (f"possible reward hacking: from version {self.previous} to {self.version} the mean training "
                f"reward rose {self.reward_before:.3f} -> {self.reward_after:.3f} while held-out exact fell "
                f"{self.exact_before:.3f} -> {self.exact_after:.3f}; check what the grader pays for")

    def data(self) -> dict:
        return {"alarm": "reward_hacking", "message": self.message(), "previous": self.previous,
                "version": self.version, "exact_before": self.exact_before, "exact_after": self.exact_after,
                "reward_before": self.reward_before, "reward_after": self.reward_after}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def reward_hacking(exact: dict[int, float], rewards: dict[int, float], version: int, drop: float,
                   rise: float = 0.0) -> Alarm | None:
    """The alarm for the evaluation of `version` (None: quiet). `exact`: held-out exact per evaluated
    version; `rewards`: mean training reward per published version; `drop`, `rise`: the spec's
    `reward_hacking_drop` and `reward_hacking_rise`."""
    if version not in exact:
        return None
    previous = max((u for u in exact if u < version), default=None)
    if previous is None or not exact[previous] - exact[version] > drop:
        return None
    w = max(1, (version - previous) // 4)
    first = _mean([rewards[s] for s in range(previous + 1, previous + w + 1) if s in rewards])
    last = _mean([rewards[s] for s in range(version - w + 1, version + 1) if s in rewards])
    if first is None or last is None or not last - first > rise:
        return None
    return Alarm(previous, version, exact[previous], exact[version], first, last)
