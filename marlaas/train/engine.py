"""The training engine: one resident base model, one PEFT LoRA adapter + AdamW state per key.

Public API, shaped like Tinker's primitives; the job RL step (`marlaas.train.step`), the Tinker ops
(`marlaas.train.tinker_ops`) and the fused multi-job step are its callers, and none reads inside it:

- `adapter(key, config, state=None, seed=0)`: make sure adapter `key` is cached (a fresh LoRA
  seeded by `seed`, B = 0, or one loaded from a `TrainState`); `load_state(key, state, config)`.
- `forward_backward(key, samples, loss, temperature, ...)`: one forward over `key`'s rows, the
  caller's `loss(Forward) -> (loss, stats)`, and a backward that ACCUMULATES into the adapter's
  gradients; `forward_backward_many(parts)` does the same for several keys in one routed pass
  (`marlaas.train.routing`: rows never mix, so each adapter gets exactly its own gradient).
  A pass whose loss is additive over rows (`Part.additive`) runs in micro-batches within
  `micro_bytes` of activations (default on the CPU: a quarter of the weights' bytes; `marlaas.train.micro`);
  one row over it recomputes just enough layers in the backward to fit (`marlaas.train.recompute`).
- `optim_step(key, AdamParams)`: optional global-norm clip, one AdamW step with the given
  hyperparameters (skipped when the clipped norm is NaN/inf), gradients cleared.
- `state(key) -> TrainState`, `adapter_blob`, `optimizer_bytes`, `evict`, `cached`, `set_version`,
  `completion_logprobs`, `parameters`; `pin(key)` / `unpin(key)`: a pinned key is never evicted to
  make room (a Tinker model holding gradients between its forward_backward and its optim_step).

One `PeftModel` wraps the base; each key is its own named adapter in it (keys are mapped to safe
adapter names: PEFT forbids '.' in them). Adapters and optimisers live in an LRU cache of
`cache_size` keys (pinned keys are skipped when making room, so the cache may hold more while they
are pinned); an evicted key is rebuilt by its caller from a `TrainState`. On the CPU the cache holds
one key by default: every live job's LoRA and Adam moments kept in the trainer's process (29 MB a job
on SmolLM2-135M at rank 8 on all linear layers) would grow its peak with the jobs, while reloading a
job from the state it published costs about 0.35 s a switch there (a step of 16 rows takes 8-13 s).

Invariants:
- The base weights never change: only the adapters being trained require grad (`set_adapter()`
  resets requires_grad, so the engine sets it after every switch and every disabled-adapter pass).
- A sample's completion tokens are right-aligned in T columns; position t of a row's T columns holds
  log p(target_t | the tokens before it), target = the completion token itself unless the sample
  names explicit `targets` (Tinker data).
- Not thread-safe: one trainer lane per engine (at most one train task holds the trainer lease).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from marlaas.adapters import blob_from_peft, lora_config_from_dict
from marlaas.devices import release_heap
from marlaas.errors import TrainStateError
from marlaas.train import micro
from marlaas.train.batch import build_batch, gather
from marlaas.train.recompute import Recompute
from marlaas.train.records import AdamParams, Forward, LossFn, Part, Result, TrainSample, TrainState
from marlaas.train.routing import routed
from marlaas.types import AdapterBlob

__all__ = ["AdamParams", "Forward", "LossFn", "Part", "Result", "TrainSample", "TrainState", "TrainingEngine"]

_OPT_FORMAT = 1


@dataclass
class _Entry:
    name: str
    version: int
    keys: list[str]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


def _safe_name(key: str, serial: int) -> str:
    # PEFT adapter names become module-dict keys: no '.', and unique even if two keys sanitise alike.
    return f"j{serial}_{re.sub(r'[^A-Za-z0-9_]', '_', key)[:40]}"


class TrainingEngine:
    """Trains per-key LoRA adapters on one resident base model (see the module docstring)."""

    def __init__(self, base_path: str | Path, *, threads: int = 1, cache_size: int | str = "auto", device: str = "cpu",
                 dtype: str = "auto", checkpointing: bool = False, micro_bytes: float | None | str = "auto"):
        from marlaas.base.tiny import load_tokenizer
        from marlaas.devices import resolve_device, resolve_dtype, without_triton

        torch.set_num_threads(threads)
        self.base_path = Path(base_path)
        self.device = resolve_device(device)
        if cache_size == "auto":  # the CPU keeps only the job it steps (see the module docstring)
            cache_size = 1 if self.device.type == "cpu" else 32
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be 'auto' or an int >= 1 (got {cache_size!r})")
        self.cache_size = cache_size
        with without_triton(self.device):  # the tokenizer's module loads transformers' model code too
            from transformers import AutoModelForCausalLM

            self.tokenizer = load_tokenizer(self.base_path)
            self.base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=resolve_dtype(dtype, self.device))
        self.base.to(self.device)
        self.base.requires_grad_(False)
        dtype_bytes = next(self.base.parameters()).element_size()
        self._row_bytes = micro.row_bytes(self.base.config, dtype_bytes)
        self.recompute = Recompute(self.base, self.base.config, dtype_bytes, always=checkpointing)
        if micro_bytes == "auto":  # the CPU's passes within a quarter of the weights' bytes; a GPU's in one
            weights = sum(p.numel() for p in self.base.parameters()) * dtype_bytes
            micro_bytes = max(64 * 2**20, weights / 4) if self.device.type == "cpu" else None
        self.micro_bytes = micro_bytes or None
        self.model = None  # the PeftModel, created with the first adapter
        self._jobs: OrderedDict[str, _Entry] = OrderedDict()
        self._pinned: set[str] = set()
        self._serial = 0
        self._prompt_ids: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- cache

    def cached(self) -> dict[str, int]:
        """key -> version held in the cache (least recently used first)."""
        return {j: e.version for j, e in self._jobs.items()}

    def set_version(self, key: str, version: int) -> None:
        """Record the version a cached adapter now is (the job step counts its published versions)."""
        self._entry(key).version = version

    def parameters(self, key: str) -> list[torch.nn.Parameter]:
        """A cached adapter's LoRA parameters, in module order (the ones its optimiser steps)."""
        return list(self._entry(key).params)

    def pin(self, key: str) -> None:
        """Keep `key` cached while others come and go (until `unpin` or an explicit `evict`)."""
        self._pinned.add(key)

    def unpin(self, key: str) -> None:
        self._pinned.discard(key)

    def evict(self, key: str) -> None:
        """Drop an adapter and its optimiser from the cache (no-op if absent); it is unpinned."""
        self._pinned.discard(key)
        entry = self._jobs.pop(key, None)
        if entry is not None:
            self._delete(entry.name)

    def adapter(self, key: str, config, state: TrainState | None = None, seed: int = 0) -> None:
        """Make sure adapter `key` is cached with PEFT LoRA `config`: with `state`, (re)load it from
        that state; without, keep a cached one or create it fresh (B = 0, A drawn from `seed` under a
        forked RNG, so the same seed gives the same adapter in any process), at version 0."""
        if state is not None:
            self.load_state(key, state, config)
        elif key in self._jobs:
            self._jobs.move_to_end(key)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self._install(key, config, 0, None, None)

    def load_state(self, key: str, state: TrainState, config=None) -> None:
        """Put `key` into the cache at `state.version` from a persisted state (replacing a cached one);
        `config` defaults to the state's own adapter config."""
        from safetensors.torch import load as st_load

        if config is None:
            config = lora_config_from_dict(state.adapter.config, inference_mode=False)
        self._install(key, config, state.version, st_load(state.adapter.weights), state.optimizer)

    def _entry(self, key: str) -> _Entry:
        entry = self._jobs.get(key)
        if entry is None:
            raise TrainStateError(f"adapter {key} is not in the trainer cache")
        self._jobs.move_to_end(key)
        return entry

    def _delete(self, name: str) -> None:
        with warnings.catch_warnings():
            # PEFT warns when the deleted adapter was active; the next pass activates its own anyway.
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(name)

    def _add_adapter(self, key: str, config) -> str:
        from peft import get_peft_model

        self._serial += 1
        name = _safe_name(key, self._serial)
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        return name

    def _install(self, key: str, config, version: int, load: dict | None, opt_bytes: bytes | None) -> None:
        """Create the adapter (+ optimiser), replacing any cached entry; evict the LRU key."""
        from peft import set_peft_model_state_dict

        old = self._jobs.pop(key, None)
        # Add the new adapter before deleting the old one so the PeftModel never has none.
        name = self._add_adapter(key, config)
        try:
            if load is not None:
                res = set_peft_model_state_dict(self.model, load, adapter_name=name)
                unexpected = [k for k in res.unexpected_keys if "lora_" in k]
                missing = [k for k in res.missing_keys if f".{name}." in k]
                if unexpected or missing:
                    raise TrainStateError(
                        f"adapter state of {key} does not fit its config "
                        f"({len(missing)} missing, {len(unexpected)} unexpected keys)"
                    )
            keys, params = self._adapter_params(name)
            # lr 0 until the first optim_step, which sets every hyperparameter.
            optimizer = torch.optim.AdamW(params, lr=0.0, betas=AdamParams.betas, weight_decay=0.0)
            if opt_bytes is not None:
                saved = torch.load(io.BytesIO(opt_bytes), weights_only=True, map_location="cpu")
                if saved.get("format") != _OPT_FORMAT or saved.get("keys") != keys:
                    raise TrainStateError(f"optimizer state of {key} does not match its adapter")
                optimizer.load_state_dict(saved["optimizer"])
        except BaseException:
            self._delete(name)
            if old is not None:
                self._delete(old.name)
            raise
        if old is not None:
            self._delete(old.name)
        self._jobs[key] = _Entry(name=name, version=version, keys=keys, params=params, optimizer=optimizer)
        while len(self._jobs) > self.cache_size:
            victim = next((k for k in self._jobs if k not in self._pinned and k != key), None)
            if victim is None:
                break  # all pinned: the cache holds more for now
            self.evict(victim)

    def _adapter_params(self, name: str) -> tuple[list[str], list[torch.nn.Parameter]]:
        # Keys in PEFT's saved format (adapter name removed), in module order: stable across processes.
        marker = f".{name}."
        keys, params = [], []
        for n, p in self.model.named_parameters():
            if marker in n:
                keys.append(n.replace(marker, "."))
                params.append(p)
        if not params:
            raise TrainStateError(f"LoRA adapter {name} matched no module of the base model")
        return keys, params

    def _trainable(self, entries: list[_Entry]) -> None:
        # set_adapter() and leaving disable_adapter() reset requires_grad: exactly these adapters train.
        for p in self.model.parameters():
            p.requires_grad_(False)
        for e in entries:
            for p in e.params:
                p.requires_grad_(True)

    # ----------------------------------------------------------------- blobs

    def adapter_blob(self, key: str) -> AdapterBlob:
        """The cached adapter as PEFT files (config dict + safetensors bytes)."""
        return blob_from_peft(self.model, self._entry(key).name)

    def optimizer_bytes(self, key: str) -> bytes:
        """The cached optimiser state (torch.save of a dict of tensors, lists and numbers)."""
        entry = self._entry(key)
        sd = entry.optimizer.state_dict()
        if self.device.type != "cpu":  # the store holds CPU tensors: any host can load them
            sd["state"] = {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in st.items()}
                           for k, st in sd["state"].items()}
        buf = io.BytesIO()
        torch.save({"format": _OPT_FORMAT, "keys": entry.keys, "optimizer": sd}, buf)
        return buf.getvalue()

    def state(self, key: str) -> TrainState:
        """The cached adapter as a TrainState."""
        return TrainState(self._entry(key).version, self.adapter_blob(key), self.optimizer_bytes(key))

    # ----------------------------------------------------------------- batches

    def _ids(self, s: TrainSample) -> list[int]:
        if s.prompt_ids is not None:
            ids = list(s.prompt_ids)
        elif (ids := self._prompt_ids.get(s.prompt)) is None:
            ids = self.tokenizer(s.prompt)["input_ids"]
            if len(self._prompt_ids) > 4096:
                self._prompt_ids.clear()
            self._prompt_ids[s.prompt] = ids
        if not ids:
            raise ValueError("a prompt must have at least one token")
        return ids

    def _batch(self, samples: list[TrainSample]):
        return build_batch(samples, self._ids, self.tokenizer.pad_token_id or 0, self.device)

    def _logits(self, model, input_ids, attn, positions, T: int) -> torch.Tensor:
        # Completions are right-aligned, so the logits that predict them are the T before the last.
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, logits_to_keep=T + 1,
                    use_cache=False)
        return out.logits[:, :-1, :]

    @torch.no_grad()
    def completion_logprobs(
        self, key: str | None, samples: list[TrainSample], temperature: float = 1.0
    ) -> list[list[float]]:
        """Log-probs of each sample's completion tokens under a cached adapter (None = base), eval mode."""
        if not samples:
            return []
        input_ids, attn, positions, targets_B_T, _, _, T = self._batch(samples)
        if key is None and self.model is None:
            lp = gather(self._logits(self.base, input_ids, attn, positions, T), targets_B_T, temperature)
        elif key is None:
            with self.model.disable_adapter():
                lp = gather(self._logits(self.model, input_ids, attn, positions, T), targets_B_T, temperature)
        else:
            entry = self._entry(key)
            self.model.set_adapter(entry.name)
            self.model.eval()
            lp = gather(self._logits(self.model, input_ids, attn, positions, T), targets_B_T, temperature)
        return [lp[i, T - len(s.completion_ids):].tolist() if s.completion_ids else [] for i, s in enumerate(samples)]

    # ----------------------------------------------------------------- training primitives

    def routable(self) -> str | None:
        """Why several adapters cannot share one routed pass now (None: they can)."""
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        for m in self.model.modules() if self.model is not None else ():
            if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear):
                return f"LoRA layer type {type(m).__name__} is not routed"
        return None

    def forward_backward(self, key: str, samples: list[TrainSample], loss: LossFn, temperature: float = 1.0,
                         *, ref: bool = False, prox: bool = False, backward: bool = True,
                         additive: bool = False) -> Result:
        """One forward over `key`'s samples in train mode, `loss(Forward)`, and (with `backward`) its
        gradient accumulated into the adapter's `.grad` (cleared only by `optim_step`)."""
        part = Part(key, samples, loss, temperature, ref, prox, additive)
        return self.forward_backward_many([part], backward=backward)[0]

    def forward_backward_many(self, parts: list[Part], *, backward: bool = True) -> list[Result]:
        """`forward_backward` for several keys in ONE pass: the parts' batches stacked row-wise (left-
        padded to one length), each LoRA layer routed per block of rows, one backward on the sum of
        the parts' losses (each adapter's gradient is its own part's: rows never mix). When every
        part's loss is additive and the rows' activations exceed `micro_bytes`, the rows run in
        consecutive micro-batches whose gradients accumulate (`marlaas.train.micro`)."""
        keys = [p.key for p in parts]
        if len(set(keys)) != len(keys):
            raise ValueError(f"a pass takes each key once (got {keys})")
        if not parts or any(not p.samples for p in parts):
            raise ValueError("every part of a pass needs at least one sample")
        if len(parts) > 1 and (why := self.routable()) is not None:
            raise ValueError(f"cannot route several adapters in one pass: {why}")
        for k in keys:
            self._entry(k)
        try:
            ranges = self._micro_ranges(parts)
            if len(ranges) <= 1:
                return self._pass(parts, backward, None)
            pieces: list[list[Result]] = [[] for _ in parts]
            for chunk in micro.split_parts(parts, ranges):
                sub = [replace(parts[i], samples=parts[i].samples[r.start:r.stop]) for i, r in chunk]
                for (i, _), res in zip(chunk, self._pass(sub, backward, [r for _, r in chunk])):
                    pieces[i].append(res)
            return [micro.merge_results(pc, p.samples) for pc, p in zip(pieces, parts)]
        finally:
            release_heap(self.device)

    def _micro_ranges(self, parts: list[Part]) -> list[range]:
        """The pass's micro-batches over its rows (concatenated in part order); one unless every part's
        loss is additive and the rows exceed `micro_bytes`."""
        n = sum(len(p.samples) for p in parts)
        if self.micro_bytes is None or not all(p.additive for p in parts):
            return [range(n)]
        shapes = [(len(self._ids(s)) + len(s.completion_ids), len(s.completion_ids)) for p in parts for s in p.samples]
        return micro.plan(shapes, *self._row_bytes, self.micro_bytes)

    def _pass(self, parts: list[Part], backward: bool, ranges: list[range] | None) -> list[Result]:
        """One forward (and backward) over the parts' rows together; `ranges`: where each part's rows
        stand in the caller's part (a micro-batch)."""
        entries = [self._entry(p.key) for p in parts]
        batches = [self._batch(p.samples) for p in parts]
        model, solo = self.model, len(parts) == 1
        if solo:
            input_ids, attn, positions = batches[0][:3]
        else:
            L = max(b[0].shape[1] for b in batches)
            pad = self.tokenizer.pad_token_id or 0
            F = torch.nn.functional
            input_ids = torch.cat([F.pad(b[0], (L - b[0].shape[1], 0), value=pad) for b in batches])
            attn = torch.cat([F.pad(b[1], (L - b[1].shape[1], 0), value=0) for b in batches])
            positions = torch.cat([F.pad(b[2], (L - b[2].shape[1], 0), value=0) for b in batches])
        T = max(b[6] for b in batches)
        names, sizes = [e.name for e in entries], [len(p.samples) for p in parts]

        def per_part(logits) -> list[torch.Tensor]:
            out, start = [], 0
            for p, b, n in zip(parts, batches, sizes):
                out.append(gather(logits[start:start + n], b[3], p.temperature))
                start += n
            return out

        def forward():
            return self._logits(model, input_ids, attn, positions, T)

        # Routed through the backward too: a recomputing layer runs its forward again there.
        with contextlib.nullcontext() if solo else routed(model, names, sizes):
            model.train()
            refs: list = [None] * len(parts)
            if any(p.ref for p in parts):
                # Before the trainable pass: leaving disable_adapter() resets requires_grad.
                with torch.no_grad(), model.disable_adapter():
                    refs = [r if p.ref else None for p, r in zip(parts, per_part(forward()))]
            if solo:
                model.set_adapter(names[0])
            proxes: list = [None] * len(parts)
            if any(p.prox for p in parts):
                model.eval()
                with torch.no_grad():
                    proxes = [x if p.prox else None for p, x in zip(parts, per_part(forward()))]
                model.train()
            self._trainable(entries)
            layers = self.recompute.for_pass(*input_ids.shape, T + 1, self._row_bytes, self.micro_bytes) \
                if backward else contextlib.nullcontext()
            with layers, torch.set_grad_enabled(backward):
                logps = per_part(forward())
                fwds = [Forward(p.samples, lp, b[4], b[5], r, x, None if ranges is None else list(ranges[i]))
                        for i, (p, lp, b, r, x) in enumerate(zip(parts, logps, batches, refs, proxes))]
                losses = [p.loss(f) for p, f in zip(parts, fwds)]
                if backward:
                    torch.stack([v for v, _ in losses]).sum().backward()
        out = []
        for f, (v, stats) in zip(fwds, losses):
            f.logp_B_T = f.logp_B_T.detach()
            out.append(Result(float(v.detach()), stats, f))
        return out

    def optim_step(self, key: str, adam: AdamParams) -> dict:
        """Apply `adam` to `key`'s accumulated gradients, then clear them. Returns `grad_norm` (when
        clipping) and `stepped` (False when nothing had a gradient or the norm was NaN/inf: a bad
        gradient would poison the weights and the moments for good)."""
        entry = self._entry(key)
        for g in entry.optimizer.param_groups:
            g.update(lr=adam.lr, betas=tuple(adam.betas), eps=adam.eps, weight_decay=adam.weight_decay)
        out: dict = {"stepped": False}
        if any(p.grad is not None for p in entry.params):
            if adam.clip > 0:
                out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(entry.params, adam.clip))
            if math.isfinite(out.get("grad_norm", 0.0)):
                entry.optimizer.step()
                out["stepped"] = True
        entry.optimizer.zero_grad(set_to_none=True)
        return out
