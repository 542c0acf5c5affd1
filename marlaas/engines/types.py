"""Plain data passed between the stations and the engines (no torch types cross this boundary).

An adapter version is identified by (job_id, version). Version 0 of every job is the base model
itself: a fresh LoRA adapter has B = 0, so it computes exactly the base; engines serve version 0
with no adapter at all, and the trainer creates the adapter on the job's first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdapterRef:
    """One published adapter version of one job."""

    job_id: str
    version: int

    @property
    def name(self) -> str:
        """A name safe for PEFT module dicts and vLLM LoRA names."""
        return f"{self.job_id}@v{self.version}"


@dataclass
class AdapterBlob:
    """A PEFT adapter as bytes: `config` is adapter_config.json's dict, `weights` a safetensors file."""

    config: dict
    weights: bytes


@dataclass
class GenRequest:
    """One prompt to sample `n` completions for, with one adapter version (None = base)."""

    key: str
    prompt: str
    adapter: AdapterRef | None
    n: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 8
    greedy: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: a completion also ends at any of them (kept in its tokens and text; `finished`
    stays False). Each must be one token of the tokenizer (both engines stop on token ids)."""


@dataclass
class Completion:
    """One sampled completion: token ids, the sampling log-prob of each token, and its text.

    `logprobs` are log pi(token) under the distribution actually sampled from, i.e.
    log_softmax(logits / temperature) (or of the raw logits when greedy).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool = True


@dataclass
class GenResult:
    key: str
    completions: list[Completion] = field(default_factory=list)
