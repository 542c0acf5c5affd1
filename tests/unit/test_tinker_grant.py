"""The Tinker grant of the trainer lane (pure parts): where a grant ends, and what it is charged beyond
the one step the tick charged when it granted the lane."""

import pytest

from marlaas.control.scheduler import grant_extra_charge
from marlaas.train.tinker_ops import GRANT_TOKENS, grant_over, op_tokens

pytestmark = pytest.mark.unit


def test_op_tokens_counts_the_forward_passes_only():
    body = {"data": [{"tokens": [1, 2, 3]}, {"tokens": [4] * 10}]}
    assert op_tokens("forward_backward", body) == 13
    assert op_tokens("forward", body) == 13
    assert op_tokens("optim_step", {"adam": {}}) == 0
    assert op_tokens("save_weights", {"name": "x"}) == 0


def test_a_grant_ends_at_the_optim_step_or_past_its_tokens():
    assert grant_over("optim_step", 0, True, GRANT_TOKENS)
    assert not grant_over("forward_backward", GRANT_TOKENS - 1, True, GRANT_TOKENS)
    assert grant_over("forward_backward", GRANT_TOKENS, True, GRANT_TOKENS)
    assert not grant_over("forward_backward", 10**9, True, None)  # no bound: until the step, as before
    assert not grant_over("optim_step", 0, False, None)  # run_queue(mid): the whole queue


def test_the_grant_pays_its_time_in_job_steps():
    assert grant_extra_charge(10.0, 1.0, 1.0) == 9.0  # ten steps' time: nine more than the tick charged
    assert grant_extra_charge(10.0, 1.0, 2.0) == 4.5  # a heavier tenant pays less per second
    assert grant_extra_charge(0.5, 1.0, 1.0) == 0.0  # shorter than a step: the step the tick charged
    assert grant_extra_charge(10.0, None, 1.0) == 0.0  # no job step measured: nobody to be fair to
