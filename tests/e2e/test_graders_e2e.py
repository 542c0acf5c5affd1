"""End to end: a python-grader job and a multi-grader job learn on the worker stack, and a grader that
loops forever ends its job (failed, errors counted) instead of hanging it.

Task data: the built-in "max" family's rows, submitted as a dataset with a grader instead of the
family's verifier. "Learns": the mean reward of the last steps is above that of the first steps.
"""

import pytest

from marlaas import Client, JobSpec, families
from tests.helpers_verifiers import PARTIAL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MULTI = {"type": "multi", "calculate_output": "0.6 * exact + 0.4 * fuzzy", "graders": {
    "exact": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
              "operation": "eq"},
    "fuzzy": {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
              "evaluation_metric": "fuzzy_match"}}}


def _spec(grader: dict, steps: int = 30, seed: int = 0) -> JobSpec:
    rows = families.rows("max", "train", 256, seed)
    return JobSpec(dataset=[{"prompt": r["prompt"], "answer": r["answer"]} for r in rows], grader=grader,
                   steps=steps, prompts_per_step=8, group_size=8, eval_size=8, eval_k=0, learning_rate=3e-3,
                   seed=seed)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.parametrize("grader", [{"type": "python", "source": PARTIAL}, MULTI], ids=["python", "multi"])
def test_a_grader_job_learns(worker_stack, grader):
    job = Client().submit(_spec(grader))
    final = job.wait(timeout=1800)
    assert final["status"] == "done", final
    assert final["verify_errors"] == 0
    rewards = [s["reward_mean"] for s in job.metrics()["steps"]]
    assert _mean(rewards[-5:]) > _mean(rewards[:5]) + 0.05, rewards


def test_an_endless_grader_ends_its_job(worker_stack):
    loop = {"type": "python", "source": "def grade(sample, item):\n    while True:\n        pass\n", "timeout_s": 0.2}
    final = Client().submit(_spec(loop, steps=4)).wait(timeout=900)
    assert final["status"] in ("failed", "done"), final
    errors = final["grader_errors"]  # a held-out row's error counts too: the job may end on its evaluation
    assert errors["train"] + errors["eval"] > 0, final
    if final["status"] == "failed":  # every group, or more than half of an evaluation's rows
        assert "groups in a row" in final["error"] or "held-out rows" in final["error"], final["error"]
