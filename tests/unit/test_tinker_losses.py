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
        tl.loss_fn("dpo")


def test_the_sdk_loss_names_are_served():
    from tinker.types.loss_fn_type import LossFnType

    assert set(LossFnType.__args__) - {"custom"} == set(tl.LOSSES)  # "custom" is forward_backward_custom


def test_dro_value_gradient_and_beta():
    lp = _t(math.log(0.5), math.log(0.25)).requires_grad_(True)
    inputs = {"logprobs": _t(math.log(0.25), math.log(0.25)), "advantages": _t(1.0, -2.0)}
    loss, elem = tl.dro(lp, inputs, {"beta": 0.5})
    # t0: -(log .5 * 1 - 0.25 * (log 2)^2) ; t1: -(log .25 * -2 - 0)
    e0 = -(math.log(0.5) - 0.25 * math.log(2) ** 2)
    e1 = 2 * math.log(0.25)
    assert elem.tolist() == pytest.approx([e0, e1])
    assert loss.item() == pytest.approx(e0 + e1)
    loss.backward()
    # d/dlp: -(A - beta * (lp - q))
    assert lp.grad.tolist() == pytest.approx([-(1 - 0.5 * math.log(2)), 2.0])
    default = tl.dro(lp.detach(), inputs)[0].item()
    assert default == pytest.approx(-(math.log(0.5) - 0.5 * 0.05 * math.log(2) ** 2) + e1)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        tl.dro(lp, inputs, {"beta": -1})


def test_gspo_sequence_ratio_over_the_mask():
    lp = _t(math.log(0.6), math.log(0.1), math.log(0.3)).requires_grad_(True)
    behav = _t(math.log(0.3), math.log(0.2), math.log(0.3))  # token ratios 2, 0.5, 1
    adv = _t(1.0, 1.0, -1.0)
    # mask on token 0 only: s = 2 for every token; A = 1 tokens take the clip 1.2 (no gradient), the
    # A = -1 token min(-2, -1.2) = -2 unclipped: gradient -A * s = 2
    loss, elem = tl.gspo(lp, {"logprobs": behav, "advantages": adv, "sequence_ratio_mask": _t(1, 0, 0)})
    assert elem.tolist() == pytest.approx([-1.2, -1.2, 2.0])
    assert loss.item() == pytest.approx(-0.4)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 2.0])


def test_gspo_without_mask_uses_every_token():
    lp = _t(math.log(0.6), math.log(0.1), math.log(0.3)).requires_grad_(True)
    behav = _t(math.log(0.3), math.log(0.2), math.log(0.3))  # log ratios log 2, -log 2, 0: mean 0, s = 1
    loss, elem = tl.gspo(lp, {"logprobs": behav, "advantages": _t(1.0, 1.0, -1.0)})
    assert elem.tolist() == pytest.approx([-1.0, -1.0, 1.0])
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.0, -1.0, 1.0])  # -A * s
    with pytest.raises(ValueError, match="marks no token"):
        tl.gspo(lp, {"logprobs": behav, "advantages": _t(1.0, 1.0, -1.0), "sequence_ratio_mask": _t(0, 0, 0)})


def test_stable_reinforce_truncated_weight_and_kl():
    lp = _t(math.log(0.6), math.log(0.1)).requires_grad_(True)
    inputs = {"logprobs": _t(math.log(0.2), math.log(0.2)), "advantages": _t(1.0, 1.0)}  # ratios 3, 0.5
    loss, elem = tl.stable_reinforce(lp, inputs)
    # weights: min(3, 2) = 2 and 0.5, constants
    assert elem.tolist() == pytest.approx([-2 * math.log(0.6), -0.5 * math.log(0.1)])
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, -0.5])
    lp.grad = None
    loss, _ = tl.stable_reinforce(lp, inputs, {"kl_coeff": 0.1})
    expect = -2 * math.log(0.6) - 0.5 * math.log(0.1) + 0.1 * (3 - 1 - math.log(3)) + 0.1 * (0.5 - 1 - math.log(0.5))
    assert loss.item() == pytest.approx(expect)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-2.0 + 0.1 * 2, -0.5 + 0.1 * -0.5])  # k3's gradient: r - 1


def test_stable_reinforce_on_policy_is_reinforce_and_mask_drops_tokens():
    lp = _t(math.log(0.6), math.log(0.1)).requires_grad_(True)
    inputs = {"logprobs": _t(math.log(0.6), math.log(0.1)), "advantages": _t(0.5, -1.0)}
    loss, _ = tl.stable_reinforce(lp, inputs, {"kl_coeff": 1.0})
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.5, 1.0])  # -A: the KL term has no gradient on-policy
    loss, elem = tl.stable_reinforce(lp.detach(), {**inputs, "mask": _t(1.0, 0.0)})
    assert elem.tolist() == pytest.approx([-0.5 * math.log(0.6), 0.0])
    with pytest.raises(ValueError, match="clip_high_threshold >= 1"):
        tl.stable_reinforce(lp, inputs, {"clip_high_threshold": 0.5})
