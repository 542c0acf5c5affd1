"""Objective variants on hand-computed values: importance weights, proximal policies, the constant
normaliser, and the `rl` spec's tagged unions (parsing and one-line errors)."""

import math

import pytest
import torch

from marlaas.errors import SpecError
from marlaas.spec import CoupledPPOLoss, DecoupledPPOLoss, MaskIS, NoIS, RLSpec, TruncateIS, parse_spec
from marlaas.train import losses as rv
from marlaas.train.rl import aggregate, policy_loss, spec_loss

pytestmark = pytest.mark.unit

LN2, LN4 = math.log(2.0), math.log(4.0)


def _ratios():
    """Log-ratios l = log pi_prox - log pi_behav of a 2x3 batch; position (1, 2) is padding.

    ratios: seq 0 [1, 4, 0.25] (3 tokens), seq 1 [4, 4, pad].
    Geometric means: seq 0 exp((0 + ln 4 - ln 4) / 3) = 1; seq 1 exp((ln 4 + ln 4) / 2) = 4.
    """
    log_ratio = torch.tensor([[0.0, LN4, -LN4], [LN4, LN4, 100.0]])  # 100 = padding garbage
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return log_ratio, mask


def test_sequence_log_ratio_is_the_masked_mean_and_zero_for_empty_rows():
    log_ratio, mask = _ratios()
    empty = torch.tensor([[5.0, 5.0]]), torch.zeros(1, 2)
    assert torch.allclose(rv.sequence_log_ratio(log_ratio, mask), torch.tensor([0.0, LN4]))
    assert rv.sequence_log_ratio(*empty).item() == 0.0  # no tokens: r = 1


def test_truncate_token():
    log_ratio, mask = _ratios()
    w, cut = rv.truncate_token(log_ratio, cap=2.0)
    # min(r, 2): seq 0 [1, 2, 0.25], seq 1 [2, 2]; 0.25 is NOT raised (truncation only cuts above)
    assert torch.allclose(w[mask > 0], torch.tensor([1.0, 2.0, 0.25, 2.0, 2.0]))
    assert cut[mask > 0].tolist() == [False, True, False, True, True]


def test_mask_token():
    log_ratio, mask = _ratios()
    w, cut = rv.mask_token(log_ratio, cap=2.0)
    # band [1/2, 2]: 1 stays; 4 and 0.25 leave it -> 0
    assert torch.allclose(w[mask > 0], torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))
    assert cut[mask > 0].tolist() == [False, True, True, True, True]
    w, _ = rv.mask_token(torch.tensor([[0.0, 1e-3]]), cap=1.0)  # cap 1: the band is [1, 1], edges included
    assert torch.equal(w, torch.tensor([[1.0, 0.0]]))


def test_truncate_sequence_uses_the_geometric_mean():
    log_ratio, mask = _ratios()
    w, cut = rv.truncate_sequence(log_ratio, mask, cap=2.0)
    # seq 0: r = 1 on every token (its 4 and 1/4 cancel); seq 1: r = 4 -> cut to 2
    assert torch.allclose(w[0], torch.ones(3)) and torch.allclose(w[1, :2], torch.full((2,), 2.0))
    assert cut[0].tolist() == [False] * 3 and cut[1, :2].tolist() == [True, True]


def test_mask_sequence_drops_whole_sequences():
    log_ratio, mask = _ratios()
    w, cut = rv.mask_sequence(log_ratio, mask, cap=2.0)
    # seq 0: r = 1 in [1/2, 2] -> kept with weight 1 (although two of its tokens leave the band)
    # seq 1: r = 4 > 2 -> every token 0
    assert torch.allclose(w[0], torch.ones(3)) and torch.equal(w[1, :2], torch.zeros(2))
    assert cut[mask > 0].tolist() == [False, False, False, True, True]
    w, _ = rv.mask_sequence(log_ratio, mask, cap=4.5)  # r = 4 in [1/4.5, 4.5]: kept, weight 4
    assert torch.allclose(w[1, :2], torch.full((2,), 4.0))


def test_importance_weights_dispatch_and_errors():
    log_ratio, mask = _ratios()
    behav = torch.full((2, 3), -3.0)
    prox = behav + log_ratio
    w, cut = rv.importance_weights(prox, behav, mask, "none")
    assert torch.equal(w, torch.ones(2, 3)) and not cut.any()
    w_seq, _ = rv.importance_weights(prox, behav, mask, "mask", "sequence", 2.0)
    assert torch.allclose(w_seq, rv.mask_sequence(log_ratio, mask, 2.0)[0])
    for kind, level, cap, words in [
        ("clip", "token", 2.0, "unknown importance kind"),
        ("mask", "batch", 2.0, "unknown importance level"),
        ("truncate", "token", 0.5, "cap must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            rv.importance_weights(prox, behav, mask, kind, level, cap)


def test_proximal_policies():
    behav = torch.tensor([[-2.0, -1.0]])
    theta = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    # a3po, alpha = 0.25: behav + 0.25 (theta - behav) = [-2 + 0.25 * 1, -1 + 0.25 * (-2)] = [-1.75, -1.5]
    prox = rv.proximal_logprobs("a3po", theta, behav, alpha=0.25)
    assert torch.allclose(prox, torch.tensor([[-1.75, -1.5]])) and not prox.requires_grad
    assert torch.equal(rv.prox_a3po(theta, behav, 0.0), behav)  # alpha 0: coupled PPO
    assert torch.equal(rv.prox_a3po(theta, behav, 1.0), theta.detach())  # alpha 1: recompute
    assert torch.equal(rv.proximal_logprobs("ppo", theta, behav), behav)
    assert torch.equal(rv.proximal_logprobs("recompute", theta, behav), theta.detach())
    recomputed = torch.tensor([[-1.5, -2.5]])
    assert torch.equal(rv.proximal_logprobs("recompute", theta, behav, recomputed_B_T=recomputed), recomputed)
    with pytest.raises(ValueError, match="alpha must be in"):
        rv.prox_a3po(theta, behav, 1.5)
    with pytest.raises(ValueError, match="unknown proximal"):
        rv.proximal_logprobs("exact", theta, behav)


def _one_seq():
    """One sequence of two tokens, A = +1, behav = [-2, -2], theta = [-2 + 2 ln 2, -2]:
    pi_theta / pi_behav = [4, 1]."""
    behav = torch.tensor([[-2.0, -2.0]])
    theta = torch.tensor([[-2.0 + 2 * LN2, -2.0]], requires_grad=True)
    return theta, behav, torch.tensor([1.0]), torch.ones(1, 2)


@pytest.mark.parametrize(
    "loss_cfg, want_loss, want_grad, want_clip, want_tis",
    [
        # recompute: prox = theta -> ratio [1, 1], w = min([4, 1], 2) = [2, 1]
        #   obj = [2 * 1, 1 * 1]; loss = -(2 + 1) / 2 = -1.5; grad = -w * ratio * A / 2 = [-1, -0.5]
        (DecoupledPPOLoss(), -1.5, [-1.0, -0.5], 0.0, 1.5),
        # a3po alpha 0.5: prox = behav + 0.5 * [2 ln 2, 0] -> w = [2, 1], ratio = [2, 1]
        #   t0: min(2, 1.2) = 1.2 (clip binds) -> obj 2 * 1.2 = 2.4; t1: obj 1
        #   loss = -(2.4 + 1) / 2 = -1.7; grad t0 = 0 (clipped), t1 = -1 * 1 * 1 / 2 = -0.5
        (DecoupledPPOLoss(prox="a3po", alpha=0.5), -1.7, [0.0, -0.5], 0.5, 1.5),
        # ppo: prox = behav -> w = [1, 1], ratio = [4, 1]; t0 clipped at 1.2
        #   loss = -(1.2 + 1) / 2 = -1.1; grad [0, -0.5]
        (CoupledPPOLoss(), -1.1, [0.0, -0.5], 0.5, 1.0),
    ],
)
def test_spec_loss_proximal_variants_hand_computed(loss_cfg, want_loss, want_grad, want_clip, want_tis):
    theta, behav, adv, mask = _one_seq()
    cfg = RLSpec(loss=loss_cfg, importance=TruncateIS(cap=2.0), clip_eps=0.2)
    loss, stats = spec_loss(cfg, theta, behav, adv, mask)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(want_clip)
    assert stats["tis_mean"] == pytest.approx(want_tis, abs=1e-6)
    loss.backward()
    assert torch.allclose(theta.grad, torch.tensor([want_grad]), atol=1e-6)


def _example():
    """The 2x3 batch of tests/test_rl.py: ratio pi/pi_prox and raw w = pi_prox/pi_behav per token,
    A = [+1, -2], clip_eps 0.2, (1, 2) padding with garbage values.

    Clipped surrogates min(ratio A, clip(ratio) A) per real token:
      seq 0: t0 1.2 (clipped), t1 1, t2 0.5          raw w [1, 3, 0.5]
      seq 1: t0 -1.6 (clipped), t1 -3                raw w [1, 4]
    """
    prox = torch.full((2, 3), -1.0)
    ratio = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.5, 1.0]])
    raw_w = torch.tensor([[1.0, 3.0, 0.5], [1.0, 4.0, 1.0]])
    logp = (prox + ratio.log()).clone()
    behav = prox - raw_w.log()
    logp[1, 2], prox[1, 2], behav[1, 2] = 100.0, -100.0, float("-inf")
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    return logp, prox, behav, torch.tensor([1.0, -2.0]), mask


def test_constant_aggregation_divides_by_the_budget():
    logp, prox, behav, adv, mask = _example()
    # truncated w = [1, 2, 0.5], [1, 2]; per-token loss -w * surr = [-1.2, -2, -0.25], [1.6, 6] (sum 4.15)
    # K = 2 sequences x 4 max_new_tokens = 8 -> loss = 4.15 / 8 = 0.51875
    loss, _ = policy_loss(logp, prox, behav, adv, mask, 0.2, 2.0, "constant", constant_norm=8.0)
    assert loss.item() == pytest.approx(0.51875, abs=1e-6)
    loss.backward()
    # grad = -w * ratio * A / 8 on unclipped tokens: seq 0 t1 -2/8, t2 -0.25/8; seq 1 t1 +6/8
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.25, -0.03125], [0.0, 0.75, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="constant_norm"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "constant")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "batch")


def test_policy_loss_mask_token_hand_computed():
    logp, prox, behav, adv, mask = _example()
    loss, stats = policy_loss(logp, prox, behav, adv, mask, 0.2, 2.0, "token", importance="mask")
    # band [0.5, 2]: w = [1, 0, 0.5], [1, 0] (raw 3 and 4 masked; 0.5 on the edge stays)
    # per-token loss = [-1.2, 0, -0.25], [1.6, 0]; token mean = 0.15 / 5 = 0.03 (masked tokens still count)
    assert loss.item() == pytest.approx(0.03, abs=1e-6)
    assert stats["tis_trunc_frac"] == pytest.approx(2 / 5)
    assert stats["tis_mean"] == pytest.approx((1 + 0 + 0.5 + 1 + 0) / 5)
    loss.backward()
    # only seq 0 t2 is unclipped with w > 0: -0.5 * 0.5 * 1 / 5 = -0.05
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, -0.05], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_policy_loss_sequence_weights_hand_computed():
    logp, prox, behav, adv, mask = _example()
    # geometric means: seq 0 (1 * 3 * 0.5)^(1/3) = 1.5^(1/3) = 1.144714; seq 1 (1 * 4)^(1/2) = 2
    r0 = 1.5 ** (1 / 3)
    # truncate, cap 2.5: w = r0 on seq 0, 2 on seq 1 (both under the cap)
    #   loss = -(r0 * (1.2 + 1 + 0.5) + 2 * (-1.6 - 3)) / 5 = (9.2 - 2.7 r0) / 5
    loss, stats = policy_loss(logp, prox, behav, adv, mask, 0.2, 2.5, "token", importance="truncate", level="sequence")
    assert loss.item() == pytest.approx((9.2 - 2.7 * r0) / 5, abs=1e-5)
    assert stats["tis_trunc_frac"] == 0.0
    # truncate, cap 1.5: seq 1 cut to 1.5 -> loss = -(2.7 r0 + 1.5 * (-4.6)) / 5 = (6.9 - 2.7 r0) / 5
    loss, stats = policy_loss(logp, prox, behav, adv, mask, 0.2, 1.5, "token", importance="truncate", level="sequence")
    assert loss.item() == pytest.approx((6.9 - 2.7 * r0) / 5, abs=1e-5)
    assert stats["tis_trunc_frac"] == pytest.approx(2 / 5)
    # mask, cap 1.5: seq 0 r0 in [2/3, 1.5] kept; seq 1 r = 2 > 1.5 dropped -> loss = -2.7 r0 / 5
    loss, stats = policy_loss(logp, prox, behav, adv, mask, 0.2, 1.5, "token", importance="mask", level="sequence")
    assert loss.item() == pytest.approx(-2.7 * r0 / 5, abs=1e-5)
    assert stats["tis_trunc_frac"] == pytest.approx(2 / 5)


# ----------------------------------------------------------------------------- the spec


def test_spec_union_members_parse():
    rl = parse_spec(
        {
            "task": "sort",
            "rl": {
                "advantage": "drgrpo",
                "aggregation": "constant",
                "loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.25},
                "importance": {"kind": "mask", "level": "sequence", "cap": 3.0},
            },
        }
    ).rl
    assert rl.loss == DecoupledPPOLoss(prox="a3po", alpha=0.25)
    assert rl.importance == MaskIS(level="sequence", cap=3.0)
    assert rl.aggregation == "constant" and rl.advantage == "drgrpo"
    assert RLSpec().loss == DecoupledPPOLoss(prox="recompute") and RLSpec().importance == TruncateIS(cap=2.0)
    assert RLSpec(loss={"kind": "ppo"}).loss == CoupledPPOLoss()
    assert RLSpec(importance={"kind": "none"}).importance == NoIS()
    assert RLSpec(importance={"kind": "truncate", "level": "sequence"}).importance.level == "sequence"
    assert RLSpec(loss={"prox": "a3po"}).loss.alpha == 0.5  # no tag = decoupled_ppo; a3po's default alpha
    assert RLSpec(importance={"cap": 5}).importance == TruncateIS(cap=5.0)  # no tag = truncate
    # The legacy flat cap still parses, and a dumped spec round-trips (as the store re-reads it).
    assert RLSpec(tis_cap=3.0).importance == TruncateIS(level="token", cap=3.0)
    full = RLSpec(loss={"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.3}, importance={"kind": "mask"})
    assert RLSpec.model_validate(full.model_dump()) == full


@pytest.mark.parametrize(
    "rl, words",
    [
        ({"importance": {"kind": "clip"}}, "rl.importance: Input tag 'clip'"),
        ({"loss": {"kind": "grpo"}}, "rl.loss: Input tag 'grpo'"),
        ({"importance": {"kind": "mask", "cap": 0.5}}, "cap: Input should be greater than or equal to 1"),
        ({"importance": {"kind": "truncate", "cap": 0.9}}, "cap: Input should be greater than or equal to 1"),
        ({"tis_cap": 0.5}, "cap: Input should be greater than or equal to 1"),
        ({"loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": 1.5}}, "alpha: Input should be less than"),
        ({"loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": -0.1}}, "alpha: Input should be greater"),
        ({"loss": {"kind": "decoupled_ppo", "alpha": 0.5}}, "alpha applies only to prox = 'a3po'"),
        ({"loss": {"kind": "ppo", "prox": "a3po"}}, "Extra inputs are not permitted"),
        ({"importance": {"kind": "none", "cap": 2}}, "Extra inputs are not permitted"),
        ({"importance": {"kind": "mask", "level": "batch"}}, "level: Input should be 'token' or 'sequence'"),
        ({"tis_cap": 2.0, "importance": {"kind": "none"}}, "either tis_cap (legacy) or importance"),
        ({"aggregation": "mean"}, "rl.aggregation: Input should be 'token', 'sequence' or 'constant'"),
    ],
)
def test_bad_rl_specs_give_one_line(rl, words):
    with pytest.raises(SpecError) as e:
        parse_spec({"task": "sort", "rl": rl})
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_stored_specs_read_back_with_their_unions_and_the_legacy_cap():
    import json

    from marlaas.store import spec_from_json

    spec = parse_spec({"task": "sort", "rl": {"loss": {"prox": "a3po", "alpha": 0.7}, "importance": {"kind": "mask"}}})
    raw = spec.model_dump_json(exclude={"dataset", "eval_dataset"})  # as the store writes it
    assert spec_from_json(raw).rl == spec.rl
    assert spec_from_json(raw).rl.loss.alpha == 0.7  # a real model, not a dict
    # A spec stored before the unions existed (flat `tis_cap`) still reads back.
    old = json.loads(raw)
    old["rl"] = {"advantage": "grpo", "aggregation": "token", "clip_eps": 0.2, "tis_cap": 3.0, "kl_coef": 0.0,
                 "drop_zero_advantage": True}  # fmt: skip
    back = spec_from_json(json.dumps(old)).rl
    assert back.importance == TruncateIS(cap=3.0) and back.loss == DecoupledPPOLoss()
