"""Learning-rate schedules on hand-computed values, and the spec fields that choose them."""

from __future__ import annotations

import math

import pytest

from marlaas.train.schedule import lr_at

pytestmark = pytest.mark.unit


def test_constant_is_the_peak_at_every_step():
    assert [lr_at(k, 5, 0.1) for k in range(5)] == [0.1] * 5


def test_linear_decay_to_zero_never_reaches_zero():
    # N = 4, W = 0: p = 0, 1/4, 2/4, 3/4 -> 1, 0.75, 0.5, 0.25 of the peak.
    assert [lr_at(k, 4, 1.0, "linear") for k in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_linear_with_floor_and_warmup():
    # N = 6, W = 2, m = 0.5: warm-up 1/2, 2/2; then p = 0, 1/4, 2/4, 3/4 -> 1 - 0.5 p.
    got = [lr_at(k, 6, 2.0, "linear", warmup=2, min_ratio=0.5) for k in range(6)]
    assert got == pytest.approx([1.0, 2.0, 2.0, 1.75, 1.5, 1.25])


def test_cosine_halfway_is_the_midpoint():
    # N = 4: p = 0, 1/4, 1/2, 3/4 -> (1 + cos(pi p)) / 2.
    want = [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]
    assert [lr_at(k, 4, 1.0, "cosine") for k in range(4)] == pytest.approx(want)
    assert lr_at(2, 4, 1.0, "cosine", min_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.5)


def test_steps_outside_the_job_take_the_nearest_end():
    assert lr_at(-3, 4, 1.0, "linear") == 1.0
    assert lr_at(99, 4, 1.0, "linear") == pytest.approx(0.25)


@pytest.mark.parametrize(
    "args, match",
    [((0, 4, 1.0, "step"), "unknown lr schedule"), ((0, 4, 1.0, "linear", 4), "warmup"),
     ((0, 4, 1.0, "linear", 0, 1.5), "min_ratio")],
)  # fmt: skip
def test_bad_arguments_are_one_line_errors(args, match):
    with pytest.raises(ValueError, match=match):
        lr_at(*args)


def test_spec_refuses_warmup_as_long_as_the_job():
    from pydantic import ValidationError

    from marlaas.spec import JobSpec

    ok = JobSpec(task="add", steps=10, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert (ok.lr_schedule, ok.warmup_steps, ok.min_lr_ratio) == ("cosine", 2, 0.1)
    with pytest.raises(ValidationError, match="warmup_steps"):
        JobSpec(task="add", steps=10, warmup_steps=10)
    with pytest.raises(ValidationError, match="lr_schedule"):
        JobSpec(task="add", lr_schedule="exponential")
