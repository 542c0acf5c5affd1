"""Reward functions ("verifiers"), the registry that resolves their names, and group scoring.

A verifier is `fn(completion: str, row: dict) -> float` (a bool counts as 0.0/1.0). Names:

- `exact`: `completion.strip() == str(row["answer"]).strip()`.
- `math`: ONE final answer is extracted from the completion -- the last `\boxed{}`, else the text
  after the last answer marker ("answer:", "answer is", "####"), else the last number that is not an
  operand of an arithmetic expression -- and compared numerically with the gold `row["answer"]`
  ("7" == "7.0", "1/2" == "0.5"; LaTeX answers through math_verify, on the extracted answer only).
  Restating the question ("To find 64 + 57, ...") has no answer and scores 0 (`marlaas.verify.answers`).
- `reasoning_gym`: a row made from a reasoning-gym task, scored by that task's own `score_answer`
  after the same honest extraction (`marlaas.verify.reasoning_gym`).
- `code`: `row["tests"]` is a list of Python assert statements, `row.get("entry", "expression")`:
  "expression": the completion is one Python expression, evaluated in a fresh namespace and bound to
  `result` (it must be plain data: None/bool/int/float/complex/str/bytes and lists, tuples, dicts,
  sets of those, so an object whose `__eq__` always says yes cannot pass); "program": the completion
  is executed as a module, then the tests run in its namespace. 1.0 when every test passes. The whole
  group runs in ONE sandbox batch (see `sandbox`): model-written code never runs in this process.
- `package.module:function`: a custom verifier, imported in the verify worker (trusted operator
  code; tenants name it only through a name the operator registered, `marlaas.verify.registry`).
  The function part is one name (attributes are never walked); standard-library modules, builtins
  and denied packages are refused, and the function must be defined in that module;
  `MARLAAS_VERIFIER_MODULES`, when set, is a comma-separated allow-list of module prefixes.
- `tool`: a multi-turn tool episode (the `calc` task): `exact` on its final answer, the text after
  its last tool call and result (`marlaas.tools.episodes.final_answer`).

Invariant: `score_group` never raises for a known verifier: a verifier that raises scores 0.0 for
that completion and is counted in `GroupScore.errors` with the first message kept (one line).
A program that fails its tests is a 0.0 reward, not an error.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from marlaas.errors import one_line

Verifier = Callable[[str, dict], "float | bool"]

BUILTIN = ("exact", "math", "code", "tool", "reasoning_gym")


@dataclass
class GroupScore:
    """Rewards of one group of completions of the same row."""

    rewards: list[float]
    """One reward per completion, in order; 0.0 where the verifier failed."""
    errors: int = 0
    """How many completions the verifier could not score (it raised)."""
    error: str | None = None
    """The first such error, one line."""


# ---------------------------------------------------------------- built-in verifiers


def exact_verifier(completion: str, row: dict) -> float:
    """1.0 when the stripped completion equals the stripped gold answer."""
    return 1.0 if completion.strip() == str(row["answer"]).strip() else 0.0


def math_verifier(completion: str, row: dict) -> float:
    """1.0 when the completion's ONE extracted final answer equals the gold `row["answer"]`
    (`marlaas.verify.answers`: last boxed answer, else an answer marker, else the last number that is
    not an operand of a restated expression); restating the question scores 0."""
    from marlaas.verify.answers import math_reward

    return math_reward(completion, row)


def reasoning_gym_verifier(completion: str, row: dict) -> float:
    """A reasoning-gym row, scored by its dataset's own `score_answer` (`marlaas.verify.reasoning_gym`)."""
    from marlaas.verify.reasoning_gym import score

    return score(completion, row)


_EXPRESSION_PRELUDE = """\
import builtins as __b
__builtins_copy = dict(vars(__b))  # taken before the completion runs: the tests see unpatched builtins


def __plain(x, depth=0, _t=type, _all=all, _atoms=(type(None), bool, int, float, complex, str, bytes),
            _seqs=(list, tuple, set, frozenset)):
    t = _t(x)
    if depth > 50:
        return False
    for a in _atoms:  # identity, not ==: a metaclass __eq__ must not fake a type
        if t is a:
            return True
    for s in _seqs:
        if t is s:
            return _all(__plain(v, depth + 1) for v in x)
    if t is dict:
        return _all(__plain(k, depth + 1) and __plain(v, depth + 1) for k, v in x.items())
    return False
"""


def code_program(completion: str, row: dict) -> str:
    """The sandbox program that checks one completion of a code row (raises on a malformed row)."""
    tests = row.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("a code row needs 'tests': a non-empty list of Python assert statements")
    test_src = "\n".join(tests)
    compile(test_src, "<tests>", "exec")  # a broken dataset row is a verifier error, not a 0 reward
    entry = row.get("entry", "expression")
    if entry == "expression":
        # Compiled in "eval" mode from a string literal: the completion cannot smuggle statements.
        return (
            _EXPRESSION_PRELUDE
            + f"result = eval(compile({completion.strip()!r}, '<completion>', 'eval'), {{'__builtins__': __b}})\n"
            + "if not __plain(result):\n"
            + "    raise TypeError('the expression did not evaluate to plain data')\n"
            + f"exec(compile({test_src!r}, '<tests>', 'exec'), {{'result': result, '__builtins__': __builtins_copy}})\n"
        )
    if entry == "program":
        # Compiled on their own: an unterminated string or block in the completion cannot swallow the
        # tests; they run in the completion's namespace.
        return (
            f"exec(compile({completion!r}, '<completion>', 'exec'))\n"
            + f"exec(compile({test_src!r}, '<tests>', 'exec'))\n"
        )
    raise ValueError(f"unknown code entry {entry!r}: use 'expression' or 'program'")


def code_verifier(completion: str, row: dict) -> float:
    """1.0 when all of row["tests"] pass on the completion (one sandbox run; groups use score_group).

    Raises on a malformed row or a sandbox failure, like any verifier; score_group counts those.
    """
    from marlaas.verify.sandbox import run_batch

    return 1.0 if run_batch([code_program(completion, row)])[0].ok else 0.0


def _score_code(completions: list[str], row: dict) -> GroupScore:
    from marlaas.verify.sandbox import SandboxError, run_batch

    try:
        programs = [code_program(c, row) for c in completions]
        results = run_batch(programs)
    except (ValueError, TypeError, SyntaxError, SandboxError) as e:
        return GroupScore(rewards=[0.0] * len(completions), errors=len(completions), error=one_line(e, typed=True))
    return GroupScore(rewards=[1.0 if r.ok else 0.0 for r in results])


def tool_verifier(completion: str, row: dict) -> float:
    """A tool episode (`marlaas.tools.episodes`): exact match of its final answer, the text after its
    last tool exchange ("[47*38]=1786;1786" -> "1786")."""
    from marlaas.tools.episodes import final_answer

    return exact_verifier(final_answer(completion), row)


_BUILTIN_FNS: dict[str, Verifier] = {"exact": exact_verifier, "math": math_verifier, "code": code_verifier,
                                     "tool": tool_verifier, "reasoning_gym": reasoning_gym_verifier}


# ---------------------------------------------------------------- registry


@functools.lru_cache(maxsize=256)
def _import_custom(name: str) -> Verifier:
    from marlaas.verify.registry import import_function

    return import_function(name)


def resolve_verifier(name: str) -> Verifier:
    """The verifier function for a built-in name or an import path (strict: `marlaas.verify.registry`);
    VerifierError (one line) if it cannot be resolved. Registered names are mapped to their import
    path by the caller (`registry.resolve`), which holds the store."""
    if name in _BUILTIN_FNS:
        return _BUILTIN_FNS[name]
    from marlaas.verify.registry import check_path

    check_path(name)
    return _import_custom(name)


def check_verifier_name(name: str) -> None:
    """Raise VerifierError (one line) unless `name` is a built-in or an importable custom verifier."""
    resolve_verifier(name)


# ---------------------------------------------------------------- scoring


def _reward(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"verifier returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"verifier returned {value}")
    return value


def score_group(verifier: str, row: dict, completions: list[str]) -> GroupScore:
    """Score every completion of one row; never raises except VerifierError for an unknown name."""
    if verifier == "code":
        return _score_code(list(completions), row)
    fn = resolve_verifier(verifier)
    rewards, errors, first = [], 0, None
    for completion in completions:
        try:
            rewards.append(_reward(fn(completion, row)))
        except Exception as e:  # noqa: BLE001 - a failing verifier scores 0 and is counted, by contract
            rewards.append(0.0)
            errors += 1
            first = first or one_line(e, typed=True)
    return GroupScore(rewards=rewards, errors=errors, error=first)


def score_groups(verifier: str, items: list[tuple[dict, list[str]]]) -> list[GroupScore]:
    """Score several groups at once: for `code`, every completion of every group in ONE sandbox batch
    (a batch's fixed cost is most of a small group's cost). Same contract as `score_group`."""
    if verifier != "code":
        return [score_group(verifier, row, comps) for row, comps in items]
    from marlaas.verify.sandbox import SandboxError, run_batch

    out: list[GroupScore | None] = [None] * len(items)
    programs: list[str] = []
    spans: list[tuple[int, int, int]] = []  # (item index, first program, count)
    for i, (row, comps) in enumerate(items):
        try:
            progs = [code_program(c, row) for c in comps]
        except (ValueError, TypeError, SyntaxError) as e:
            out[i] = GroupScore(rewards=[0.0] * len(comps), errors=len(comps), error=one_line(e, typed=True))
            continue
        spans.append((i, len(programs), len(progs)))
        programs += progs
    if programs:
        try:
            results = run_batch(programs)
        except SandboxError as e:
            for i, _, n in spans:
                out[i] = GroupScore(rewards=[0.0] * n, errors=n, error=one_line(e, typed=True))
        else:
            for i, start, n in spans:
                out[i] = GroupScore(rewards=[1.0 if r.ok else 0.0 for r in results[start:start + n]])
    return [s for s in out if s is not None]
