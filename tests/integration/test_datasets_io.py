"""The user's own data: JSONL, parquet and `datasets` directories, field mapping, chat templates."""

import datetime
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marlaas.api.datasets_io import Fields, render_chat
from marlaas.api.rows import job_rows, load_rows
from marlaas.errors import MarlaasError, SpecError
from marlaas.spec import parse_spec
from marlaas.verify.grader_fields import ROW_REF, strip_ref

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _records(n, start=0):
    return [{"question": f"q{i}", "solution": i * 10, "level": i % 3} for i in range(start, start + n)]


def _parquet(path, recs):
    pq.write_table(pa.Table.from_pylist(recs), path)
    return str(path)


def _hf_dir(path, recs):
    from datasets import Dataset

    Dataset.from_list(recs).save_to_disk(str(path))
    return str(path)


def _hf_dict_dir(path, **splits):
    from datasets import Dataset, DatasetDict

    DatasetDict({k: Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return str(path)


def _one_line_error(fn, *words):
    with pytest.raises(SpecError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


CUSTOM = {"prompt_field": "question", "answer_field": "solution"}


@pytest.mark.unit
def test_parquet_round_trip_with_custom_fields(tmp_path):
    src = _parquet(tmp_path / "data.parquet", _records(20))
    rows = load_rows(src, fields=Fields(prompt="question", answer="solution"), verifier="exact")
    assert rows[3] == {"prompt": "q3", "answer": 30, "level": 0}  # other columns are kept
    train, held = job_rows(parse_spec({"dataset": src, **CUSTOM}))
    assert len(train) == 18 and len(held) == 2  # 10% of 20 held out
    assert sorted(r["prompt"] for r in train + held) == sorted(f"q{i}" for i in range(20))
    assert all(r["answer"] == int(r["prompt"][1:]) * 10 for r in train + held)


@pytest.mark.unit
def test_code_rows_from_parquet_with_a_tests_column(tmp_path):
    recs = [{"task": "two", "cases": ["assert result == 2"], "entry": "expression"}] * 3
    src = _parquet(tmp_path / "code.parquet", recs)
    train, held = job_rows(parse_spec({"dataset": src, "verifier": "code", "prompt_field": "task",
                                       "tests_field": "cases"}))
    assert strip_ref(train[0]) == {"prompt": "two", "tests": ["assert result == 2"], "entry": "expression"}
    recs[1] = {"task": "two", "cases": None, "entry": "expression"}
    _parquet(tmp_path / "code.parquet", recs)
    _one_line_error(lambda: job_rows(parse_spec({"dataset": src, "verifier": "code", "prompt_field": "task",
                                                 "tests_field": "cases"})),
                    "code.parquet row 2", "needs 'cases'")


@pytest.mark.unit
def test_hf_dataset_dir_round_trip(tmp_path):
    src = _hf_dir(tmp_path / "ds", _records(10))
    rows = load_rows(src, fields=Fields(prompt="question", answer="solution"))
    assert [r["prompt"] for r in rows] == [f"q{i}" for i in range(10)]
    assert rows[7] == {"prompt": "q7", "answer": 70, "level": 1}
    ev = _hf_dir(tmp_path / "ev", _records(3, 100))
    train, held = job_rows(parse_spec({"dataset": src, **CUSTOM, "eval_dataset": ev}))
    assert len(train) == 10 and [r["prompt"] for r in held] == ["q100", "q101", "q102"]


@pytest.mark.unit
def test_dataset_dict_split_choice(tmp_path):
    src = _hf_dict_dir(tmp_path / "dd", train=_records(6), test=_records(2, 50), extra=_records(4, 200))
    train, held = job_rows(parse_spec({"dataset": src, **CUSTOM}))
    # train split for training, the "test" split held out (no 10% taken from train)
    assert sorted(r["prompt"] for r in train) == [f"q{i}" for i in range(6)]
    assert [r["prompt"] for r in held] == ["q50", "q51"]
    train, held = job_rows(parse_spec({"dataset": src, **CUSTOM, "dataset_split": "extra"}))
    assert sorted(r["prompt"] for r in train) == [f"q{i}" for i in range(200, 204)]
    assert [r["prompt"] for r in held] == ["q50", "q51"]
    train, held = job_rows(parse_spec({"dataset": src, **CUSTOM, "eval_dataset_split": "extra"}))
    assert [r["prompt"] for r in held] == [f"q{i}" for i in range(200, 204)]
    # as eval_dataset: "validation" is used when there is no "test"
    ev = _hf_dict_dir(tmp_path / "ev", train=_records(2, 70), validation=_records(1, 90))
    _, held = job_rows(parse_spec({"dataset": _parquet(tmp_path / "t.parquet", _records(4)), **CUSTOM,
                                   "eval_dataset": ev}))
    assert [r["prompt"] for r in held] == ["q90"]
    _one_line_error(lambda: job_rows(parse_spec({"dataset": src, **CUSTOM, "dataset_split": "nope"})),
                    "no split 'nope'", "train, test, extra")
    only_train = _hf_dict_dir(tmp_path / "ot", train=_records(2))
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "u.parquet", _records(4)),
                                                 **CUSTOM, "eval_dataset": only_train})),
                    "eval_dataset ot", "none of the splits test, validation", "it has train")
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "v.parquet", _records(4)),
                                                 **CUSTOM, "dataset_split": "train"})),
                    "v.parquet", "only for a DatasetDict")


@pytest.mark.unit
def test_a_bad_row_is_named_in_every_format(tmp_path):
    recs = _records(20)
    recs[17] = {"solution": 1, "level": 0}  # no question: the 18th row
    spec = {**CUSTOM}
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "data.parquet", recs), **spec})),
                    "dataset data.parquet row 18: 'question' is missing")
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _hf_dir(tmp_path / "hf", recs), **spec})),
                    "dataset hf row 18: 'question' is missing")
    dd = _hf_dict_dir(tmp_path / "dd", train=_records(3), test=recs)
    _one_line_error(lambda: job_rows(parse_spec({"dataset": dd, **spec})),
                    "dataset dd[test] row 18: 'question' is missing")
    lines = [json.dumps(r) for r in recs]
    lines.insert(5, "")  # blank lines are skipped but counted: row 18 is on line 19
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    _one_line_error(lambda: job_rows(parse_spec({"dataset": str(tmp_path / "d.jsonl"), **spec})),
                    "dataset d.jsonl line 19: 'question' is missing")
    recs[17] = {"question": "q", "solution": None}  # a null answer is a missing answer
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "n.parquet", recs), **spec})),
                    "n.parquet row 18: 'solution' is missing (the exact verifier needs it)")
    recs[17] = {"question": "", "solution": 1}
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "e.parquet", recs), **spec})),
                    "e.parquet row 18: 'question' must be a non-empty string")
    recs = [{**r, "when": None} for r in _records(3)]
    recs[2]["when"] = datetime.datetime(2026, 1, 1)
    _one_line_error(lambda: job_rows(parse_spec({"dataset": _parquet(tmp_path / "ts.parquet", recs), **spec})),
                    "ts.parquet row 3: column 'when' holds a datetime value")


@pytest.mark.unit
def test_missing_unknown_and_broken_sources(tmp_path):
    _one_line_error(lambda: parse_spec({"dataset": str(tmp_path / "nope.parquet")}), "dataset file not found")
    (tmp_path / "rows.csv").write_text("prompt,answer\na,b\n")
    _one_line_error(lambda: parse_spec({"dataset": str(tmp_path / "rows.csv")}), "rows.csv: unknown format '.csv'")
    _one_line_error(lambda: parse_spec({"task": "sort", "eval_dataset": str(tmp_path)}),
                    "eval_dataset", "not one written by datasets' save_to_disk")
    _one_line_error(lambda: parse_spec({"dataset": ""}), "dataset path is empty")
    (tmp_path / "bad.parquet").write_text("not parquet at all")
    _one_line_error(lambda: job_rows(parse_spec({"dataset": str(tmp_path / "bad.parquet")})),
                    "bad.parquet: not a readable parquet file")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    _one_line_error(lambda: job_rows(parse_spec({"dataset": str(tmp_path / "empty.jsonl")})), "has no rows")


@pytest.mark.unit
def test_spec_validates_the_new_fields(tmp_path):
    s = parse_spec({"dataset": [{"question": "a", "solution": "b"}], **CUSTOM})
    assert (s.prompt_field, s.answer_field, s.tests_field, s.chat_template) == ("question", "solution", "tests", None)
    _one_line_error(lambda: parse_spec({"dataset": [{"prompt": "a", "solution": "b"}], **CUSTOM}),
                    "dataset row 1 needs a non-empty string 'question'")
    _one_line_error(lambda: parse_spec({"dataset": [{"question": "a", "answer": "b"}], **CUSTOM}),
                    "row 1 needs an 'solution'")
    _one_line_error(lambda: parse_spec({"task": "sort", "prompt_field": ""}), "prompt_field")
    _one_line_error(lambda: parse_spec({"task": "sort", "prompt_field": "x", "answer_field": "x"}),
                    "must be different columns")
    _one_line_error(lambda: parse_spec({"task": "sort", "chat_template": "maybe"}), "chat_template")
    _one_line_error(lambda: job_rows(parse_spec({"dataset": [{"prompt": "a", "answer": "1"}] * 3,
                                                 "eval_dataset_split": "test"})),
                    "eval_dataset_split is only for a DatasetDict")
    rows = job_rows(parse_spec({"dataset": [{"question": "a", "solution": 1, "answer": "stale"}] * 2, **CUSTOM}))
    assert [strip_ref(r) for r in rows[0]] == [{"prompt": "a", "answer": 1}]  # the mapped column wins


class _Tok:
    """A tokenizer stand-in for the rendering logic only (the real one is tested below)."""

    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True and len(messages) == 1
        return f"[{messages[0]['role']}]{messages[0]['content']}[bot]"


@pytest.mark.unit
def test_chat_template_rendering():
    from marlaas.base.tiny import build_tokenizer

    tok = build_tokenizer()
    assert not tok.chat_template
    tok.chat_template = TEMPLATE
    rows = [{"prompt": "sort 3 1 2", "answer": "1 2 3"}]
    out = render_chat(rows, tok)
    assert out == [{"prompt": "<|user|>sort 3 1 2\n<|assistant|>", "answer": "1 2 3", "raw_prompt": "sort 3 1 2"}]
    assert rows[0]["prompt"] == "sort 3 1 2"  # input untouched
    assert render_chat(out, tok) == out  # rendering twice renders the raw text once
    assert render_chat(rows, _Tok())[0]["prompt"] == "[user]sort 3 1 2[bot]"
    tok.chat_template = "{{ raise_exception('no users here') }}"
    _one_line_error(lambda: render_chat(rows, tok), "chat template fails on the prompt 'sort 3 1 2'", "no users here")


def _base_dir(path, template):
    """A base directory the client can read: a config and the char tokenizer (no weights needed)."""
    from marlaas.base.tiny import build_tokenizer

    tok = build_tokenizer()
    if template:
        tok.chat_template = template
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    return str(path)


@pytest.mark.unit
def test_client_chat_template_modes(tmp_path):
    from marlaas.api.admission import _chat_template

    rows = [{"prompt": "p", "answer": "a"}]
    with_t = _base_dir(tmp_path / "with", TEMPLATE)
    without = _base_dir(tmp_path / "without", None)

    def run(base, flag):
        spec = parse_spec({"dataset": rows, "chat_template": flag})
        train, held, how = _chat_template(base, spec, rows, rows)
        return train[0]["prompt"], how

    assert run(with_t, None) == ("<|user|>p\n<|assistant|>", "applied")
    assert run(with_t, True) == ("<|user|>p\n<|assistant|>", "applied")
    assert run(with_t, False) == ("p", "off")
    assert run(without, None) == ("p", "none")
    assert run(None, None) == ("p", "base not readable here")
    assert run(str(tmp_path / "gone"), None) == ("p", "base not readable here")
    _one_line_error(lambda: run(without, True), "chat_template is true, but the base model has no chat template")
    _one_line_error(lambda: run(None, True), "base model is not readable on this machine")


@pytest.mark.integration
def test_submit_parquet_job_stores_mapped_rendered_rows(scratch_url, tmp_path):
    from marlaas.api.client import Client
    from marlaas.store import Store

    store = Store(scratch_url)
    store.set_deployment(base=_base_dir(tmp_path / "base", TEMPLATE), base_name="tiny-chat")
    src = _parquet(tmp_path / "data.parquet", _records(20))
    job = Client(scratch_url).submit({"dataset": src, **CUSTOM, "steps": 2})
    train, held = store.rows(job.id, "train"), store.rows(job.id, "eval")
    assert len(train) == 18 and len(held) == 2
    for r in train + held:
        assert r["prompt"] == f"<|user|>{r['raw_prompt']}\n<|assistant|>"
        assert r["answer"] == int(r["raw_prompt"][1:]) * 10 and set(r) == {"prompt", "raw_prompt", "answer", "level",
                                                                          ROW_REF}
    assert store.job(job.id).extra["chat_template"] == "applied"
    # the context check sees the rendered prompt: 20 template chars + a prompt of 100 > 128 - 8
    long_rows = [{"question": "x" * 100, "solution": 1}] * 3
    with pytest.raises(MarlaasError, match="exceeds the base model's context of 128"):
        Client(scratch_url).submit({"dataset": _parquet(tmp_path / "long.parquet", long_rows), **CUSTOM})
    bad = _records(20)
    bad[4] = {"solution": 1}
    with pytest.raises(MarlaasError, match="data2.parquet row 5: 'question' is missing"):
        Client(scratch_url).submit({"dataset": _parquet(tmp_path / "data2.parquet", bad), **CUSTOM})
    assert store.job_ids() == [job.id]  # the refused jobs stored nothing
