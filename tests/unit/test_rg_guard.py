"""The reasoning-gym boundary: tasks whose code can run text as Python are refused, config paths are
refused, rows are made in a child process under CPU, memory and time limits."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("reasoning_gym")

from marlaas.errors import TaskSourceError
from marlaas.verify import rg_guard
from marlaas.verify.reasoning_gym import parse_task

pytestmark = pytest.mark.unit


def test_scan_source_finds_every_way_text_becomes_code():
    src = """
import re, json
from sympy.parsing.sympy_parser import parse_expr
x = eval(answer)
exec("1")
compile("1", "f", "eval")
__import__("os")
pattern = re.compile("a+")
data = json.loads(answer)
obj = pickle.loads(blob)
expr = sympify(answer)
"""
    hits = set(rg_guard.scan_source(src, "m.py"))
    # lines 8 and 9 (re.compile, json.loads) are not code
    assert hits == {"m.py:3: imports sympy", "m.py:4: eval()", "m.py:5: exec()", "m.py:6: compile()",
                    "m.py:7: __import__()", "m.py:10: loads()", "m.py:11: sympify()"}
    assert rg_guard.scan_source("import json\nvalue = int(answer)\n") == []


def test_tasks_that_eval_the_models_answer_are_refused():
    # string_insertion's scorer calls eval() on the model's answer; spiral_matrix too; the sympy ones parse it
    for name in ("string_insertion", "spiral_matrix", "binary_matrix", "simple_equations", "codeio", "composite"):
        why = rg_guard.refusal(name)
        assert why is not None and ("run text as Python" in why and ".py:" in why or "by name" in why), name
        with pytest.raises(TaskSourceError, match="is not offered"):
            parse_task(f"reasoning_gym:{name}")
    # read and allowed: basic_arithmetic (audited); these have no eval at all
    for name in ("basic_arithmetic", "chain_sum", "products", "gcd", "lcm", "letter_counting", "count_primes"):
        assert rg_guard.refusal(name) is None, name


def test_config_paths_are_refused():
    with pytest.raises(TaskSourceError, match="data_file.*must name one of the package's data files"):
        parse_task("reasoning_gym:spell_backward", {"data_file": "/etc/passwd"})
    with pytest.raises(TaskSourceError, match="data_file"):
        parse_task("reasoning_gym:spell_backward", {"data_file": "../../../secrets.txt"})
    with pytest.raises(TaskSourceError, match="looks like a path"):
        rg_guard.check_config_values("x", {"words": ["ok", "~/.ssh/id_rsa"]})
    parse_task("reasoning_gym:spell_backward", {"data_file": "words3to10.txt"})  # the package's own file
    rg_guard.check_config_values("basic_arithmetic", {"operators": ["+", "-", "*", "/"]})  # "/" alone is no path


def test_config_is_checked_without_building_the_dataset():
    # count_primes builds a sieve of max_n entries in its constructor: parse_task must not build it
    parse_task("reasoning_gym:count_primes", {"max_n": 10**5})
    with pytest.raises(TaskSourceError, match="bad config .*max_n"):
        parse_task("reasoning_gym:count_primes", {"min_n": 10, "max_n": 5})


def test_configs_whose_cost_is_predictable_are_refused_naming_the_field():
    t = time.monotonic()
    with pytest.raises(TaskSourceError, match=r"^reasoning-gym config 'max_n' of 'count_primes' is 3e\+07, at most "
                                              r"100000: .*CPU a submit may spend making rows$") as e:
        parse_task("reasoning_gym:count_primes", {"max_n": 3 * 10**7})  # 42 s per submit before
    assert "\n" not in str(e.value) and time.monotonic() - t < 2.0
    with pytest.raises(TaskSourceError, match="'simulation_steps' of 'game_of_life'"):
        parse_task("reasoning_gym:game_of_life", {"simulation_steps": 10**6})
    parse_task("reasoning_gym:game_of_life", {"simulation_steps": 5})


def test_row_making_cpu_is_bounded():
    # past the predictable bounds (make_split_bounded called directly): the child's RLIMIT_CPU ends it
    t = time.monotonic()
    with pytest.raises(TaskSourceError, match=r"count_primes.*needs more than .*make it smaller"):
        rg_guard.make_split_bounded("count_primes", {"max_n": 3 * 10**7}, seed=0, n_train=256, n_held=8, cpu_s=2)
    assert time.monotonic() - t < 10


def test_rows_are_made_under_limits():
    train, held = rg_guard.make_split_bounded("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                            "max_digits": 2}, seed=3, n_train=8, n_held=5)
    assert len(train) == 8 and len(held) == 5
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    # a sieve of 10^10 booleans: refused by the child's memory limit, the caller gets one line
    with pytest.raises(TaskSourceError, match=r"count_primes.*needs more than .* MB.*make it smaller"):
        rg_guard.make_split_bounded("count_primes", {"max_n": 10**10}, seed=0, n_train=4, n_held=4)
    # a config the generator fails on (no word of that length): the generator's error, one line
    with pytest.raises(TaskSourceError, match=r"could not make rows with this config: IndexError") as e:
        rg_guard.make_split_bounded("spell_backward", {"min_word_len": 40, "max_word_len": 50}, seed=0,
                                    n_train=4, n_held=4)
    assert "\n" not in str(e.value)
