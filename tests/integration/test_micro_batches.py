"""The trainer's micro-batches on a tiny random model: a step whose rows run in several passes within an
activation budget trains the same adapter, with the same loss and stats, as one pass over all rows
(solo and fused steps, every loss aggregation, a KL term's reference pass, Tinker-style summed losses)."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load as st_load

from marlaas.spec import JobSpec, LoraSpec, RLSpec
from marlaas.train import micro
from marlaas.train.engine import TrainingEngine, TrainSample
from marlaas.train.step import GRAD_CLIP, step, step_fused

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def random_base(tmp_path_factory):
    from marlaas.base.tiny import init_model, save

    model, tok = init_model("test", seed=0)
    return save(model, tok, tmp_path_factory.mktemp("micro-base"))


def _spec(seed: int = 0, **rl) -> JobSpec:
    return JobSpec.model_construct(task="sort", lora=LoraSpec(rank=4, alpha=8.0), rl=RLSpec(**rl),
                                   learning_rate=1e-2, temperature=1.0, seed=seed, max_new_tokens=6)


def _samples(seed: int, n: int = 7) -> list[TrainSample]:
    """Rows of different prompt and completion lengths, off-policy behaviour log-probs, one zero-advantage
    row (skipped, yet counted in the normaliser unless dropped)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = "".join(rnd.choice("abcdef0123:") for _ in range(rnd.randint(3, 9)))
        comp = [rnd.randint(4, 60) for _ in range(rnd.randint(1, 5))] + [1]
        behav = [rnd.uniform(-9.0, -1.0) for _ in comp]
        out.append(TrainSample(prompt, comp, behav, advantage=0.0 if i == 3 else rnd.uniform(-1.5, 1.5)))
    return out


class _Passes:
    """Counts the engine's forward passes (one per micro-batch)."""

    def __init__(self, engine: TrainingEngine):
        self.n, self._inner, self.engine = 0, engine._pass, engine

    def __enter__(self):
        def counted(*args, **kwargs):
            self.n += 1
            return self._inner(*args, **kwargs)

        self.engine._pass = counted
        return self

    def __exit__(self, *exc):
        del self.engine._pass


class _Grads:
    """The gradients each optimiser step of the engine saw (before clipping), per job key, by parameter
    name in PEFT's saved format (the adapter blob's keys)."""

    def __init__(self, engine: TrainingEngine):
        self.engine, self.seen, self._inner = engine, {}, engine.optim_step

    def __enter__(self):
        def recorded(key, adam):
            entry = self.engine._entry(key)
            self.seen[key] = {k: p.grad.detach().clone() for k, p in zip(entry.keys, entry.params)
                              if p.grad is not None}
            return self._inner(key, adam)

        self.engine.optim_step = recorded
        return self

    def __exit__(self, *exc):
        del self.engine.optim_step


# Adam's first step moves a weight by about lr * g / (|g| + eps), eps 1e-8: a gradient within a few
# hundred eps of zero turns float32 summation-order noise (a few 1e-10 here, depending on the CPU's
# kernels and threads) into a move of up to 1e-4, where a whole pass and its micro-batches add the same
# terms in another order. Such weights are held to their gradients; every other weight to 1e-6.
FLAT_GRAD = 1e-5


def _assert_same(a, b, ga: dict, gb: dict):
    """The same step: the same gradients (to float32 noise: atol 1e-7, the largest here about 0.07),
    the same weights wherever the clipped gradient is not flat, the same loss and stats."""
    wa, wb = st_load(a.adapter.weights), st_load(b.adapter.weights)
    assert wa.keys() == wb.keys() == ga.keys() == gb.keys()
    scale = min(1.0, GRAD_CLIP / a.metrics["grad_norm"])
    checked = total = 0
    for k in wa:
        assert torch.allclose(ga[k], gb[k], rtol=1e-5, atol=1e-7), k
        held = (ga[k].abs() * scale >= FLAT_GRAD) | ((ga[k] == 0) & (gb[k] == 0))
        assert torch.allclose(wa[k][held], wb[k][held], atol=1e-6), k
        checked, total = checked + int(held.sum()), total + held.numel()
    assert checked >= 0.9 * total, (checked, total)  # flat gradients are the exception (1-4% here)
    for k in ("loss", "grad_norm", "clip_frac", "tis_mean", "tis_trunc_frac", "kl", "n_tokens", "prox_minus_behav"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("rl", [
    {},
    {"aggregation": "sequence"},
    {"aggregation": "constant", "advantage": "drgrpo"},
    {"drop_zero_advantage": True, "importance": {"kind": "mask", "cap": 2.0}},
    {"kl_coef": 0.1},
])
def test_a_step_in_micro_batches_trains_the_same_adapter(random_base, rl):
    samples, spec = _samples(5), _spec(seed=3, **rl)
    whole_eng = TrainingEngine(random_base, threads=1, cache_size=2, micro_bytes=None)
    split_eng = TrainingEngine(random_base, threads=1, cache_size=2, micro_bytes=1)  # one row per pass
    with _Passes(whole_eng) as whole_passes, _Grads(whole_eng) as gw:
        whole = step(whole_eng, "j", 0, spec, samples, None)
    with _Passes(split_eng) as split_passes, _Grads(split_eng) as gs:
        split = step(split_eng, "j", 0, spec, samples, None)
    assert whole_passes.n == 1 and split_passes.n == whole.metrics["n_samples"] > 1
    assert whole.metrics["grad_norm"] > 0 and abs(whole.metrics["tis_mean"] - 1.0) > 0.01  # off-policy rows
    _assert_same(whole, split, gw.seen["j"], gs.seen["j"])


def test_a_fused_step_in_micro_batches_trains_the_same_adapters(random_base):
    """Micro-batches that cut across two jobs' rows (a budget of about three rows) give each job the
    adapter of one fused pass."""
    jobs = [("a", 0, _spec(seed=1), _samples(1), None), ("b", 0, _spec(seed=2), _samples(2), None)]
    whole_eng = TrainingEngine(random_base, threads=1, cache_size=4, micro_bytes=None)
    split_eng = TrainingEngine(random_base, threads=1, cache_size=4)
    per_token, per_position = split_eng._row_bytes
    split_eng.micro_bytes = 3 * (18 * per_token + 7 * per_position)
    with _Grads(whole_eng) as gw:
        whole = step_fused(whole_eng, jobs)
    with _Passes(split_eng) as passes, _Grads(split_eng) as gs:
        split = step_fused(split_eng, jobs)
    assert passes.n >= 3 and all(o.metrics["fused_jobs"] == 2 for o in split)
    for (job, *_), w, s in zip(jobs, whole, split):
        _assert_same(w, s, gw.seen[job], gs.seen[job])


def test_a_summed_loss_sees_each_micro_batch_with_its_rows_indices(random_base):
    """A Tinker-style loss (a sum over datums, each with its own inputs) reads its rows' inputs by
    `Forward.indices()`: the same loss, gradients and returned log-probs as one pass."""
    samples = _samples(9)
    weights = [torch.linspace(-1.0, 1.0, len(s.completion_ids)) * (i + 1) for i, s in enumerate(samples)]
    out = {}
    for name, budget in (("whole", None), ("split", 1)):
        eng = TrainingEngine(random_base, threads=1, cache_size=2, micro_bytes=budget)
        from marlaas.adapters import lora_config_from_spec

        eng.adapter("m", lora_config_from_spec(LoraSpec(rank=4, alpha=8.0)), seed=4)
        seen = []

        def loss(f, seen=seen):
            seen.append(f.indices())
            return sum((lp * weights[j]).sum() for lp, j in zip(f.rows(), f.indices())), {}

        res = eng.forward_backward("m", samples, loss, additive=True)
        out[name] = (res, [p.grad.clone() for p in eng.parameters("m")], seen)
    (whole, g_whole, seen_whole), (split, g_split, seen_split) = out["whole"], out["split"]
    assert seen_whole == [list(range(len(samples)))]
    assert seen_split == [[i] for i in range(len(samples))]
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_whole, g_split))
    for a, b in zip(whole.forward.rows(), split.forward.rows()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_loss_not_marked_additive_runs_in_one_pass(random_base):
    eng = TrainingEngine(random_base, threads=1, cache_size=2, micro_bytes=1)
    from marlaas.adapters import lora_config_from_spec

    eng.adapter("m", lora_config_from_spec(LoraSpec(rank=4, alpha=8.0)), seed=4)
    with _Passes(eng) as passes:
        eng.forward_backward("m", _samples(4), lambda f: (f.logp_B_T.sum(), {}))
    assert passes.n == 1


def test_a_row_over_the_budget_recomputes_just_the_layers_it_must(random_base):
    """A micro-batch of one row that alone exceeds the budget recomputes the activations of its first
    layers in the backward (as few as fit it) instead of keeping them: the same adapter and loss."""
    samples, spec = _samples(5), _spec(seed=3)
    whole_eng = TrainingEngine(random_base, threads=1, cache_size=2, micro_bytes=None)
    with _Grads(whole_eng) as gw:
        whole = step(whole_eng, "j", 0, spec, samples, None)
    eng = TrainingEngine(random_base, threads=1, cache_size=2)
    layers, per_layer, kept = eng.recompute.sizes
    assert layers == len(eng.recompute.layers) == 2
    width = max(len(eng._ids(s)) + len(s.completion_ids) for s in samples)
    positions = max(len(s.completion_ids) for s in samples) + 1
    # half a layer's saving under the widest row's cost: that row recomputes one of the two layers, the
    # narrowest rows fit with none
    eng.micro_bytes = micro.pass_bytes(1, width, positions, *eng._row_bytes) - 0.5 * width * (per_layer - kept)
    with _Grads(eng) as gs:
        split = step(eng, "j", 0, spec, samples, None)
    counts = eng.recompute.counts
    assert counts["passes"] == whole.metrics["n_samples"] and counts["most"] == 1, counts
    assert 0 < counts["recomputing"] < counts["passes"], counts
    assert not any(m.gradient_checkpointing for m in eng.recompute.layers)  # flags reset after each pass
    _assert_same(whole, split, gw.seen["j"], gs.seen["j"])


def test_a_fused_step_with_checkpointing_trains_the_same_adapters(random_base):
    """Every layer recomputing in the backward of a routed pass over two jobs' rows: the recompute is
    routed too, so each job gets the adapter of a pass that kept its activations."""
    jobs = [("a", 0, _spec(seed=1), _samples(1), None), ("b", 0, _spec(seed=2), _samples(2), None)]
    whole_eng = TrainingEngine(random_base, threads=1, cache_size=4, micro_bytes=None)
    with _Grads(whole_eng) as gw:
        whole = step_fused(whole_eng, jobs)
    eng = TrainingEngine(random_base, threads=1, cache_size=4, micro_bytes=None, checkpointing=True)
    with _Passes(eng) as passes, _Grads(eng) as gc:
        ckpt = step_fused(eng, jobs)
    assert passes.n == 1 and all(m.gradient_checkpointing for m in eng.recompute.layers)
    for (job, *_), w, c in zip(jobs, whole, ckpt):
        _assert_same(w, c, gw.seen[job], gc.seen[job])
