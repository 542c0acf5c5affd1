"""The training engine: one resident base model, one PEFT LoRA adapter + AdamW state per job.

One `PeftModel` wraps the base; each job is its own named adapter in it (job ids are mapped to safe
adapter names: PEFT forbids '.' in them). Adapters and their optimisers live in an LRU cache of
`cache_size` jobs; an evicted or foreign job is rebuilt from the `TrainState` its last published
version stored (adapter weights in PEFT's file format + the optimiser state), so any trainer
process can take any step and a crash loses nothing.

Invariants:
- The base weights never change: only the active job's LoRA parameters require grad and are in
  its optimiser (`set_adapter()` resets requires_grad, so the engine sets it after every switch).
- `step(job, version, ...)` trains the adapter AT `version` and leaves the cache holding the job at
  `version + 1`. Version 0 is the base itself (a fresh LoRA has B = 0); the adapter is created on
  the job's first step, deterministically from `spec.seed`.
- A step that fails evicts the job: the cache never holds a half-updated adapter. A step whose
  gradient is NaN/inf publishes the unchanged adapter (metrics `noop`, `nonfinite_grad`).
- One optimiser step per batch, so pi_prox = pi_theta at the step start (see `marlaas.train.rl`): the
  gradient pass gives it for free. The job's `rl` spec picks the objective (`job_loss`); only
  prox = 'recompute' with LoRA dropout > 0 runs an extra no-grad pass (`needs_prox_pass`).
- Not thread-safe: one trainer lane per engine (at most one train task holds the trainer lease).

Zero-advantage samples contribute nothing to the policy term and are not run through the model
(unless a KL term is on). With `rl.drop_zero_advantage` they are dropped from the loss's normaliser
too; without it the loss is rescaled so it equals the loss over the full batch.
"""

from __future__ import annotations

import io
import math
import re
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from marlaas.adapters import blob_from_peft
from marlaas.errors import MarlaasError
from marlaas.spec import JobSpec, LoraSpec
from marlaas.train import rl
from marlaas.train.schedule import spec_lr
from marlaas.types import AdapterBlob

_OPT_FORMAT = 1
GRAD_CLIP = 1.0
BETAS = (0.9, 0.999)


class TrainStateError(MarlaasError):
    """The trainer cannot take this step: no state for the version, or a state that does not fit."""


@dataclass
class TrainSample:
    """One sampled completion to train on (one row of a group).

    `completion_ids` include the EOS token when one was generated; `behav_logprobs` holds one
    sampling log-prob per completion token (log_softmax(logits / temperature) of the sampler).
    `loss_mask` (None = all ones) marks the tokens the policy is trained on: a tool episode's
    tool-result tokens are context, not actions (mask 0; their behaviour log-prob is unused).
    """

    prompt: str
    completion_ids: list[int]
    behav_logprobs: list[float]
    advantage: float
    loss_mask: list[int] | None = None

    @property
    def n_actions(self) -> int:
        """Tokens the loss counts (mask 1)."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))


@dataclass
class TrainState:
    """What a published version persists so any trainer can continue the job from it."""

    version: int
    adapter: AdapterBlob
    optimizer: bytes


@dataclass
class StepOutput:
    """The adapter and optimiser after a step (version + 1), and the step's metrics."""

    adapter: AdapterBlob
    optimizer: bytes
    metrics: dict = field(default_factory=dict)


@dataclass
class _Job:
    name: str
    version: int
    keys: list[str]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


def set_lr(optimizer: torch.optim.Optimizer, spec: JobSpec, step: int) -> float:
    """Put the job's scheduled rate for `step` (the version trained from) on every parameter group."""
    lr = spec_lr(spec, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def needs_prox_pass(spec: JobSpec) -> bool:
    """Whether the step runs a separate no-grad forward for pi_prox: only prox = 'recompute' with LoRA
    dropout > 0. Without dropout the gradient pass's detached log-probs ARE pi_prox (one optimiser step
    per batch), and 'a3po' / 'ppo' never need one."""
    loss = spec.rl.loss
    return loss.kind == "decoupled_ppo" and loss.prox == "recompute" and spec.lora.dropout > 0


def job_loss(
    spec: JobSpec,
    samples: list[TrainSample],
    kept: list[TrainSample],
    logp_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    behav_B_T: torch.Tensor,
    ref_B_T: torch.Tensor | None = None,
    prox_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """One job's step loss over its `kept` rows (the batch's tensors), as its `rl` spec selects.

    Normalisers: 'token' and 'sequence' count the kept rows, rescaled to the whole batch when
    `drop_zero_advantage` is off; 'constant' divides by K = max_new_tokens x len(samples) (Dr. GRPO's
    constant: independent of lengths, and every row handed to the trainer counts).
    `prox_B_T` is a recomputed pi_prox (see `needs_prox_pass`); None reads it off `logp_B_T`.
    """
    cfg = spec.rl
    adv_B = torch.tensor([s.advantage for s in kept], dtype=torch.float32, device=logp_B_T.device)
    loss, stats = rl.spec_loss(
        cfg, logp_B_T, behav_B_T, adv_B, mask_B_T, recomputed_prox_B_T=prox_B_T, ref_logprobs_B_T=ref_B_T,
        constant_norm=float(spec.max_new_tokens * max(len(samples), 1)),
    )  # fmt: skip
    if not cfg.drop_zero_advantage and len(kept) < len(samples):
        # Skipped rows still count in the normaliser: rescale to the full batch's loss.
        if cfg.aggregation == "token":
            loss = loss * mask_B_T.sum() / max(1, sum(s.n_actions for s in samples))
        elif cfg.aggregation == "sequence":
            loss = loss * sum(1 for s in kept if s.completion_ids) / sum(1 for s in samples if s.completion_ids)
    return loss, stats


def lora_config(lora: LoraSpec):
    """The PEFT LoraConfig for a job's LoraSpec."""
    from peft import LoraConfig

    targets = "all-linear" if lora.targets == "all-linear" else list(lora.targets)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _safe_name(job_id: str, serial: int) -> str:
    # PEFT adapter names become module-dict keys: no '.', and unique even if two ids sanitise alike.
    return f"j{serial}_{re.sub(r'[^A-Za-z0-9_]', '_', job_id)[:40]}"


class TrainingEngine:
    """Trains per-job LoRA adapters on one resident base model (see the module docstring)."""

    def __init__(self, base_path: str | Path, *, threads: int = 1, cache_size: int = 32, device: str = "cpu",
                 dtype: str = "auto"):
        from transformers import AutoModelForCausalLM

        from marlaas.base.tiny import load_tokenizer
        from marlaas.devices import resolve_device, resolve_dtype

        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        torch.set_num_threads(threads)
        self.base_path = Path(base_path)
        self.cache_size = cache_size
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(self.base_path)
        self.base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=resolve_dtype(dtype, self.device))
        self.base.to(self.device)
        self.base.requires_grad_(False)
        self.model = None  # the PeftModel, created with the first job's adapter
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._serial = 0
        self._prompt_ids: dict[str, list[int]] = {}

    # ----------------------------------------------------------------- cache

    def cached(self) -> dict[str, int]:
        """job_id -> version held in the cache (least recently used first)."""
        return {j: e.version for j, e in self._jobs.items()}

    def evict(self, job_id: str) -> None:
        """Drop a job's adapter and optimiser from the cache (no-op if absent)."""
        entry = self._jobs.pop(job_id, None)
        if entry is not None:
            self._delete(entry.name)

    def _delete(self, name: str) -> None:
        with warnings.catch_warnings():
            # PEFT warns when the deleted adapter was active; the next step activates its own anyway.
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(name)

    def _add_adapter(self, job_id: str, config) -> str:
        from peft import get_peft_model

        self._serial += 1
        name = _safe_name(job_id, self._serial)
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        return name

    def _install(self, job_id: str, config, version: int, load: dict | None, opt_bytes: bytes | None, lr: float):
        """Create the job's adapter (+ optimiser), replacing any cached entry; evict the LRU job."""
        from peft import set_peft_model_state_dict

        old = self._jobs.pop(job_id, None)
        # Add the new adapter before deleting the old one so the PeftModel never has none.
        name = self._add_adapter(job_id, config)
        try:
            if load is not None:
                res = set_peft_model_state_dict(self.model, load, adapter_name=name)
                unexpected = [k for k in res.unexpected_keys if "lora_" in k]
                missing = [k for k in res.missing_keys if f".{name}." in k]
                if unexpected or missing:
                    raise TrainStateError(
                        f"adapter state of job {job_id} does not fit its config "
                        f"({len(missing)} missing, {len(unexpected)} unexpected keys)"
                    )
            keys, params = self._adapter_params(name)
            optimizer = torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=0.0)
            if opt_bytes is not None:
                saved = torch.load(io.BytesIO(opt_bytes), weights_only=True, map_location="cpu")
                if saved.get("format") != _OPT_FORMAT or saved.get("keys") != keys:
                    raise TrainStateError(f"optimizer state of job {job_id} does not match its adapter")
                optimizer.load_state_dict(saved["optimizer"])
                for group in optimizer.param_groups:  # the spec's lr wins over a stored one
                    group["lr"] = lr
        except BaseException:
            self._delete(name)
            if old is not None:
                self._delete(old.name)
            raise
        if old is not None:
            self._delete(old.name)
        entry = _Job(name=name, version=version, keys=keys, params=params, optimizer=optimizer)
        self._jobs[job_id] = entry
        while len(self._jobs) > self.cache_size:
            lru = next(iter(self._jobs))
            self.evict(lru)
        return entry

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

    def _activate(self, entry: _Job) -> None:
        self.model.set_adapter(entry.name)
        # set_adapter() resets requires_grad: make exactly this job's LoRA weights trainable.
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in entry.params:
            p.requires_grad_(True)

    def load_state(self, job_id: str, spec: JobSpec, state: TrainState) -> None:
        """Put a job into the cache at `state.version` from a persisted state."""
        from peft import PeftConfig
        from safetensors.torch import load as st_load

        cfg = dict(state.adapter.config)
        cfg["inference_mode"] = False
        config = PeftConfig.from_peft_type(**cfg)
        if config.r != spec.lora.rank or float(config.lora_alpha) != float(spec.lora.alpha):
            raise TrainStateError(
                f"stored adapter of job {job_id} (r={config.r}, alpha={config.lora_alpha}) does not match "
                f"its spec (r={spec.lora.rank}, alpha={spec.lora.alpha})"
            )
        self._install(
            job_id, config, state.version, st_load(state.adapter.weights), state.optimizer, spec.learning_rate
        )

    def _entry_for(self, job_id: str, version: int, spec: JobSpec, state: TrainState | None) -> _Job:
        entry = self._jobs.get(job_id)
        if entry is not None and entry.version == version:
            self._jobs.move_to_end(job_id)
            return entry
        if state is not None:
            if state.version != version:
                raise TrainStateError(
                    f"job {job_id}: asked to train version {version} but the given state is version {state.version}"
                )
            self.load_state(job_id, spec, state)
            return self._jobs[job_id]
        if version == 0:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                return self._install(job_id, lora_config(spec.lora), 0, None, None, spec.learning_rate)
        held = f"holds version {entry.version}" if entry is not None else "does not hold it"
        raise TrainStateError(f"job {job_id}: no state for version {version} (the trainer cache {held})")

    # ----------------------------------------------------------------- blobs

    def adapter_blob(self, job_id: str) -> AdapterBlob:
        """The cached adapter of a job as PEFT files (config dict + safetensors bytes)."""
        return blob_from_peft(self.model, self._jobs[job_id].name)

    def optimizer_bytes(self, job_id: str) -> bytes:
        """The cached optimiser state of a job (torch.save of a dict of tensors, lists and numbers)."""
        entry = self._jobs[job_id]
        sd = entry.optimizer.state_dict()
        if self.device.type != "cpu":  # the store holds CPU tensors: any host can load them
            sd["state"] = {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in st.items()}
                           for k, st in sd["state"].items()}
        buf = io.BytesIO()
        torch.save({"format": _OPT_FORMAT, "keys": entry.keys, "optimizer": sd}, buf)
        return buf.getvalue()

    def state(self, job_id: str) -> TrainState:
        """The cached job as a TrainState."""
        return TrainState(self._jobs[job_id].version, self.adapter_blob(job_id), self.optimizer_bytes(job_id))

    # ----------------------------------------------------------------- maths

    def _ids(self, prompt: str) -> list[int]:
        ids = self._prompt_ids.get(prompt)
        if ids is None:
            ids = self.tokenizer(prompt)["input_ids"]
            if len(self._prompt_ids) > 4096:
                self._prompt_ids.clear()
            self._prompt_ids[prompt] = ids
        if not ids:
            raise ValueError("a prompt must have at least one token")
        return ids

    def _batch(self, samples: list[TrainSample]):
        """Left-padded input ids, attention mask, positions, and right-aligned completion tensors."""
        seqs, lens = [], []
        for i, s in enumerate(samples):
            if len(s.behav_logprobs) != len(s.completion_ids):
                raise ValueError(
                    f"sample {i}: {len(s.completion_ids)} completion tokens but {len(s.behav_logprobs)} logprobs"
                )
            if s.loss_mask is not None and len(s.loss_mask) != len(s.completion_ids):
                raise ValueError(f"sample {i}: {len(s.completion_ids)} tokens but {len(s.loss_mask)} mask values")
            seqs.append(self._ids(s.prompt) + list(s.completion_ids))
            lens.append(len(s.completion_ids))
        B, L, T = len(seqs), max(map(len, seqs)), max(lens)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((B, L), pad, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        mask_B_T = torch.zeros((B, T))
        behav_B_T = torch.zeros((B, T))
        for i, (seq, n) in enumerate(zip(seqs, lens)):
            input_ids[i, L - len(seq) :] = torch.tensor(seq)
            attn[i, L - len(seq) :] = 1
            if n:
                m = samples[i].loss_mask
                mask_B_T[i, T - n :] = 1 if m is None else torch.tensor(m, dtype=torch.float32)
                behav_B_T[i, T - n :] = torch.tensor(samples[i].behav_logprobs, dtype=torch.float32)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        return input_ids.to(dev), attn.to(dev), positions.to(dev), mask_B_T.to(dev), behav_B_T.to(dev), T

    @staticmethod
    def _logprobs(model, input_ids, attn, positions, T: int, temperature: float) -> torch.Tensor:
        # Completions are right-aligned, so the logits that predict them are the T before the last.
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, logits_to_keep=T + 1)
        logits_B_T_V = out.logits[:, :-1, :].float() / temperature
        targets_B_T = input_ids[:, -T:]
        return torch.log_softmax(logits_B_T_V, dim=-1).gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def completion_logprobs(
        self, job_id: str | None, samples: list[TrainSample], temperature: float = 1.0
    ) -> list[list[float]]:
        """Log-probs of each sample's completion tokens under a cached job's adapter (None = base)."""
        if not samples:
            return []
        input_ids, attn, positions, mask_B_T, _, T = self._batch(samples)
        if job_id is None and self.model is None:
            lp = self._logprobs(self.base, input_ids, attn, positions, T, temperature)
        elif job_id is None:
            with self.model.disable_adapter():
                lp = self._logprobs(self.model, input_ids, attn, positions, T, temperature)
        else:
            self._activate(self._jobs[job_id])
            self.model.eval()
            lp = self._logprobs(self.model, input_ids, attn, positions, T, temperature)
        return [lp[i, T - len(s.completion_ids) :].tolist() if s.completion_ids else [] for i, s in enumerate(samples)]

    # ----------------------------------------------------------------- step

    def step(
        self, job_id: str, version: int, spec: JobSpec, samples: list[TrainSample], state: TrainState | None
    ) -> StepOutput:
        """One policy-gradient step of `job_id` from adapter `version`; the cache then holds version + 1.

        `state` (the TrainState published with `version`) is needed unless version == 0 or the cache
        holds the job at `version`. Raises TrainStateError when neither is available.
        """
        t0 = time.perf_counter()
        entry = self._entry_for(job_id, version, spec, state)
        try:
            metrics = self._train(entry, spec, samples)
        except BaseException:
            self.evict(job_id)
            raise
        entry.version = version + 1
        out = StepOutput(adapter=self.adapter_blob(job_id), optimizer=self.optimizer_bytes(job_id), metrics=metrics)
        metrics["seconds"] = time.perf_counter() - t0
        for k, v in metrics.items():  # metrics travel as JSON: no NaN/inf
            if isinstance(v, float) and not math.isfinite(v):
                metrics[k] = None
        return out

    def _train(self, entry: _Job, spec: JobSpec, samples: list[TrainSample]) -> dict:
        cfg = spec.rl
        with_kl = cfg.kl_coef > 0
        kept = samples if with_kl else [s for s in samples if s.advantage != 0.0]
        metrics = {
            "loss": 0.0, "clip_frac": 0.0, "tis_mean": 0.0, "tis_trunc_frac": 0.0, "kl": 0.0,
            "grad_norm": 0.0, "n_tokens": 0, "n_samples": len(kept), "n_skipped": len(samples) - len(kept),
            "noop": False, "nonfinite_grad": False,
        }  # fmt: skip
        if not kept or not any(s.completion_ids for s in kept):
            # Nothing carries signal: publish the same weights and optimiser as version + 1.
            metrics["noop"] = True
            return metrics

        self._activate(entry)
        entry.optimizer.zero_grad(set_to_none=True)
        input_ids, attn, positions, mask_B_T, behav_B_T, T = self._batch(kept)
        prox_B_T = None
        if needs_prox_pass(spec):
            # With LoRA dropout the training pass is a perturbed policy, not pi_prox: recompute it.
            self.model.eval()
            with torch.no_grad():
                prox_B_T = self._logprobs(self.model, input_ids, attn, positions, T, spec.temperature)
        self.model.train()
        logp_B_T = self._logprobs(self.model, input_ids, attn, positions, T, spec.temperature)
        ref_B_T = None
        if with_kl:
            with torch.no_grad(), self.model.disable_adapter():
                ref_B_T = self._logprobs(self.model, input_ids, attn, positions, T, spec.temperature)
        loss, stats = job_loss(spec, samples, kept, logp_B_T, mask_B_T, behav_B_T, ref_B_T, prox_B_T)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(entry.params, GRAD_CLIP)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            metrics["lr"] = set_lr(entry.optimizer, spec, entry.version)
            entry.optimizer.step()
        else:
            # A NaN/inf gradient would poison the adapter and the moments for good: publish the
            # unchanged weights (like a no-op step) and flag it, so the job can go on.
            metrics.update(noop=True, nonfinite_grad=True)
        entry.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            m = mask_B_T > 0
            diff = (logp_B_T.detach() - behav_B_T)[m]
        metrics.update(stats)
        metrics.update(
            loss=loss.item(), grad_norm=float(grad_norm), n_tokens=int(mask_B_T.sum()),
            prox_minus_behav=float(diff.mean()) if diff.numel() else 0.0,
        )  # fmt: skip
        return metrics
