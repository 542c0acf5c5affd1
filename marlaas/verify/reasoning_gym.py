"""reasoning-gym as a task source: `task="reasoning_gym:NAME"` plus a config dict.

Rows. `make_rows(name, config, seed, n)` returns `n` rows
`{"prompt": question + "\\n" + FORMAT_INSTRUCTION, "answer": gold string, "rg": {...}}` (the
instruction is not repeated when the question already asks for a final answer); `rg` holds what
scoring needs: name, config, seed, size, index, and `entry` (the dataset entry's question, answer
and metadata as JSON data). Scoring uses `entry` as is when it survived the JSON round trip
unchanged (`entry_exact`); otherwise (metadata with tuples, or not serialisable) it re-creates the
entry from seed + index -- reasoning-gym entries are a pure function of the dataset's seed, config
and index -- and refuses with an error when the re-created question differs from the stored one (a
different reasoning-gym version). Rows are deterministic per (name, config, seed).

Train and held-out sets are disjoint (`make_split`): train rows come from the dataset seeded
`dataset_seed(job seed, "train")`, held-out rows from `dataset_seed(job seed, "held")`, and a
held-out row whose question is also a train question (small configs repeat questions) is dropped
and replaced by the next index, so the held-out set is never scored on a question the job trained
on. Held-out questions are also unique. A job's seed is hashed into the dataset's seed because
reasoning-gym draws item i from `Random(dataset seed + i)`: with the job's seed used as is, jobs
seeded s and s + 1 got the same rows shifted by one place.

Scoring (`score`). The prompt ends with FORMAT_INSTRUCTION ("Give only the final answer."); the
answer is extracted as: the last `<answer>...</answer>` when the completion has one (the
reasoning-gym convention), else `marlaas.verify.answers.extract_answer` (last `\\boxed{}`, answer
marker, else the last number that is not an operand of a restated expression), else -- for a
non-numeric gold only -- the completion's last non-empty line. Two guards against restating the
question: verbatim copies of the question are removed from the completion before extraction, and
a bare last number (rule (d), no tag/box/marker) that is one of the question's own numbers counts
only when it is the whole completion or follows "=" ("LCM of 4 and 12" is not an answer of 12;
"12" and "lcm(4, 12) = 12" are; "The LCM is 12" is not -- the prompt asks for the answer alone).
A numeric answer equal to the gold is passed in the gold's own spelling ("121.0" -> "121"). Then the dataset's own
`score_answer(answer, entry)` decides, with one change: reasoning-gym's generic substring credit
(`len(gold) / len(answer)` when the gold occurs inside a longer answer, e.g. 0.5 for "13" against
gold "3") is a wrong answer and scores 0.0; other partial scores of a dataset's own scorer are kept.

Dataset objects are cached per (name, config JSON, seed, size). reasoning_gym is imported lazily.
What a tenant may ask (tasks whose code can run text as Python are refused, no file paths in a
config, rows made under CPU, memory and time limits) is `marlaas.verify.rg_guard`'s.

A dataset scorer that raises on the extracted answer (prime_factorization calls int() on prose)
scores it 0.0: a wrong answer, not a verifier error counted against the job.

Invariant: `score` returns a float in [0, 1] and never rewards an answer that is not extracted
(a restated question has none).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from typing import Any

from marlaas.errors import TaskSourceError, one_line
from marlaas.verify import rg_guard
from marlaas.verify.answers import answers_match, extract_answer_rule, numbers_in, parse_number

PREFIX = "reasoning_gym:"
FORMAT_INSTRUCTION = "Give only the final answer."
_RESERVED = ("seed", "size")
_MAX_SCAN = 50  # held-out: scan at most this many indices per wanted row before giving up



def is_task(task: object) -> bool:
    """True for a `reasoning_gym:NAME` task string."""
    return isinstance(task, str) and task.startswith(PREFIX)


def registry() -> dict:
    """reasoning-gym's registered datasets: {name: (dataset class, config class)}."""
    import reasoning_gym  # noqa: F401  (registers every dataset)
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _check_name(name: str) -> None:
    names = registry()
    if name not in names:
        close = difflib.get_close_matches(name, list(names), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise TaskSourceError(
            f"unknown reasoning-gym task {name!r}: {hint}{len(names)} names are registered, list them with "
            f"python -c \"import reasoning_gym.factory as f; print(sorted(f.DATASETS))\""
        )


def parse_task(task: str, config: dict | None = None) -> tuple[str, dict]:
    """(name, config) for `task="reasoning_gym:NAME"` and its config dict; checked against the registry."""
    if not is_task(task):
        raise TaskSourceError(f"not a reasoning-gym task: {task!r} (expected '{PREFIX}NAME')")
    name = task[len(PREFIX):].strip()
    cfg = dict(config or {})
    bad = [k for k in _RESERVED if k in cfg]
    if bad:
        raise TaskSourceError(f"reasoning-gym config must not set {', '.join(bad)}: the job's seed decides")
    _check_name(name)
    why = rg_guard.refusal(name)
    if why:
        raise TaskSourceError(why)
    rg_guard.check_config_values(name, cfg)
    rg_guard.check_config_cost(name, cfg)
    _check_config(name, cfg)
    return name, cfg


def _check_config(name: str, config: dict) -> None:
    """The config's keys and values, by its own dataclass and validate(); no dataset is built here (its
    cost is the config's: rows are made under limits by `rg_guard.make_split_bounded`)."""
    _, config_cls = registry()[name]
    try:
        cfg = config_cls(**json.loads(_config_json(config)), seed=0, size=1)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except (TypeError, ValueError, AssertionError) as e:
        raise TaskSourceError(f"bad config for reasoning-gym task {name!r}: {one_line(e)}") from e


def _config_json(config: dict) -> str:
    try:
        return json.dumps(config, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TaskSourceError(f"reasoning-gym config is not JSON data: {e}") from e


@functools.lru_cache(maxsize=8)  # a dataset may hold up to rg_guard.DATASET_MB
def _dataset(name: str, config_json: str, seed: int, size: int):
    import reasoning_gym

    _check_name(name)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (TypeError, ValueError, AssertionError) as e:
        raise TaskSourceError(f"bad config for reasoning-gym task {name!r}: {one_line(e)}") from e


def _portable_entry(entry: dict) -> tuple[dict | None, bool]:
    """(question/answer/metadata as JSON data or None when not serialisable, whether the round trip is exact)."""
    kept = {k: entry[k] for k in ("question", "answer", "metadata") if k in entry}
    try:
        back = json.loads(json.dumps(kept))
    except (TypeError, ValueError):
        return None, False
    return back, back == kept


def _prompt(question: str) -> str:
    if "final answer" in question.lower():
        return question  # the dataset already asks for it (e.g. gcd)
    return f"{question}\n{FORMAT_INSTRUCTION}"


def _row(name: str, config: dict, seed: int, size: int, index: int, entry: dict) -> dict:
    rg: dict[str, Any] = {"name": name, "config": config, "seed": seed, "size": size, "index": index}
    portable, exact = _portable_entry(entry)
    if portable is not None:
        rg["entry"] = portable
        rg["entry_exact"] = exact
    return {"prompt": _prompt(entry["question"]), "answer": str(entry["answer"]), "rg": rg}


def make_rows(name: str, config: dict, seed: int, n: int, *, size: int | None = None) -> list[dict]:
    """`n` rows of task `name` (indices 0..n-1 of the dataset with this seed); deterministic."""
    _check_name(name)
    size = size or max(n, 1)
    ds = _dataset(name, _config_json(config), seed, size)
    return [_row(name, config, seed, size, i, ds[i]) for i in range(n)]


def _questions(name: str, config: dict, seed: int, n: int) -> set[str]:
    ds = _dataset(name, _config_json(config), seed, max(n, 1))
    return {ds[i]["question"] for i in range(n)}


def dataset_seed(seed: int, part: str) -> int:
    """The reasoning-gym dataset seed of a job seeded `seed` for `part` ("train" or "held"): a hash,
    so neighbouring job seeds draw unrelated items (item i is `Random(dataset seed + i)`); below
    2**31, so dataset seed + index stays within numpy's 32-bit seeds (pool_matrix seeds numpy)."""
    digest = hashlib.sha256(f"marlaas-rg:{part}:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def make_split(name: str, config: dict, seed: int, n_train: int, n_held: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) of a job seeded `seed`: disjoint by dataset seed (`dataset_seed(seed, "train")`
    vs `dataset_seed(seed, "held")`) and by question text."""
    train_seed, held_seed = dataset_seed(seed, "train"), dataset_seed(seed, "held")
    train = make_rows(name, config, train_seed, n_train)
    seen = _questions(name, config, train_seed, n_train)
    scan = max(n_held * _MAX_SCAN, 1)
    ds = _dataset(name, _config_json(config), held_seed, scan)
    held: list[dict] = []
    for i in range(scan):
        if len(held) == n_held:
            break
        entry = ds[i]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        held.append(_row(name, config, held_seed, scan, i, entry))
    if len(held) < n_held:
        raise TaskSourceError(
            f"reasoning-gym task {name!r} with this config has too few distinct questions for "
            f"{n_held} held-out rows disjoint from {n_train} train rows: widen the config"
        )
    return train, held


def _entry_of(row: dict) -> tuple[Any, dict]:
    rg = row["rg"]
    ds = _dataset(rg["name"], _config_json(rg["config"]), int(rg["seed"]), int(rg["size"]))
    stored = rg.get("entry")
    if stored is not None and rg.get("entry_exact"):
        return ds, stored
    entry = ds[int(rg["index"])]
    if stored is not None and stored.get("question") != entry["question"]:
        raise TaskSourceError(
            f"reasoning-gym re-created a different question for {rg['name']!r} index {rg['index']}: "
            f"the installed reasoning-gym differs from the one that made the row"
        )
    return ds, entry


def completion_answer(completion: str, gold: str, question: str = "") -> str | None:
    """The answer `score` hands to the dataset's scorer (module docstring's rule), or None."""
    from reasoning_gym.utils import extract_answer as rg_extract

    if question:
        completion = completion.replace(question, " ")
    tagged = rg_extract(completion)
    if tagged is not None:
        answer = tagged
    else:
        answer, rule = extract_answer_rule(completion)
        if rule == "number" and _restated_operand(completion, answer, question):
            answer = None
    if answer is None and parse_number(gold) is None:
        lines = [ln.strip() for ln in completion.strip().split("\n") if ln.strip()]
        answer = lines[-1] if lines else None
    if answer is not None and parse_number(gold) is not None and answers_match(answer, gold):
        answer = gold
    return answer


def _restated_operand(completion: str, answer: str | None, question: str) -> bool:
    """A bare last number that is one of the question's numbers, neither alone nor after "=": a restatement."""
    if answer is None or not question or _clean_number(answer) not in {_clean_number(q) for q in numbers_in(question)}:
        return False
    if completion.strip().rstrip(".") == answer:
        return False
    before = completion[: completion.rfind(answer)].rstrip()
    return not before.endswith("=")


def _clean_number(s: str) -> str:
    value = parse_number(s)
    return str(value) if value is not None else s


def score(completion: str, row: dict) -> float:
    """Reward in [0, 1] of `completion` for a reasoning-gym row (module docstring's rule)."""
    ds, entry = _entry_of(row)
    gold = str(entry["answer"])
    question = str(entry.get("question", ""))
    answer = completion_answer(completion, gold, question) if isinstance(completion, str) else None
    if answer is None:
        return 0.0
    try:
        value = float(ds.score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - a task's scorer that cannot parse the model's answer: a wrong answer
        return 0.0  # (e.g. prime_factorization's int() on prose), not a verifier error counted against the job
    if 0.0 < value < 1.0 and gold in answer and answer.strip() != gold.strip():
        value = 0.0  # reasoning-gym's substring credit: the gold inside a longer, different answer
    return min(max(value, 0.0), 1.0)
