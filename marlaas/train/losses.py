"""Objective variants: importance weights and proximal policies, one pure function each.

`marlaas.train.rl` holds the advantages and the loss; this module holds the pieces a job picks in its
`rl` spec (`marlaas.spec.RLSpec`). Every function maps tensors to tensors, treats its inputs as
constants (no gradient flows through a weight or a proximal log-prob) and is unit-tested on
hand-computed values (tests/unit/test_losses.py). Shapes: `_B_T` per (sequence, completion token),
`_B` per sequence; `mask_B_T` is 1 on real completion tokens, 0 on padding.

Importance weights (correct for the gap between the proximal policy and the sampler)
------------------------------------------------------------------------------------
With the per-token log-ratio  l_it = log pi_prox(y_it) - log pi_behav(y_it)  and cap C >= 1:

    token level      r_it = exp(l_it)
    sequence level   r_i  = exp( sum_t m_it l_it / sum_t m_it )      GEOMETRIC mean of the token
                     ratios (length-normalised, as GSPO's sequence ratio), the same for every token
                     of sequence i; a sequence without tokens gets r_i = 1.

    truncate   w = min(r, C)                          (TIS: Yao et al., 2025)
    mask       w = r if 1/C <= r <= C else 0          (masked IS / IcePop-style veto: the token, or
                                                       the whole sequence, contributes nothing)
    none       w = 1

A masked token stays in the loss normaliser (its weight is 0, not its mask), so masking lowers
the loss's scale instead of re-weighting the tokens that remain. We use the geometric mean, not
the product of the token ratios, at sequence level: the product of T ratios explodes or vanishes
with length, so a cap or a [1/C, C] band on it would hit almost every long sequence.

Proximal policy (the trust-region anchor of decoupled PPO)
----------------------------------------------------------
    recompute   log pi_prox = log pi_theta at the start of the step (no gradient)
    a3po        log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav)     (detached)
    ppo         log pi_prox = log pi_behav   (coupled PPO/GRPO: weight 1, the clip is the whole
                correction; equal to a3po with alpha = 0)

A-3PO (Li, Wu & Shen, 2025, "A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware
Proximal Policy Approximation", arXiv:2512.06547; AReaL's `prox_logp_method = "loglinear"`,
docs/algorithms/prox_approx.md) interpolates in log space between the cached behaviour log-prob
and the current one instead of running the extra no-grad forward pass that computes pi_prox.
Where we depart:
- The paper sets alpha per token from versions, alpha = (v_prox - v_behav) / (v_theta - v_behav);
  here alpha is one constant of the job's spec (0.5 = the paper's value for staleness 1).
  Our alpha weights pi_theta as the paper's does: alpha = 1 gives pi_prox = pi_theta (recompute),
  alpha = 0 gives pi_prox = pi_behav (coupled PPO).
- Our trainer takes one optimiser step per batch, so pi_theta at the step start IS pi_prox and
  "recompute" is read off the gradient forward pass for free (an extra pass runs only when LoRA
  dropout makes the training pass differ from the policy; see `marlaas.train.engine`). With
  one step, a3po is therefore not an approximation of recompute but a different anchor: in value
  the ratio is exp((1 - alpha)(log pi_theta - log pi_behav)) and the weight exp(alpha * (...)),
  so the clip binds on tokens the sampler and the trainer disagree on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

IMPORTANCE_KINDS = ("truncate", "mask", "none")
LEVELS = ("token", "sequence")


def sequence_log_ratio(log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Mean log-ratio per sequence over its real tokens (0 for a sequence without tokens): the log
    of the geometric-mean ratio r_i."""
    m = mask_B_T.to(log_ratio_B_T.dtype)
    lengths_B = m.sum(dim=1)
    return (log_ratio_B_T * m).sum(dim=1) / lengths_B.clamp(min=1.0)


def truncate_token(log_ratio_B_T: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_it = min(exp(l_it), C). Returns (weights_B_T, cut_B_T: True where the cap bit)."""
    raw = torch.exp(log_ratio_B_T)
    return raw.clamp(max=cap), raw > cap


def mask_token(log_ratio_B_T: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_it = exp(l_it) if 1/C <= exp(l_it) <= C else 0. Returns (weights_B_T, cut_B_T: True where masked)."""
    raw = torch.exp(log_ratio_B_T)
    out = (raw > cap) | (raw < 1.0 / cap)  # NaN stays NaN: the engine flags a non-finite step
    return torch.where(out, torch.zeros_like(raw), raw), out


def truncate_sequence(
    log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """w_it = min(r_i, C) with r_i the geometric-mean ratio of sequence i, broadcast over its tokens."""
    w_B, cut_B = truncate_token(sequence_log_ratio(log_ratio_B_T, mask_B_T), cap)
    return w_B.unsqueeze(1).expand_as(log_ratio_B_T), cut_B.unsqueeze(1).expand_as(log_ratio_B_T)


def mask_sequence(log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_it = r_i if 1/C <= r_i <= C else 0: a sequence whose geometric-mean ratio leaves the band
    is dropped whole."""
    w_B, cut_B = mask_token(sequence_log_ratio(log_ratio_B_T, mask_B_T), cap)
    return w_B.unsqueeze(1).expand_as(log_ratio_B_T), cut_B.unsqueeze(1).expand_as(log_ratio_B_T)


WeightFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(log_ratio_B_T, mask_B_T) -> (weights_B_T, cut_B_T): one importance-weight variant, bound once."""
ProxFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""(logp_B_T, behav_B_T, recomputed_B_T or None) -> log pi_prox (detached): one proximal policy, bound once."""


def _no_weights(log_ratio_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones_like(log_ratio_B_T), torch.zeros_like(log_ratio_B_T, dtype=torch.bool)


def weight_fn(kind: str = "truncate", level: str = "token", cap: float = 2.0) -> WeightFn:
    """The importance-weight function of one variant, with its arguments checked once."""
    if kind not in IMPORTANCE_KINDS:
        raise ValueError(f"unknown importance kind {kind!r} (expected one of {', '.join(IMPORTANCE_KINDS)})")
    if level not in LEVELS:
        raise ValueError(f"unknown importance level {level!r} (expected 'token' or 'sequence')")
    if not cap >= 1.0:
        raise ValueError(f"importance cap must be >= 1, got {cap}")
    if kind == "none":
        return _no_weights
    if level == "token":
        fn = truncate_token if kind == "truncate" else mask_token
        return lambda log_ratio, mask: fn(log_ratio, cap)
    fn = truncate_sequence if kind == "truncate" else mask_sequence
    return lambda log_ratio, mask: fn(log_ratio, mask, cap)


def prox_fn(kind: str, alpha: float = 0.5) -> ProxFn:
    """The proximal-policy function of one mode ('recompute', 'a3po', 'ppo'), checked once."""
    if kind == "recompute":
        return lambda logp, behav, recomputed: (recomputed if recomputed is not None else logp).detach()
    if kind == "a3po":
        if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
            raise ValueError(f"a3po alpha must be in [0, 1], got {alpha}")
        return lambda logp, behav, recomputed: prox_a3po(logp, behav, alpha)
    if kind == "ppo":
        return lambda logp, behav, recomputed: behav.detach()
    raise ValueError(f"unknown proximal policy {kind!r} (expected 'recompute', 'a3po' or 'ppo')")


def importance_weights(
    prox_B_T: torch.Tensor,
    behav_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    kind: str = "truncate",
    level: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight pi_prox / pi_behav of each token under one variant (module docstring).

    Inputs are detached; padded positions should already hold finite values (the caller zeroes
    them). Returns (weights_B_T, cut_B_T) where cut marks tokens whose weight was truncated or masked.
    """
    return weight_fn(kind, level, cap)((prox_B_T - behav_B_T).detach(), mask_B_T)


def prox_a3po(logp_B_T: torch.Tensor, behav_B_T: torch.Tensor, alpha: float) -> torch.Tensor:
    """A-3PO proximal log-probs: log pi_behav + alpha * (log pi_theta - log pi_behav), detached."""
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"a3po alpha must be in [0, 1], got {alpha}")
    behav = behav_B_T.detach()
    return behav + alpha * (logp_B_T.detach() - behav)


def proximal_logprobs(
    kind: str,
    logp_B_T: torch.Tensor,
    behav_B_T: torch.Tensor,
    alpha: float = 0.5,
    recomputed_B_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """log pi_prox for one proximal mode: 'recompute' (the given recomputed values, else the
    detached current log-probs, exact with one optimiser step per batch), 'a3po' or 'ppo'."""
    return prox_fn(kind, alpha)(logp_B_T, behav_B_T, recomputed_B_T)
