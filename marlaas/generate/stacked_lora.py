"""Stacked multi-LoRA forward: every adapter of a mixed batch in one pair of batched matmuls per layer.

PEFT's mixed-batch path (`adapter_names`) loops over the distinct adapters in every LoRA layer at
every decoding step (select the adapter's rows, two small matmuls, write back), so its cost grows
with the number of adapters in the batch. Here the adapters' weights of one layer are stacked once
per `generate` call and the rows are laid out adapter by adapter:

    U = distinct adapters in the batch, m = most rows any one adapter has
    A_u  [U, in, r_max]   = lora_A[u].weight^T, zero-padded to the largest rank r_max
    B_u  [U, r_max, out]  = lora_B[u].weight^T * scaling[u]
    perm [U*m]            rows of the batch in adapter order, padded with a zero row
    inv  [rows]           each row's position in that layout (base rows -> a zero output row)

    for x [rows, T, in]:  o = bmm(bmm(x[perm].view(U, m*T, in), A_u), B_u).view(U*m, T, out)
                          y = base_layer(x);  y[perm[j]] += o[j] for every slot j (in place)

Zero padding leaves each row's result exactly `x @ A^T @ B^T * scaling` of its own adapter (padded
rank columns and padded rows contribute zeros), i.e. PEFT's LoRA forward without dropout. The flops
equal one LoRA per row whatever U is; no per-row copy of any weight is made.

Usage: run the PeftModel inside `stacked_lora(peft_model, row_adapters, base_name)`: its LoRA layers
compute the base only (`base_only`) and forward hooks on each LoRA layer add the stacked delta; both
are undone on exit, also on error. `base_only` flips each LoRA layer's disabled flag directly:
PEFT's `disable_adapter()` also resets requires_grad on every registered adapter's weights, which
a fixed cost per call that grows with the engine's adapter cache rather than the batch
(docs/performance.md); generation needs no gradients.
Unsupported (refused, so the caller falls back to PEFT): DoRA, non-Linear LoRA layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial


class StackedLoRAUnsupported(Exception):
    """The batch uses a LoRA feature the stacked path does not implement."""


def row_layout(row_adapters: list[str], names: list[str]):
    """(perm, inv, m): rows in adapter-major order (see module docstring); rows of no listed adapter
    (the base) map to the zero output row U*m."""
    import torch

    rows = len(row_adapters)
    pos = {n: u for u, n in enumerate(names)}
    members: list[list[int]] = [[] for _ in names]
    for i, a in enumerate(row_adapters):
        if a in pos:
            members[pos[a]].append(i)
    m = max((len(x) for x in members), default=0)
    perm = torch.full((len(names) * m,), rows, dtype=torch.long)
    inv = torch.full((rows,), len(names) * m, dtype=torch.long)
    for u, idx in enumerate(members):
        if idx:
            t = torch.tensor(idx, dtype=torch.long)
            perm[u * m: u * m + len(idx)] = t
            inv[t] = torch.arange(u * m, u * m + len(idx))
    return perm, inv, m


def stack_weights(layer, names: list[str]):
    """(A_u [U, in, r_max], B_u [U, r_max, out]) of one PEFT LoRA Linear layer for `names`
    (an adapter the layer lacks contributes zeros)."""
    import torch

    base = layer.get_base_layer()
    if not isinstance(base, torch.nn.Linear):
        raise StackedLoRAUnsupported(f"LoRA on {type(base).__name__} layers")
    present = [n for n in names if n in layer.lora_A]
    if any(layer.use_dora.get(n, False) for n in present):
        raise StackedLoRAUnsupported("DoRA adapters")
    r_max = max((layer.lora_A[n].weight.shape[0] for n in present), default=1)
    w = base.weight
    A = w.new_zeros(len(names), base.in_features, r_max)
    B = w.new_zeros(len(names), r_max, base.out_features)
    for u, n in enumerate(names):
        if n in layer.lora_A:
            a = layer.lora_A[n].weight  # [r, in]
            b = layer.lora_B[n].weight  # [out, r]
            r = a.shape[0]
            A[u, :, :r] = a.t()
            B[u, :r, :] = b.t() * layer.scaling[n]
    return A, B


def _add_delta(layer, args, out, *, A, B, perm, into, m, pad_in):
    import torch

    x = args[0]
    rows, d_in = x.shape[0], x.shape[-1]
    T = x[0].numel() // d_in
    U = A.shape[0]
    x3 = x.reshape(rows, T, d_in).to(A.dtype)
    if pad_in:  # some adapter has fewer than m rows: its padding rows read a zero row
        x3 = torch.cat([x3, x3.new_zeros(1, T, d_in)])
    xp = x3.index_select(0, perm)  # [U*m, T, in]
    o = torch.bmm(torch.bmm(xp.view(U, m * T, d_in), A), B)  # [U, m*T, out]
    # Added in place into the base output (generation runs under inference_mode): no [rows, T, out]
    # copy of the delta and no third tensor for the sum. A padding slot's delta is zero (its input
    # row is zero) and `into` sends it to a row of its own adapter; base rows are in no slot.
    out.view(rows, T, -1).index_add_(0, into, o.view(U * m, T, -1).to(out.dtype))
    return out


def lora_layers(peft_model) -> list:
    """Every PEFT LoRA layer of `peft_model`."""
    from peft.tuners.lora import LoraLayer

    return [m for m in peft_model.modules() if isinstance(m, LoraLayer)]


@contextmanager
def base_only(peft_model, layers: list | None = None):
    """Within this context every LoRA layer of `peft_model` computes its base layer only (PEFT's
    `disable_adapters` state, set without touching requires_grad: for inference). `layers`: the
    model's LoRA layers when the caller keeps them (walking the modules grows with the adapters)."""
    layers = lora_layers(peft_model) if layers is None else layers
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


@contextmanager
def stacked_lora(peft_model, row_adapters: list[str], base_name: str, layers: list | None = None):
    """Within this context, a forward of `peft_model` with its adapters disabled adds each row's own
    adapter (row i uses `row_adapters[i]`; `base_name` rows get none). Raises StackedLoRAUnsupported
    before touching the model when the adapters use something this path does not implement.
    `layers`: as in `base_only`."""
    import torch

    names = sorted(set(row_adapters) - {base_name})
    perm, _, m = row_layout(row_adapters, names)
    pad_in = bool((perm == len(row_adapters)).any())  # else no zero row is needed on the way in
    # Each slot's output row; a padding slot's is its adapter's first row, so even a delta that is
    # not zero (an adapter with inf or NaN weights) only ever lands on that adapter's own rows.
    first = perm.view(len(names), m)[:, :1].expand(len(names), m).reshape(-1)
    into = torch.where(perm == len(row_adapters), first, perm)
    hooks = []
    plans = []
    layers = lora_layers(peft_model) if layers is None else layers
    for module in layers:
        if any(n in module.lora_A for n in names):
            plans.append((module, *stack_weights(module, names)))
    if plans and plans[0][1].device != perm.device:  # the layout is built on the CPU
        perm, into = perm.to(plans[0][1].device), into.to(plans[0][1].device)
    try:
        for module, A, B in plans:
            hooks.append(module.register_forward_hook(partial(_add_delta, A=A, B=B, perm=perm, into=into, m=m,
                                                              pad_in=pad_in)))
        with base_only(peft_model, layers):
            yield
    finally:
        for h in hooks:
            h.remove()


def purge_row_hooks(model) -> int:
    """Remove PEFT's per-row `adapter_names` forward pre-hooks left behind by a failed call."""
    from peft.tuners.lora import model as lora_model

    target = getattr(lora_model, "_adapter_names_pre_forward_hook", None)
    removed = 0
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for hid, hook in list(hooks.items()):
            if isinstance(hook, partial) and hook.func is target:
                del hooks[hid]
                module._forward_pre_hooks_with_kwargs.pop(hid, None)
                removed += 1
    return removed
