"""Prompt rows of a job: built-in task families or the user's own data, validated at submit.

A row is a dict with a non-empty string "prompt" and the fields its verifier needs ("answer" for
exact / math, "tests" for code). Training rows are shuffled once by the job's seed; group g of the
job samples row g mod n (see `stations.train_row_index`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from marlaas.errors import SpecError
from marlaas.spec import JobSpec

MAX_TRAIN_ROWS_BUILTIN = 2048


def load_rows(src: list[dict] | str, what: str = "dataset") -> list[dict]:
    """Rows from a list or a local JSONL file; a bad row raises SpecError naming it."""
    if isinstance(src, list):
        return [dict(r) for r in src]
    path = Path(src)
    if not path.is_file():
        raise SpecError(f"{what} file not found: {src}")
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{what} {path.name}: not UTF-8 ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{what} {path.name} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise SpecError(f"{what} {path.name} line {i}: expected a JSON object")
        rows.append(row)
    if not rows:
        raise SpecError(f"{what} {path.name} has no rows")
    return rows


def check_rows(rows: list[dict], verifier: str, what: str = "dataset") -> None:
    for i, row in enumerate(rows):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise SpecError(f"{what} row {i}: needs a non-empty string 'prompt'")
        if verifier == "code":
            tests = row.get("tests")
            if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
                raise SpecError(f"{what} row {i}: the code verifier needs 'tests', a list of assert statements")
        elif verifier in ("exact", "math") and "answer" not in row:
            raise SpecError(f"{what} row {i}: the {verifier} verifier needs an 'answer'")


def job_rows(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a validated spec."""
    verifier = spec.verifier_name()
    if spec.task is not None:
        from marlaas import families

        n = min(spec.steps * spec.prompts_per_step, MAX_TRAIN_ROWS_BUILTIN)
        train = families.rows(spec.task, "train", n, spec.seed)
        held = families.rows(spec.task, "eval", spec.eval_size, spec.seed)
    else:
        train = load_rows(spec.dataset)
        if spec.eval_dataset is not None:
            held = load_rows(spec.eval_dataset, "eval_dataset")
        else:
            rng = random.Random(spec.seed)
            order = list(range(len(train)))
            rng.shuffle(order)
            k = max(1, len(train) // 10) if len(train) > 1 else 0
            held = [train[i] for i in order[:k]]
            train = [train[i] for i in order[k:]] or train
        check_rows(train, verifier)
        check_rows(held, verifier, "eval_dataset")
        held = held[: spec.eval_size]
    if not held:
        raise SpecError("no held-out rows: give eval_dataset or at least 2 dataset rows")
    random.Random(spec.seed).shuffle(train)
    return train, held
