"""A job's RL step, solo or fused over several jobs: a caller of the training engine's public API.

`step(engine, job_id, version, spec, samples, state)` trains the job's adapter AT `version` and leaves
the engine's cache holding it at `version + 1`; `step_fused(engine, jobs)` does the same for several
jobs with ONE forward/backward (`TrainingEngine.forward_backward_many`), then each job's own clip and
AdamW step. Both are the same code: a solo step is a pass of one part.

Invariants:
- Version 0 is the base itself (a fresh LoRA has B = 0): the adapter is created on the job's first
  step, deterministically from `spec.seed`. Any other version comes from the cache or from the
  `TrainState` published with it (`ensure_job`); neither raises TrainStateError.
- A step that fails evicts its job(s): the cache never holds a half-updated adapter. A step whose
  gradient is NaN/inf publishes the unchanged adapter (metrics `noop`, `nonfinite_grad`).
- One optimiser step per batch, so pi_prox = pi_theta at the step start (see `marlaas.train.rl`): the
  gradient pass gives it for free. The job's `rl` spec picks the objective (`rl.job_loss`); only
  prox = 'recompute' with LoRA dropout > 0 runs an extra no-grad pass (`rl.needs_prox_pass`).
- Zero-advantage samples contribute nothing to the policy term and are not run through the model
  (unless a KL term is on). With `rl.drop_zero_advantage` they are dropped from the loss's normaliser
  too; without it the loss is rescaled so it equals the loss over the full batch.

Why a fused step's gradients equal the solo ones: rows never mix in a causal LM forward (attention,
norms and matmuls act per row; padding is masked), and adapter j's weights only touch rows of job j
(`marlaas.train.routing`), so dL/dtheta_j = dL_j/dtheta_j for L = sum_j L_j. Up to float rounding
(padding lengths and GEMM blocking differ) fused and solo steps agree; with LoRA dropout > 0 they
agree in distribution only (the dropout masks come from one RNG stream). `step_fused` falls back to
solo steps when fusion cannot be exact or useful: a single job, more jobs than the engine's cache
holds, or a LoRA layer type the router does not know (`TrainingEngine.routable`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from marlaas.adapters import lora_config_from_dict, lora_config_from_spec
from marlaas.errors import TrainStateError
from marlaas.spec import JobSpec
from marlaas.train import rl
from marlaas.train.engine import AdamParams, Forward, Part, TrainingEngine, TrainSample, TrainState
from marlaas.train.schedule import spec_lr
from marlaas.types import AdapterBlob

GRAD_CLIP = 1.0
BETAS = (0.9, 0.999)

Job = tuple[str, int, JobSpec, list[TrainSample], TrainState | None]
"""(job_id, version, spec, samples, state) of one step."""


@dataclass
class StepOutput:
    """The adapter and optimiser after a step (version + 1), and the step's metrics."""

    adapter: AdapterBlob
    optimizer: bytes
    metrics: dict = field(default_factory=dict)


def job_adam(spec: JobSpec, version: int) -> AdamParams:
    """The optimiser step of a job training from `version`: its scheduled rate, clip GRAD_CLIP."""
    return AdamParams(lr=spec_lr(spec, version), betas=BETAS, clip=GRAD_CLIP)


def ensure_job(engine: TrainingEngine, job_id: str, version: int, spec: JobSpec, state: TrainState | None) -> None:
    """Make the engine's cache hold `job_id` at `version`: cached, loaded from `state` (which must be
    that version, with the spec's rank and alpha), or fresh at version 0; else TrainStateError."""
    held = engine.cached().get(job_id)
    if held == version:
        engine.adapter(job_id, lora_config_from_spec(spec.lora))  # a cache hit: marks it recently used
        return
    if state is not None:
        if state.version != version:
            raise TrainStateError(
                f"job {job_id}: asked to train version {version} but the given state is version {state.version}"
            )
        config = lora_config_from_dict(state.adapter.config, inference_mode=False)
        if config.r != spec.lora.rank or float(config.lora_alpha) != float(spec.lora.alpha):
            raise TrainStateError(
                f"stored adapter of job {job_id} (r={config.r}, alpha={config.lora_alpha}) does not match "
                f"its spec (r={spec.lora.rank}, alpha={spec.lora.alpha})"
            )
        engine.load_state(job_id, state, config)
        return
    if version == 0:
        engine.evict(job_id)
        engine.adapter(job_id, lora_config_from_spec(spec.lora), seed=spec.seed)
        return
    where = f"holds version {held}" if held is not None else "does not hold it"
    raise TrainStateError(f"job {job_id}: no state for version {version} (the trainer cache {where})")


@dataclass
class _Step:
    job_id: str
    version: int
    spec: JobSpec
    samples: list[TrainSample]
    kept: list[TrainSample]
    metrics: dict

    def part(self) -> Part:
        def loss(f: Forward):
            return rl.job_loss(self.spec, self.samples, self.kept, f.logp_B_T, f.mask_B_T, f.behav_B_T,
                               f.ref_B_T, f.prox_B_T, rows=f.samples)

        return Part(self.job_id, self.kept, loss, self.spec.temperature, ref=self.spec.rl.kl_coef > 0,
                    prox=rl.needs_prox_pass(self.spec), additive=True)


def _prepare(engine: TrainingEngine, job_id: str, version: int, spec: JobSpec, samples: list[TrainSample],
             state: TrainState | None) -> _Step:
    ensure_job(engine, job_id, version, spec, state)
    kept = samples if spec.rl.kl_coef > 0 else [s for s in samples if s.advantage != 0.0]
    metrics = {
        "loss": 0.0, "clip_frac": 0.0, "tis_mean": 0.0, "tis_trunc_frac": 0.0, "kl": 0.0,
        "grad_norm": 0.0, "n_tokens": 0, "n_samples": len(kept), "n_skipped": len(samples) - len(kept),
        "noop": False, "nonfinite_grad": False,
    }  # fmt: skip
    if not kept or not any(s.completion_ids for s in kept):
        metrics["noop"] = True  # nothing carries signal: the same weights and optimiser become version + 1
    return _Step(job_id, version, spec, samples, kept, metrics)


def _train(engine: TrainingEngine, steps: list[_Step]) -> None:
    """One forward/backward over the steps' kept rows, then each job's own clipped AdamW step."""
    for s, res in zip(steps, engine.forward_backward_many([s.part() for s in steps])):
        adam = job_adam(s.spec, s.version)
        opt = engine.optim_step(s.job_id, adam)
        grad_norm = opt.get("grad_norm", 0.0)
        if opt["stepped"]:
            s.metrics["lr"] = adam.lr
        elif not math.isfinite(grad_norm):
            s.metrics.update(noop=True, nonfinite_grad=True)  # the unchanged weights are published
        f = res.forward
        diff = (f.logp_B_T - f.behav_B_T)[f.mask_B_T > 0]
        s.metrics.update(res.stats)
        s.metrics.update(
            loss=res.loss, grad_norm=grad_norm, n_tokens=int(f.mask_B_T.sum()),
            prox_minus_behav=float(diff.mean()) if diff.numel() else 0.0,
        )  # fmt: skip


def _run(engine: TrainingEngine, jobs: list[Job], fuse: bool) -> list[StepOutput]:
    t0 = time.perf_counter()
    try:
        steps = [_prepare(engine, *j) for j in jobs]
    except BaseException:
        if fuse:
            for j in jobs:
                engine.evict(j[0])
        raise
    active = [s for s in steps if not s.metrics["noop"]]
    fused = fuse and len(active) > 1 and engine.routable() is None
    try:
        for group in [active] if fused else [[s] for s in active]:
            _train(engine, group)
    except BaseException:
        for s in steps:
            engine.evict(s.job_id)
        raise
    outs = []
    for s in steps:
        engine.set_version(s.job_id, s.version + 1)
        if fuse:
            s.metrics["fused_jobs"] = len(active) if fused else 1
        out = StepOutput(engine.adapter_blob(s.job_id), engine.optimizer_bytes(s.job_id), s.metrics)
        s.metrics["seconds"] = time.perf_counter() - t0
        for k, v in s.metrics.items():  # metrics travel as JSON: no NaN/inf
            if isinstance(v, float) and not math.isfinite(v):
                s.metrics[k] = None
        outs.append(out)
    return outs


def step(engine: TrainingEngine, job_id: str, version: int, spec: JobSpec, samples: list[TrainSample],
         state: TrainState | None) -> StepOutput:
    """One policy-gradient step of `job_id` from adapter `version`; the cache then holds version + 1.

    `state` (the TrainState published with `version`) is needed unless version == 0 or the cache
    holds the job at `version`. Raises TrainStateError when neither is available.
    """
    return _run(engine, [(job_id, version, spec, samples, state)], fuse=False)[0]


def fusable(engine: TrainingEngine, n_jobs: int) -> str | None:
    """Why `n_jobs` jobs cannot be fused on this engine now (None: they can)."""
    if n_jobs < 2:
        return "fewer than two jobs"
    if n_jobs > engine.cache_size:
        return f"{n_jobs} jobs exceed the adapter cache ({engine.cache_size})"
    return engine.routable()


def step_fused(engine: TrainingEngine, jobs: list[Job]) -> list[StepOutput]:
    """One fused step for each `(job_id, version, spec, samples, state)`; outputs in input order.

    Same contract per job as `step`; on any failure every job of the call is evicted. Metrics add
    `fused_jobs` (how many jobs shared the pass)."""
    ids = [j[0] for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a fused step takes each job once (got {ids})")
    if fusable(engine, len(jobs)) is not None:
        return [step(engine, *j) for j in jobs]
    return _run(engine, jobs, fuse=True)
