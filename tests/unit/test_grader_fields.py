"""The fields a grader reads, found without running it; the tenant-facing error line."""

import pytest

from marlaas.verify.grader_fields import ROW_REF, missing_fields, python_fields, ref_of, required_fields, strip_ref
from marlaas.verify.graders import parse_grader
from marlaas.verify.job_scoring import tenant_line

pytestmark = pytest.mark.unit


def py(body: str) -> dict:
    return {"type": "python", "source": body}


@pytest.mark.parametrize(("source", "fields"), [
    ('def grade(sample, item):\n    return float(sample["output_text"] == item["answer"])\n', {"answer"}),
    # get, with or without a default, is not required
    ('def grade(sample, item):\n    return float(item.get("answer") == item.get("gold", "x"))\n', set()),
    # the second parameter is the row, whatever its name
    ('def grade(s, row):\n    return float(row["a"] == row["b"] and s["output_text"] == "x")\n', {"a", "b"}),
    # a membership test says the grader copes with absence
    ('def grade(sample, item):\n    if "hint" in item:\n        return float(item["hint"] == "y")\n'
     '    return float(item["answer"] == "z")\n', {"answer"}),
    ('def grade(sample, item):\n    if "hint" not in item:\n        return 0.0\n'
     '    return float(item["hint"] == "y")\n', set()),
    # inside a try that catches KeyError (or broader): optional; a narrower handler: required
    ('def grade(sample, item):\n    try:\n        return float(item["x"] == 1)\n'
     '    except KeyError:\n        return 0.0\n', set()),
    ('def grade(sample, item):\n    try:\n        return float(item["x"] == 1)\n    except (ValueError, LookupError):\n'
     '        return 0.0\n', set()),
    ('def grade(sample, item):\n    try:\n        return float(item["x"] == 1)\n'
     '    except ValueError:\n        return 0.0\n', {"x"}),
    # non-constant keys, other names' subscripts and assignments into the row are not reads of a field
    ('def grade(sample, item):\n    k = "answer"\n    d = {"y": 1}\n    item["new"] = d["y"]\n'
     '    return float(item[k] == 1)\n', set()),
    # a nested function may never run
    ('def grade(sample, item):\n    def later():\n        return item["deep"]\n    return 1.0\n', set()),
    # the last grade wins, as Python defines it; other functions are not grade
    ('def helper(sample, item):\n    return item["h"]\n\n'
     'def grade(sample, item):\n    return float(item["g"] == 1)\n', {"g"}),
    ("this is not python", set()),
    ("def grade(sample):\n    return 1.0\n", set()),
])
def test_python_fields(source, fields):
    assert python_fields(source) == fields


def test_required_fields_of_every_grader_type():
    check = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{ item.answer }}",
             "operation": "eq"}
    sim = {"type": "text_similarity", "input": "{{item.a}} {{sample.output_text}}", "reference": "{{item.ref}}",
           "evaluation_metric": "fuzzy_match"}
    multi = {"type": "multi", "calculate_output": "0.5 * c + 0.5 * p", "graders": {
        "c": check, "p": py('def grade(sample, item):\n    return float(item["level"] > 1)\n')}}
    assert required_fields(parse_grader(check)) == {"answer"}
    assert required_fields(parse_grader(sim)) == {"a", "ref"}
    assert required_fields(parse_grader(multi)) == {"answer", "level"}
    assert required_fields(parse_grader({"type": "builtin", "verifier": "exact"})) == set()
    assert missing_fields(parse_grader(multi), {"prompt": "p", "answer": "1"}) == ["level"]
    assert missing_fields(parse_grader(multi), {"prompt": "p", "answer": "1", "level": 2}) == []


def test_the_row_label_is_not_a_column():
    row = {"prompt": "p", "answer": "1", ROW_REF: "dataset data.jsonl line 3"}
    assert strip_ref(row) == {"prompt": "p", "answer": "1"}
    assert ref_of(row, "x") == "dataset data.jsonl line 3" and ref_of({"prompt": "p"}, "held-out prompt 2") == \
        "held-out prompt 2"


def test_tenant_lines_carry_no_operator_paths():
    err = ('python grader: Traceback: File "/srv/marlaas/home/sandbox/run-1/grader.py", line 3, in grade: '
           "KeyError: 'answer'\nmore")
    line = tenant_line(err)
    assert "/srv" not in line and "grader.py" in line and "KeyError: 'answer'" in line and "\n" not in line
    assert tenant_line("ValueError: 1/2 is not 0.5") == "ValueError: 1/2 is not 0.5"
    assert tenant_line(None) == "error"
