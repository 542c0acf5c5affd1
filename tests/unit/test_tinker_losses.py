"""The Tinker protocol's loss functions against hand-computed values and their gradients."""

import math

import pytest
import torch

from marlaas.train import tinker_losses as tl

pytestmark = pytest.mark.unit


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_cross_entropy_weights_and_default():
    lp = _t(-1.0, -2.0, -0.5)
    loss, elem = tl.cross_entropy(lp, {"weights": _t(0.0, 1.0, 2.0)})
    assert loss.item() == pytest.approx(0 + 2.0 + 1.0)
    assert elem.tolist() == pytest.approx([0.0, 2.0, 1.0])
    assert tl.cross_entropy(lp, {})[0].item() == pytest.approx(3.5)


def test_importance_sampling_value_and_gradient():
    lp = _t(math.log(0.5), math.log(0.2)).requires_grad_(True)
    inputs = {"logprobs": _t(math.log(0.25), math.log(0.4)), "advantages": _t(1.0, -2.0)}
    loss, _ = tl.importance_sampling(lp, inputs)
    # ratios 2 and 0.5: -(2*1 + 0.5*(-2)) = -1
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    # d/dlp of -r*A = -r*A
    assert lp.grad.tolist() == pytest.approx([-2.0, 1.0])


def test_ppo_clips_like_the_documented_formula():
    lp = _t(math.log(0.6), math.log(0.1), math.log(0.3)).requires_grad_(True)
    behav = _t(math.log(0.3), math.log(0.2), math.log(0.3))  # ratios 2.0, 0.5, 1.0
    adv = _t(1.0, -1.0, 0.5)
    loss, elem = tl.ppo(lp, {"logprobs": behav, "advantages": adv})
    # t0: min(2*1, 1.2*1) = 1.2 ; t1: min(0.5*-1, 0.8*-1) = -0.8 ; t2: 0.5
    assert elem.tolist() == pytest.approx([-1.2, 0.8, -0.5])
    assert loss.item() == pytest.approx(-0.9)
    loss.backward()
    # clipped tokens have no gradient; t2: -r*A = -0.5
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5])


def test_ppo_custom_thresholds():
    lp, behav, adv = _t(math.log(0.6)), _t(math.log(0.3)), _t(1.0)
    loss, _ = tl.ppo(lp, {"logprobs": behav, "advantages": adv}, {"clip_low_threshold": 0.5, "clip_high_threshold": 3})
    assert loss.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="clip thresholds"):
        tl.ppo(lp, {"logprobs": behav, "advantages": adv}, {"clip_high_threshold": 0.9})


def test_cispo_weight_is_clipped_and_constant():
    lp = _t(math.log(0.6), math.log(0.1)).requires_grad_(True)
    behav = _t(math.log(0.3), math.log(0.2))  # ratios 2.0 -> 1.2, 0.5 -> 0.8
    adv = _t(1.0, -1.0)
    loss, _ = tl.cispo(lp, {"logprobs": behav, "advantages": adv})
    expect = -(1.2 * math.log(0.6) * 1.0 + 0.8 * math.log(0.1) * -1.0)
    assert loss.item() == pytest.approx(expect)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.2, 0.8])  # the clipped weight is a constant


def test_errors_are_one_clear_line():
    with pytest.raises(ValueError, match="needs the loss_fn_input 'advantages'"):
        tl.importance_sampling(_t(0.0), {"logprobs": _t(0.0)})
    with pytest.raises(ValueError, match="2 values for 1 target tokens"):
        tl.importance_sampling(_t(0.0), {"logprobs": _t(0.0, 0.0), "advantages": _t(1.0)})
    with pytest.raises(ValueError, match="not supported here"):
        tl.loss_fn("dro")
