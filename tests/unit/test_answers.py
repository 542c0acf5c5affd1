"""Final-answer extraction and comparison: hand-computed cases, and restating the question never pays."""

from __future__ import annotations

import pytest

from marlaas.verify.answers import answers_match, extract_answer, math_reward, parse_number

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("To find 64 + 57, we can start by adding the", 121, 0.0),  # the old bug: math_verify gave 1.0
        ("64 + 57 = 121.", 121, 1.0),
        ("121", 121, 1.0),
        ("The answer is 121", 121, 1.0),
        ("\\boxed{121}", 121, 1.0),
        ("64 + 57", 121, 0.0),
        ("I think 120... no, 121", 121, 1.0),
        ("121.0", 121, 1.0),
        ("1,234", 1234, 1.0),
        ("-5", -5, 1.0),
        ("1/2", 0.5, 1.0),
        ("1/2", "0.5", 1.0),
        ("0.5", "1/2", 1.0),
        ("The answer is 122", 121, 0.0),
        ("\\boxed{120} and then 121", 121, 0.0),  # the box decides, not the last number
        ("First \\boxed{120}, corrected: \\boxed{121}", 121, 1.0),  # the LAST box
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # \frac parsed natively
        ("\\boxed{{121}}", 121, 1.0),  # balanced braces
        ("\\boxed{\\text{121}}", 121, 1.0),
        ("Answer: 64 + 57 = 121", 121, 1.0),
        ("The answer is 121, since 100 + 21 = 121", 121, 1.0),
        ("x = 3 - 8 = -5", -5, 1.0),
        ("10 - 5", 5, 0.0),  # an expression is not an answer
        ("#### 72", 72, 1.0),
        ("Final answer:\n42", 42, 1.0),
        ("**Answer:** $1,000$.", 1000, 1.0),
        ("3 x 4 = 12", 12, 1.0),
        ("3 × 4", 12, 0.0),
        ("The result is 5 apples", 5, 1.0),
        ("The answer is yes.", "Yes", 1.0),
        ("", 0, 0.0),
        ("no digits at all", 0, 0.0),
    ],
)
def test_math_reward_cases(completion, gold, reward):
    assert math_reward(completion, {"answer": gold}) == reward


@pytest.mark.parametrize(
    "restated",
    [
        "What is 64 + 57? Reply with only the number.",
        "What is 64 + 57?",
        "To find 64 + 57, we add 64 and 57.",
        "We need to compute 64+57.",
        "64 + 57 is what we are asked for. Let us add 64 + 57 step by step.",
        "Sure! The question asks: what is 64 + 57?",
        "Adding 64 and 57",
        "64 plus 57",
    ],
)
def test_restating_the_question_scores_zero(restated):
    assert math_reward(restated, {"answer": 121}) == 0.0


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("64 + 57 = 121.", "121"),
        ("What is 64 + 57?", None),
        ("The answer is 121.", "121"),
        ("\\boxed{\\frac{3}{4}} done", "\\frac{3}{4}"),
        ("so the total is -7", "-7"),
        ("from 10 - 3 we get 7", "7"),
        ("Answer: Paris.", "Paris"),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_compare_numbers():
    assert answers_match("121", "121.000")
    assert answers_match("0.3333333333333", "1/3")  # within 1e-9 relative
    assert not answers_match("0.3333", "1/3")
    assert not answers_match(None, 121)
    assert not answers_match("one hundred", 121)
    assert answers_match(" Paris ", "paris")
    assert parse_number("1,234.5") == parse_number("1234.5")
    assert parse_number("1/0") is None
    assert parse_number("abc") is None


def test_latex_answer_falls_back_to_math_verify_on_the_answer_only():
    pytest.importorskip("math_verify")
    assert math_reward("The final answer is $\\sqrt{4}$", {"answer": 2}) == 1.0
    assert math_reward("The final answer is $\\sqrt{5}$", {"answer": 2}) == 0.0


def test_a_list_items_number_is_no_answer():
    from marlaas.verify.answers import extract_answer, math_reward

    assert extract_answer('1. The text is "explanation"\n2. The letter "i') is None
    assert math_reward('1. The text is "explanation"\n2. The letter "i', {"answer": "2"}) == 0.0
    assert extract_answer("Steps:\n1. add 3 and 4\n2. the sum is 7") == "7"
    assert extract_answer("1. 7") == "7" and extract_answer("7.") == "7"
