"""Generation engines: one resident base model serving many tenants' LoRA adapter versions.

Two implementations share one interface (`GenerationEngine`):

- `HFEngine` (`marlaas.engines.hf_engine`): transformers + PEFT, fp32, mixed-adapter batches via
  PEFT's per-row `adapter_names`.
- `VLLMEngine` (`marlaas.engines.vllm_engine`): vLLM's `LLM` in-process with `enable_lora=True`,
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
  from: log_softmax(logits / temperature), or log_softmax(logits) for greedy rows. No top-k/top-p is
  ever applied.
- Adapters are fetched lazily through `adapter_source(ref) -> AdapterBlob` on the first request that
  uses a ref, kept in an LRU of `max_adapters` versions, and `serves(ref)` says whether that version
  is loaded in the engine right now (vLLM: checked against the engine's own list of LoRA ids).
  `adapter=None` is served by the base model.
- Each engine honours a `threads` budget (several worker processes share few cores).

Tokenization: both engines tokenize prompts and decode completions with `load_tokenizer(base_path)`,
and vLLM gets token ids (never text). `AutoTokenizer` is not safe for the project's own base: for
model_type "qwen2", transformers 5 always builds `Qwen2Tokenizer` (byte-level BPE pre-tokenizer),
which silently drops the character tokenizer's spaces and newlines; vLLM's tokenizer loader does the
same.

`blob_from_peft` turns a PeftModel's adapter into an `AdapterBlob` exactly as `save_pretrained`
would write it (adapter_config.json dict + adapter_model.safetensors bytes); `write_blob` writes a
blob as a PEFT adapter directory.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from marlaas.basemodel import load_tokenizer  # noqa: F401  (re-exported: engines import it from here)
from marlaas.engines.types import AdapterBlob, AdapterRef, GenRequest, GenResult

AdapterSource = Callable[[AdapterRef], AdapterBlob]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


class GenerationEngine(ABC):
    """Serves completions for many adapter versions of one base model."""

    kind: str = "abstract"

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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_engine(
    kind: Literal["hf", "vllm"],
    base_path: str | Path,
    adapter_source: AdapterSource,
    *,
    threads: int = 1,
    max_adapters: int = 64,
    cache_dir: str | Path | None = None,
    **kwargs,
) -> GenerationEngine:
    """Build a generation engine. Extra keyword arguments go to the engine's constructor."""
    if kind == "hf":
        from marlaas.engines.hf_engine import HFEngine

        return HFEngine(base_path, adapter_source, threads=threads, max_adapters=max_adapters, **kwargs)
    if kind == "vllm":
        from marlaas.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            base_path, adapter_source, threads=threads, max_adapters=max_adapters, cache_dir=cache_dir, **kwargs
        )
    raise ValueError(f"unknown engine kind {kind!r} (expected 'hf' or 'vllm')")


# ---------------------------------------------------------------------------------------------
# Helpers shared by both engines.


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


def stop_token_ids(tokenizer, stop: tuple[str, ...] | list[str]) -> list[int]:
    """The token id of each stop string; ValueError when one is not exactly one token."""
    out = []
    for s in stop:
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"stop string {s!r} is not one token of this tokenizer")
        out.append(ids[0])
    return out


def validate_requests(requests: list[GenRequest]) -> None:
    for r in requests:
        if r.n < 1:
            raise ValueError(f"request {r.key!r}: n must be >= 1")
        if r.max_new_tokens < 1:
            raise ValueError(f"request {r.key!r}: max_new_tokens must be >= 1")
        if not r.greedy and not r.temperature > 0:
            raise ValueError(f"request {r.key!r}: temperature must be > 0 unless greedy")


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(_json_safe(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "value") and isinstance(obj.value, (str, int)):  # enums
        return obj.value
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def blob_from_peft(peft_model, adapter_name: str = "default") -> AdapterBlob:
    """The named adapter of a PeftModel as an AdapterBlob, as `save_pretrained` would write it.

    `config` is the JSON-safe adapter_config.json dict (sets as sorted lists, inference_mode True);
    `weights` are the bytes of adapter_model.safetensors (PEFT key names, without the adapter name).
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    config = peft_model.peft_config[adapter_name]
    cfg = _json_safe(config.to_dict())
    cfg["inference_mode"] = True
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    return AdapterBlob(config=cfg, weights=save(tensors, metadata={"format": "pt"}))


def write_blob(blob: AdapterBlob, directory: str | Path) -> Path:
    """Write a blob as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / ADAPTER_CONFIG_NAME).write_text(json.dumps(blob.config, indent=2, sort_keys=True))
    (d / ADAPTER_WEIGHTS_NAME).write_bytes(blob.weights)
    return d


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


def lora_config_from_dict(config: dict):
    """A PEFT LoraConfig from an adapter_config.json dict (unknown keys from newer PEFTs dropped)."""
    import dataclasses

    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in config.items() if k in fields}
    kwargs.pop("peft_type", None)
    kwargs["inference_mode"] = True
    return LoraConfig(**kwargs)
