"""Graders in process: string_check operations and templates, text-similarity metrics on hand-computed
values, multi formulas (and what the formula language refuses), validation at the boundary, the strict
import paths of custom verifiers (the audit's four paths refused) and the job spec's grader field."""

from __future__ import annotations

import math

import pytest

from marlaas.errors import SpecError, VerifierError
from marlaas.spec import parse_spec
from marlaas.verify import formula
from marlaas.verify.boundary import check_spec_verifier
from marlaas.verify.graders import MAX_TEXT, grade_group, parse_grader, render
from marlaas.verify.registry import check_path, import_function
from marlaas.verify.verifiers import check_verifier_name

pytestmark = pytest.mark.unit

OUT = "{{sample.output_text}}"


def check(op: str, reference: str = "{{item.answer}}", input: str = OUT) -> dict:
    return {"type": "string_check", "input": input, "reference": reference, "operation": op}


def sim(metric: str, **kw) -> dict:
    return {"type": "text_similarity", "input": OUT, "reference": "{{item.answer}}", "evaluation_metric": metric, **kw}


def rewards(grader: dict, item: dict, completions: list[str]) -> list[float]:
    return grade_group(parse_grader(grader), item, completions).rewards


# ---------------------------------------------------------------- string_check and templates
@pytest.mark.parametrize("op, expected", [("eq", [1.0, 0.0, 0.0, 0.0]), ("ne", [0.0, 1.0, 1.0, 1.0]),
                                          ("like", [1.0, 1.0, 0.0, 0.0]), ("ilike", [1.0, 1.0, 1.0, 0.0])])
def test_string_check_operations(op, expected):
    assert rewards(check(op), {"answer": "Paris"}, ["Paris", "It is Paris.", "paris!", "Rome"]) == expected


def test_templates_fill_item_fields_and_json_values():
    item = {"answer": 42, "city": "Paris", "tags": ["a", "b"]}
    assert render("{{ item.city }}-{{item.answer}}-{{item.tags}}-{{sample.output_text}}", item, "x") == \
        'Paris-42-["a", "b"]-x'
    assert rewards(check("eq"), item, ["42", "41"]) == [1.0, 0.0]
    assert rewards(check("eq", reference="{{item.city}} {{item.answer}}"), item, ["Paris 42"]) == [1.0]


def test_a_missing_item_field_is_a_counted_error():
    score = grade_group(parse_grader(check("eq", "{{item.nope}}")), {"answer": "a"}, ["a", "b"])
    assert score.rewards == [0.0, 0.0] and score.errors == 2 and "'nope'" in score.error and "\n" not in score.error


@pytest.mark.parametrize("template", ["{{item}}", "{{os.environ}}", "{{sample.output_json}}", "{{item.a.b}}",
                                      "{{ item.x | upper }}", "{{__import__('os')}}"])
def test_only_item_fields_and_output_text_are_placeholders(template):
    with pytest.raises(SpecError, match="placeholder"):
        parse_grader(check("eq", template))


def test_item_placeholders_are_key_lookups_not_attributes():
    score = grade_group(parse_grader(check("eq", "{{item.__class__}}")), {"answer": "a"}, ["a"])
    assert score.errors == 1 and "no field '__class__'" in score.error


def test_rendered_strings_are_capped():
    assert len(render(OUT + OUT, {}, "x" * MAX_TEXT)) == MAX_TEXT


# ---------------------------------------------------------------- text_similarity
def test_fuzzy_match_is_the_normalised_indel_similarity():
    # "abcd" vs "abce": one deletion and one insertion over 8 characters -> 1 - 2/8
    assert rewards(sim("fuzzy_match"), {"answer": "abcd"}, ["abcd", "abce", "wxyz"]) == [1.0, 0.75, 0.0]


def test_bleu_and_gleu():
    item = {"answer": "the cat sat on the mat"}
    assert rewards(sim("bleu"), item, ["the cat sat on the mat"]) == [1.0]
    assert rewards(sim("bleu"), item, ["dogs run"])[0] < 0.05
    # GLEU of "a b" against "a c": n-grams (1..4) {a, b, a b} vs {a, c, a c}: one match of 3 -> 1/3
    assert rewards(sim("gleu"), {"answer": "a c"}, ["a b"]) == [pytest.approx(1 / 3)]


def test_rouge_f_measures():
    item = {"answer": "a b c d"}
    # hypothesis "a b": rouge-1 P 1, R 1/2 -> F 2/3; rouge-2 P 1, R 1/3 -> F 1/2; rouge-L as rouge-1
    assert rewards(sim("rouge_1"), item, ["a b"]) == [pytest.approx(2 / 3)]
    assert rewards(sim("rouge_2"), item, ["a b"]) == [pytest.approx(0.5)]
    assert rewards(sim("rouge_l"), item, ["a b"]) == [pytest.approx(2 / 3)]
    assert rewards(sim("rouge_5"), item, ["a b"]) == [0.0]


def test_pass_threshold_makes_the_reward_binary():
    assert rewards(sim("fuzzy_match", pass_threshold=0.7), {"answer": "abcd"}, ["abce", "wxyz"]) == [1.0, 0.0]


@pytest.mark.parametrize("metric, message", [("meteor", "not available"), ("cosine", "not available"),
                                             ("levenshtein", "unknown evaluation_metric")])
def test_unsupported_metrics_are_refused(metric, message):
    with pytest.raises(SpecError, match=message):
        parse_grader(sim(metric))


# ---------------------------------------------------------------- multi and the formula language
def multi(expr: str, **graders) -> dict:
    return {"type": "multi", "graders": graders or {"exact": check("eq"), "fuzzy": sim("fuzzy_match")},
            "calculate_output": expr}


def test_multi_weights_sub_graders():
    item = {"answer": "abcd"}
    assert rewards(multi("0.5 * exact + 0.5 * fuzzy"), item, ["abcd", "abce"]) == [1.0, 0.375]
    assert rewards(multi("max(exact, fuzzy) - 0 * abs(-1)"), item, ["abce"]) == [0.75]
    assert rewards(multi("min(exact, fuzzy) / 1"), item, ["abce"]) == [0.0]


def test_multi_out_of_range_or_division_by_zero_is_a_counted_error():
    score = grade_group(parse_grader(multi("2 * fuzzy")), {"answer": "abcd"}, ["abcd", "wxyz"])
    assert score.rewards == [0.0, 0.0] and score.errors == 1 and "outside [0, 1]" in score.error
    score = grade_group(parse_grader(multi("exact / fuzzy")), {"answer": "abcd"}, ["wxyz"])
    assert score.errors == 1 and "division by zero" in score.error


def test_a_failing_sub_grader_is_an_error_of_the_multi_grader():
    g = multi("exact", exact=check("eq", "{{item.missing}}"))
    score = grade_group(parse_grader(g), {"answer": "a"}, ["a"])
    assert score.errors == 1 and score.error.startswith("exact:")


@pytest.mark.parametrize("expr, message", [
    ("exact.__class__", "attribute"),
    ("exact.real", "attribute"),
    ("__import__('os').system('id')", "only min"),
    ("eval('1')", "only min"),
    ("exact ** 99999999", "Pow"),
    ("9 ** 9 ** 9", "Pow"),
    ("exact[0]", "Subscript"),
    ("(lambda: 1)()", "only min"),
    ("exact if fuzzy else 1", "IfExp"),
    ("exact and fuzzy", "BoolOp"),
    ("exact < fuzzy", "Compare"),
    ("'a' * 10", "only numbers"),
    ("1e300 * exact", "out of range"),
    ("other + exact", "unknown name"),
    ("min", "unknown name"),
    ("max(*[exact])", "plain arguments"),
    ("max(a=1)", "plain arguments"),
    ("abs(exact, fuzzy)", "one argument"),
    ("[x for x in ()]", "ListComp"),
    ("exact +", "does not parse"),
    ("+".join(["exact"] * 150), "too long"),
])
def test_formula_language_refuses(expr, message):
    with pytest.raises(SpecError, match=message):
        parse_grader(multi(expr))


def test_formula_evaluation_is_plain_arithmetic():
    tree = formula.parse_formula("0.25 * a + max(b, 0.5) - abs(-0.25)", {"a", "b"})
    assert formula.evaluate(tree, {"a": 1.0, "b": 0.0}) == 0.5
    with pytest.raises(formula.FormulaError, match="evaluated to"):
        formula.evaluate(formula.parse_formula("a * 1000000 * 1000000", {"a"}), {"a": math.inf})


def test_multi_limits_nesting_and_size():
    deep = check("eq")
    for _ in range(4):
        deep = multi("x", x=deep)
    with pytest.raises(SpecError, match="nested"):
        parse_grader(deep)
    with pytest.raises(SpecError, match="at most 16"):
        parse_grader(multi("a0", **{f"a{i}": check("eq") for i in range(16)}))
    with pytest.raises(SpecError, match="sub-grader name"):
        parse_grader(multi("1", **{"max": check("eq")}))


# ---------------------------------------------------------------- validation of the other types
@pytest.mark.parametrize("grader, message", [
    ({"type": "score_model", "model": "x"}, "type"),
    ({"type": "string_check", "input": OUT, "reference": "x", "operation": "regex"}, "operation"),
    ({"type": "string_check", "input": OUT, "reference": "x", "operation": "eq", "extra": 1}, "extra"),
    ({"type": "python", "source": "def grade(sample, item):\n  return ("}, "does not parse"),
    ({"type": "python", "source": "def score(sample, item):\n  return 1"}, "grade"),
    ({"type": "python", "source": "def grade(sample):\n  return 1"}, "two arguments"),
    ({"type": "python", "source": "def grade(s, i):\n  return 1", "timeout_s": 60}, "timeout_s"),
    ({"type": "builtin", "verifier": "sympy:sympify"}, "import paths are not accepted"),
    ({"type": "builtin", "verifier": "Bad Name"}, "registered"),
])
def test_invalid_graders_are_one_line_spec_errors(grader, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_grader(grader)
    assert "\n" not in str(info.value)


def test_builtin_grader_uses_the_existing_verifiers():
    assert rewards({"type": "builtin", "verifier": "exact"}, {"answer": "7"}, ["7", " 7 ", "8"]) == [1.0, 1.0, 0.0]
    assert rewards({"type": "builtin", "verifier": "math"}, {"answer": "0.5"}, ["The answer is 1/2"]) == [1.0]


# ---------------------------------------------------------------- strict import paths (the audit)
@pytest.mark.parametrize("path, message", [
    ("marlaas.rewards.sandbox:shutil.rmtree", "one name"),
    ("marlaas.rewards.sandbox:subprocess.run", "one name"),
    ("marlaas.verify.sandbox:run_batch", "'marlaas'"),
    ("requests:get", "'requests'"),
    ("sympy:sympify", "'sympy'"),
    ("os:system", "standard-library"),
    ("builtins:eval", "standard-library"),
    ("_thread:start_new_thread", "standard-library"),
    ("tests.unit.test_graders:check_path", "re-exports are refused"),
])
def test_audit_paths_are_refused(path, message):
    with pytest.raises(VerifierError, match=message) as info:
        import_function(path)
    assert "\n" not in str(info.value)
    with pytest.raises(VerifierError):
        check_verifier_name(path)
    with pytest.raises((SpecError, VerifierError)):
        parse_spec({"task": "sort", "verifier": path})


def test_well_formed_paths_and_registered_names_pass():
    assert check_path("myorg.rewards:score") == ("myorg.rewards", "score")
    check_spec_verifier("my-reward")  # a registered name: its registration is checked at submit
    assert import_function("tests.helpers_verifiers:always_raises").__name__ == "always_raises"


# ---------------------------------------------------------------- the job spec
ROWS = [{"prompt": f"sort:{i}{i + 2}{i + 1}=", "answer": f"{i}{i + 1}{i + 2}"} for i in range(5)]


def test_job_spec_takes_a_grader_and_round_trips():
    spec = parse_spec({"dataset": ROWS, "grader": multi("0.5 * exact + 0.5 * fuzzy")})
    assert spec.grader.type == "multi" and spec.verifier_name() == "grader"
    assert parse_spec(spec.model_dump()).grader == spec.grader
    assert parse_spec({"dataset": ROWS, "grader": {"type": "builtin", "verifier": "exact"}}).verifier_name() == "exact"


def test_job_spec_grader_errors_and_exclusivity():
    with pytest.raises(SpecError, match="not both"):
        parse_spec({"dataset": ROWS, "verifier": "exact", "grader": check("eq")})
    with pytest.raises(SpecError, match="grader.*placeholder"):
        parse_spec({"dataset": ROWS, "grader": check("eq", "{{item.a.b}}")})
    # rows without an answer are fine when a grader reads other fields
    parse_spec({"dataset": [{"prompt": "p", "city": "Paris"}], "grader": check("eq", "{{item.city}}")})
