"""Built-in task families and the base-model build (marlaas.families, marlaas.base.pretrain)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from marlaas import families
from marlaas.base import tiny
from marlaas.families import FAMILIES, correct, rows

pytestmark = pytest.mark.unit

NAMES = sorted(FAMILIES)


def test_at_least_six_families_with_known_verifiers():
    assert {"reverse", "sort", "max", "min", "add", "code"} <= set(FAMILIES)
    for name, fam in FAMILIES.items():
        assert fam.name == name
        assert fam.verifier in {"exact", "math", "code", "tool"}
    assert FAMILIES["add"].verifier == "math"
    assert FAMILIES["code"].verifier == "code"


@pytest.mark.parametrize("name", NAMES)
def test_rows_deterministic_and_seeded(name):
    a = rows(name, "train", 50, seed=3)
    assert a == rows(name, "train", 50, seed=3)
    assert a != rows(name, "train", 50, seed=4)
    assert rows(name, "eval", 20, seed=0) == rows(name, "eval", 20, seed=0)
    assert len(a) == 50
    assert len({r["prompt"] for r in a}) == 50  # distinct while the split has enough prompts


@pytest.mark.parametrize("name", NAMES)
def test_train_eval_disjoint(name):
    train = {r["prompt"] for s in range(3) for r in rows(name, "train", 300, seed=s)}
    ev = {r["prompt"] for s in range(3) for r in rows(name, "eval", 100, seed=s)}
    assert train and ev
    assert not train & ev
    assert all(families.split_of(p) == "eval" for p in ev)


@pytest.mark.parametrize("name", NAMES)
def test_charset_lengths_and_reference_answers(name):
    fam = FAMILIES[name]
    for r in rows(name, "train", 200, seed=1) + rows(name, "eval", 100, seed=1):
        assert set(r["prompt"]) <= set(tiny.CHARSET)
        assert set(r["answer"]) <= set(tiny.CHARSET)
        assert 1 <= len(r["answer"]) <= families.MAX_ANSWER_TOKENS
        assert correct(name, r["prompt"], r["answer"])
        x = fam.parse(r["prompt"])
        assert fam.prompt(x) == r["prompt"]
        # Pretraining's labels: the right one passes, the wrong one never does.
        label, wrong = fam.correct_label(x), fam.wrong(x)
        # a tool family's right label is a whole episode: a call, its result, the answer
        limit = families.MAX_ANSWER_TOKENS * (3 if fam.tool else 1)
        assert len(label) <= limit and len(wrong) <= families.MAX_ANSWER_TOKENS
        assert set(label + wrong) <= set(tiny.CHARSET)
        assert correct(name, r["prompt"], label)
        assert not correct(name, r["prompt"], wrong)
        if fam.verifier == "code":
            assert r["tests"] and all(t.startswith("assert ") for t in r["tests"])
        else:
            assert "tests" not in r


@pytest.mark.parametrize("name", ["max", "min"])
def test_no_majority_answer_trap(name):
    answers = [r["answer"] for r in rows(name, "eval", 400, seed=0)]
    top = max(answers.count(a) for a in set(answers))
    assert top / len(answers) < 0.2


@pytest.mark.parametrize(
    "name,prompt,completion,ok",
    [
        ("reverse", "rev:3817=", "7183", True),
        ("reverse", "rev:3817=", " 7183\n", True),
        ("reverse", "rev:3817=", "3817", False),
        ("reverse", "rev:3817=", "718", False),
        ("sort", "sort:3817=", "1378", True),
        ("sort", "sort:3817=", "8731", False),
        ("sort", "sort:90902=", "00299", True),
        ("max", "max:38172=", "8", True),
        ("max", "max:38172=", "1", False),
        ("max", "max:38172=", "88", False),
        ("min", "min:38172=", "1", True),
        ("min", "min:38172=", "8", False),
        ("add", "add:417+5=", "422", True),
        ("add", "add:417+5=", "423", False),
        ("add", "add:417+5=", "422.0", True),
        ("add", "add:417+5=", "4 22", False),
        ("add", "add:999+9=", "1008", True),
        ("add", "add:417+5=", "", False),
        ("code", "code:17>", "9+8", True),
        ("code", "code:17>", "17", True),
        ("code", "code:17>", "(20-3)*1", True),
        ("code", "code:17>", "17+1", False),
        ("code", "code:17>", "9+", False),
        ("code", "code:17>", "x", False),
        ("code", "code:17>", "__import__('os')", False),
        ("code", "code:17>", "9**9**99", False),
        ("code", "code:17>", "1/0", False),
    ],
)
def test_correct_hand_written(name, prompt, completion, ok):
    assert correct(name, prompt, completion) is ok


def test_bad_inputs_raise():
    with pytest.raises(KeyError):
        rows("nope", "train", 1)
    with pytest.raises(ValueError):
        rows("sort", "test", 1)
    with pytest.raises(ValueError):
        correct("sort", "max:123=", "3")


def test_build_test_preset_loads_with_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlaas.base import pretrain

    out = pretrain.build_base(tmp_path / "base", preset="test", seed=0, steps=20, progress=False, threads=1)
    meta = json.loads((out / pretrain.META_FILE).read_text())
    assert meta["preset"] == "test" and meta["seed"] == 0 and meta["steps"] == 20
    assert set(meta["families"]) == set(FAMILIES)
    for m in meta["families"].values():
        assert 0.0 <= m["greedy_acc"] <= 1.0 and 0.0 <= m["pass_at_8"] <= 1.0

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert tok.padding_side == "left" and tok.eos_token_id == model.config.eos_token_id
    enc = tok(["rev:abc=", "sort:3817="], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[0] == 2 and gen.shape[1] <= enc["input_ids"].shape[1] + 4


def test_ensure_base_caches(tmp_path, monkeypatch):
    from marlaas.base import pretrain

    calls = []

    def fake_build(out_dir, preset="default", seed=0, steps=None, progress=True, threads=2):
        calls.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "weights").write_text("w")
        meta = {"preset": preset, "seed": seed, "families": {nm: {} for nm in families.FAMILIES}}
        (out_dir / pretrain.META_FILE).write_text(json.dumps(meta))
        return out_dir

    monkeypatch.setattr(pretrain, "build_base", fake_build)
    target = tmp_path / "cache" / "base"
    assert pretrain.ensure_base(target, "test", 0, progress=False) == target
    assert pretrain.ensure_base(target, "test", 0, progress=False) == target
    assert len(calls) == 1 and calls[0] != target  # built elsewhere, then renamed into place
    assert (target / "weights").is_file()
    assert [p.name for p in target.parent.iterdir()] == ["base"]  # no temp dir left

    # A base pretrained before a family existed (or of another seed) is out of date: rebuilt.
    meta = json.loads((target / pretrain.META_FILE).read_text())
    meta["families"].pop("calc")
    (target / pretrain.META_FILE).write_text(json.dumps(meta))
    assert not pretrain.is_current(target, "test", 0)
    pretrain.ensure_base(target, "test", 0, progress=False)
    assert len(calls) == 2 and pretrain.is_current(target, "test", 0)
    assert not pretrain.is_current(target, "test", 1) and not pretrain.is_current(target, "default", 0)
    # ... and so is one pretrained with another recipe (e.g. other family weights).
    meta = json.loads((target / pretrain.META_FILE).read_text())
    meta["recipe"] = {**json.loads(json.dumps(asdict(pretrain.RECIPES["test"]))), "steps": 1}
    (target / pretrain.META_FILE).write_text(json.dumps(meta))
    assert not pretrain.is_current(target, "test", 0)
    meta["recipe"]["steps"] = pretrain.RECIPES["test"].steps
    (target / pretrain.META_FILE).write_text(json.dumps(meta))
    assert pretrain.is_current(target, "test", 0)


def test_ensure_base_crash_leaves_nothing(tmp_path, monkeypatch):
    from marlaas.base import pretrain

    def crash(out_dir, **kw):
        Path_ = type(out_dir)
        (Path_(out_dir) / "half").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(pretrain, "build_base", crash)
    with pytest.raises(RuntimeError):
        pretrain.ensure_base(tmp_path / "base", "test", 0, progress=False)
    assert list(tmp_path.iterdir()) == []
