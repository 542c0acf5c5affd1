"""The learnability check's maths: figures and a verdict from the base's group rewards (pure, no I/O).

A preflight (`JobSpec.preflight`) samples the base (version 0) on N training prompts, G completions
each, and scores them with the job's own verifier or grader. From the N groups of rewards r_ij:

- `exact`: the share of completions with full reward, #{(i, j) : r_ij >= FULL} / (N G);
- `mean_reward`: the mean reward over all completions, (1 / N G) sum_ij r_ij;
- `signal`: the share of groups whose rewards differ, #{i : max_j r_ij > min_j r_ij} / N. A group
  whose completions all get the same reward has zero advantage under GRPO (r - mean = 0), so it
  teaches nothing: only these groups move the policy.
- `partial`: the share of completions with a reward strictly between 0 and full (partial credit).

The verdict says in one line whether training can learn anything (`verdict`, with `ok` True or False).
The same test (`has_signal`) warns a real job whose first steps have no signal (train/station.py).
"""

from __future__ import annotations

from marlaas.verify.evaluation import CORRECT_AT

FULL = CORRECT_AT
"""Full reward (the evaluations' threshold: a completion counts for `exact` when its reward is at least this)."""
WEAK = 0.25
"""Below this share of groups with signal the verdict says learning will be slow."""

NO_SIGNAL_ZERO = ("no group has any signal: the base never earns reward here; make the task easier "
                  "or give partial credit")


def has_signal(rewards: list[float]) -> bool:
    """Whether a group's rewards differ (a nonzero GRPO advantage for some completion)."""
    return bool(rewards) and max(rewards) > min(rewards)


def summarize(groups: list[list[float]], errors: int = 0) -> dict:
    """The preflight's figures and verdict from each group's rewards (see the module docstring);
    `errors`: completions the grader could not score (scored 0). ValueError on no groups."""
    if not groups or not all(groups):
        raise ValueError("a preflight summary needs at least one group, each with rewards")
    flat = [float(r) for g in groups for r in g]
    n = len(flat)
    with_signal = sum(1 for g in groups if has_signal(g))
    out = {
        "prompts": len(groups),
        "group_size": max(len(g) for g in groups),
        "completions": n,
        "exact": sum(1 for r in flat if r >= FULL) / n,
        "mean_reward": sum(flat) / n,
        "partial": sum(1 for r in flat if 0.0 < r < FULL) / n,
        "signal": with_signal / len(groups),
        "groups_with_signal": with_signal,
        "grader_errors": int(errors),
    }
    out["ok"], out["verdict"] = verdict(out)
    return out


def verdict(s: dict) -> tuple[bool, str]:
    """(ok, one line) from the figures of `summarize`: can GRPO learn anything from this base here?"""
    pct = round(100 * s["signal"])
    errs = f"; the grader failed on {s['grader_errors']} completions (scored 0)" if s.get("grader_errors") else ""
    if s["groups_with_signal"] == 0:
        if s["mean_reward"] <= 0.0:
            return False, NO_SIGNAL_ZERO + errs
        if s["exact"] >= 1.0:
            return False, "no group has any signal: the base already earns full reward on every completion; " \
                          "there is nothing to learn" + errs
        return False, ("no group has any signal: every completion of a prompt earns the same reward; "
                       "raise group_size or temperature, or give graded credit" + errs)
    if s["exact"] <= 0.0:
        return True, (f"only partial credit: {pct}% of groups have signal, but no completion earns full "
                      "reward; training can raise the mean reward without one exact answer" + errs)
    if s["signal"] < WEAK:
        return True, f"weak: only {pct}% of groups have signal; expect slow learning" + errs
    return True, f"ok: {pct}% of groups have signal" + errs
