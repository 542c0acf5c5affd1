"""Scoring a job's groups with its grader or verifier, and telling the tenant when it fails.

`score_job(store, jid, spec, items, kind)` is what the verify station calls. It scores with:

- the job's `grader` (`marlaas.verify.graders.grade_groups`, registered names from the store), or
- its `verifier`: a built-in or an import path as before (`score_groups`), a registered name through
  its registered import path.

Rows reach graders without their label (`grader_fields.strip_ref`).

Every grader error reaches the tenant (`report_train` / `report_eval`, called by the station):

- counted apart: training completions in the job's `verify_errors`, evaluation completions in
  `eval_verify_errors` (the API's `grader_errors: {"train", "eval"}`);
- shown as `grader_error` notices in the job's events: the tenant's row ("dataset data.jsonl line 5";
  built-in tasks: "training prompt" / "held-out prompt N") and the error's one line with absolute
  paths cut to their last part (`tenant_line`); at most `NOTICES_PER_PHASE` per training version and
  per evaluated version, the counts always complete.

Failure policy (graders and registered verifiers only; built-in verifiers and import paths keep
scoring 0 and counting errors, with the same notices):

- a grader that cannot load (`GraderLoadError`, e.g. a registered name removed or unimportable)
  fails the job at once, with the reason in its status (`store.set_status(jid, "failed", reason)`),
  and `score_job` returns None;
- a training group on which the grader errs on EVERY completion adds one to the job's streak; a group
  with at least one scored completion resets it. At half of `spec.max_grader_error_groups` the tenant
  gets a `warning` notice; at `max_grader_error_groups` groups in a row the job fails with the first
  error (that call's errors are still counted). A `while True: pass` python grader thus ends in
  bounded time: each call by its time limit, the job after a bounded number of groups;
- an evaluation in which the grader errs on some held-out rows gets a `warning` notice; on more than
  `spec.max_grader_error_share` of them, the job fails with that reason (its evaluation is stored
  first). Evaluations do not move the streak.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from marlaas.errors import VerifierError, one_line
from marlaas.types import ACTIVE_STATUSES, ItemKind
from marlaas.verify.grader_fields import ref_of, strip_ref
from marlaas.verify.graders import GraderLoadError, grade_groups
from marlaas.verify.registry import resolve
from marlaas.verify.sandbox import bounded
from marlaas.verify.verifiers import BUILTIN, GroupScore, score_groups

log = logging.getLogger("marlaas.verify")

STREAK_FIELD = "grader_fail_streak"
TRAIN_ERRORS, EVAL_ERRORS = "verify_errors", "eval_verify_errors"
NOTICES_PER_PHASE = 3
"""Grader-error notices kept per training version and per evaluated version (counts are complete)."""
_ABS_PATH = re.compile(r"(?<![\w.~:/])(?:/[^\s/'\",:;()\[\]]+)+/([^\s/'\",:;()\[\]]+)")


def tenant_line(error: str | None) -> str:
    """An error as its tenant may read it: one line, absolute paths cut to their last part
    ('/srv/marlaas/x/grader.py' -> 'grader.py'), so no operator path leaks."""
    return one_line(_ABS_PATH.sub(r"\1", error or "error"))


def _fail(store, jid: str, reason: str) -> None:
    log.warning("job %s failed: %s", jid, reason)
    store.set_status(jid, "failed", tenant_line(reason))


def _policed(spec) -> bool:
    """Whether the failure policy applies: a grader, or a registered verifier name."""
    if spec.grader is not None:
        return True
    name = spec.verifier_name()
    return name not in BUILTIN and ":" not in name


GRADER_S_PER_STEP = 300.0
"""The default plan's grader seconds per training step (Quotas.max_grader_s_per_step)."""
GRADER_S_PER_EVAL = 300.0
"""The default plan's grader seconds per evaluation (Quotas.max_grader_s_per_eval)."""


def grader_budget(store, jid: str, spec, kind: str, key: int) -> tuple[str, float, float]:
    """(counter field, seconds spent, the plan's bound) of the job's grading of one training step or
    one evaluated version (`key`): the tenant's plan bounds the sandbox's wall time of each."""
    tenant = store.job_fields(jid, "tenant")[0]
    quotas = ((store.tenant(tenant) if tenant else None) or {}).get("quotas") or {}
    if kind == ItemKind.EVALVER:
        field, bound = f"grader_ms:eval:{key}", float(quotas.get("max_grader_s_per_eval", GRADER_S_PER_EVAL))
    else:
        field, bound = f"grader_ms:step:{key}", float(quotas.get("max_grader_s_per_step", GRADER_S_PER_STEP))
    return field, int(store.job_fields(jid, field)[0] or 0) / 1000.0, bound


def score_job(store, jid: str, spec, items: list[tuple[dict, list[str]]],
              kind: str = ItemKind.VER, report: Callable[[list[GroupScore]], None] | None = None,
              key: int | None = None) -> list[GroupScore] | None:
    """Scores of the groups, in order; None when the job was just failed (its grader cannot load or
    kept failing). `kind`: VER (training groups: a grader failing on every completion is policed) or
    EVALVER (an evaluation). `report`: called with the scores before the failure policy runs (the
    station's `report_train`), so the errors of the call that fails a job reach its tenant too.
    `key`: the training step or evaluated version graded: its sandbox batches run under what is left
    of the plan's grader seconds for it (`grader_budget`) and stop when the job is cancelled; past
    the bound the tenant gets a warning notice and the calls score as errors (the policy above)."""
    items = [(strip_ref(row), comps) for row, comps in items]
    bound = None
    if key is not None:
        field, spent, bound = grader_budget(store, jid, spec, kind, key)
        if spent >= bound:
            what = "version" if kind == ItemKind.EVALVER else "step"
            store.add_notice(jid, "warning", {"message": tenant_line(
                f"grading used the plan's {bound:g} grader seconds of {what} {key}: its remaining grader "
                "calls score as errors")}, phase=f"grader_s:{kind}:{key}", limit=1)
    start = time.monotonic()
    deadline = None if bound is None else start + max(0.0, bound - spent)
    try:
        with bounded(deadline, lambda: store.job_fields(jid, "status")[0] not in ACTIVE_STATUSES):
            scores = _grade(store, spec, items)
    except (GraderLoadError, VerifierError) as e:
        _fail(store, jid, f"grader cannot load: {e}")
        return None
    finally:
        if bound is not None:
            store.incr_field(jid, field, int((time.monotonic() - start) * 1000))
    if report is not None:
        report(scores)
    if _policed(spec) and kind == ItemKind.VER and scores:
        return scores if _streak(store, jid, spec, items, scores, counted=report is not None) else None
    return scores


def _grade(store, spec, items: list[tuple[dict, list[str]]]) -> list[GroupScore]:
    if spec.grader is not None:
        return grade_groups(spec.grader, items, store.registered_verifiers())
    name = spec.verifier_name()
    if name not in BUILTIN and ":" not in name:  # a registered name
        name = resolve(store, name)
    return score_groups(name, items)


def _streak(store, jid: str, spec, items: list[tuple[dict, list[str]]], scores: list[GroupScore],
            counted: bool = False) -> bool:
    """Move the all-errors streak over these groups; False when the job was failed. `counted`: the
    call's errors were counted already (else they are counted here before the job fails)."""
    limit = spec.max_grader_error_groups
    warn_at = max(1, limit // 2)
    streak = int(store.job_fields(jid, STREAK_FIELD)[0] or 0)
    start, first = streak, None
    for (_, comps), s in zip(items, scores):
        if comps and s.errors >= len(comps):
            streak += 1
            first = first or s.error
            if streak == warn_at and streak < limit:
                store.add_notice(jid, "warning", {"message": tenant_line(
                    f"the grader failed on every completion of {streak} training groups in a row; the job "
                    f"fails at {limit} (max_grader_error_groups): {first}")})
            if streak >= limit:  # the errors of this call are counted before the job ends
                if not counted:
                    store.incr_field(jid, TRAIN_ERRORS, sum(x.errors for x in scores))
                _fail(store, jid, f"the grader failed on every completion of {streak} groups in a row "
                                  f"(max_grader_error_groups {limit}): {first}")
                return False
        else:
            streak = 0
    if streak != start:
        store.incr_field(jid, STREAK_FIELD, streak - start)
    return True


def report_train(store, jid: str, rolls: list[tuple[int, dict]], scores: list[GroupScore]) -> None:
    """Count the training groups' grader errors and tell the tenant (rate-limited notices)."""
    for (g, roll), s in zip(rolls, scores):
        if not s.errors:
            continue
        store.incr_field(jid, TRAIN_ERRORS, s.errors)
        where = ref_of(roll.get("row") or {}, "training prompt")
        log.warning("job %s group %s (%s): %d grader errors: %s", jid, g, where, s.errors, s.error)
        version = roll.get("version", "?")
        store.add_notice(jid, "grader_error", {
            "phase": "train", "version": roll.get("version"), "row": where, "errors": s.errors,
            "completions": len(s.rewards), "error": tenant_line(s.error)},
            phase=f"train:{version}", limit=NOTICES_PER_PHASE)


def report_eval(store, jid: str, spec, version: int, rows: list[dict], scores: list[GroupScore]) -> bool:
    """Count an evaluation's grader errors, tell the tenant, and apply the share limit; False when
    the job was failed. `rows`: the evaluation's stored rows ({"row": ..., ...}), in `scores`' order."""
    bad = [(i, r, s) for i, (r, s) in enumerate(zip(rows, scores), start=1) if s.errors]
    if not bad:
        return True
    store.incr_field(jid, EVAL_ERRORS, sum(s.errors for _, _, s in bad))
    for i, r, s in bad:
        store.add_notice(jid, "grader_error", {
            "phase": "eval", "version": version, "row": ref_of(r.get("row") or {}, f"held-out prompt {i}"),
            "errors": s.errors, "completions": len(s.rewards), "error": tenant_line(s.error)},
            phase=f"eval:{version}", limit=NOTICES_PER_PHASE)
    i, r, s = bad[0]
    first = f"{ref_of(r.get('row') or {}, f'held-out prompt {i}')}: {s.error}"
    share = len(bad) / max(len(rows), 1)
    what = f"the grader failed on {len(bad)} of {len(rows)} held-out rows of version {version}"
    log.warning("job %s: %s; first: %s", jid, what, first)
    if _policed(spec) and share > spec.max_grader_error_share:
        _fail(store, jid, f"{what} (more than max_grader_error_share {spec.max_grader_error_share:g}): {first}")
        return False
    store.add_notice(jid, "warning", {"message": tenant_line(
        f"{what}; they score 0 (the job fails past max_grader_error_share {spec.max_grader_error_share:g}): {first}")})
    return True
