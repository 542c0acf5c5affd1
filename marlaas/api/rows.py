"""Prompt rows of a job: built-in task families or the user's own data, validated at submit.

A row is a dict with a non-empty string "prompt" and the fields its verifier needs ("answer" for
exact / math, "tests" for code); user data is read and mapped by `marlaas.api.datasets_io`. Held-out
rows: `eval_dataset`, else the held-out split of a DatasetDict `dataset`, else 10% of `dataset`.
Training rows are shuffled once by the job's seed; group g of the job samples row g mod n (see
`marlaas.generate.station.train_row_index`). Rows of the tenant's data keep their label ("dataset
data.jsonl line 5", "eval_dataset row 2": numbered from 1, for files and inline rows alike) under
`grader_fields.ROW_REF`, so errors found later name the tenant's own row.

Graders: every field a job's grader reads (`grader_fields.required_fields`: `{{item.FIELD}}`
templates, `item["FIELD"]` in a python grader's source) must exist in every training and held-out
row; the first row without one is refused with one line naming it.
"""

from __future__ import annotations

import random

from marlaas.api import datasets_io
from marlaas.api.datasets_io import Fields
from marlaas.errors import SpecError
from marlaas.spec import JobSpec
from marlaas.verify.grader_fields import ref_of, required_fields

MAX_TRAIN_ROWS_BUILTIN = 2048


def load_rows(src: list[dict] | str, what: str = "dataset", fields: Fields = Fields(),
              verifier: str | None = None, split: str | None = None,
              default_splits: tuple[str, ...] = datasets_io.TRAIN_SPLITS, label: bool = False) -> list[dict]:
    """Rows from a list, a JSONL or parquet file or a `datasets` directory, mapped to our shape
    (see `marlaas.api.datasets_io`); a bad row raises SpecError naming the file and line or row.
    With `label`, each row keeps its label for the tenant (`grader_fields.ROW_REF`)."""
    return datasets_io.load(src, what, fields, verifier, split, default_splits, label)


def fields_of(spec: JobSpec) -> Fields:
    return Fields(prompt=spec.prompt_field, answer=spec.answer_field, tests=spec.tests_field)


def job_rows(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a validated spec."""
    verifier = spec.verifier_name()
    if spec.task is not None:
        from marlaas import families
        from marlaas.verify import reasoning_gym

        n = min(spec.steps * spec.prompts_per_step, MAX_TRAIN_ROWS_BUILTIN)
        if reasoning_gym.is_task(spec.task):  # disjoint train and held-out sets, made under limits
            from marlaas.verify import rg_guard

            name, config = reasoning_gym.parse_task(spec.task, spec.task_config)
            train, held = rg_guard.make_split_bounded(name, config, spec.seed, n, spec.eval_size)
        else:
            train = families.rows(spec.task, "train", n, spec.seed)
            held = families.rows(spec.task, "eval", spec.eval_size, spec.seed)
    else:
        fields = fields_of(spec)
        train = load_rows(spec.dataset, "dataset", fields, verifier, spec.dataset_split, label=True)
        held_split = _held_split_of_dataset(spec)
        if spec.eval_dataset is not None:
            held = load_rows(spec.eval_dataset, "eval_dataset", fields, verifier, spec.eval_dataset_split,
                             datasets_io.EVAL_SPLITS, label=True)
        elif held_split is not None:
            held = load_rows(spec.dataset, "dataset", fields, verifier, held_split, label=True)
        else:
            rng = random.Random(spec.seed)
            order = list(range(len(train)))
            rng.shuffle(order)
            k = max(1, len(train) // 10) if len(train) > 1 else 0
            held = [train[i] for i in order[:k]]
            train = [train[i] for i in order[k:]] or train
        held = held[: spec.eval_size]
    if not held:
        raise SpecError("no held-out rows: give eval_dataset or at least 2 dataset rows")
    check_grader_fields(spec, train, held)
    random.Random(spec.seed).shuffle(train)
    return train, held


def check_grader_fields(spec: JobSpec, train: list[dict], held: list[dict]) -> None:
    """SpecError naming the first row (training, then held-out) without a field the job's grader reads."""
    needed = required_fields(spec.grader) if spec.grader is not None else set()
    if not needed:
        return
    for what, rows in (("dataset", train), ("eval_dataset", held)):
        for i, row in enumerate(rows, start=1):
            missing = sorted(needed - set(row))
            if missing:
                names = ", ".join(f"item[{f!r}]" for f in missing)
                raise SpecError(f"{ref_of(row, f'{what} row {i}')}: the grader reads {names}, missing from this "
                                "row; add it to every row, or read it with item.get(...) in the grader")


def _held_split_of_dataset(spec: JobSpec) -> str | None:
    """With no eval_dataset and a DatasetDict `dataset`: its held-out split (`eval_dataset_split`,
    else the first of "test", "validation" it has), unless that is the training split itself."""
    if spec.eval_dataset is not None:
        return None
    splits = datasets_io.dict_splits(spec.dataset) if isinstance(spec.dataset, str) else None
    if splits is None:
        if spec.eval_dataset_split is not None:
            raise SpecError("eval_dataset_split is only for a DatasetDict directory (as eval_dataset or dataset)")
        return None
    train_split = datasets_io.pick_split(splits, spec.dataset_split, datasets_io.TRAIN_SPLITS, "dataset")
    if spec.eval_dataset_split is not None:
        held = datasets_io.pick_split(splits, spec.eval_dataset_split, (), "dataset")
    else:
        held = next((s for s in datasets_io.EVAL_SPLITS if s in splits), None)
    return held if held != train_split else None
