"""reasoning-gym task source: deterministic rows, disjoint splits, its own scorer behind honest extraction."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

from marlaas.verify import reasoning_gym as rgs
from marlaas.verify.reasoning_gym import TaskSourceError, dataset_seed, make_rows, make_split, parse_task, score

pytestmark = pytest.mark.unit

EASY = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "max_value": 60},
    "lcm": {"min_numbers": 2, "max_numbers": 2, "max_value": 12},
    "letter_counting": {"min_words": 3, "max_words": 6},
}


@pytest.mark.parametrize("name", sorted(EASY))
def test_rows_deterministic_and_json(name):
    task, cfg = parse_task(f"reasoning_gym:{name}", EASY[name])
    assert task == name and cfg == EASY[name]
    a = make_rows(name, cfg, seed=11, n=20)
    b = make_rows(name, cfg, seed=11, n=20)
    assert a == b and len(a) == 20
    assert json.loads(json.dumps(a)) == a  # rows travel as JSON through the store
    other = make_rows(name, cfg, seed=12, n=20)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in a]
    for r in a:
        assert r["rg"]["entry"]["question"] in r["prompt"] and "final answer" in r["prompt"].lower()
        assert isinstance(r["answer"], str) and r["answer"] == r["rg"]["entry"]["answer"]


@pytest.mark.parametrize("name", sorted(EASY))
def test_split_is_disjoint(name):
    train, held = make_split(name, EASY[name], seed=5, n_train=100, n_held=30)
    assert len(train) == 100 and len(held) == 30
    train_q = {r["rg"]["entry"]["question"] for r in train}
    held_q = [r["rg"]["entry"]["question"] for r in held]
    assert not train_q & set(held_q) and len(set(held_q)) == len(held_q)
    assert {r["rg"]["seed"] for r in train} == {dataset_seed(5, "train")}
    assert {r["rg"]["seed"] for r in held} == {dataset_seed(5, "held")}


def test_neighbouring_job_seeds_draw_unrelated_rows():
    """reasoning-gym draws item i from Random(dataset seed + i): with the job's seed as the dataset's,
    jobs seeded 5 and 6 shared 96 of 100 train questions and 49 of 50 held-out ones (the same rows
    shifted by one place); now only what two independent draws of this config repeat by chance."""
    cfg = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    a, a_held = make_split("chain_sum", cfg, seed=5, n_train=100, n_held=50)
    b, b_held = make_split("chain_sum", cfg, seed=6, n_train=100, n_held=50)

    def shared(x, y):
        return len({r["rg"]["entry"]["question"] for r in x} & {r["rg"]["entry"]["question"] for r in y})

    assert shared(a, b) <= 10 and shared(a_held, b_held) <= 5
    assert dataset_seed(5, "train") != dataset_seed(5, "held")
    assert all(0 <= dataset_seed(s, p) < 2**31 for s in (0, 1, 2**40) for p in ("train", "held"))


@pytest.mark.parametrize("name", sorted(EASY))
def test_scores(name):
    rows = make_rows(name, EASY[name], seed=3, n=10)
    for r in rows:
        gold = r["answer"]
        wrong = str(int(gold) + 1)
        assert score(gold, r) == 1.0
        assert score(f"Let me think.\nThe answer is {gold}.", r) == 1.0
        assert score(f"<answer>{gold}</answer>", r) == 1.0
        assert score(f"\\boxed{{{gold}}}", r) == 1.0
        assert score(f"{gold}.0", r) == 1.0
        assert score(wrong, r) == 0.0
        assert score("1" + gold, r) == 0.0  # reasoning-gym's substring credit would pay 0.5 here
        assert score(r["prompt"], r) == 0.0  # restating the question
        assert score(r["rg"]["entry"]["question"], r) == 0.0
        assert score("", r) == 0.0


def test_restated_expression_scores_zero():
    row = next(r for r in make_rows("basic_arithmetic", EASY["basic_arithmetic"], seed=1, n=50)
               if "+" in r["prompt"])
    expr = row["prompt"].split("Calculate ", 1)[1].split(".", 1)[0]  # e.g. "6 + 10"
    assert score(f"To find {expr}, we can start by adding the", row) == 0.0
    assert score(f"{expr} = {row['answer']}", row) == 1.0


def test_entry_recreated_from_seed_and_index():
    row = make_rows("gcd", EASY["gcd"], seed=9, n=3)[2]
    row["rg"]["entry_exact"] = False  # as for metadata that does not survive JSON: re-create by index
    assert score(row["answer"], row) == 1.0
    row["rg"]["entry"]["question"] = "something else"
    with pytest.raises(TaskSourceError, match="different question"):
        score(row["answer"], row)


def test_errors():
    with pytest.raises(TaskSourceError, match=r"unknown reasoning-gym task 'basic_arithmetc': did you mean basic_"):
        parse_task("reasoning_gym:basic_arithmetc")
    with pytest.raises(TaskSourceError, match="sorted\\(f.DATASETS\\)"):
        parse_task("reasoning_gym:no_such_task")
    with pytest.raises(TaskSourceError, match="bad config .*unexpected keyword argument 'nope'"):
        parse_task("reasoning_gym:gcd", {"nope": 1})
    with pytest.raises(TaskSourceError, match="must not set seed"):
        parse_task("reasoning_gym:gcd", {"seed": 1})
    with pytest.raises(TaskSourceError, match="not a reasoning-gym task"):
        parse_task("gcd")
    with pytest.raises(TaskSourceError, match="too few distinct questions"):
        make_split("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                        "operators": ["+"], "allow_parentheses": False, "allow_negation": False},
                   seed=0, n_train=200, n_held=100)
    assert rgs.is_task("reasoning_gym:gcd") and not rgs.is_task("gcd")


def test_gold_that_is_an_operand_is_not_paid_for_a_restatement():
    rows = make_rows("lcm", EASY["lcm"], seed=3, n=200)
    row = next(r for r in rows if int(r["answer"]) in r["rg"]["entry"]["metadata"]["numbers"])
    a, b = row["rg"]["entry"]["metadata"]["numbers"]
    gold = row["answer"]
    assert score(f"The LCM of {a} and {b}", row) == 0.0
    assert score(f"We need the least common multiple of {a}, {b}", row) == 0.0
    assert score(gold, row) == 1.0
    assert score(f"lcm({a}, {b}) = {gold}", row) == 1.0
    assert score(f"The answer is {gold}", row) == 1.0


def test_a_scorer_that_cannot_parse_the_answer_scores_zero_without_an_error():
    # prime_factorization's own score_answer calls int() on every factor: prose raises ValueError there.
    from marlaas.verify.verifiers import score_group

    row = make_rows("prime_factorization", {"min_value": 2, "max_value": 100}, seed=0, n=1)[0]
    prose = "To find the prime factorization of it, we"
    assert score(prose, row) == 0.0
    res = score_group("reasoning_gym", row, [prose, row["answer"]])
    assert res.rewards == [0.0, 1.0] and res.errors == 0, res
