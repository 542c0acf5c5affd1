"""Job spec and dataset validation: every bad input is one clear error."""

import json

import pytest

from marlaas.api.rows import job_rows, load_rows
from marlaas.errors import MarlaasError, SpecError
from marlaas.spec import JobSpec, parse_spec

pytestmark = pytest.mark.unit


def test_defaults_and_verifier_from_task():
    s = parse_spec({"task": "sort"})
    assert s.verifier_name() == "exact"
    assert parse_spec({"task": "code"}).verifier_name() == "code"
    assert parse_spec({"dataset": [{"prompt": "a", "answer": "b"}]}).verifier_name() == "exact"


@pytest.mark.parametrize(
    "data, words",
    [
        ({}, "exactly one of 'task'"),
        ({"task": "sort", "dataset": [{"prompt": "a", "answer": "b"}]}, "exactly one of 'task'"),
        ({"task": "nope"}, "unknown task 'nope'"),
        ({"task": "sort", "steps": 0}, "steps"),
        ({"task": "sort", "group_size": 1}, "group_size"),
        ({"task": "sort", "learning_rate": -1}, "learning_rate"),
        ({"task": "sort", "tenant": "bad name!"}, "tenant"),
        ({"task": "sort", "bogus": 1}, "bogus"),
        ({"task": "sort", "lora": {"rank": 0}}, "lora.rank"),
        ({"dataset": []}, "dataset is empty"),
        ({"dataset": [{"answer": "x"}]}, "row 1 needs a non-empty string 'prompt'"),
        ({"dataset": "does/not/exist.jsonl"}, "dataset file not found"),
    ],
)
def test_bad_specs_give_one_line(data, words):
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_unknown_verifier_is_a_clear_error():
    with pytest.raises(MarlaasError) as e:
        parse_spec({"task": "sort", "verifier": "no.such.module:fn"})
    assert "\n" not in str(e.value)


def test_jsonl_rows_errors_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(SpecError, match="line 2: not valid JSON"):
        load_rows(str(p))
    p.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(SpecError, match="not UTF-8"):
        load_rows(str(p))


def test_dataset_split_is_deterministic_and_checked(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(30)]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    spec = parse_spec({"dataset": str(p), "seed": 3})
    tr1, ev1 = job_rows(spec)
    tr2, ev2 = job_rows(spec)
    assert (tr1, ev1) == (tr2, ev2)
    assert len(ev1) == 3 and len(tr1) == 27
    assert not {r["prompt"] for r in ev1} & {r["prompt"] for r in tr1}
    with pytest.raises(SpecError, match="row 1: the code verifier needs 'tests'"):
        job_rows(parse_spec({"dataset": rows, "verifier": "code"}))


def test_builtin_task_rows():
    spec = JobSpec(task="sort", steps=5, prompts_per_step=4, eval_size=16)
    train, held = job_rows(spec)
    assert len(train) == 20 and len(held) == 16
    assert all(r["prompt"] and "answer" in r for r in train + held)
