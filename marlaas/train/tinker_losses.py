"""The built-in loss functions of the Tinker protocol, as pure functions over one datum's tokens.

A Tinker `forward_backward` names a loss and sends, per datum, per-token inputs aligned with the
model input (position i predicts token i + 1 of the full sequence). With `target_logprobs` the
log-probabilities the trained policy gives `target_tokens` (the only tensor that carries gradient),
`sampling_logprobs` the sampler's (Tinker's input "logprobs"), `A` the advantages and `w` the weights,
each loss is a SUM over tokens (Tinker does not normalise: the client scales advantages or weights):

    cross_entropy        L = -sum_t w_t * target_logprobs_t
    importance_sampling  L = -sum_t r_t * A_t,            r_t = exp(target_logprobs_t - sampling_logprobs_t)
    ppo                  L = -sum_t min(r_t * A_t, clip(r_t, lo, hi) * A_t)
    cispo                L = -sum_t sg(clip(r_t, lo, hi)) * target_logprobs_t * A_t      (sg: no gradient)
    dro                  L = -sum_t (target_logprobs_t * A_t - beta/2 * (target_logprobs_t - sampling_logprobs_t)^2)
    gspo                 L = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t),
                             s_t = sg(s) * exp(target_logprobs_t - sg(target_logprobs_t)),
                             s = exp(mean over M of (sg(target_logprobs) - sampling_logprobs))
    stable_reinforce     L = -sum_t m_t * sg(min(r_t, c)) * A_t * target_logprobs_t
                             + kl_coeff * sum_t m_t * (r_t - 1 - log r_t)

`lo` / `hi` are the loss config's `clip_low_threshold` / `clip_high_threshold` (default 0.8 / 1.2,
epsilon 0.2 either side) for ppo, cispo and gspo. The other config keys, as the SDK sends them in
`loss_fn_config`:
- dro: `beta` (default 0.05, the SDK docs' example; the docs publish no default).
- gspo: GSPO-token as the SDK docs define it; M is the positions the loss input `sequence_ratio_mask`
  marks (non-zero), every position without one (the cookbook's rl_loop sends it).
- stable_reinforce: the SDK names the loss and its config key `kl_coeff` (default 0) but does not
  publish its formula. marlaas serves it as truncated-importance-weighted REINFORCE: each token's weight
  is the stop-gradient ratio capped at `c` = `clip_high_threshold` (default 2.0), so on-policy data
  (r = 1) gives exactly REINFORCE's gradient -A * grad(log p) and stale tokens never weigh more than c;
  `kl_coeff` adds the k3 estimate of KL(sampler || learner) (zero, with zero gradient, on-policy). `m`
  is the loss input `mask` (the sampled positions) when given, else every position; prompt positions
  the cookbook pads with advantage 0 add nothing to the first term.
Each function returns (loss, per-token elementwise loss) so the caller can report both; the tests
check hand-computed values (tests/unit/test_tinker_losses.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

CLIP_LOW = 0.8
CLIP_HIGH = 1.2
DRO_BETA = 0.05
STABLE_CAP = 2.0

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], tuple[torch.Tensor, torch.Tensor]]
"""(target_logprobs_T, inputs by name, config) -> (scalar loss, elementwise loss_T)."""


def _need(inputs: Mapping[str, torch.Tensor], name: str, loss: str, like: torch.Tensor) -> torch.Tensor:
    if name not in inputs:
        raise ValueError(f"loss {loss!r} needs the loss_fn_input {name!r} (got {', '.join(sorted(inputs)) or 'none'})")
    t = inputs[name].to(dtype=like.dtype, device=like.device).reshape(-1)
    if t.shape != like.shape:
        raise ValueError(f"loss {loss!r}: input {name!r} has {t.numel()} values for {like.numel()} target tokens")
    return t


def _clip(config: Mapping[str, float]) -> tuple[float, float]:
    lo = float(config.get("clip_low_threshold", CLIP_LOW))
    hi = float(config.get("clip_high_threshold", CLIP_HIGH))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"clip thresholds must satisfy 0 <= low <= 1 <= high, got low={lo}, high={hi}")
    return lo, hi


def cross_entropy(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                  config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t w_t * target_logprobs_t (weights default to 1)."""
    w = (_need(inputs, "weights", "cross_entropy", target_logprobs) if "weights" in inputs
         else torch.ones_like(target_logprobs))
    elem = -w * target_logprobs
    return elem.sum(), elem


def importance_sampling(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                        config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t exp(target - sampling) * A_t."""
    behav = _need(inputs, "logprobs", "importance_sampling", target_logprobs)
    adv = _need(inputs, "advantages", "importance_sampling", target_logprobs)
    elem = -torch.exp(target_logprobs - behav) * adv
    return elem.sum(), elem


def ppo(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)."""
    lo, hi = _clip(config or {})
    behav = _need(inputs, "logprobs", "ppo", target_logprobs)
    adv = _need(inputs, "advantages", "ppo", target_logprobs)
    ratio = torch.exp(target_logprobs - behav)
    elem = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    return elem.sum(), elem


def cispo(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t sg(clip(r_t, lo, hi)) * target_logprobs_t * A_t."""
    lo, hi = _clip(config or {})
    behav = _need(inputs, "logprobs", "cispo", target_logprobs)
    adv = _need(inputs, "advantages", "cispo", target_logprobs)
    weight = torch.exp(target_logprobs - behav).clamp(lo, hi).detach()
    elem = -weight * target_logprobs * adv
    return elem.sum(), elem


def dro(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t (target_t * A_t - beta/2 * (target_t - sampling_t)^2)."""
    beta = float((config or {}).get("beta", DRO_BETA))
    if beta < 0:
        raise ValueError(f"loss 'dro': beta must be >= 0, got {beta}")
    behav = _need(inputs, "logprobs", "dro", target_logprobs)
    adv = _need(inputs, "advantages", "dro", target_logprobs)
    elem = -(target_logprobs * adv - 0.5 * beta * (target_logprobs - behav) ** 2)
    return elem.sum(), elem


def gspo(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
         config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token: every token carries the sequence ratio's value (the geometric mean of the ratios
    over the masked positions) with its own log-probability's gradient, clipped like ppo."""
    lo, hi = _clip(config or {})
    behav = _need(inputs, "logprobs", "gspo", target_logprobs)
    adv = _need(inputs, "advantages", "gspo", target_logprobs)
    mask = (_need(inputs, "sequence_ratio_mask", "gspo", target_logprobs) != 0 if "sequence_ratio_mask" in inputs
            else torch.ones_like(target_logprobs, dtype=torch.bool))
    if not bool(mask.any()):
        raise ValueError("loss 'gspo': sequence_ratio_mask marks no token")
    detached = target_logprobs.detach()
    log_ratio = (detached - behav)[mask].mean()
    ratio = torch.exp(log_ratio + target_logprobs - detached)
    elem = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    return elem.sum(), elem


def stable_reinforce(target_logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                     config: Mapping[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_t m_t sg(min(r_t, c)) A_t target_t + kl_coeff * sum_t m_t (r_t - 1 - log r_t)."""
    config = config or {}
    cap = float(config.get("clip_high_threshold", STABLE_CAP))
    kl = float(config.get("kl_coeff", 0.0))
    if not cap >= 1.0 or kl < 0:
        raise ValueError(f"loss 'stable_reinforce': needs clip_high_threshold >= 1 and kl_coeff >= 0, "
                         f"got {cap} and {kl}")
    behav = _need(inputs, "logprobs", "stable_reinforce", target_logprobs)
    adv = _need(inputs, "advantages", "stable_reinforce", target_logprobs)
    mask = (_need(inputs, "mask", "stable_reinforce", target_logprobs) if "mask" in inputs
            else torch.ones_like(target_logprobs))
    log_ratio = target_logprobs - behav
    weight = torch.exp(log_ratio.detach()).clamp(max=cap)
    elem = -mask * weight * adv * target_logprobs
    if kl:
        elem = elem + kl * mask * (torch.exp(log_ratio) - 1.0 - log_ratio)
    return elem.sum(), elem


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}


def loss_fn(name: str) -> LossFn:
    """The loss of this name; ValueError naming the supported ones otherwise."""
    if name not in LOSSES:
        raise ValueError(f"loss_fn {name!r} is not supported here (supported: {', '.join(LOSSES)})")
    return LOSSES[name]
