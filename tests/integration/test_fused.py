"""The fused multi-tenant training step equals each job's solo step (gradients, metrics, adapters)."""

from __future__ import annotations

import io
import random

import pytest
import torch
from safetensors.torch import load as st_load
from torch.optim.optimizer import register_optimizer_step_pre_hook

from marlaas.spec import JobSpec, LoraSpec, RLSpec
from marlaas.train.engine import Part, TrainingEngine, TrainSample, TrainState
from marlaas.train.step import fusable, step, step_fused

pytestmark = pytest.mark.integration

TOL = 1e-5


def _spec(rank: int, seed: int, temperature: float = 1.0, targets="all-linear", dropout: float = 0.0, **rl) -> JobSpec:
    # model_construct: the engine reads only lora/rl/learning_rate/temperature/seed. lr is the spec
    # default: Adam's first update is ~lr * g / (|g| + eps), so float rounding in a tiny gradient
    # moves a weight by up to ~lr * 1e-3 (1.4e-5 measured at lr 1e-2 with gradients within 1e-5).
    return JobSpec.model_construct(
        task="sort", lora=LoraSpec(rank=rank, alpha=2.0 * rank, targets=targets, dropout=dropout), rl=RLSpec(**rl),
        learning_rate=1e-3, temperature=temperature, seed=seed,
    )  # fmt: skip


def _samples(seed: int, n: int, zero_every: int = 0, masked: bool = False) -> list[TrainSample]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = "".join(rnd.choice("abcdef0123:") for _ in range(rnd.randint(2, 12)))
        comp = [rnd.randint(4, 30) for _ in range(rnd.randint(1, 7))] + [1]
        adv = 0.0 if zero_every and i % zero_every == 0 else rnd.choice([1.5, -0.5, 0.75, -1.25])
        behav = [rnd.uniform(-5.0, -1.0) for _ in comp]
        # A multi-turn episode's tool-result tokens are context (loss mask 0): mask all but the ends.
        mask = [1] + [0] * (len(comp) - 2) + [1] if masked and len(comp) > 2 else None
        out.append(TrainSample(prompt, comp, behav, advantage=adv, loss_mask=mask))
    return out


# Three jobs that differ in rank, targets, temperature, objective, aggregation, KL, loss masks and
# zero-advantage handling.
JOBS = {
    "alice/j1": _spec(
        2, seed=1, loss={"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.5},
        importance={"kind": "truncate", "level": "sequence", "cap": 1.5},
    ),
    "bob/j2": _spec(4, seed=2, temperature=0.7, aggregation="sequence", drop_zero_advantage=False).model_copy(
        update={"steps": 3, "lr_schedule": "cosine", "warmup_steps": 2}),  # rates 0.5x then 1x the peak
    "carol/j3": _spec(8, seed=3, targets=["q_proj", "v_proj", "down_proj"], kl_coef=0.1, aggregation="constant"),
}  # fmt: skip
SIZES = {"alice/j1": 4, "bob/j2": 6, "carol/j3": 5}


class _GradSpy:
    """Records every optimiser's gradients just before its step (torch's global step pre-hook)."""

    def __init__(self):
        self.grads: dict[int, list[torch.Tensor]] = {}
        self._h = None

    def __enter__(self):
        def hook(opt, args, kwargs):  # keyed by the optimiser's first parameter: one adapter's
            params = [p for g in opt.param_groups for p in g["params"]]
            self.grads[id(params[0])] = [p.grad.detach().clone() for p in params]

        self._h = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self._h.remove()

    def of(self, engine: TrainingEngine, job: str) -> list[torch.Tensor]:
        return self.grads[id(engine.parameters(job)[0])]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _weights(blob) -> dict[str, torch.Tensor]:
    return st_load(blob.weights)


@pytest.fixture(scope="module")
def engines(tiny_base):
    return TrainingEngine(tiny_base, threads=1, cache_size=8), TrainingEngine(tiny_base, threads=1, cache_size=8)


def _compare(solo_eng, fused_eng, solo_outs, fused_outs, spy_solo, spy_fused):
    for job, so, fo in zip(JOBS, solo_outs, fused_outs):
        gs, gf = spy_solo.of(solo_eng, job), spy_fused.of(fused_eng, job)
        assert any(float(g.abs().max()) > 1e-4 for g in gs), f"{job}: solo gradient is all zero"
        assert _max_diff(gs, gf) < TOL, f"{job}: fused gradient differs from the solo one"
        ws, wf = _weights(so.adapter), _weights(fo.adapter)
        assert ws.keys() == wf.keys()
        assert _max_diff([ws[k] for k in ws], [wf[k] for k in ws]) < TOL, f"{job}: post-step adapter differs"
        assert so.adapter.config == fo.adapter.config
        os_ = torch.load(io.BytesIO(so.optimizer), weights_only=True)["optimizer"]["state"]
        of_ = torch.load(io.BytesIO(fo.optimizer), weights_only=True)["optimizer"]["state"]
        assert _max_diff([os_[i]["exp_avg_sq"] for i in os_], [of_[i]["exp_avg_sq"] for i in os_]) < TOL
        for k in ("loss", "grad_norm", "kl", "tis_mean", "clip_frac", "prox_minus_behav", "lr"):
            assert so.metrics[k] == pytest.approx(fo.metrics[k], abs=TOL), f"{job}: metric {k}"
        for k in ("n_tokens", "n_samples", "n_skipped", "noop", "nonfinite_grad"):
            assert so.metrics[k] == fo.metrics[k], f"{job}: metric {k}"
        assert fo.metrics["fused_jobs"] == 3


def test_fused_step_equals_solo_steps(engines):
    solo, fused = engines
    batches = [
        {j: _samples(100 * step + i, SIZES[j], zero_every=3 * (j == "bob/j2"), masked=j == "carol/j3")
         for i, j in enumerate(JOBS)}
        for step in range(2)
    ]  # fmt: skip
    # Step 0 (fresh adapters, B = 0) then step 1 (trained adapters, non-zero Adam moments).
    carol_state = None
    for t in range(2):
        with _GradSpy() as spy_s:
            solo_outs = [step(solo, j, t, spec, batches[t][j], None) for j, spec in JOBS.items()]
        states = {}
        if carol_state is not None:  # one job comes back from its persisted state, not from the cache
            fused.evict("carol/j3")
            states["carol/j3"] = carol_state
        with _GradSpy() as spy_f:
            fused_outs = step_fused(fused, [(j, t, spec, batches[t][j], states.get(j)) for j, spec in JOBS.items()])
        _compare(solo, fused, solo_outs, fused_outs, spy_s, spy_f)
        assert [o.metrics["lr"] for o in fused_outs] == pytest.approx([1e-3, 0.5e-3 * (t + 1), 1e-3])
        assert solo.cached() == fused.cached() == {j: t + 1 for j in JOBS}
        carol_state = TrainState(t + 1, fused_outs[2].adapter, fused_outs[2].optimizer)


def test_routing_gives_each_row_its_own_adapter(engines):
    """Log-probs of one routed pass over three adapters equal each adapter's own pass (carol's adapter
    lacks most layers: those rows get the base there), through the engine's public API; the routing
    is undone afterwards and no gradient is left behind by a forward-only pass."""
    _, eng = engines
    jobs = list(JOBS)
    assert all(j in eng.cached() for j in jobs), "runs after the fused-step test"
    samples = _samples(7, 2)

    def nothing(f):
        return f.logp_B_T.sum() * 0.0, {}

    mixed = eng.forward_backward_many([Part(j, samples, nothing) for j in jobs], backward=False)
    for j, m in zip(jobs, mixed):
        own = eng.forward_backward(j, samples, nothing, backward=False)
        assert float((m.forward.logp_B_T - own.forward.logp_B_T).abs().max()) < TOL
    assert not any("forward" in vars(m) for m in eng.model.modules())
    assert all(p.grad is None for j in jobs for p in eng.parameters(j))


def test_fused_edge_cases(engines):
    _, eng = engines
    with pytest.raises(ValueError, match="each job once"):
        step_fused(eng, [("alice/j1", 2, JOBS["alice/j1"], [], None)] * 2)
    assert fusable(eng, 1) == "fewer than two jobs"
    assert "exceed" in fusable(eng, 9)
    # A job with nothing to learn from is a no-op version bump next to a fused one.
    zero = [TrainSample("ab", [5, 1], [-1.0, -1.0], 0.0)]
    outs = step_fused(eng, [("alice/j1", 2, JOBS["alice/j1"], zero, None),
                           ("bob/j2", 2, JOBS["bob/j2"], _samples(9, 3), None)])  # fmt: skip
    assert outs[0].metrics["noop"] is True and outs[1].metrics["noop"] is False
    assert eng.cached()["alice/j1"] == 3 and eng.cached()["bob/j2"] == 3
    # LoRA dropout: pi_prox comes from a separate routed no-grad pass (equal to solo in distribution only).
    drop = _spec(4, seed=4, dropout=0.2)
    outs = step_fused(eng,
        [("dave/j4", 0, drop, _samples(11, 4), None), ("bob/j2", 3, JOBS["bob/j2"], _samples(12, 4), None)]
    )
    assert [o.metrics["fused_jobs"] for o in outs] == [2, 2]
    assert all(o.metrics["grad_norm"] > 0 and not o.metrics["noop"] for o in outs)
