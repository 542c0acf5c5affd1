"""Per-row LoRA routing for training: each contiguous block of rows uses its own PEFT adapter.

Inside `routed(model, names, sizes)` every `peft` LoRA `Linear` of `model` computes

    y[rows_j] = W x[rows_j] + s_j * B_j A_j dropout_j(x[rows_j])      (s_j = alpha_j / r_j)

for rows_j = [sum(sizes[:j]), sum(sizes[:j + 1])), via `x.split(sizes)` in and `torch.cat` out (no
full-size scatter per adapter, unlike PEFT's `adapter_names` path, which also refuses train mode).
A block whose adapter does not adapt a layer gets the base output there. Gradients flow to every
adapter whose parameters require grad; each adapter only ever sees its own rows.

Only plain LoRA `Linear` layers are routed: callers check that the model holds no other LoRA layer
type (`TrainingEngine.routable`). Depends on torch and peft only, so scripts that run
without the project's other dependencies (bench/gpu_check.py) can load this file by path.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def routed(model, names: list[str], sizes: list[int]):
    """Route rows to adapters in every LoRA Linear of `model`: rows [sum(sizes[:j]), +sizes[j]) use
    adapter `names[j]` (no LoRA delta where a layer lacks that adapter). Restores on exit."""
    from peft.tuners.lora import Linear as LoraLinear

    patched = []

    def make(m):
        def forward(x, *args, **kwargs):
            result = m.base_layer(x, *args, **kwargs)
            if m.disable_adapters or not any(n in m.lora_A for n in names):
                return result
            deltas = []
            for name, x_j in zip(names, x.split(sizes, dim=0)):
                if name in m.lora_A:
                    a, b = m.lora_A[name], m.lora_B[name]
                    d = b(a(m.lora_dropout[name](x_j.to(a.weight.dtype)))) * m.scaling[name]
                    deltas.append(d.to(result.dtype))
                else:
                    deltas.append(result.new_zeros(x_j.shape[:-1] + result.shape[-1:]))
            return result + torch.cat(deltas, dim=0)

        return forward

    try:
        for m in model.modules():
            if isinstance(m, LoraLinear):
                m.forward = make(m)  # an instance attribute shadows the class method
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
