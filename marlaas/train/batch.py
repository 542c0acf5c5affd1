"""A training pass's tensors from its rows: prompts left-padded so every completion is right-aligned
in the same T columns, and the log-probs of the targets read off the logits. Pure torch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from marlaas.train.records import TrainSample


def gather(logits_B_L_V: torch.Tensor, targets_B_T: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs (at `temperature`) of the targets: the last T logit positions predict the T columns."""
    T = targets_B_T.shape[1]
    lg = logits_B_L_V[:, logits_B_L_V.shape[1] - T:, :].float() / temperature
    return torch.log_softmax(lg, dim=-1).gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)


def build_batch(samples: list[TrainSample], ids: Callable[[TrainSample], list[int]], pad_id: int,
                device: torch.device):
    """Left-padded input ids, attention mask, positions; right-aligned targets, mask, behaviour
    log-probs; T. `ids(sample)` gives a sample's prompt token ids."""
    seqs, lens = [], []
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        for what, vals in (("logprobs", s.behav_logprobs), ("mask values", s.loss_mask), ("targets", s.targets)):
            if vals is not None and len(vals) != n:
                raise ValueError(f"sample {i}: {n} completion tokens but {len(vals)} {what}")
        seqs.append(ids(s) + list(s.completion_ids))
        lens.append(n)
    B, L, T = len(seqs), max(map(len, seqs)), max(lens)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask_B_T, behav_B_T = torch.zeros((B, T)), torch.zeros((B, T))
    for i, seq in enumerate(seqs):
        input_ids[i, L - len(seq):] = torch.tensor(seq)
        attn[i, L - len(seq):] = 1
    targets_B_T = input_ids[:, L - T:].clone()
    for i, (s, n) in enumerate(zip(samples, lens)):
        if n:
            m = s.loss_mask
            mask_B_T[i, T - n:] = 1 if m is None else torch.tensor(m, dtype=torch.float32)
            behav_B_T[i, T - n:] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
            if s.targets is not None:
                targets_B_T[i, T - n:] = torch.tensor(s.targets, dtype=torch.long)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return (input_ids.to(device), attn.to(device), positions.to(device), targets_B_T.to(device),
            mask_B_T.to(device), behav_B_T.to(device), T)
