"""The training engine's records: the rows it trains on, persisted states, optimiser settings, and
what a caller's loss function sees (`Forward`). Plain dataclasses over torch tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from marlaas.types import AdapterBlob


@dataclass
class TrainSample:
    """One row to train on: a prompt and the completion tokens whose log-probs the loss reads.

    `completion_ids` include the EOS token when one was generated; `behav_logprobs` holds one
    sampling log-prob per completion token (log_softmax(logits / temperature) of the sampler).
    `loss_mask` (None = all ones) marks the tokens the policy is trained on: a tool episode's
    tool-result tokens are context, not actions (mask 0; their behaviour log-prob is unused).
    `prompt_ids` (token ids) replace the tokenized `prompt` when given; `targets` (one per completion
    position) replace the completion tokens as the tokens whose log-probs are read.
    """

    prompt: str
    completion_ids: list[int]
    behav_logprobs: list[float]
    advantage: float
    loss_mask: list[int] | None = None
    prompt_ids: list[int] | None = None
    targets: list[int] | None = None

    @property
    def n_actions(self) -> int:
        """Tokens the loss counts (mask 1)."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))


@dataclass
class TrainState:
    """What a published version persists so any trainer can continue from it (optimizer None: fresh
    Adam moments)."""

    version: int
    adapter: AdapterBlob
    optimizer: bytes | None


@dataclass(frozen=True)
class AdamParams:
    """One optimiser step's hyperparameters (AdamW, decoupled weight decay); clip > 0 clips the
    global gradient norm first."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 0.0


@dataclass
class Forward:
    """What a loss sees of one key's rows: log-probs (carrying the gradient in a backward pass) and the
    batch's mask, behaviour log-probs and, when asked, the reference (adapter disabled) and proximal
    (eval-mode, no-grad) log-probs. All [B, T], completions right-aligned."""

    samples: list[TrainSample]
    logp_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    behav_B_T: torch.Tensor
    ref_B_T: torch.Tensor | None = None
    prox_B_T: torch.Tensor | None = None
    index: list[int] | None = None
    """Where these rows stand in the part's samples when they are one micro-batch of it (None: all)."""

    def indices(self) -> list[int]:
        """The rows' positions in the part's samples."""
        return list(range(len(self.samples))) if self.index is None else self.index

    def rows(self) -> list[torch.Tensor]:
        """Each sample's log-probs over its own completion positions."""
        T = self.logp_B_T.shape[1]
        return [self.logp_B_T[i, T - len(s.completion_ids):] for i, s in enumerate(self.samples)]


LossFn = Callable[[Forward], tuple[torch.Tensor, dict]]


@dataclass
class Part:
    """One key's share of a `forward_backward_many` call."""

    key: str
    samples: list[TrainSample]
    loss: LossFn
    temperature: float = 1.0
    ref: bool = False  # also compute the reference log-probs (every adapter disabled)
    prox: bool = False  # also compute no-grad eval-mode log-probs (pi_prox under LoRA dropout)
    additive: bool = False
    """The loss over all rows is the sum of its values over any consecutive split of them (each call's
    Forward holds those rows, `Forward.index` says which; its stats are per-token means): the engine
    may then run the rows in micro-batches (`marlaas.train.micro`)."""


@dataclass
class Result:
    """A key's loss value and stats, and its forward with detached log-probs."""

    loss: float
    stats: dict
    forward: Forward = field(repr=False)
