"""Scoring a job's groups with its grader or verifier, and the policy for graders that fail.

`score_job(store, jid, spec, items, kind)` is what the verify station calls. It scores with:

- the job's `grader` (`marlaas.verify.graders.grade_groups`, registered names from the store), or
- its `verifier`: a built-in or an import path as before (`score_groups`), a registered name through
  its registered import path.

Failure policy (graders and registered verifiers only; built-in verifiers keep scoring 0 and
counting errors):

- a grader that cannot load (`GraderLoadError`, e.g. a registered name removed or unimportable)
  fails the job at once, with the reason in its status (`store.set_status(jid, "failed", reason)`),
  and `score_job` returns None;
- a training group on which the grader errs on EVERY completion adds one to the job's streak;
  a group with at least one scored completion resets it; `FAIL_AFTER_GROUPS` such groups in a row
  fail the job with the first error (that call's errors are still counted in `verify_errors`).
  A `while True: pass` python grader thus ends in bounded time: each call by its time limit, the
  job after a few groups. Evaluations count errors but do not move the streak.
"""

from __future__ import annotations

import logging

from marlaas.errors import VerifierError
from marlaas.types import ItemKind
from marlaas.verify.graders import GraderLoadError, grade_groups
from marlaas.verify.registry import resolve
from marlaas.verify.verifiers import BUILTIN, GroupScore, score_groups

log = logging.getLogger("marlaas.verify")

FAIL_AFTER_GROUPS = 3
STREAK_FIELD = "grader_fail_streak"


def _fail(store, jid: str, reason: str) -> None:
    log.warning("job %s failed: %s", jid, reason)
    store.set_status(jid, "failed", reason)


def score_job(store, jid: str, spec, items: list[tuple[dict, list[str]]],
              kind: str = ItemKind.VER) -> list[GroupScore] | None:
    """Scores of the groups, in order; None when the job was just failed (its grader cannot load or
    kept failing). `kind`: VER (training groups: a grader failing on every completion is policed) or
    EVALVER (an evaluation)."""
    policed = spec.grader is not None
    try:
        if spec.grader is not None:
            scores = grade_groups(spec.grader, items, store.registered_verifiers())
        else:
            name = spec.verifier_name()
            if name not in BUILTIN and ":" not in name:  # a registered name
                policed = True
                name = resolve(store, name)
            scores = score_groups(name, items)
    except (GraderLoadError, VerifierError) as e:
        _fail(store, jid, f"grader cannot load: {e}")
        return None
    if policed and kind == ItemKind.VER and scores:
        return scores if _streak(store, jid, items, scores) else None
    return scores


def _streak(store, jid: str, items: list[tuple[dict, list[str]]], scores: list[GroupScore]) -> bool:
    """Move the all-errors streak over these groups; False when the job was failed."""
    streak = int(store.job_fields(jid, STREAK_FIELD)[0] or 0)
    start, first = streak, None
    for (_, comps), s in zip(items, scores):
        if comps and s.errors >= len(comps):
            streak += 1
            first = first or s.error
            if streak >= FAIL_AFTER_GROUPS:  # the errors of this call are counted before the job ends
                store.incr_field(jid, "verify_errors", sum(x.errors for x in scores))
                _fail(store, jid, f"the grader failed on every completion of {streak} groups in a row: {first}")
                return False
        else:
            streak = 0
    if streak != start:
        store.incr_field(jid, STREAK_FIELD, streak - start)
    return True
