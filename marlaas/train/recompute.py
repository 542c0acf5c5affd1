"""Decoder layers that recompute their activations in the backward instead of keeping them (gradient
checkpointing per layer), chosen per trainer pass.

A trainer pass keeps every layer's activations for its backward (`marlaas.train.micro` counts them);
a layer set to recompute keeps only its input and runs its forward again during the backward. With
`always` every layer recomputes in every pass (MARLAAS_TRAIN_CHECKPOINTING); otherwise `for_pass`
sets just as many layers as bring the pass within its activation budget (`micro.recompute_layers`),
for that pass only: a micro-batch of one row longer than the budget, which micro-batching cannot
split further, pays recompute for the layers it must and no more. The FIRST layers recompute: their
recompute comes last in the backward, when the later layers' kept activations are already freed.
Non-reentrant checkpointing: inputs need not require grad, and whatever a layer's forward depends on
(LoRA routing, `marlaas.train.routing`) must stay in force through the backward.
"""

from __future__ import annotations

from contextlib import contextmanager

from marlaas.train import micro


class Recompute:
    """The recompute flags of a model's decoder layers, and counts of what the passes recomputed."""

    def __init__(self, model, config, dtype_bytes: int, always: bool = False):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.always = always
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.sizes = micro.layer_bytes(config, dtype_bytes)  # (layers, kept per token a layer, when recomputing)
        self.counts = {"passes": 0, "recomputing": 0, "layers": 0, "most": 0}
        if self.layers:  # gives every layer its (non-reentrant) checkpoint function and flags them all
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.disable_input_require_grads()  # non-reentrant: the embeddings' output needs no grad
            for m in self.layers:
                m.gradient_checkpointing = always

    @contextmanager
    def for_pass(self, rows: int, width: int, positions: int, row_bytes: tuple[int, int], budget: float | None):
        """Within it, the first layers that a pass of `rows` x `width` tokens with logits at `positions`
        (costed by `row_bytes`, `micro.row_bytes`) must recompute to fit `budget` do so."""
        k = 0 if self.always else min(len(self.layers), micro.recompute_layers(
            micro.pass_bytes(rows, width, positions, *row_bytes), budget, rows * width, *self.sizes))
        for i, m in enumerate(self.layers):
            m.gradient_checkpointing = self.always or i < k
        c = self.counts
        c["passes"], c["recomputing"], c["layers"], c["most"] = \
            c["passes"] + 1, c["recomputing"] + (k > 0), c["layers"] + k, max(c["most"], k)
        try:
            yield k
        finally:
            for m in self.layers:
                m.gradient_checkpointing = self.always
