"""RL maths: group-relative advantages and the decoupled, truncated PPO policy loss (pure torch).

No model here: every function maps tensors to tensors, so each formula is unit-tested on
hand-computed values (tests/test_rl.py). Shape suffixes: `_G` one value per group member,
`_B` per sequence of a batch, `_B_T` per (sequence, completion token).

Advantages (one group = the G completions sampled for one prompt, rewards r_1..r_G)
-----------------------------------------------------------------------------------
    grpo:    A_i = (r_i - mean(r)) / (std(r) + eps)      std = POPULATION std (divide by G)
    drgrpo:  A_i =  r_i - mean(r)

Every token of completion i gets A_i. A group whose rewards are all equal gets A = 0 in both modes.

Policy loss (per completion token t of sequence i; all log-probs are of the sampled token)
------------------------------------------------------------------------------------------
    ratio_it = exp(logp_it - prox_it)                         pi_theta / pi_prox (carries the gradient)
    w_it     = min(exp(prox_it - behav_it), C)  (detached)   truncated importance weight pi_prox / pi_behav
    obj_it   = w_it * min(ratio_it * A_i, clip(ratio_it, 1 - eps, 1 + eps) * A_i)
    k3_it    = exp(ref_it - logp_it) - (ref_it - logp_it) - 1     (only when kl_coef > 0)
    l_it     = -obj_it + kl_coef * k3_it

    token:    loss = sum_{i,t} m_it l_it / sum_{i,t} m_it                 (one mean over all tokens)
    sequence: loss = mean_i [ sum_t m_it l_it / sum_t m_it ]              (over sequences with >= 1 token)

Here `behav` is the log-prob under which the engine actually sampled (adapter version v at the
sampling temperature), `prox` the proximal policy (the trainer's weights at the start of this
step, recomputed) and `ref` the base model (the same network with the adapter disabled).

Where this departs from the papers
----------------------------------
- GRPO (Shao et al., 2024, DeepSeekMath): the paper's loss is our `sequence` aggregation with
  pi_prox = pi_behav (w = 1) and the KL to a separate reference copy. Our reference is the base
  with the adapter disabled (no second model). The paper leaves the std unspecified; TRL uses the
  unbiased sample std; we use the population std, so for G = 4 our advantages are sqrt(4/3) larger
  in magnitude than TRL's.
- Dr. GRPO (Liu et al., 2025): the paper drops the std division AND the per-sequence length
  normalisation (it divides a token sum by a constant, the generation budget). `drgrpo` here only
  drops the std; the length bias is removed by choosing `token` aggregation, which divides by the
  number of tokens in the batch (DAPO-style) instead of a constant.
- Decoupled PPO (AReaL, Fu et al., 2025): same objective, but AReaL leaves pi_prox / pi_behav
  uncapped (or masks tokens over a cap). We truncate it at C (truncated importance sampling,
  Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"),
  which bounds the variance from both staleness and sampler/trainer numeric mismatch; TIS's own
  weight is pi_trainer / pi_sampler, which is our w when pi_prox is the trainer's current policy.
- The trainer takes ONE optimiser step per batch, so pi_prox = pi_theta at the step start: the
  ratio is exactly 1 in value (its gradient is grad logp), the clip never binds and the loss
  reduces to -w A logp per token. The clip is kept for callers that take several steps per batch.
- The k3 estimator is unbiased for KL(pi_theta || pi_ref) only when tokens are sampled from
  pi_theta; here they come from pi_behav and we do not reweight it (as GRPO implementations do).
"""

from __future__ import annotations

from typing import Literal

import torch


def group_advantages(
    rewards_G: torch.Tensor, mode: Literal["grpo", "drgrpo"] = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of one group's rewards (formulas in the module docstring)."""
    rewards_G = rewards_G.to(torch.float32)
    centered_G = rewards_G - rewards_G.mean()
    if mode == "drgrpo":
        return centered_G
    if mode == "grpo":
        return centered_G / (rewards_G.std(correction=0) + eps)
    raise ValueError(f"unknown advantage mode {mode!r} (expected 'grpo' or 'drgrpo')")


def _aggregate(values_B_T: torch.Tensor, mask_B_T: torch.Tensor, aggregation: str) -> torch.Tensor:
    if aggregation == "token":
        return (values_B_T * mask_B_T).sum() / mask_B_T.sum().clamp(min=1.0)
    if aggregation == "sequence":
        lengths_B = mask_B_T.sum(dim=1)
        per_seq_B = (values_B_T * mask_B_T).sum(dim=1) / lengths_B.clamp(min=1.0)
        has_tokens_B = lengths_B > 0
        n = has_tokens_B.sum().clamp(min=1)
        return (per_seq_B * has_tokens_B).sum() / n
    raise ValueError(f"unknown aggregation {aggregation!r} (expected 'token' or 'sequence')")


def policy_loss(
    logprobs_B_T: torch.Tensor,
    prox_logprobs_B_T: torch.Tensor,
    behav_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    clip_eps: float,
    tis_cap: float,
    aggregation: Literal["token", "sequence"] = "token",
    kl_coef: float = 0.0,
    ref_logprobs_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss with truncated importance weights and an optional k3 KL term.

    Returns (loss, stats). Only `logprobs_B_T` carries gradient; prox, behav and ref are treated as
    constants. Padded positions (mask 0) may hold any finite or non-finite value.
    Stats (over masked tokens): `clip_frac` share of tokens whose gradient the clip zeroes,
    `tis_mean` mean truncated weight, `tis_trunc_frac` share of weights cut at the cap, `kl` mean k3
    (0 without a reference), `ratio_mean` mean pi_theta / pi_prox.
    """
    if kl_coef > 0 and ref_logprobs_B_T is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_B_T")
    m = mask_B_T.to(logprobs_B_T.dtype)
    valid = m > 0
    zero = torch.zeros((), dtype=logprobs_B_T.dtype, device=logprobs_B_T.device)
    # Padding may hold garbage: zero it before exp() so inf * 0 never makes a NaN.
    logp = torch.where(valid, logprobs_B_T, zero)
    prox = torch.where(valid, prox_logprobs_B_T.detach(), zero)
    behav = torch.where(valid, behav_logprobs_B_T.detach(), zero)
    adv_B_1 = advantages_B.detach().to(logp.dtype).unsqueeze(1)

    ratio = torch.exp(logp - prox)
    raw_w = torch.exp(prox - behav)
    w = raw_w.clamp(max=tis_cap)
    surr_unclipped = ratio * adv_B_1
    surr_clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_B_1
    per_token = -w * torch.minimum(surr_unclipped, surr_clipped)

    kl = zero
    if ref_logprobs_B_T is not None:
        ref = torch.where(valid, ref_logprobs_B_T.detach(), zero)
        log_r = ref - logp
        k3 = torch.exp(log_r) - log_r - 1.0
        kl = (k3 * m).sum() / m.sum().clamp(min=1.0)
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3

    loss = _aggregate(per_token, m, aggregation)

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        clipped = (surr_clipped < surr_unclipped) & valid
        stats = {
            "clip_frac": float(clipped.sum() / n),
            "tis_mean": float((w * m).sum() / n),
            "tis_trunc_frac": float(((raw_w > tis_cap) & valid).sum() / n),
            "kl": float(kl),
            "ratio_mean": float((ratio * m).sum() / n),
        }
    return loss, stats
