"""Micro-batches of a training pass: how the trainer splits a step's rows so one forward/backward holds
a bounded amount of activations, and how it merges the pieces back into one result.

A backward pass keeps, for every row-token, the inputs of each LoRA-adapted projection and the MLP's
activations of every layer, and for every completion position the logits' float copy and their
log-softmax: on SmolLM2-135M one 16-row step of 58-token rows held 2.3 GB, 4.5x the model's weights.
The trainer therefore runs a step's rows in consecutive micro-batches, each within an activation
budget, and accumulates their gradients. That is exact when the caller's loss is ADDITIVE over rows
(`Part.additive`: its value over all rows equals the sum of its values over the micro-batches, each
normalised by whole-batch counts; `marlaas.train.rl.job_loss` and the Tinker losses are): the summed
gradients are the one-pass gradients up to float rounding. Pure planning (`plan`, `row_bytes`) and
tensor merging (`merge_forwards`, `merge_stats`); unit-tested in tests/unit/test_micro.py.
"""

from __future__ import annotations

import math

import torch

from marlaas.train.records import Forward, Part, Result

# Activation bytes kept for the backward pass per row-token and layer, in units of the hidden and
# intermediate sizes (float32 on the CPU): the adapted projections' inputs, the attention's q/k/v and
# output, the norms' inputs and the MLP's gate, up, activation and product, with the autograd graph's
# own copies. Calibrated on SmolLM2-135M (30 layers, hidden 576, intermediate 1536): one pass over 16
# rows of 60 tokens peaked 2.5 GB above the loaded engine, 2.64 MB per row-token, which 17 hidden and
# 7 intermediate vectors per layer (2.47 MB) and the logits (below) give; bench/memory.py measures it.
HIDDEN_VECTORS = 17
INTER_VECTORS = 7
LOGIT_COPIES = 4  # per completion position: the logits, their float copy, log-softmax and its gradient


def row_bytes(config, dtype_bytes: int) -> tuple[int, int]:
    """(bytes per row-token, bytes per completion position) a training pass keeps for its backward."""
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    hidden = int(getattr(config, "hidden_size", 1) or 1)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", 1) or 1)
    return dtype_bytes * layers * (HIDDEN_VECTORS * hidden + INTER_VECTORS * inter), 4 * LOGIT_COPIES * vocab


def layer_bytes(config, dtype_bytes: int) -> tuple[int, float, float]:
    """(layers, bytes per row-token one layer keeps for its backward, bytes per row-token it keeps
    when it recomputes its activations in the backward instead: its input, one hidden vector)."""
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    hidden = int(getattr(config, "hidden_size", 1) or 1)
    return layers, row_bytes(config, dtype_bytes)[0] / layers, float(dtype_bytes * hidden)


def pass_bytes(rows: int, width: int, positions: int, per_token: float, per_position: float) -> float:
    """What one pass of `rows` left-padded to `width` tokens, with logits at `positions` (the
    completion columns plus one), keeps for its backward."""
    return rows * (width * per_token + positions * per_position)


def recompute_layers(cost: float, budget_bytes: float | None, row_tokens: int, layers: int, per_layer: float,
                     kept_per_layer: float) -> int:
    """How many layers of a pass (the first ones: their recompute comes when the later layers' kept
    activations are already freed) recompute their activations in the backward so that the pass's
    `cost` bytes fit `budget_bytes`: each saves `row_tokens` x (`per_layer` - `kept_per_layer`).
    0 when it fits or there is no budget; every layer when even that does not fit. A micro-batch of
    one row longer than the budget (which `plan` cannot split further) pays recompute for just the
    layers it must, instead of holding its whole activations (or recomputing all of them)."""
    if budget_bytes is None or cost <= budget_bytes or layers < 1:
        return 0
    saving = row_tokens * (per_layer - kept_per_layer)
    if saving <= 0:
        return layers
    return min(layers, math.ceil((cost - budget_bytes) / saving))


def plan(shapes: list[tuple[int, int]], per_token: int, per_position: int, budget_bytes: float | None) -> list[range]:
    """Split rows (each `(length, completion positions)`, in order) into consecutive micro-batches whose
    cost, rows x (longest row x `per_token` + most positions x `per_position`) as left padding lays
    them out, is within `budget_bytes`. A row that alone exceeds it gets a micro-batch of its own;
    None: one micro-batch. Returns each micro-batch's row range."""
    if budget_bytes is None or not shapes:
        return [range(len(shapes))] if shapes else []
    out: list[range] = []
    start, width, positions = 0, 0, 0
    for i, (length, t) in enumerate(shapes):
        w, p = max(width, length), max(positions, t + 1)
        if i > start and pass_bytes(i - start + 1, w, p, per_token, per_position) > budget_bytes:
            out.append(range(start, i))
            start, w, p = i, length, t + 1
        width, positions = w, p
    out.append(range(start, len(shapes)))
    return out


def merge_forwards(pieces: list[Forward], samples: list) -> Forward:
    """One Forward over `samples` from the Forwards of its consecutive micro-batches (columns left-
    padded to the widest: completions stay right-aligned, padding has mask 0)."""
    T = max(f.logp_B_T.shape[1] for f in pieces)

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(f, name) for f in pieces]
        if any(p is None for p in parts):
            return None
        return torch.cat([torch.nn.functional.pad(p, (T - p.shape[1], 0)) for p in parts])

    return Forward(samples, cat("logp_B_T"), cat("mask_B_T"), cat("behav_B_T"), cat("ref_B_T"), cat("prox_B_T"))


def merge_stats(stats: list[dict], tokens: list[float]) -> dict:
    """Per-token means of the micro-batches (each weighted by its masked tokens) as the whole batch's.
    Non-numeric values are taken from the last micro-batch that has them."""
    total = sum(tokens)
    out: dict = {}
    for k in dict.fromkeys(k for s in stats for k in s):
        vals = [(s[k], n) for s, n in zip(stats, tokens) if k in s]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in vals):
            out[k] = sum(v * n for v, n in vals) / total if total > 0 else float(vals[-1][0])
        else:
            out[k] = vals[-1][0]
    return out


def split_parts(parts: list[Part], ranges: list[range]) -> list[list[tuple[int, range]]]:
    """The rows of `parts` (concatenated in order) cut at `ranges`: per micro-batch, each part it
    touches as (part index, that part's row range)."""
    out = []
    for r in ranges:
        chunk, offset = [], 0
        for i, p in enumerate(parts):
            lo, hi = max(r.start, offset), min(r.stop, offset + len(p.samples))
            if lo < hi:
                chunk.append((i, range(lo - offset, hi - offset)))
            offset += len(p.samples)
        out.append(chunk)
    return out


def merge_results(pieces: list[Result], samples: list) -> Result:
    """One part's Result from its micro-batches' (in row order): losses summed (additive), stats as
    token-weighted means, forwards concatenated."""
    if len(pieces) == 1:
        return pieces[0]
    tokens = [float(r.forward.mask_B_T.sum()) for r in pieces]
    return Result(sum(r.loss for r in pieces), merge_stats([r.stats for r in pieces], tokens),
                  merge_forwards([r.forward for r in pieces], samples))
