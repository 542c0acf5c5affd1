"""transformers + PEFT generation engine (the CPU default: faster than vLLM's CPU LoRA path here).

One resident base (float32 on the CPU, bfloat16 on a GPU: MARLAAS_DEVICE, MARLAAS_DTYPE) wrapped in
a PeftModel that holds up to `max_adapters` adapter versions and, on the CPU, idle ones within
`adapter_bytes` (default an eighth of the weights' bytes, at least 64 MiB: 6 rank-8 all-linear
adapters on SmolLM2-135M; a finished job's adapter would otherwise stay resident until 64 had come
and gone; a batch that needs more holds them all while it runs). A job's new version is written in
place into the slot of its previous version (same LoRA shape), or once the cache is full into the
least recently used slot, instead of PEFT's add/delete, whose cost grows with the adapters
registered (`_ensure`; `load(ref)` loads one ahead of a call).
Requests are grouped by (temperature, max_new_tokens, greedy, top_k, top_p); each group is one
`generate` call over its rows (each request's prompt, its `prompt_ids` as given or its text
tokenized, repeated `n` times, left-padded), split into several calls of whole requests where it
would pass `max_rows_per_call` rows or the call's token budget (`marlaas.generate.calls`): a
call's working memory (its KV cache, the prefill's activations) grows with rows x (padded prompt +
new tokens), so on the CPU one call holds at most `call_tokens` of them, by default what a quarter
of the weights' bytes buy (`calls.call_token_budget`: a generate worker's peak stays near weights +
libraries + adapters + a quarter of the weights, where a 200-prompt evaluation in one call took it
to 3.5x the weights of SmolLM2-135M; half the weights' bytes took it to 2.39-2.58x, a third to
2.40x alone and up to 2.54x in a worker serving four live jobs; a quarter's calls peak 36-39 MB
lower than a third's, for an evaluation 6-16% longer). The peak of a call is its prefill (one new
token peaks as high as twelve): the KV cache and one layer's activations over every row-token. On the
CPU each call gets a KV cache of its own final length (`kv_cache="static"`), allocated once, where
transformers' default grows it by a copy per token (`kv_cache="dynamic"`, the GPU's default).
Stops are per row (`RowStops`, a transformers StoppingCriteria over each request's `StopMatcher`):
a row ends at its own stop token ids and stop strings (multi-token strings on the decoded tail);
only EOS marks a completion `finished`:

- every row on one adapter: the stacked path below with one adapter (PEFT's `set_adapter` walks
  every registered adapter, a cost that grows with the cache: docs/performance.md); `set_adapter` with
  `mixed_path="peft"`;
- every row on the base: `stacked_lora.base_only` (PEFT's `disable_adapter()` without its grad bookkeeping);
- mixed (default `mixed_path="stacked"`): every adapter of the batch in one pair of batched matmuls
  per LoRA layer (`marlaas.generate.stacked_lora`; figures in results/generation_engines.json);
- mixed with `mixed_path="peft"` (or adapters the stacked path refuses, e.g. DoRA): PEFT's per-row
  `adapter_names` ("__base__" for base rows). peft 0.21.2 leaves its forward pre-hooks registered
  when such a call raises, so every failure purges them (`purge_row_hooks`).

Log-probs are `log_softmax` of the scores the sampler actually used (transformers' processed
scores: logits / temperature when sampling, then the request's top-k / top-p, which set the cut
tokens to -inf; raw logits when greedy); top-k and top-p are off unless a request asks, set
explicitly so a model's generation_config defaults (e.g. top_k=50) never apply.
`prompt_logprobs(ref, tokens, last_n)` (Tinker's prompt logprobs) is one forward on the same adapter
paths.

Seeds: a sampled row of a request with a seed draws from a stream of its own
(`marlaas.generate.sampling.RowSampler`: one uniform per token from a generator seeded by the
request's seed and the row's index in it, inverse CDF over the processed distribution), so its
samples do not depend on what else is in the call: the same request gives the same completions
alone, in a batch of other tenants' rows, or with its step split over several calls and workers.
Rows without a seed get a stream seeded from the process's RNG. Every sampled call samples this way,
and a greedy call keeps its log-probs with `GreedyLogprobs`: no call keeps transformers' per-step
scores (`output_scores`, a [rows, vocab] tensor per step), which set a generate worker's peak memory.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from pathlib import Path

from marlaas.adapters import lora_config_from_dict
from marlaas.devices import release_heap
from marlaas.generate.calls import call_plan, call_token_budget
from marlaas.generate.engine import (
    AdapterSource,
    GenerationEngine,
    RowStops,
    StopMatcher,
    check_rank,
    completion_end,
    eos_token_ids,
    group_requests_by_adapter_budget,
    load_tokenizer,
    safe_adapter_name,
    validate_requests,
)
from marlaas.generate.sampling import GreedyLogprobs, RowSampler, row_seeds
from marlaas.generate.stacked_lora import StackedLoRAUnsupported, base_only, purge_row_hooks, stacked_lora
from marlaas.types import AdapterRef, Completion, GenRequest, GenResult

BASE = "__base__"


def _set_threads(n: int) -> None:
    import torch

    # torch._C.set_num_threads, not torch.set_num_threads: vLLM's CPU worker replaces the latter with
    # a no-op in any process that started a vLLM engine.
    torch._C.set_num_threads(max(1, int(n)))


class HFEngine(GenerationEngine):
    kind = "hf"

    def __init__(
        self,
        base_path: str | Path,
        adapter_source: AdapterSource,
        *,
        threads: int = 1,
        max_adapters: int = 64,
        max_rows_per_call: int = 1024,
        mixed_path: str = "stacked",
        device: str = "cpu",
        dtype: str = "auto",
        reuse_slots: bool = True,
        max_lora_rank: int = 64,
        call_tokens: int | None | str = "auto",
        kv_cache: str = "auto",
        adapter_bytes: int | None | str = "auto",
    ) -> None:
        from marlaas.devices import resolve_device, resolve_dtype, without_triton

        super().__init__(adapter_source, max_adapters=max_adapters)
        self.threads = threads
        if max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        self.max_lora_rank = int(max_lora_rank)  # any rank works here: the deployment's cap
        self.max_rows_per_call = max_rows_per_call
        if mixed_path not in ("stacked", "peft"):
            raise ValueError(f"mixed_path must be 'stacked' or 'peft', not {mixed_path!r}")
        self.mixed_path = mixed_path
        self.reuse_slots = reuse_slots  # False: PEFT's add/delete for every load (bench/adapter_load.py's baseline)
        _set_threads(threads)
        self.device = resolve_device(device)
        with without_triton(self.device):  # the tokenizer's module loads transformers' model code too
            from transformers import AutoModelForCausalLM

            self.tokenizer = load_tokenizer(base_path)
            self.model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=resolve_dtype(dtype, self.device))
        self.model.to(self.device)
        self.model.eval()
        self.eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config)
        weight_bytes = sum(t.numel() * t.element_size() for t in self.model.parameters())
        if call_tokens == "auto":  # the CPU's calls within a quarter of the weights' bytes; a GPU's by rows only
            dtype_bytes = next(self.model.parameters()).element_size()
            call_tokens = (call_token_budget(self.model.config, dtype_bytes, max(64 * 2**20, weight_bytes / 4))
                           if self.device.type == "cpu" else None)
        self.call_tokens = call_tokens
        if kv_cache not in ("auto", "static", "dynamic"):
            raise ValueError(f"kv_cache must be 'auto', 'static' or 'dynamic', not {kv_cache!r}")
        # static: each call's KV cache allocated once at its final length; dynamic (transformers' default)
        # grows it by a copy per token, whose freed sizes fragment a CPU heap (SmolLM2-135M, four live jobs,
        # side by side: 1,252 MB dynamic, 1,217 MB static, as fast: bench/memory.py --kv-cache)
        self.kv_cache = ("static" if self.device.type == "cpu" else "dynamic") if kv_cache == "auto" else kv_cache
        if adapter_bytes == "auto":  # the CPU's idle adapter slots within an eighth of the weights' bytes
            adapter_bytes = int(max(64 * 2**20, weight_bytes / 8)) if self.device.type == "cpu" else None
        self.adapter_bytes = adapter_bytes
        self.peft = None  # PeftModel, created with the first adapter
        self._cache: OrderedDict[AdapterRef, str] = OrderedDict()
        self._shape: dict[str, str] = {}  # adapter name -> its LoRA config (JSON): slots are reused by shape
        self._bytes: dict[str, int] = {}  # adapter name -> its weights' bytes
        self._lora_layers: dict | None = None  # module path -> LoraLayer, found once
        self._uid = itertools.count(1)

    # -- adapters --------------------------------------------------------------------------------

    def serves(self, ref: AdapterRef) -> bool:
        name = self._cache.get(ref)
        return name is not None and self.peft is not None and name in self.peft.peft_config

    def loaded(self) -> list[AdapterRef]:
        return list(self._cache)

    def load(self, ref: AdapterRef) -> None:
        """Load adapter version `ref` now (a generate call that needs it loads it too)."""
        self._ensure(ref)

    def _ensure(self, ref: AdapterRef, keep: frozenset = frozenset()) -> str:
        """The registered name serving `ref`, loading it if needed. A new version takes over, in
        place, the slot of an older version of the same job (generation always samples with a
        job's newest version; an evaluation of the older one loads it again), else the least
        recently used slot once the cache is full (`max_adapters`, or on the CPU its byte budget
        `adapter_bytes`); `keep`, the refs the current batch uses, are never taken over."""
        if ref in self._cache:
            self._cache.move_to_end(ref)
            return self._cache[ref]
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load

        blob = self.adapter_source(ref)
        check_rank(ref, blob.config, self.max_lora_rank)
        state = load(blob.weights)
        shape = json.dumps(blob.config, sort_keys=True)
        older = next(((r, n) for r, n in self._cache.items()  # least recently used first
                      if r.job_id == ref.job_id and r.version < ref.version and r not in keep), None)
        size = sum(t.numel() * t.element_size() for t in state.values())
        lru = next(((r, n) for r, n in self._cache.items() if r not in keep), None) if self._full(size) else None
        for old_ref, old in [c for c in (older, lru) if c is not None]:
            if old_ref not in keep and self.reuse_slots and self._shape.get(old) == shape \
                    and self._overwrite(old, state):
                del self._cache[old_ref]
                self._cache[ref] = old
                self._trim(keep | {ref})
                return old
        name = safe_adapter_name(ref, next(self._uid))
        cfg = lora_config_from_dict(blob.config)
        if self.peft is None:
            self.peft = PeftModel(self.model, cfg, adapter_name=name)
        else:
            self.peft.add_adapter(name, cfg)
        result = set_peft_model_state_dict(self.peft, state, adapter_name=name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in getattr(result, "missing_keys", []) or [] if name in k]
        if unexpected or missing:
            self.peft.delete_adapter(name)
            raise ValueError(
                f"adapter {ref.name}: weights do not match its config "
                f"(unexpected {unexpected[:3]}, missing {missing[:3]})"
            )
        self.peft.eval()
        self._lora_layers = None  # new targets may have added LoRA layers: found again when needed
        self._cache[ref] = name
        self._shape[name] = shape
        self._bytes[name] = size
        self._trim(keep | {ref})
        return name

    def _trim(self, keep: frozenset) -> None:
        """Delete least recently used slots outside `keep` while the cache is past its count or byte
        budget (a batch that needs more slots than the budget holds them until a later load trims)."""
        while self._full():
            victim = next((r for r in self._cache if r not in keep), None)
            if victim is None:
                return
            old = self._cache.pop(victim)
            self.peft.delete_adapter(old)
            self._shape.pop(old, None)
            self._bytes.pop(old, None)

    def _full(self, incoming: int = 0) -> bool:
        """Whether the cache is past its count `max_adapters` or, on the CPU, its byte budget
        `adapter_bytes`, with a new slot of `incoming` bytes added (0: as it is)."""
        held, cap = sum(self._bytes.get(n, 0) for n in self._cache.values()), self.adapter_bytes
        return len(self._cache) + (incoming > 0) > self.max_adapters or (cap is not None and held + incoming > cap)

    def _layers(self) -> dict:
        """Module path -> LoRA layer of the PeftModel, found once per set of targets (walking the
        modules grows with the adapters registered)."""
        if self._lora_layers is None:
            from peft.tuners.lora import LoraLayer

            self._lora_layers = {n: m for n, m in self.peft.named_modules() if isinstance(m, LoraLayer)}
        return self._lora_layers

    def _overwrite(self, name: str, state: dict) -> bool:
        """Write an adapter's weights into the slot of registered adapter `name` (same LoRA config),
        in place: PEFT's add_adapter + set_peft_model_state_dict walk every module of the model,
        whose count grows with the adapters registered (docs/performance.md), while this is one
        tensor copy per weight. False (nothing written) when
        a key is not a plain lora_A / lora_B weight of a LoRA layer (e.g. DoRA): the caller then
        loads the slow way."""
        layers = self._layers()
        dests = []
        for key, tensor in state.items():
            prefix, _, leaf = key.rpartition(".")  # "<layer path>.lora_A" / "weight"
            path, _, kind = prefix.rpartition(".")
            layer = layers.get(path)
            if leaf != "weight" or kind not in ("lora_A", "lora_B") or layer is None \
                    or name not in getattr(layer, kind):
                return False
            dest = getattr(layer, kind)[name].weight
            if dest.shape != tensor.shape:
                return False
            dests.append((dest, tensor))
        if len(dests) != sum(2 for m in layers.values() if name in m.lora_A):
            return False  # not every weight of the slot would be replaced
        import torch

        with torch.no_grad():
            for dest, tensor in dests:
                dest.copy_(tensor)
        return True

    def prompt_logprobs(self, ref: AdapterRef | None, tokens: list[int],
                        last_n: int | None = None) -> list[float | None]:
        """log p(token_i | tokens_<i) under adapter `ref` (None = base), by one forward with the
        generation paths' own adapter switching; None at position 0 and, with `last_n`, before the
        last `last_n` positions (only those are scored)."""
        import torch

        n = len(tokens) - 1 if last_n is None else int(last_n)
        if not 1 <= n <= len(tokens) - 1:
            raise ValueError(f"prompt_logprobs_last_n must be in 1..{len(tokens) - 1} (the prompt has "
                             f"{len(tokens)} tokens), got {last_n}")

        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            if self.peft is None and ref is None:
                logits = self.model(input_ids=ids).logits
            elif ref is None:
                with base_only(self.peft, list(self._layers().values())):
                    logits = self.peft(input_ids=ids).logits
            else:
                name = self._ensure(ref)
                with stacked_lora(self.peft, [name], BASE, list(self._layers().values())):
                    logits = self.peft(input_ids=ids).logits
            scored = logits[0, -n - 1:-1].float()  # the positions predicting the last n tokens
            lp = torch.log_softmax(scored, dim=-1).gather(-1, ids[0, -n:].unsqueeze(-1)).squeeze(-1)
        return [None] * (len(tokens) - n) + lp.tolist()

    # -- generation ------------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest], *, ignore_eos: bool = False) -> list[GenResult]:
        validate_requests(requests)
        _set_threads(self.threads)
        results: list[GenResult | None] = [None] * len(requests)
        for chunk in group_requests_by_adapter_budget(requests, self.max_adapters):
            names = {}
            keep = frozenset(requests[i].adapter for i in chunk if requests[i].adapter is not None)
            for i in chunk:
                ref = requests[i].adapter
                if ref is not None and ref not in names:
                    names[ref] = self._ensure(ref, keep)
            groups: dict[tuple, list[int]] = {}
            matchers = {i: StopMatcher(self.tokenizer, requests[i].stop, requests[i].stop_token_ids) for i in chunk}
            for i in chunk:
                r = requests[i]
                key = (True, 1.0, r.max_new_tokens, 0, 1.0) if r.greedy else \
                    (False, float(r.temperature), r.max_new_tokens, max(0, int(r.top_k)), float(r.top_p))
                groups.setdefault(key, []).append(i)
            for key, idxs in groups.items():
                ids = {i: self._prompt_ids(requests[i]) for i in idxs}  # tokenized once: planned, then run
                sized = [(requests[i].n, len(ids[i])) for i in idxs]
                for call in call_plan(sized, key[2], self.max_rows_per_call, self.call_tokens):
                    try:
                        self._run_group(requests, [idxs[k] for k in call], names, key, ignore_eos, results,
                                        matchers, ids)
                    finally:
                        release_heap(self.device)
        return results  # type: ignore[return-value]

    def _prompt_ids(self, r: GenRequest) -> list[int]:
        return list(r.prompt_ids) if r.prompt_ids is not None else self.tokenizer(r.prompt)["input_ids"]

    def _run_group(self, requests, idxs, names, key, ignore_eos, results, matchers, ids) -> None:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StaticCache, StoppingCriteriaList

        greedy, temperature, max_new, top_k, top_p = key
        prompts: list[list[int]] = []
        row_adapters: list[str] = []
        row_stops: list[StopMatcher] = []
        for i in idxs:
            r = requests[i]
            name = BASE if r.adapter is None else names[r.adapter]
            prompts.extend([ids[i]] * r.n)
            row_adapters.extend([name] * r.n)
            row_stops.extend([matchers[i]] * r.n)
        width = max(map(len, prompts))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long, device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                                 device=self.device)
        # transformers itself always decodes greedily here (do_sample False: none of its warpers, so a
        # model's generation_config defaults such as top_k=50 never apply); a sampled call's draw, with
        # the request's own top-k / top-p (off unless asked), is RowSampler's.
        sampler: GreedyLogprobs | RowSampler = GreedyLogprobs()
        if not greedy:  # each row samples from its own stream (RowSampler); the call itself runs greedy
            seeds_by_row: list[int] = []
            for i in idxs:
                sd = requests[i].seed
                seeds_by_row += (row_seeds(sd, requests[i].n) if sd is not None else
                                 [int(x) for x in torch.randint(0, 2**62, (requests[i].n,)).tolist()])
            sampler = RowSampler(seeds_by_row, temperature, top_k, top_p)
        gc = GenerationConfig(
            do_sample=False,
            repetition_penalty=1.0,
            max_new_tokens=max_new,
            num_beams=1,
            pad_token_id=pad,
            eos_token_id=None if ignore_eos else list(self.eos_ids),
            return_dict_in_generate=True,
            disable_compile=True,  # a static cache would otherwise compile the forward on a GPU
        )
        kwargs = dict(input_ids=input_ids, attention_mask=attention, generation_config=gc,
                      logits_processor=LogitsProcessorList([sampler]))
        if self.kv_cache == "static":  # this call's own: transformers' would keep the longest call's length
            kwargs["past_key_values"] = StaticCache(config=self.model.config, max_cache_len=width + max_new)
        if any(row_stops):
            kwargs["stopping_criteria"] = StoppingCriteriaList([RowStops(row_stops, width)])
        distinct = set(row_adapters)

        def call():
            if self.peft is None:
                return self.model.generate(**kwargs)
            if distinct == {BASE}:
                with base_only(self.peft, list(self._layers().values())):
                    return self.peft.generate(**kwargs)
            if len(distinct) == 1 and self.mixed_path != "stacked":
                self.peft.set_adapter(row_adapters[0])
                return self.peft.generate(**kwargs)
            if self.mixed_path == "stacked":  # one adapter too: PEFT's set_adapter walks every registered adapter
                try:
                    with stacked_lora(self.peft, row_adapters, BASE, list(self._layers().values())):
                        return self.peft.generate(**kwargs)
                except StackedLoRAUnsupported:
                    pass  # e.g. DoRA: PEFT's own per-row path below
            try:
                return self.peft.generate(**kwargs, adapter_names=row_adapters)
            except BaseException:
                purge_row_hooks(self.peft)
                raise

        with torch.inference_mode():
            out = call()
            gen = out.sequences[:, width:]
            logp = torch.stack(sampler.logprobs, dim=1)  # [rows, steps], under the distribution sampled from

        eos = set() if ignore_eos else set(self.eos_ids)
        gen_l = gen.tolist()
        logp_l = logp.tolist()
        row = 0
        for i in idxs:
            r = requests[i]
            comps = []
            for _ in range(r.n):
                toks, lps = gen_l[row], logp_l[row]
                end, finished = completion_end(toks, eos, matchers[i])
                toks, lps = toks[:end], lps[:end]
                body = toks[:-1] if finished else toks
                text = self.tokenizer.decode(body, skip_special_tokens=True)
                comps.append(Completion(token_ids=toks, logprobs=lps, text=text, finished=finished))
                row += 1
            results[i] = GenResult(key=r.key, completions=comps)

    def close(self) -> None:
        self.peft = None
        self.model = None
        self._cache.clear()
