"""Fused multi-tenant training step: one forward/backward over several jobs' batches.

`step_fused(engine, jobs)` trains several jobs of one `TrainingEngine` at once. Each job's kept
samples are batched exactly as its solo step batches them (`TrainingEngine._batch`); the per-job
batches are stacked (left-padded to a common length) into one batch whose rows are contiguous per
job, and every `peft` LoRA `Linear` is switched, for the duration of the forward, to per-segment
routing (`marlaas.train.routing`):

    y[rows_j] = W x[rows_j] + s_j * B_j A_j dropout_j(x[rows_j])      (s_j = alpha_j / r_j)

(`x.split(sizes)` in, `torch.cat` out: no full-size scatter per adapter, unlike PEFT's
`adapter_names` path, which also refuses train mode). Job j's log-probs are read from its own rows
with its own temperature, its loss is computed exactly as in its solo step (same normaliser), and
one backward runs on  L = sum_j L_j.

Why the gradients equal the solo ones: rows never mix in a causal LM forward (attention, norms and
matmuls act per row; padding is masked), and adapter j's weights only touch rows of job j, so
dL/dtheta_j = dL_j/dtheta_j. Then each job clips its own gradient (GRAD_CLIP) and takes its own
AdamW step, as `TrainingEngine.step` does. Up to float rounding (padding lengths and GEMM blocking
differ), fused and solo steps agree; with LoRA dropout > 0 they agree in distribution only (the
dropout masks come from one RNG stream).

Falls back to one solo step per job when fusion cannot be exact or useful: a single job, more jobs
than the engine's cache holds, or any LoRA layer that is not a plain `Linear` (the router only
knows that layer type). Losses come from the solo step's own `job_loss`; the rest of the step
(kept rows, KL reference pass, pi_prox pass, clip, metrics) mirrors `TrainingEngine._train`, and
`tests/integration/test_fused.py` fails if the two drift apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from marlaas.spec import JobSpec
from marlaas.train.engine import (
    GRAD_CLIP,
    StepOutput,
    TrainingEngine,
    TrainSample,
    TrainState,
    job_loss,
    needs_prox_pass,
    set_lr,
)
from marlaas.train.routing import routed


@dataclass
class _Part:
    """One job of a fused step: its cache entry, spec, samples and (once prepared) its batch."""

    job_id: str
    version: int
    spec: JobSpec
    samples: list[TrainSample]
    entry: object = None
    kept: list[TrainSample] | None = None
    batch: tuple | None = None
    metrics: dict | None = None


def fusable(engine: TrainingEngine, n_jobs: int) -> str | None:
    """Why `n_jobs` jobs cannot be fused on this engine now (None: they can)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    if n_jobs < 2:
        return "fewer than two jobs"
    if n_jobs > engine.cache_size:
        return f"{n_jobs} jobs exceed the adapter cache ({engine.cache_size})"
    if engine.model is not None:
        for m in engine.model.modules():
            if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear):
                return f"LoRA layer type {type(m).__name__} is not routed"
    return None


def _empty_metrics(kept: list, samples: list) -> dict:
    return {
        "loss": 0.0, "clip_frac": 0.0, "tis_mean": 0.0, "tis_trunc_frac": 0.0, "kl": 0.0,
        "grad_norm": 0.0, "n_tokens": 0, "n_samples": len(kept), "n_skipped": len(samples) - len(kept),
        "noop": False, "nonfinite_grad": False,
    }  # fmt: skip


def _stack(batches: list[tuple], pad: int):
    """Left-pad per-job (input_ids, attn, positions) to one length and stack them row-wise."""
    L = max(b[0].shape[1] for b in batches)
    ids, attn, pos = [], [], []
    for input_ids, a, p, *_ in batches:
        extra = L - input_ids.shape[1]
        ids.append(torch.nn.functional.pad(input_ids, (extra, 0), value=pad))
        attn.append(torch.nn.functional.pad(a, (extra, 0), value=0))
        pos.append(torch.nn.functional.pad(p, (extra, 0), value=0))
    return torch.cat(ids), torch.cat(attn), torch.cat(pos)


def _loss(part: _Part, logp_B_T: torch.Tensor, ref_B_T: torch.Tensor | None, prox_B_T: torch.Tensor | None):
    """Job's loss from its log-probs through the solo step's own `job_loss` (same normaliser)."""
    _, _, _, mask_B_T, behav_B_T, _ = part.batch
    return job_loss(part.spec, part.samples, part.kept, logp_B_T, mask_B_T, behav_B_T, ref_B_T, prox_B_T)


def _per_job_logprobs(logits_B_T_V, input_ids, parts: list[_Part]) -> list[torch.Tensor]:
    # Completions are right-aligned: job j's T_j predicting logits are the last T_j kept positions.
    out, start = [], 0
    for p in parts:
        n, T = len(p.kept), p.batch[5]
        lg = logits_B_T_V[start : start + n, -T:, :].float() / p.spec.temperature
        tgt = input_ids[start : start + n, -T:]
        out.append(torch.log_softmax(lg, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
        start += n
    return out


def fused_backward(engine: TrainingEngine, parts: list[_Part]) -> list[torch.Tensor]:
    """One forward/backward over the parts' stacked batches; leaves each job's gradient in its
    adapter's `.grad` and fills `part.metrics`. Returns the per-job log-probs (detached)."""
    model = engine.model
    for p in parts:
        p.entry.optimizer.zero_grad(set_to_none=True)
        p.batch = engine._batch(p.kept)
    model.train()
    input_ids, attn, positions = _stack([p.batch for p in parts], engine.tokenizer.pad_token_id or 0)
    T_max = max(p.batch[5] for p in parts)
    kw = dict(input_ids=input_ids, attention_mask=attn, position_ids=positions, logits_to_keep=T_max + 1)
    refs: list = [None] * len(parts)
    if any(p.spec.rl.kl_coef > 0 for p in parts):
        # Before the trainable forward: leaving disable_adapter() resets requires_grad to the active
        # adapter only, and autograd skips leaves that stopped requiring grad.
        with torch.no_grad(), model.disable_adapter():
            ref_logits = model(**kw).logits[:, :-1, :]
        refs = [
            r if p.spec.rl.kl_coef > 0 else None for p, r in zip(parts, _per_job_logprobs(ref_logits, input_ids, parts))
        ]
        del ref_logits
    names, sizes = [p.entry.name for p in parts], [len(p.kept) for p in parts]
    proxes: list = [None] * len(parts)
    if any(needs_prox_pass(p.spec) for p in parts):
        # As in the solo step: with LoRA dropout, pi_prox is a separate no-dropout (eval) pass.
        model.eval()
        with torch.no_grad(), routed(model, names, sizes):
            prox_logits = model(**kw).logits[:, :-1, :]
        model.train()
        proxes = [
            x if needs_prox_pass(p.spec) else None
            for p, x in zip(parts, _per_job_logprobs(prox_logits, input_ids, parts))
        ]
        del prox_logits
    for q in model.parameters():
        q.requires_grad_(False)
    for p in parts:
        for q in p.entry.params:
            q.requires_grad_(True)
    with routed(model, names, sizes):
        logits = model(**kw).logits[:, :-1, :]
    logps = _per_job_logprobs(logits, input_ids, parts)
    losses = []
    for p, logp, ref, prox in zip(parts, logps, refs, proxes):
        loss, stats = _loss(p, logp, ref, prox)
        losses.append(loss)
        p.metrics.update(stats)
        p.metrics["loss"] = loss.item()
    torch.stack(losses).sum().backward()
    return [lp.detach() for lp in logps]


def _optimizer_steps(parts: list[_Part], logps: list[torch.Tensor]) -> None:
    for p, logp in zip(parts, logps):
        grad_norm = torch.nn.utils.clip_grad_norm_(p.entry.params, GRAD_CLIP)
        if bool(torch.isfinite(grad_norm)):
            p.metrics["lr"] = set_lr(p.entry.optimizer, p.spec, p.version)
            p.entry.optimizer.step()
        else:
            p.metrics.update(noop=True, nonfinite_grad=True)
        p.entry.optimizer.zero_grad(set_to_none=True)
        mask_B_T, behav_B_T = p.batch[3], p.batch[4]
        diff = (logp - behav_B_T)[mask_B_T > 0]
        p.metrics.update(
            grad_norm=float(grad_norm), n_tokens=int(mask_B_T.sum()),
            prox_minus_behav=float(diff.mean()) if diff.numel() else 0.0,
        )  # fmt: skip


def step_fused(
    engine: TrainingEngine,
    jobs: list[tuple[str, int, JobSpec, list[TrainSample], TrainState | None]],
) -> list[StepOutput]:
    """One fused step for each `(job_id, version, spec, samples, state)`; outputs in input order.

    Same contract per job as `TrainingEngine.step` (the cache then holds each job at version + 1;
    `state` needed unless version == 0 or cached). On any failure every job of the call is evicted.
    """
    ids = [j[0] for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a fused step takes each job once (got {ids})")
    if fusable(engine, len(jobs)) is not None:
        return [engine.step(*j) for j in jobs]
    t0 = time.perf_counter()
    parts = [_Part(job_id, version, spec, samples) for job_id, version, spec, samples, _ in jobs]
    try:
        for p, (_, _, _, _, state) in zip(parts, jobs):
            p.entry = engine._entry_for(p.job_id, p.version, p.spec, state)
        if fusable(engine, len(jobs)) is not None:  # the first install may add a non-Linear layer type
            raise _Unfusable
        for p in parts:
            with_kl = p.spec.rl.kl_coef > 0
            p.kept = p.samples if with_kl else [s for s in p.samples if s.advantage != 0.0]
            p.metrics = _empty_metrics(p.kept, p.samples)
            if not p.kept or not any(s.completion_ids for s in p.kept):
                p.metrics["noop"] = True
        active = [p for p in parts if not p.metrics["noop"]]
        if len(active) == 1:
            active[0].metrics = engine._train(active[0].entry, active[0].spec, active[0].samples)
        elif active:
            _optimizer_steps(active, fused_backward(engine, active))
    except _Unfusable:
        return [engine.step(*j) for j in jobs]
    except BaseException:
        for p in parts:
            engine.evict(p.job_id)
        raise
    outs = []
    seconds = time.perf_counter() - t0
    for p in parts:
        p.entry.version = p.version + 1
        metrics = p.metrics
        metrics.update(seconds=seconds, fused_jobs=len(active))
        for k, v in metrics.items():  # metrics travel as JSON: no NaN/inf
            if isinstance(v, float) and not math.isfinite(v):
                metrics[k] = None
        outs.append(StepOutput(engine.adapter_blob(p.job_id), engine.optimizer_bytes(p.job_id), metrics))
    return outs


class _Unfusable(Exception):
    pass
