"""The work vocabulary: plain data passed between the stations, the store and the engines.

No torch types cross this boundary; everything here is stdlib only (pure).

An adapter version is identified by (job_id, version). Version 0 of every job is the base model
itself: a fresh LoRA adapter has B = 0, so it computes exactly the base; engines serve version 0
with no adapter at all, and the trainer creates the adapter on the job's first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple, NotRequired, TypedDict


class ItemKind(StrEnum):
    """A work item's kind. A group of a job goes generate (GEN) -> verify (VER), and a tool episode's
    next model turn is CONT; an evaluation of a version goes EVAL -> EVALVER. StrEnum: the values are
    the wire strings (`kind|job|idx` lease names, Celery messages), so both compare equal."""

    GEN = "gen"
    VER = "ver"
    CONT = "cont"
    EVAL = "eval"
    EVALVER = "evalver"


# Kinds that name the same piece of work at different stages: dropping a job's leases drops them all.
GROUP_KINDS = (ItemKind.GEN.value, ItemKind.VER.value, ItemKind.CONT.value)
EVAL_KINDS = (ItemKind.EVAL.value, ItemKind.EVALVER.value)


class JobStatus(StrEnum):
    """A job's status (stored as its string value)."""

    RUNNING = "running"
    EVALUATING = "evaluating"  # training over, final evaluations pending
    PAUSED = "paused"  # kept whole, not scheduled, until resumed (the HTTP API's pause)
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATUSES = (JobStatus.RUNNING.value, JobStatus.EVALUATING.value)
"""Statuses the scheduler and the stations work on; any other drops the job's work."""
TERMINAL_STATUSES = (JobStatus.DONE.value, JobStatus.FAILED.value, JobStatus.CANCELLED.value)


def item_name(kind: str, job: str, idx: int) -> str:
    """A work item's wire name: 'kind|job|idx' (idx: group index, or version for evaluations)."""
    return f"{kind}|{job}|{idx}"


@lru_cache(maxsize=1 << 16)
def parse_item(name: str | bytes) -> tuple[str, str, int]:
    """'kind|job|idx' -> (kind, job, idx); cached (a tick parses every expired lease's name)."""
    if isinstance(name, bytes):
        name = name.decode()
    kind, job, idx = name.split("|")
    return kind, job, int(idx)


class WorkItem(NamedTuple):
    """One piece of work: its kind, its job and its index (group index, or the version evaluated).

    The one work vocabulary of the scheduler, the tick, the store's leases and the stations. A tuple,
    so a Celery message carries it as a JSON list [kind, job, idx] (`WorkItem.of` reads one back)
    and a lease as its `name`, 'kind|job|idx' (`WorkItem.parse` reads one back)."""

    kind: ItemKind
    job: str
    idx: int

    @property
    def name(self) -> str:
        """The lease name, 'kind|job|idx'."""
        return item_name(self.kind, self.job, self.idx)

    @classmethod
    def parse(cls, name: str | bytes) -> WorkItem:
        """A lease name back to an item; ValueError for a malformed name or an unknown kind."""
        kind, job, idx = parse_item(name)
        return cls(ItemKind(kind), job, idx)

    @classmethod
    def of(cls, wire: list | tuple) -> WorkItem:
        """A Celery message's [kind, job, idx] back to an item; ValueError for an unknown kind."""
        kind, job, idx = wire
        return cls(ItemKind(kind), str(job), int(idx))


def eval_request_key(job: str, version: int, row: int, sampled: bool) -> str:
    """The generation request key of held-out row `row` of the evaluation of (job, version): its greedy
    completion (`sampled` False) or its pass@k samples (True). The one spelling of these keys; they
    start with 'eval|' (`is_eval_request`) and `parse_eval_request` reads one back."""
    return f"{ItemKind.EVAL.value}|{job}|{version}|{row}|{'k' if sampled else 'g'}"


def is_eval_request(key: str) -> bool:
    """Whether a generation request key is an evaluation's (`eval_request_key`)."""
    return key.startswith(ItemKind.EVAL.value + "|")


def parse_eval_request(key: str) -> tuple[str, int, int, bool]:
    """An `eval_request_key` back to (job, version, row, sampled)."""
    _, job, version, row, which = key.split("|")
    return job, int(version), int(row), which == "k"


def eval_versions(steps: int, every: int) -> list[int]:
    """Adapter versions evaluated on the held-out set: 0 (the base), every `every`-th published
    version (every, 2*every, ... < steps; none when every = 0) and the final one, `steps`."""
    mid = range(every, steps, every) if every > 0 else range(0)
    return [0, *mid, steps]


@dataclass(frozen=True)
class AdapterRef:
    """One published adapter version of one job."""

    job_id: str
    version: int

    @property
    def name(self) -> str:
        """A name safe for PEFT module dicts and vLLM LoRA names."""
        return f"{self.job_id}@v{self.version}"


def adapter_for(job_id: str, version: int) -> AdapterRef | None:
    """The adapter that serves (job, version): version 0 is the base itself (a fresh LoRA has B = 0),
    served with no adapter."""
    return AdapterRef(job_id, version) if version > 0 else None


@dataclass
class AdapterBlob:
    """A PEFT adapter as bytes: `config` is adapter_config.json's dict, `weights` a safetensors file."""

    config: dict
    weights: bytes
    sha256: str = ""
    """The content hash of `weights` when it came from the store (the object's name); empty otherwise."""


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
    stays False). A string that is one token of the tokenizer stops at that token; a longer one as soon
    as the decoded completion contains it (it may span tokens)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop token ids: a completion also ends at any of them (kept; `finished` stays False)."""
    prompt_ids: list[int] | None = None
    """The prompt as token ids, fed to the model as they are (no decode -> encode round trip, so any
    token sequence is served exactly); `prompt` is then only its text for display."""
    top_k: int = 0
    """Sample from the k most likely tokens only; 0 (or -1) samples from all."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much probability; 1.0 is all."""


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


# ---------------------------------------------------------------- rollout records (as stored, JSON)


class CompletionRecord(TypedDict):
    """One sampled completion of a stored rollout."""

    ids: list[int]
    logprobs: list[float]
    text: str
    mask: NotRequired[list[int]]
    """Tool episodes: 1 on model-written tokens, 0 on tool-result tokens (masked out of the loss)."""


class Rewards(TypedDict):
    """The verify station's scores of one group."""

    rewards: list[float]
    errors: int


class Rollout(TypedDict):
    """One group as the store returns it (`Store.rollout`): the row, the adapter version that sampled
    it, its completions, and once verified its rewards."""

    row: dict
    row_idx: int
    completions: list[CompletionRecord]
    version: int
    attempt: str
    rewards: NotRequired[Rewards]
    awaiting_cont: NotRequired[bool]
    """A tool episode waits for its next model turn (a 'cont' item)."""
