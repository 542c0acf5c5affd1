"""Generation engines: one resident base model serving many tenants' LoRA adapter versions.

Two implementations share one interface (`GenerationEngine`):

- `HFEngine` (`marlaas.generate.hf`): transformers + PEFT, fp32, mixed-adapter batches via
  PEFT's per-row `adapter_names`.
- `VLLMEngine` (`marlaas.generate.vllm`): vLLM's `LLM` in-process with `enable_lora=True`,
  one `LoRARequest` (fresh `lora_int_id`) per adapter version.

Contract, common to both:

- `generate(requests)` returns one `GenResult` per request, in request order, with `n` completions.
  Requests may differ in adapter, temperature, max_new_tokens and greedy; they are served in as few
  engine calls as the engine allows (HF: one call per (temperature, max_new_tokens, greedy) group;
  vLLM: one call for everything).
- `Completion.token_ids` include the EOS token when the model emitted one (`finished=True`);
  `Completion.text` is the decoded completion without EOS and special tokens. A completion cut by
  `max_new_tokens` has `finished=False`.
- `Completion.logprobs[i]` is the log-probability of `token_ids[i]` under the distribution sampled
  from: log_softmax(logits / temperature), or log_softmax(logits) for greedy rows; a request's top_k /
  top_p (off by default: no truncation unless asked) renormalise it over the tokens they keep.
- A request's `prompt_ids` are fed as they are (no decode -> encode); else `prompt` is tokenized.
- Stops (`StopMatcher`): EOS finishes a completion (`finished=True`); a request's stop token ids and
  stop strings end it without finishing it (one-token strings as ids, longer ones on the decoded text,
  so a string may span tokens); the stop stays in `token_ids` and `text`.
- Adapters are fetched lazily through `adapter_source(ref) -> AdapterBlob` on the first request that
  uses a ref, kept in an LRU of `max_adapters` versions, and `serves(ref)` says whether that version
  is loaded in the engine right now (vLLM: checked against the engine's own list of LoRA ids).
  `adapter=None` is served by the base model.
- `prompt_logprobs(ref, tokens, last_n)`: log p(token_i | tokens_<i) under an adapter (None = base),
  None at position 0 and, with `last_n`, before the last n positions (Tinker's prompt logprobs). The
  HF engine computes them with one forward; an engine that cannot (vLLM here) raises `SampleError`, a
  one-line MarlaasError the Tinker door reports.
- Each engine honours a `threads` budget (several worker processes share few cores).
- `max_lora_rank`: the largest LoRA rank the engine serves (the HF engine: its constructor's
  `max_lora_rank`, any value; vLLM: the engine's own configured max_lora_rank, one of vLLM's ranks). A
  generate worker records it in the deployment record, the one value the API admits ranks against
  (`tasks.common.register_lora_rank`, `marlaas.api.access.max_lora_rank`); an adapter of a higher rank
  is refused with a ValueError.

Tokenization: both engines tokenize prompts and decode completions with `load_tokenizer(base_path)`,
and vLLM gets token ids (never text). `AutoTokenizer` is not safe for the project's own base: for
model_type "qwen2", transformers 5 always builds `Qwen2Tokenizer` (byte-level BPE pre-tokenizer),
which silently drops the character tokenizer's spaces and newlines; vLLM's tokenizer loader does the
same.

Adapters travel as `AdapterBlob`s in the one PEFT-directory format of `marlaas.adapters`
(`write_adapter_dir` writes a blob as a PEFT adapter directory).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from marlaas.base.tiny import load_tokenizer  # noqa: F401  (re-exported: engines import it from here)
from marlaas.errors import SampleError
from marlaas.types import AdapterBlob, AdapterRef, GenRequest, GenResult

AdapterSource = Callable[[AdapterRef], AdapterBlob]



class GenerationEngine(ABC):
    """Serves completions for many adapter versions of one base model."""

    kind: str = "abstract"
    max_lora_rank: int = 64
    """The largest LoRA rank this engine serves."""

    def __init__(self, adapter_source: AdapterSource, *, max_adapters: int = 64) -> None:
        if max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")
        self.adapter_source = adapter_source
        self.max_adapters = max_adapters

    @abstractmethod
    def generate(self, requests: list[GenRequest], *, ignore_eos: bool = False) -> list[GenResult]:
        """One GenResult per request, same order, `n` completions each.

        `ignore_eos=True` keeps sampling after EOS until max_new_tokens (benchmarks only: every row
        then does the same amount of work); EOS is then an ordinary token and `finished` is False.
        """

    @abstractmethod
    def serves(self, ref: AdapterRef) -> bool:
        """True when this adapter version is loaded in the engine right now."""

    @abstractmethod
    def close(self) -> None:
        """Release the model (and the engine's resources)."""

    def loaded(self) -> list[AdapterRef]:
        """The adapter versions currently cached, least recently used first."""
        return []

    def prompt_logprobs(self, ref: AdapterRef | None, tokens: list[int],
                        last_n: int | None = None) -> list[float | None]:
        """log p(token_i | tokens_<i) under adapter `ref` (None = base); None at position 0 and, with
        `last_n`, at every position before the last `last_n`."""
        raise SampleError(f"prompt logprobs are not supported by the {self.kind} engine: serve them with the hf engine")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()




# ---------------------------------------------------------------------------------------------
# Helpers shared by both engines.


def adapter_rank(config: dict) -> int:
    """The largest LoRA rank of an adapter_config dict (its `r` and any `rank_pattern` entry)."""
    return max([int(config.get("r", 0))] + [int(v) for v in (config.get("rank_pattern") or {}).values()])


def check_rank(ref: AdapterRef, config: dict, max_rank: int) -> None:
    """ValueError (one line) when the adapter's rank is over the engine's `max_rank`."""
    rank = adapter_rank(config)
    if rank > max_rank:
        raise ValueError(f"adapter {ref.name}: rank {rank} exceeds the engine's max_lora_rank ({max_rank}); "
                         "start the engine with a larger one")


def safe_adapter_name(ref: AdapterRef, uid: int) -> str:
    """A unique name valid as a PEFT adapter name (no '.') derived from the ref and a fresh uid."""
    return f"a{uid}_" + re.sub(r"[^A-Za-z0-9_@-]", "_", ref.name)


def group_requests_by_adapter_budget(requests: list[GenRequest], max_adapters: int) -> Iterable[list[int]]:
    """Split request indices into consecutive chunks that use at most `max_adapters` distinct adapters."""
    chunk: list[int] = []
    seen: set[AdapterRef] = set()
    for i, r in enumerate(requests):
        if r.adapter is not None and r.adapter not in seen and len(seen) >= max_adapters:
            yield chunk
            chunk, seen = [], set()
        chunk.append(i)
        if r.adapter is not None:
            seen.add(r.adapter)
    if chunk:
        yield chunk


class StopMatcher:
    """Where a completion ends on its request's stop token ids and stop strings.

    A stop string that is exactly one token of the tokenizer is matched as that token id (cheap, and
    exact for the built-in character tokenizer); a longer one on the decoded text: the completion ends
    at the first token whose text completes it. Only the last few tokens are decoded at each check
    (`window`: every token decodes to at least one character here, so a string of L characters ends
    within the last L + 2 tokens).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = (), stop_ids: tuple[int, ...] | list[int] = ()):
        self.tokenizer = tokenizer
        ids, strs = set(int(t) for t in stop_ids), []
        for s in stop:
            if not s:
                raise ValueError("a stop string must not be empty")
            tok = tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(tok) == 1 and tok[0] != tokenizer.unk_token_id:
                ids.add(int(tok[0]))
            else:
                strs.append(s)
        self.ids = frozenset(ids)
        self.strs = tuple(strs)
        self.window = max(map(len, strs)) + 2 if strs else 0

    def __bool__(self) -> bool:
        return bool(self.ids or self.strs)

    def hit(self, toks: list[int]) -> bool:
        """Whether a completion whose tokens so far are `toks` ends at its last token."""
        if not toks:
            return False
        if toks[-1] in self.ids:
            return True
        if self.strs:
            tail = self.tokenizer.decode(toks[-self.window:])
            return any(s in tail for s in self.strs)
        return False

    def end(self, toks: list[int]) -> int | None:
        """The length of the completion cut at its first stop (the stop kept), None if it has none."""
        if not self:
            return None
        for j in range(len(toks)):
            if toks[j] in self.ids or (self.strs and self.hit(toks[:j + 1])):
                return j + 1
        return None


def completion_end(toks: list[int], eos: set[int] | frozenset[int], stops: StopMatcher) -> tuple[int, bool]:
    """(length, finished) of a sampled row cut at its first EOS (kept, finished) or, before it, at
    its first stop (kept, not finished); uncut rows are not finished (max_new_tokens)."""
    eos_at = next((j for j, t in enumerate(toks) if t in eos), None)
    stop = stops.end(toks if eos_at is None else toks[:eos_at])
    if stop is not None:
        return stop, False
    return (len(toks), False) if eos_at is None else (eos_at + 1, True)


def validate_requests(requests: list[GenRequest]) -> None:
    for r in requests:
        if r.n < 1:
            raise ValueError(f"request {r.key!r}: n must be >= 1")
        if r.max_new_tokens < 1:
            raise ValueError(f"request {r.key!r}: max_new_tokens must be >= 1")
        if not r.greedy and not r.temperature > 0:
            raise ValueError(f"request {r.key!r}: temperature must be > 0 unless greedy")
        if r.top_k < -1 or not 0 < r.top_p <= 1:
            raise ValueError(f"request {r.key!r}: top_k must be >= -1 and top_p in (0, 1]")
        if r.prompt_ids is not None and not r.prompt_ids:
            raise ValueError(f"request {r.key!r}: prompt_ids must not be empty")


def eos_token_ids(tokenizer, generation_config=None) -> list[int]:
    """EOS ids: the tokenizer's plus the model generation_config's."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


class RowStops:
    """A transformers StoppingCriteria: row i is done once its request's `StopMatcher` hits (stop token
    ids, or a stop string on the decoded tail of the row's generated tokens). Rows without stops are
    never checked."""

    def __init__(self, matchers: list[StopMatcher], prompt_len: int):
        self.matchers, self.prompt_len = matchers, prompt_len
        self.rows = [i for i, m in enumerate(matchers) if m]
        self.window = max([m.window for m in matchers] + [1])

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        gen = input_ids[:, self.prompt_len:]
        if gen.shape[1] == 0:
            return done
        tails = gen[self.rows, -self.window:].tolist()
        for i, tail in zip(self.rows, tails):
            done[i] = self.matchers[i].hit(tail)
        return done
