"""exact, mean_reward and pass@k named for what they count: partial credit never passes."""

import pytest

from marlaas.verify.evaluation import figures, summarize, table, table_row

pytestmark = pytest.mark.unit


def test_partial_credit_is_mean_reward_not_exact():
    # 4 prompts: full, half, a near-miss 0.999, none; hand-computed figures
    s = summarize([1.0, 0.5, 0.999, 0.0], None, errors=1)
    assert s["exact"] == 0.25  # only the full-reward completion counts
    assert s["mean_reward"] == pytest.approx((1.0 + 0.5 + 0.999) / 4)  # 0.62475
    assert s["acc"] == s["exact"] and s["grader_errors"] == 1 and s["k"] == 0 and s["pass_at_k"] is None


def test_full_reward_within_float_noise_counts():
    s = summarize([1.0 - 1e-12, 0.9999999], None)
    assert s["exact"] == 0.5


def test_pass_at_k_counts_full_reward_samples_only():
    # prompt 1: samples 1.0, 0.5 -> c = 1 of n = 2; prompt 2: 0.9, 0.9 -> c = 0
    s = summarize([0.5, 0.9], [[1.0, 0.5], [0.9, 0.9]])
    assert s["exact"] == 0.0 and s["mean_reward"] == pytest.approx(0.7)
    assert s["pass_at"] == {"1": pytest.approx(0.25), "2": pytest.approx(0.5)}  # (1/2 + 0)/2, (1 + 0)/2
    assert s["pass1_sampled"] == pytest.approx(0.25) and s["pass_at_k"] == pytest.approx(0.5)


def test_old_records_are_not_read_as_exact():
    # before `exact` existed `acc` was the mean greedy reward: it is shown as mean_reward only
    assert figures({"acc": 0.4, "n": 5}) == (None, 0.4)
    assert figures({"exact": 0.2, "mean_reward": 0.4, "acc": 0.2}) == (0.2, 0.4)
    row = table_row(3, {"acc": 0.4, "n": 5, "at": 1.0})
    assert row["exact"] is None and row["acc"] is None and row["mean_reward"] == 0.4 and row["k"] == 0


def test_table_puts_the_training_reward_beside_each_version():
    evals = {0: summarize([0.0, 1.0], None), 2: summarize([1.0, 1.0], None)}
    steps = [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.75}]
    rows = table(evals, steps)
    assert [(r["version"], r["exact"], r["train_reward"]) for r in rows] == [(0, 0.5, None), (2, 1.0, 0.75)]
