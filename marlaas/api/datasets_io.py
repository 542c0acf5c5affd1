"""Reading the user's own data: rows, JSONL, parquet and local Hugging Face `datasets` directories.

Sources (`JobSpec.dataset` / `eval_dataset`):

- a list of dicts;
- `*.jsonl` / `*.ndjson`: one JSON object per line; errors name the line, counted from 1 as an
  editor shows it (blank lines are skipped but counted);
- `*.parquet` / `*.pq`: read with pyarrow; errors name the row, counted from 1 (the first row is
  row 1, as for inline rows: `dataset row 1` is the list's first element);
- a directory written by `datasets.Dataset.save_to_disk` (it holds `state.json`) or by
  `DatasetDict.save_to_disk` (`dataset_dict.json`; one split is read: the one asked for, else
  "train" for training data and the first of "test", "validation" for held-out data). Errors
  name the row as for parquet, with the split: `dataset mydir[test] row 3: ...`.

Uploads (`check_upload`, before a file is kept): read as a stream in a child process limited in
memory and time; a parquet file is first measured by its footer (rows, uncompressed column sizes)
and refused past the plan's `max_dataset_bytes` before any data is decoded, then every record's
JSON size is summed and the file refused (413) as soon as it passes that bound.

Files are named as their user knows them: an uploaded file keeps the name it was uploaded under in
a sidecar (`<file id>.name`, `remember_name`), and every message names that, never the server's
file id or path. `load(..., label=True)` keeps each row's label (`grader_fields.ROW_REF`, e.g.
"dataset data.jsonl line 5") in the stored row, so later errors (a grader failing on that row) can
name it to the tenant.

Field mapping (invariant of every row this module returns): `rec[fields.prompt]` becomes "prompt"
(a non-empty string), `rec[fields.answer]` becomes "answer" and `rec[fields.tests]` becomes
"tests" when present and not null; every other column is kept under its own name (custom verifiers
see them), except the reserved names "prompt", "answer", "tests", "raw_prompt", which only the
mapping fills. A row must be storable as JSON; a column holding e.g. a timestamp is refused.

Chat templates (`render_chat`): with a base tokenizer that has a `chat_template`, a row's prompt
becomes template([{"role": "user", "content": prompt}], add_generation_prompt=True) and the
original text is kept as "raw_prompt"; generation, training and evaluation all read "prompt".

Every problem raises one `SpecError` line that names the source and the line or row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from marlaas.errors import SpecError, TooLarge
from marlaas.spec import DATA_SUFFIXES as SUFFIXES
from marlaas.spec import format_error
from marlaas.verify.grader_fields import ROW_REF

TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("test", "validation")
RESERVED = ("prompt", "answer", "tests", "raw_prompt", ROW_REF)
NAME_SUFFIX = ".name"
UPLOAD_MEMORY_MB = 1536
"""Address space of the child that reads an upload (pyarrow and one batch of rows)."""
UPLOAD_WALL_S = 120.0
"""Wall-clock seconds that child may take (a 256 MiB JSONL file reads in well under a minute)."""


@dataclass(frozen=True)
class Fields:
    """Which source columns hold the prompt, the answer and the code tests."""

    prompt: str = "prompt"
    answer: str = "answer"
    tests: str = "tests"


def read_records(src: list[dict] | str, what: str = "dataset", split: str | None = None,
                 default_splits: tuple[str, ...] = TRAIN_SPLITS) -> list[tuple[str, object]]:
    """(where, record) pairs of a source, in order; `where` names the source and line/row."""
    if isinstance(src, list):
        return [(f"{what} row {i}", r) for i, r in enumerate(src, start=1)]
    path = Path(src)
    err = format_error(path, what)
    if err:
        raise SpecError(err)
    if path.is_dir():
        out = _read_hf_dir(path, what, split, default_splits)
    else:
        if split is not None:
            raise SpecError(f"{what} {display_name(path)}: a split ({split!r}) is only for a DatasetDict directory")
        kind = SUFFIXES[path.suffix.lower()]
        out = _read_jsonl(path, what) if kind == "jsonl" else _read_parquet(path, what)
    if not out:
        raise SpecError(f"{what} {display_name(path)} has no rows")
    return out


def remember_name(path: Path, filename: str | None) -> None:
    """Keep the name a stored upload had on its user's machine (its last path part), for messages."""
    if filename:
        Path(path).with_suffix(NAME_SUFFIX).write_text(Path(filename).name[:255], encoding="utf-8")


def display_name(path: str | Path) -> str:
    """The name a file is known by to its user: the uploaded name kept by `remember_name`, else its
    own name (a local file of the direct client)."""
    path = Path(path)
    try:
        name = path.with_suffix(NAME_SUFFIX).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    return name or path.name


def dict_splits(path: str | Path) -> list[str] | None:
    """The splits of a DatasetDict directory, or None when `path` is not one."""
    f = Path(path) / "dataset_dict.json"
    if not f.is_file():
        return None
    try:
        splits = json.loads(f.read_text(encoding="utf-8")).get("splits")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise SpecError(f"{Path(path).name}/dataset_dict.json is not valid JSON") from None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise SpecError(f"{Path(path).name}/dataset_dict.json has no list of 'splits'")
    return splits


def pick_split(splits: list[str], split: str | None, default_splits: tuple[str, ...], where: str) -> str:
    """The split asked for, else the first default present; a clear error otherwise."""
    if split is not None:
        if split not in splits:
            raise SpecError(f"{where}: no split {split!r}; it has {', '.join(splits) or 'none'}")
        return split
    for s in default_splits:
        if s in splits:
            return s
    raise SpecError(f"{where}: none of the splits {', '.join(default_splits)}; it has "
                    f"{', '.join(splits) or 'none'} (choose one with the split option)")


def _read_jsonl(path: Path, what: str) -> list[tuple[str, object]]:
    return list(_iter_jsonl(path, what))


def _iter_jsonl(path: Path, what: str) -> Iterator[tuple[str, object]]:
    """(where, record) of each non-blank line, read one line at a time."""
    name, offset = display_name(path), 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecError(f"{what} {name}: not UTF-8 ({e.reason} at byte {offset + e.start})") from None
            offset += len(raw)
            if not line.strip():
                continue
            where = f"{what} {name} line {i}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecError(f"{where}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise SpecError(f"{where}: not valid JSON (nested too deeply)") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _read_parquet(path: Path, what: str) -> list[tuple[str, object]]:
    return list(_iter_parquet(path, what))


def _iter_parquet(path: Path, what: str, batch: int = 64) -> Iterator[tuple[str, object]]:
    """(where, record) of each row, decoded `batch` rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name, i = display_name(path), 0
    try:
        for b in pq.ParquetFile(path).iter_batches(batch_size=batch):
            for rec in b.to_pylist():
                i += 1
                yield f"{what} {name} row {i}", rec
    except (pa.ArrowException, OSError, ValueError) as e:
        raise SpecError(f"{what} {name}: not a readable parquet file ({_first_line(e)})") from None


def parquet_size(path: str | Path) -> tuple[int, int]:
    """(rows, uncompressed bytes of every column chunk) from a parquet file's footer, decoding no data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError, ValueError) as e:
        raise SpecError(f"file {display_name(path)}: not a readable parquet file ({_first_line(e)})") from None
    return md.num_rows, sum(md.row_group(g).column(c).total_uncompressed_size
                            for g in range(md.num_row_groups) for c in range(md.num_columns))


def measure(path: str | Path, kind: str, max_bytes: int) -> dict:
    """{"rows", "bytes"} of an uploaded file read as a stream (bytes: its rows as JSON); TooLarge past
    `max_bytes` (a parquet file first by its footer's uncompressed sizes), SpecError for a record
    that is no object or a file that does not parse."""
    path = Path(path)
    if kind == "parquet":
        rows, raw = parquet_size(path)
        if raw > max_bytes:
            raise TooLarge(f"over quota: the parquet file {display_name(path)} holds {raw} bytes uncompressed "
                           f"({rows} rows), more than the plan's max_dataset_bytes {max_bytes}")
    records = _iter_parquet(path, "file") if kind == "parquet" else _iter_jsonl(path, "file")
    rows = total = 0
    for where, rec in records:
        if not isinstance(rec, dict):
            raise SpecError(f"{where}: expected an object (one row), got {type(rec).__name__}")
        rows += 1
        total += len(json.dumps(rec, default=str))
        if total > max_bytes:
            raise TooLarge(f"over quota: the rows of {display_name(path)} hold more than {max_bytes} bytes as JSON "
                           f"by {where.removeprefix('file ')} (plan: max_dataset_bytes)")
    if rows == 0:
        raise SpecError(f"file {display_name(path)} has no rows")
    return {"rows": rows, "bytes": total}


def check_upload(path: str | Path, kind: str, max_bytes: int, memory_mb: int = UPLOAD_MEMORY_MB,
                 wall_s: float = UPLOAD_WALL_S) -> dict:
    """`measure` in a child process limited to `memory_mb` of address space and `wall_s` seconds, so a
    file that decodes to far more than its size (a parquet "bomb") never grows the caller."""
    import subprocess
    import sys

    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system", "OMP_NUM_THREADS": "1"}  # no arena reservations
    request = json.dumps({"path": str(path), "kind": kind, "max_bytes": max_bytes, "memory_mb": memory_mb})
    try:
        proc = subprocess.run([sys.executable, "-m", "marlaas.api._file_check"], input=request, capture_output=True,
                              text=True, timeout=wall_s, env=env, cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        raise TooLarge(f"file {display_name(path)} takes more than {wall_s:.0f} s to read") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TooLarge(f"file {display_name(path)} could not be read within {memory_mb} MB ({_first_line(tail)})")
    out = json.loads(proc.stdout)
    if "error" in out:
        raise (TooLarge if out["too_large"] else SpecError)(out["error"])
    return out


def _read_hf_dir(path: Path, what: str, split: str | None,
                 default_splits: tuple[str, ...]) -> list[tuple[str, object]]:
    splits = dict_splits(path)
    name = path.name
    if splits is not None:
        chosen = pick_split(splits, split, default_splits, f"{what} {name}")
        path, name = path / chosen, f"{name}[{chosen}]"
    elif split is not None:
        raise SpecError(f"{what} {name}: a split ({split!r}) is only for a DatasetDict directory")
    if not (path / "state.json").is_file():
        raise SpecError(f"{what} {name}: a directory, but not one written by datasets' save_to_disk "
                        "(no state.json or dataset_dict.json)")
    try:
        from datasets import load_from_disk

        recs = load_from_disk(str(path)).to_list()
    except Exception as e:  # datasets raises many types for a damaged directory; report it in one line
        raise SpecError(f"{what} {name}: cannot read the datasets directory ({_first_line(e)})") from None
    return [(f"{what} {name} row {i}", r) for i, r in enumerate(recs, start=1)]


def to_row(rec: object, fields: Fields, where: str, verifier: str | None = None) -> dict:
    """One record mapped to our row shape and checked for `verifier` (see the module docstring)."""
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected an object with a {fields.prompt!r} field")
    prompt = rec.get(fields.prompt)
    if prompt is None:
        raise SpecError(f"{where}: {fields.prompt!r} is missing")
    if not isinstance(prompt, str) or not prompt:
        raise SpecError(f"{where}: {fields.prompt!r} must be a non-empty string")
    mapped = (fields.prompt, fields.answer, fields.tests)
    row = {k: v for k, v in rec.items() if k not in mapped and k not in RESERVED}
    row["prompt"] = prompt
    if rec.get(fields.answer) is not None:
        row["answer"] = rec[fields.answer]
    if rec.get(fields.tests) is not None:
        row["tests"] = rec[fields.tests]
    if verifier == "code":
        tests = row.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise SpecError(f"{where}: the code verifier needs {fields.tests!r}, a list of assert statements")
    elif verifier in ("exact", "math") and "answer" not in row:
        raise SpecError(f"{where}: {fields.answer!r} is missing (the {verifier} verifier needs it)")
    try:
        json.dumps(row)
    except (TypeError, ValueError):
        bad = next((k for k, v in row.items() if not _jsonable(v)), "?")
        raise SpecError(f"{where}: column {bad!r} holds a {type(row[bad]).__name__} value that cannot be "
                        "stored as JSON; drop the column") from None
    return row


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def load(src: list[dict] | str, what: str = "dataset", fields: Fields = Fields(), verifier: str | None = None,
         split: str | None = None, default_splits: tuple[str, ...] = TRAIN_SPLITS,
         label: bool = False) -> list[dict]:
    """Rows of a source, mapped and checked; the first bad one raises SpecError naming it. With
    `label`, each row keeps its label under `ROW_REF` (see the module docstring)."""
    rows = []
    for where, rec in read_records(src, what, split, default_splits):
        row = to_row(rec, fields, where, verifier)
        rows.append({**row, ROW_REF: where} if label else row)
    return rows


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(rows: list[dict], tokenizer, what: str = "dataset") -> list[dict]:
    """Rows with "prompt" rendered by the tokenizer's chat template and the original in "raw_prompt".

    prompt' = apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
    add_generation_prompt=True). Rows already rendered (they carry "raw_prompt") are re-rendered
    from the raw text, so rendering is idempotent.
    """
    out = []
    for row in rows:
        raw = row.get("raw_prompt", row["prompt"])
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": raw}], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # a template is user-supplied Jinja: any error is the template's
            raise SpecError(f"{what}: the base model's chat template fails on the prompt {raw[:40]!r} "
                            f"({_first_line(e)})") from None
        if not isinstance(text, str) or not text:
            raise SpecError(f"{what}: the base model's chat template gave no text for the prompt {raw[:40]!r}")
        out.append({**row, "prompt": text, "raw_prompt": raw})
    return out
