"""RL maths: group-relative advantages and the decoupled PPO policy loss (pure torch).

No model here: every function maps tensors to tensors, so each formula is unit-tested on
hand-computed values (tests/unit/test_rl.py, tests/unit/test_losses.py). The selectable pieces (importance
weights, proximal policies) live in `marlaas.train.losses`; `spec_loss` wires a job's `RLSpec` to
them; `job_loss` is a job's whole step loss (with its normaliser) and `needs_prox_pass` says when
the step needs a separate pi_prox pass. Shape suffixes: `_G` one value per group member, `_B` per
sequence of a batch, `_B_T` per (sequence, completion token).

Advantages (one group = the G completions sampled for one prompt, rewards r_1..r_G)
-----------------------------------------------------------------------------------
    grpo:    A_i = (r_i - mean(r)) / (std(r) + eps)      std = POPULATION std (divide by G)
    drgrpo:  A_i =  r_i - mean(r)

Every token of completion i gets A_i. A group whose rewards are all equal gets A = 0 in both modes.

Policy loss (per completion token t of sequence i; all log-probs are of the sampled token)
------------------------------------------------------------------------------------------
    ratio_it = exp(logp_it - prox_it)                         pi_theta / pi_prox (carries the gradient)
    w_it     = importance weight of pi_prox / pi_behav        (detached; truncate = min(., C), mask,
                                                               none; token or sequence level)
    obj_it   = w_it * min(ratio_it * A_i, clip(ratio_it, 1 - eps, 1 + eps) * A_i)
    k3_it    = exp(ref_it - logp_it) - (ref_it - logp_it) - 1     (only when kl_coef > 0)
    l_it     = -obj_it + kl_coef * k3_it

    token:    loss = sum_{i,t} m_it l_it / sum_{i,t} m_it                 (one mean over all tokens)
    sequence: loss = mean_i [ sum_t m_it l_it / sum_t m_it ]              (over sequences with >= 1 token)
    constant: loss = sum_{i,t} m_it l_it / K                              (K = max_new_tokens x sequences,
                                                                           Dr. GRPO's constant normaliser)

Here `behav` is the log-prob under which the engine actually sampled (adapter version v at the
sampling temperature), `prox` the proximal policy (recomputed = the trainer's weights at the
start of this step, A-3PO interpolation, or behav itself for coupled PPO; see
`marlaas.train.losses`) and `ref` the base model (the same network with the adapter disabled).

Where this departs from the papers
----------------------------------
- GRPO (Shao et al., 2024, DeepSeekMath): the paper's loss is our `sequence` aggregation with
  pi_prox = pi_behav (loss kind `ppo`) and the KL to a separate reference copy. Our reference is
  the base with the adapter disabled (no second model). The paper leaves the std unspecified; TRL
  uses the unbiased sample std; we use the population std, so for G = 4 our advantages are
  sqrt(4/3) larger in magnitude than TRL's.
- Dr. GRPO (Liu et al., 2025): the paper drops the std division AND the per-sequence length
  normalisation, dividing each sequence's token sum by a constant generation budget and averaging
  over sequences. That is `advantage = "drgrpo"` with `aggregation = "constant"` here, with
  K = max_new_tokens x (sequences in the batch). `token` aggregation (DAPO-style, divide by the
  batch's token count) also removes the per-sequence length bias but its scale varies by batch.
- Decoupled PPO (AReaL, Fu et al., 2025): same objective, but AReaL leaves pi_prox / pi_behav
  uncapped (or masks tokens over a cap). Our default truncates it at C (truncated importance
  sampling, Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"), which bounds the variance from both staleness and sampler/trainer numeric mismatch;
  TIS's own weight is pi_trainer / pi_sampler, which is our w when pi_prox is the trainer's
  current policy. `mask` (token or sequence) is the veto variant.
- The trainer takes ONE optimiser step per batch, so with `recompute` pi_prox = pi_theta at the
  step start: the ratio is exactly 1 in value (its gradient is grad logp), the clip never binds and
  the loss reduces to -w A logp per token. The clip binds with `a3po` (alpha < 1) and `ppo`, whose
  anchor lies towards pi_behav, and for callers that take several steps per batch.
- The k3 estimator is unbiased for KL(pi_theta || pi_ref) only when tokens are sampled from
  pi_theta; here they come from pi_behav and we do not reweight it (as GRPO implementations do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from marlaas.train import losses


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


AGGREGATIONS = ("token", "sequence", "constant")


def aggregate(
    values_B_T: torch.Tensor, mask_B_T: torch.Tensor, aggregation: str, constant_norm: float | None = None,
    total: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to one scalar: 'token', 'sequence' or 'constant' (module docstring).

    `total` replaces the normaliser read off this batch ('token': its tokens, 'sequence': its
    sequences with tokens) by one counted over a larger batch that these rows are a part of: the
    losses of the parts then sum to the whole batch's loss."""
    if aggregation == "token":
        n = mask_B_T.sum().clamp(min=1.0) if total is None else max(float(total), 1.0)
        return (values_B_T * mask_B_T).sum() / n
    if aggregation == "sequence":
        lengths_B = mask_B_T.sum(dim=1)
        per_seq_B = (values_B_T * mask_B_T).sum(dim=1) / lengths_B.clamp(min=1.0)
        has_tokens_B = lengths_B > 0
        n = has_tokens_B.sum().clamp(min=1) if total is None else max(float(total), 1.0)
        return (per_seq_B * has_tokens_B).sum() / n
    if aggregation == "constant":
        if constant_norm is None or not constant_norm > 0:
            raise ValueError(f"'constant' aggregation needs a positive constant_norm, got {constant_norm}")
        return (values_B_T * mask_B_T).sum() / constant_norm
    raise ValueError(f"unknown aggregation {aggregation!r} (expected one of {', '.join(AGGREGATIONS)})")


def policy_loss(
    logprobs_B_T: torch.Tensor,
    prox_logprobs_B_T: torch.Tensor,
    behav_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    clip_eps: float,
    tis_cap: float = 2.0,
    aggregation: Literal["token", "sequence", "constant"] = "token",
    kl_coef: float = 0.0,
    ref_logprobs_B_T: torch.Tensor | None = None,
    *,
    importance: Literal["truncate", "mask", "none"] = "truncate",
    level: Literal["token", "sequence"] = "token",
    constant_norm: float | None = None,
    weights: losses.WeightFn | None = None,
    total: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss with importance weights (cap `tis_cap`) and an optional k3 KL term.

    Returns (loss, stats). Only `logprobs_B_T` carries gradient; prox, behav and ref are treated as
    constants. Padded positions (mask 0) may hold any finite or non-finite value.
    Stats (over masked tokens): `clip_frac` share of tokens whose gradient the clip zeroes,
    `tis_mean` mean importance weight, `tis_trunc_frac` share of weights cut at the cap (truncate)
    or zeroed (mask), `kl` mean k3 (0 without a reference), `ratio_mean` mean pi_theta / pi_prox.
    `weights`: the importance-weight function already bound (`losses.weight_fn`, as `make_loss` does);
    without it, `importance`, `level` and `tis_cap` choose one here. `total`: the normaliser of the
    whole batch these rows belong to (`aggregate`).
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
    weights = weights or losses.weight_fn(importance, level, tis_cap)
    w, cut = weights((prox - behav).detach(), m)
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

    loss = aggregate(per_token, m, aggregation, constant_norm, total)

    with torch.no_grad():
        n = m.sum().clamp(min=1.0)
        clipped = (surr_clipped < surr_unclipped) & valid
        stats = {
            "clip_frac": float(clipped.sum() / n),
            "tis_mean": float((w * m).sum() / n),
            "tis_trunc_frac": float((cut & valid).sum() / n),
            "kl": float(kl),
            "ratio_mean": float((ratio * m).sum() / n),
        }
    return loss, stats


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def make_loss(cfg) -> LossFn:
    """The loss a job's `RLSpec` selects, its pieces chosen ONCE from the config's types: the proximal
    policy from the loss type (coupled PPO anchors at pi_behav; decoupled PPO recomputes pi_prox or
    interpolates it, A-3PO), the importance weights from the importance type (truncate / mask / none,
    per token or sequence, with its cap). The returned function takes
    (logprobs_B_T, behav_logprobs_B_T, advantages_B, mask_B_T, *, recomputed_prox_B_T, ref_logprobs_B_T,
    constant_norm, total) and applies `policy_loss` with the clip, aggregation and KL of the config."""
    loss_cfg, imp = cfg.loss, cfg.importance
    prox = losses.prox_fn("ppo") if loss_cfg.kind == "ppo" else losses.prox_fn(
        loss_cfg.prox, loss_cfg.alpha if loss_cfg.prox == "a3po" else 0.5)
    weights = losses.weight_fn(imp.kind, getattr(imp, "level", "token"), getattr(imp, "cap", 1.0))

    def loss(logprobs_B_T, behav_logprobs_B_T, advantages_B, mask_B_T, *, recomputed_prox_B_T=None,
             ref_logprobs_B_T=None, constant_norm=None, total=None):
        prox_B_T = prox(logprobs_B_T, behav_logprobs_B_T, recomputed_prox_B_T)
        return policy_loss(
            logprobs_B_T, prox_B_T, behav_logprobs_B_T, advantages_B, mask_B_T, cfg.clip_eps,
            aggregation=cfg.aggregation, kl_coef=cfg.kl_coef, ref_logprobs_B_T=ref_logprobs_B_T,
            constant_norm=constant_norm, weights=weights, total=total,
        )  # fmt: skip

    return loss


def spec_loss(
    cfg,
    logprobs_B_T: torch.Tensor,
    behav_logprobs_B_T: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_T: torch.Tensor,
    *,
    recomputed_prox_B_T: torch.Tensor | None = None,
    ref_logprobs_B_T: torch.Tensor | None = None,
    constant_norm: float | None = None,
    total: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`make_loss(cfg)` applied once (callers that take many steps keep the `make_loss` function)."""
    return make_loss(cfg)(logprobs_B_T, behav_logprobs_B_T, advantages_B, mask_B_T,
                          recomputed_prox_B_T=recomputed_prox_B_T, ref_logprobs_B_T=ref_logprobs_B_T,
                          constant_norm=constant_norm, total=total)


def needs_prox_pass(spec) -> bool:
    """Whether a job's step runs a separate no-grad forward for pi_prox: only prox = 'recompute' with
    LoRA dropout > 0. Without dropout the gradient pass's detached log-probs ARE pi_prox (one optimiser
    step per batch), and 'a3po' / 'ppo' never need one."""
    loss = spec.rl.loss
    return loss.kind == "decoupled_ppo" and loss.prox == "recompute" and spec.lora.dropout > 0


def job_loss(
    spec,
    samples: list,
    kept: list,
    logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    behav_B_T: torch.Tensor,
    ref_B_T: torch.Tensor | None = None,
    prox_B_T: torch.Tensor | None = None,
    rows: list | None = None,
) -> tuple[torch.Tensor, dict]:
    """One job's step loss over `rows` (default: all of `kept`; the batch's tensors), as its `rl` spec
    selects.

    `samples` are the step's rows (objects with `advantage`, `completion_ids`, `n_actions`), `kept` the
    ones run through the model, `rows` the kept rows these tensors hold. Normalisers, counted over
    whole lists so that the losses of any split of `kept` into `rows` sum to the loss over all of it
    (the trainer's micro-batches): 'token' divides by the tokens (`n_actions`) and 'sequence' by the
    sequences with >= 1 token of `kept`, or of `samples` when `drop_zero_advantage` is off (skipped
    rows still count: the loss equals the full batch's); 'constant' divides by K = max_new_tokens x
    len(samples) (Dr. GRPO's constant: independent of lengths, every row handed to the trainer counts).
    `prox_B_T` is a recomputed pi_prox (see `needs_prox_pass`); None reads it off `logp_B_T`.
    """
    cfg = spec.rl
    rows = kept if rows is None else rows
    counted = kept if cfg.drop_zero_advantage else samples
    total = (sum(s.n_actions for s in counted) if cfg.aggregation == "token"
             else sum(1 for s in counted if s.n_actions > 0))
    adv_B = torch.tensor([s.advantage for s in rows], dtype=torch.float32, device=logp_B_T.device)
    return spec_loss(
        cfg, logp_B_T, behav_B_T, adv_B, mask_B_T, recomputed_prox_B_T=prox_B_T, ref_logprobs_B_T=ref_B_T,
        constant_norm=float(spec.max_new_tokens * max(len(samples), 1)), total=total,
    )  # fmt: skip
