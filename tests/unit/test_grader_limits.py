"""Every in-process grader's cost is bounded by its inputs: long similarity inputs are capped in tokens
(20,000 characters of rouge_l used to take 40 s and a GB), and a dry run grades a multi once."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from marlaas.verify import graders, similarity

pytestmark = pytest.mark.unit

LONG = " ".join("abcdefghij"[i % 10] for i in range(10_000))  # 19,999 characters, 10,000 tokens


@pytest.mark.parametrize("metric", similarity.METRICS)
def test_every_metric_on_20000_characters_is_fast_and_small(metric):
    similarity.similarity(metric, "warm up", "the imports")
    t = time.monotonic()
    value = similarity.similarity(metric, LONG, LONG[::-1])
    took = time.monotonic() - t
    assert 0.0 <= value <= 1.0
    assert took < 2.0, took  # uncapped rouge_l: about 40 s
    tracemalloc.start()  # (slows the call down: timed above, without it)
    similarity.similarity(metric, LONG, LONG[::-1])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 64 << 20, peak  # uncapped rouge_l: about 1 GB


def test_rouge_l_compares_the_first_tokens_only():
    head = " ".join(f"w{i}" for i in range(similarity.MAX_LCS_TOKENS))
    assert similarity.similarity("rouge_l", head + " tail differs", head + " other words") == 1.0
    assert similarity.similarity("rouge_1", head + " x", head + " y") < 1.0  # n-gram metrics see more
    assert similarity.capped_tokens("The Cat, sat!", 2) == "the cat"


def test_a_grader_on_long_text_through_grade_group_is_bounded():
    g = graders.parse_grader({"type": "text_similarity", "input": "{{sample.output_text}}",
                              "reference": "{{item.answer}}", "evaluation_metric": "rouge_l"})
    t = time.monotonic()
    score = graders.grade_group(g, {"answer": LONG[::-1] * 3}, [LONG * 3] * 4)
    assert score.errors == 0 and time.monotonic() - t < 4.0


def test_a_dry_run_grades_a_multi_once(monkeypatch):
    batches = []

    class Ok:
        ok, status, error = True, "ok", ""
        stdout = "\n__marlaas_grade__=0.5\n"

    def fake_batch(queued):
        batches.append(len(queued))
        return [Ok() for _ in queued]

    monkeypatch.setattr(graders, "run_python", fake_batch)
    py = {"type": "python", "source": "def grade(sample, item):\n    return 0.5\n"}
    g = graders.parse_grader({"type": "multi", "calculate_output": "a + b", "graders": {
        "a": py, "b": py, "c": {"type": "string_check", "input": "x", "reference": "y", "operation": "eq"}}})
    assert graders.dry_run(g, {}, "out") == {"reward": 1.0, "error": None,
                                            "sub_rewards": {"a": 0.5, "b": 0.5, "c": 0.0}}
    assert batches == [2]  # one sandbox batch, one call per python sub-grader
    single = graders.parse_grader(py)
    assert graders.dry_run(single, {}, "out") == {"reward": 0.5, "error": None, "sub_rewards": {}}
