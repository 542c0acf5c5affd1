"""marlaas.train.rl on hand-computed values: advantages, the decoupled/truncated PPO loss, the k3 KL."""

import math

import pytest
import torch

from marlaas.train.rl import group_advantages, policy_loss

pytestmark = pytest.mark.unit


def test_group_advantages_grpo_and_drgrpo():
    rewards_G = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean = 0.5 -> centred [0.5, -0.5, -0.5, 0.5]
    # population std = sqrt(mean(0.25, 0.25, 0.25, 0.25)) = 0.5 (the sample std would be 0.577)
    # grpo = centred / (0.5 + 1e-6) = +-0.5 / 0.500001
    grpo = group_advantages(rewards_G, "grpo", eps=1e-6)
    expected = 0.5 / 0.500001
    assert torch.allclose(grpo, torch.tensor([expected, -expected, -expected, expected]), atol=1e-7)
    drgrpo = group_advantages(rewards_G, "drgrpo")
    assert torch.equal(drgrpo, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_equal_rewards_are_zero():
    # centred = 0 and std = 0, so grpo = 0 / (0 + eps) = 0, no division by zero
    for mode in ("grpo", "drgrpo"):
        assert torch.equal(group_advantages(torch.tensor([0.7, 0.7, 0.7]), mode), torch.zeros(3))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2), "ppo")


def _example():
    """A 2x3 batch where the clip binds on two tokens and the weight is truncated on two.

    clip_eps = 0.2, tis_cap = 2. Per token (ratio = pi/pi_prox, raw w = pi_prox/pi_behav):
      seq 0, A = +1, mask [1, 1, 1]
        t0 ratio 1.5, raw w 1 -> min(1.5*1, 1.2*1) = 1.2 (clipped)        obj = 1 * 1.2   = 1.2
        t1 ratio 1.0, raw w 3 -> w = 2 (truncated), min(1, 1) = 1          obj = 2 * 1     = 2
        t2 ratio 0.5, raw w 0.5 -> min(0.5, 0.8) = 0.5 (not clipped)       obj = 0.5 * 0.5 = 0.25
      seq 1, A = -2, mask [1, 1, 0]
        t0 ratio 0.5, raw w 1 -> min(-1, 0.8*-2 = -1.6) = -1.6 (clipped)   obj = -1.6
        t1 ratio 1.5, raw w 4 -> w = 2 (truncated), min(-3, -2.4) = -3    obj = 2 * -3    = -6
        t2 padding: garbage values that must not leak (no NaN)
    per-token loss = -obj: seq 0 [-1.2, -2, -0.25] (sum -3.45), seq 1 [1.6, 6] (sum 7.6)
    """
    prox = torch.full((2, 3), -1.0)
    ratio = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.5, 1.0]])
    raw_w = torch.tensor([[1.0, 3.0, 0.5], [1.0, 4.0, 1.0]])
    logp = (prox + ratio.log()).clone()
    behav = prox - raw_w.log()
    logp[1, 2], prox[1, 2], behav[1, 2] = 100.0, -100.0, float("-inf")  # padding garbage
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -2.0])
    return logp, prox, behav, adv, mask


def test_policy_loss_token_aggregation_hand_computed():
    logp, prox, behav, adv, mask = _example()
    loss, stats = policy_loss(logp, prox, behav, adv, mask, clip_eps=0.2, tis_cap=2.0, aggregation="token")
    # token mean over the 5 real tokens: (-3.45 + 7.6) / 5 = 4.15 / 5 = 0.83
    assert loss.item() == pytest.approx(0.83, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5)  # seq0 t0, seq1 t0
    assert stats["tis_mean"] == pytest.approx((1 + 2 + 0.5 + 1 + 2) / 5)  # = 1.3
    assert stats["tis_trunc_frac"] == pytest.approx(2 / 5)  # raw 3 and 4 cut to 2
    assert stats["kl"] == 0.0
    loss.backward()
    # d loss / d logp = -w * ratio * A / 5 where the unclipped term is chosen, 0 where the clip binds:
    #   seq0: t0 clipped -> 0; t1 -2*1*1/5 = -0.4; t2 -0.5*0.5*1/5 = -0.05
    #   seq1: t0 clipped -> 0; t1 -2*1.5*(-2)/5 = +1.2; t2 padding -> 0
    expected = torch.tensor([[0.0, -0.4, -0.05], [0.0, 1.2, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_policy_loss_sequence_aggregation_hand_computed():
    logp, prox, behav, adv, mask = _example()
    loss, _ = policy_loss(logp, prox, behav, adv, mask, clip_eps=0.2, tis_cap=2.0, aggregation="sequence")
    # seq0 mean = -3.45 / 3 = -1.15; seq1 mean = 7.6 / 2 = 3.8; loss = (-1.15 + 3.8) / 2 = 1.325
    assert loss.item() == pytest.approx(1.325, abs=1e-6)
    loss.backward()
    # per-sequence means: seq0 divides by 3 and by 2 sequences, seq1 by 2 and by 2
    #   seq0 t1: -2*1*1/6 = -1/3; t2: -0.25/6 = -0.041667; seq1 t1: +6/4 = 1.5
    expected = torch.tensor([[0.0, -1 / 3, -0.25 / 6], [0.0, 1.5, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_k3_kl_penalty_hand_computed():
    # one sequence, two tokens; ref - logp = [ln 2, 0]
    # k3 = exp(x) - x - 1 -> [2 - ln 2 - 1, 0] = [1 - ln 2, 0] = [0.306853, 0]
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    ref = logp.detach() + torch.tensor([[math.log(2.0), 0.0]])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        logp.detach(),
        torch.zeros(1),
        mask,
        0.2,
        2.0,
        "token",
        kl_coef=0.5,
        ref_logprobs_B_T=ref,
    )
    # advantage 0 -> policy term 0; loss = 0.5 * mean(k3) = 0.5 * (1 - ln 2) / 2
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)) / 2, abs=1e-6)
    assert stats["kl"] == pytest.approx((1 - math.log(2)) / 2, abs=1e-6)
    loss.backward()
    # d k3 / d logp = -exp(ref - logp) + 1 = [-1, 0]; times 0.5 / 2 tokens -> [-0.25, 0]:
    # the penalty pulls logp up towards the reference where the reference is more likely
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, logp, torch.zeros(1), mask, 0.2, 2.0, kl_coef=0.1)


def _toy_step(advantage: float):
    """One SGD step on a 5-way softmax after sampling token 2; returns (logp before, after, grad)."""
    logits = torch.zeros(5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[2].reshape(1, 1)
    loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.tensor([advantage]), torch.ones(1, 1), 0.2, 2.0)
    loss.backward()
    with torch.no_grad():
        after = torch.log_softmax(logits - 0.5 * logits.grad, -1)[2]
    return logp.item(), after.item(), loss.item(), logits.grad


def test_positive_advantage_raises_logprob_negative_lowers_it():
    before, after, _, _ = _toy_step(+1.0)
    assert after > before
    before, after, _, _ = _toy_step(-1.0)
    assert after < before


def test_zero_advantage_gives_zero_loss_and_gradient():
    _, _, loss, grad = _toy_step(0.0)
    assert loss == 0.0
    assert torch.count_nonzero(grad) == 0


def _job(dropout: float = 0.0, **rl):
    from marlaas.spec import JobSpec, LoraSpec, RLSpec

    return JobSpec.model_construct(task="sort", lora=LoraSpec(dropout=dropout), rl=RLSpec(**rl), max_new_tokens=4)


class _Row:
    def __init__(self, n: int, advantage: float):
        self.completion_ids, self.advantage, self.n_actions = [7] * n, advantage, n


def test_needs_prox_pass_only_for_recompute_with_dropout():
    from marlaas.train.rl import needs_prox_pass

    assert needs_prox_pass(_job(0.1)) is True
    assert needs_prox_pass(_job(0.0)) is False
    assert needs_prox_pass(_job(0.1, loss={"kind": "ppo"})) is False
    assert needs_prox_pass(_job(0.1, loss={"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.5})) is False


def test_job_loss_counts_skipped_rows_in_the_normaliser_unless_dropped():
    """On-policy rows (ratio 1, weight 1): the per-token loss is -A. Kept rows: A = 1 (2 tokens) and
    A = -1 (1 token); a skipped zero-advantage row of 3 tokens still counts unless dropped."""
    from marlaas.train.rl import job_loss

    kept = [_Row(2, 1.0), _Row(1, -1.0)]
    samples = [*kept, _Row(3, 0.0)]
    logp = torch.tensor([[-1.0, -2.0], [0.0, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    behav = logp.detach().clone()
    kept_sum = -(1.0 + 1.0) + 1.0  # sum over kept tokens of -A
    dropped, _ = job_loss(_job(drop_zero_advantage=True), samples, kept, logp, mask, behav)
    assert dropped.item() == pytest.approx(kept_sum / 3)  # token mean over the 3 kept tokens
    full, _ = job_loss(_job(drop_zero_advantage=False), samples, kept, logp, mask, behav)
    assert full.item() == pytest.approx(kept_sum / 6)  # over all 6 tokens handed to the trainer
    seq, _ = job_loss(_job(drop_zero_advantage=False, aggregation="sequence"), samples, kept, logp, mask, behav)
    assert seq.item() == pytest.approx((-1.0 + 1.0) / 3)  # per-sequence means (-1, +1) over 3 sequences
    const, _ = job_loss(_job(aggregation="constant"), samples, kept, logp, mask, behav)
    assert const.item() == pytest.approx(kept_sum / (4 * 3))  # K = max_new_tokens x len(samples)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
@pytest.mark.parametrize("drop", [True, False])
def test_job_loss_of_a_split_sums_to_the_whole(aggregation, drop):
    """The trainer's micro-batches: the losses (and gradients) of the kept rows split in two, each with
    its own rows' tensors, add up to the loss over all kept rows. Off-policy rows (weights != 1)."""
    from marlaas.train.rl import job_loss

    kept = [_Row(2, 1.0), _Row(1, -1.0), _Row(2, 0.5)]
    samples = [*kept, _Row(3, 0.0)]
    logp = torch.tensor([[-1.0, -2.0], [0.0, -1.5], [-0.5, -0.25]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    behav = logp.detach() - torch.tensor([[0.2, -0.1], [0.0, 0.3], [-0.4, 0.1]])
    job = _job(drop_zero_advantage=drop, aggregation=aggregation)
    whole, _ = job_loss(job, samples, kept, logp, mask, behav)
    (g_whole,) = torch.autograd.grad(whole, logp)
    a, _ = job_loss(job, samples, kept, logp[:2], mask[:2], behav[:2], rows=kept[:2])
    b, _ = job_loss(job, samples, kept, logp[2:], mask[2:], behav[2:], rows=kept[2:])
    (g_split,) = torch.autograd.grad(a + b, logp)
    assert (a + b).item() == pytest.approx(whole.item(), abs=1e-6)
    assert whole.item() != pytest.approx(a.item())  # both halves carry signal
    assert torch.allclose(g_split, g_whole, atol=1e-7)
