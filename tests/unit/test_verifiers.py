"""Verifiers on hand-written cases: exact, math, code (through the sandbox), custom by import path."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from marlaas.errors import VerifierError
from marlaas.verify import sandbox
from marlaas.verify.verifiers import GroupScore, check_verifier_name, score_group

pytestmark = pytest.mark.unit

NOT_CALLABLE = 3


def my_verifier(completion: str, row: dict) -> float:
    """A custom verifier referred to as 'tests.test_verifiers:my_verifier'."""
    return 0.5 if completion == row["answer"] else 0.0


def bool_verifier(completion: str, row: dict) -> bool:
    return completion.startswith("y")


def raising_verifier(completion: str, row: dict) -> float:
    if completion == "boom":
        raise RuntimeError("verifier blew up\non two lines")
    return 1.0


def one_arg(completion: str) -> float:
    return 1.0


def test_exact():
    assert score_group("exact", {"answer": " 42 "}, ["42", " 42\n", "43", "42.0"]).rewards == [1.0, 1.0, 0.0, 0.0]
    assert score_group("exact", {"answer": 7}, ["7"]) == GroupScore(rewards=[1.0], errors=0, error=None)


def test_math_equivalences():
    seven = score_group("math", {"answer": "7"}, ["7", "7.0", "The answer is $7$.", "\\frac{14}{2}", "8"])
    assert seven.rewards == [1.0, 1.0, 1.0, 1.0, 0.0] and seven.errors == 0
    half = score_group("math", {"answer": "0.5"}, ["1/2", "$\\frac{1}{2}$", "0.50", "2"])
    assert half.rewards == [1.0, 1.0, 1.0, 0.0]


def test_math_works_off_the_main_thread():
    out: list[GroupScore] = []
    t = threading.Thread(target=lambda: out.append(score_group("math", {"answer": "1/2"}, ["0.5", "3"])))
    t.start()
    t.join()
    assert out == [GroupScore(rewards=[1.0, 0.0])]


def test_math_unparseable_gold_is_an_error_not_a_crash():
    score = score_group("math", {"answer": ""}, ["1", "2"])
    assert score.rewards == [0.0, 0.0] and score.errors == 2 and "gold" in score.error


def test_code_expressions_in_one_sandbox_call(monkeypatch):
    calls = []
    real = sandbox.run_batch
    monkeypatch.setattr(sandbox, "run_batch", lambda programs, limits=None: calls.append(1) or real(programs, limits))
    row = {"tests": ["assert result == 4", "assert isinstance(result, int)"]}
    completions = [
        "2 + 2",
        " 4\n",
        "5",
        "4.0",  # fails the isinstance test
        "2 +",  # syntax error
        "type('A', (), {'__eq__': lambda s, o: True})()",  # not plain data
        "__import__('os')._exit(0)",  # exits before the tests
        "[4][0]",
    ]
    score = score_group("code", row, completions)
    assert score == GroupScore(rewards=[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], errors=0, error=None)
    assert len(calls) == 1


def test_code_expression_cannot_patch_builtins_used_by_tests():
    row = {"tests": ["assert sorted(result) == [1, 2]"]}
    hack = "(__import__('builtins').__setattr__('sorted', lambda x: [1, 2]), [])[1]"
    assert score_group("code", row, [hack, "[2, 1]"]).rewards == [0.0, 1.0]


def test_code_programs():
    row = {"entry": "program", "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
    completions = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    return 5\n",
        "def add(a, b):\n    return a + b\nx = '''",  # must not swallow the tests
        "import sys\nsys.exit(0)",
    ]
    assert score_group("code", row, completions).rewards == [1.0, 0.0, 0.0, 0.0]


def test_code_malformed_rows_are_errors():
    for row in ({}, {"tests": []}, {"tests": ["assert ("]}, {"tests": ["assert True"], "entry": "repl"}):
        score = score_group("code", row, ["1", "2"])
        assert score.rewards == [0.0, 0.0] and score.errors == 2 and "\n" not in score.error


def test_code_sandbox_failure_is_counted_not_raised(monkeypatch):
    def broken(programs, limits=None):
        raise sandbox.SandboxError("sandbox runner failed (exit 1): boom")

    monkeypatch.setattr(sandbox, "run_batch", broken)
    score = score_group("code", {"tests": ["assert result"]}, ["1", "1"])
    assert score == GroupScore(rewards=[0.0, 0.0], errors=2, error="SandboxError: sandbox runner failed (exit 1): boom")


def test_custom_verifier_by_import_path():
    check_verifier_name("tests.unit.test_verifiers:my_verifier")
    assert score_group("tests.unit.test_verifiers:my_verifier", {"answer": "a"}, ["a", "b"]).rewards == [0.5, 0.0]
    assert score_group("tests.unit.test_verifiers:bool_verifier", {}, ["yes", "no"]).rewards == [1.0, 0.0]


def test_raising_custom_verifier_scores_zero_and_counts():
    score = score_group("tests.unit.test_verifiers:raising_verifier", {}, ["ok", "boom", "boom", "fine"])
    assert score.rewards == [1.0, 0.0, 0.0, 1.0]
    assert score.errors == 2
    assert score.error == "RuntimeError: verifier blew up on two lines"


@pytest.mark.parametrize(
    "name, message",
    [
        ("nope", "unknown verifier"),
        ("", "unknown verifier"),
        ("tests.unit.test_verifiers", "unknown verifier"),
        ("builtins:eval", "standard-library"),
        ("os:system", "standard-library"),
        ("tests.no_such_module:f", "cannot import"),
        ("tests.unit.test_verifiers:missing", "no attribute"),
        ("tests.unit.test_verifiers:NOT_CALLABLE", "not a Python function"),
        ("tests.unit.test_verifiers:one_arg", "must accept"),
    ],
)
def test_unknown_verifiers_raise_one_line(name, message):
    with pytest.raises(VerifierError, match=message) as info:
        check_verifier_name(name)
    assert "\n" not in str(info.value)
    with pytest.raises(VerifierError):
        score_group(name, {}, ["x"])


def test_allow_list_of_custom_modules(monkeypatch):
    monkeypatch.setenv("MARLAAS_VERIFIER_MODULES", "myorg.rewards, other")
    with pytest.raises(VerifierError, match="MARLAAS_VERIFIER_MODULES"):
        check_verifier_name("tests.unit.test_verifiers:bool_verifier")
    monkeypatch.setenv("MARLAAS_VERIFIER_MODULES", "tests")
    check_verifier_name("tests.unit.test_verifiers:raising_verifier")


def test_builtin_names_are_cheap():
    code = (
        "import sys\nfrom marlaas.verify.verifiers import check_verifier_name\n"
        "for n in ('exact', 'math', 'code'):\n    check_verifier_name(n)\n"
        "assert 'math_verify' not in sys.modules and 'sympy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_code_verifier_alone():
    from marlaas.verify.verifiers import code_verifier

    assert code_verifier("3 * 3", {"tests": ["assert result == 9"]}) == 1.0
    with pytest.raises(ValueError, match="tests"):
        code_verifier("1", {"answer": "1"})


def test_score_groups_batches_code_and_matches_per_group(monkeypatch):
    from marlaas.verify import sandbox as sb
    from marlaas.verify.verifiers import score_group, score_groups

    calls = []
    real = sb.run_batch
    monkeypatch.setattr(sb, "run_batch", lambda progs, limits=None: calls.append(len(progs)) or real(progs, limits))
    items = [
        ({"tests": ["assert result == 17"]}, ["9+8", "9+9"]),
        ({"tests": "not a list"}, ["1"]),  # malformed row: its own errors, others unaffected
        ({"tests": ["assert result == 3"]}, ["1+2", "2+1", "4"]),
    ]
    got = score_groups("code", items)
    assert calls == [5]  # one sandbox batch for both valid groups
    assert [g.rewards for g in got] == [[1.0, 0.0], [0.0], [1.0, 1.0, 0.0]]
    assert got[1].errors == 1 and got[0].errors == got[2].errors == 0
    assert [g.rewards for g in got] == [score_group("code", r, c).rewards for r, c in items]
    assert [g.rewards for g in score_groups("exact", [({"answer": "a"}, ["a", "b"])])] == [[1.0, 0.0]]
