"""Every objective variant runs a real training step and moves the adapter; A-3PO and coupled PPO
never run a pi_prox forward pass, and recompute runs one only when LoRA dropout needs it."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load as st_load

from marlaas.spec import JobSpec, LoraSpec, RLSpec
from marlaas.train.engine import TrainingEngine, TrainSample
from marlaas.train.step import step

pytestmark = pytest.mark.integration

VARIANTS = {
    "grpo-recompute-tis": {},
    "drgrpo-constant": {"advantage": "drgrpo", "aggregation": "constant"},
    "a3po-mask-seq": {"loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.5},
                      "importance": {"kind": "mask", "level": "sequence", "cap": 1.1}},
    "a3po-mask-token": {"loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.2},
                        "importance": {"kind": "mask", "level": "token", "cap": 1.5}},
    "recompute-trunc-seq": {"importance": {"kind": "truncate", "level": "sequence", "cap": 1.5}},
    "ppo-none-sequence": {"loss": {"kind": "ppo"}, "importance": {"kind": "none"}, "aggregation": "sequence"},
    "kl": {"kl_coef": 0.1, "loss": {"prox": "a3po"}},
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from marlaas.base.tiny import init_model, save

    model, tok = init_model("test", seed=0)
    return TrainingEngine(save(model, tok, tmp_path_factory.mktemp("variants-base")), threads=1, cache_size=16)


def _spec(dropout: float = 0.0, **rl) -> JobSpec:
    # As in tests/test_training.py: the engine reads only lora/rl/learning_rate/temperature/seed/max_new_tokens.
    return JobSpec.model_construct(
        task="sort", lora=LoraSpec(rank=4, alpha=8.0, dropout=dropout), rl=RLSpec(**rl), learning_rate=1e-2,
        temperature=1.0, seed=0, max_new_tokens=8,
    )  # fmt: skip


def _samples(engine: TrainingEngine, job: str | None, seed: int, n: int = 6) -> list[TrainSample]:
    """Random completions (3-6 tokens) whose behaviour log-probs are the current policy's, nudged
    off-policy: -0.2, +0.2, -0.2, ... per token and, in even rows, another -2 on the first token, so
    truncation, masking and the clip have something to act on and odd rows stay in any band."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = "".join(rnd.choice("abcdef0123:") for _ in range(rnd.randint(3, 9)))
        comp = [rnd.randint(4, 60) for _ in range(rnd.randint(2, 5))] + [1]
        out.append(TrainSample(prompt, comp, [0.0] * len(comp), advantage=1.0 if i % 2 == 0 else -1.0))
    lps = engine.completion_logprobs(job, out)
    for i, (s, lp) in enumerate(zip(out, lps)):
        far = 2.0 if i % 2 == 0 else 0.0
        s.behav_logprobs = [x + (0.2 if t % 2 else -0.2) - (far if t == 0 else 0.0) for t, x in enumerate(lp)]
    return out


def _lora_b(blob) -> dict[str, torch.Tensor]:
    return {k: w for k, w in st_load(blob.weights).items() if "lora_B" in k}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_steps_and_moves_the_adapter(engine, name):
    spec = _spec(**VARIANTS[name])
    job = f"var-{name}"
    out1 = step(engine, job, 0, spec, _samples(engine, None, 1), None)
    # Version 0 is the base (LoRA B = 0); one step must make B non-zero.
    assert not out1.metrics["noop"] and out1.metrics["grad_norm"] > 0
    assert any(torch.count_nonzero(w) > 0 for w in _lora_b(out1.adapter).values())
    out2 = step(engine, job, 1, spec, _samples(engine, job, 2), None)
    assert not out2.metrics["noop"] and isinstance(out2.metrics["loss"], float)
    b1, b2 = _lora_b(out1.adapter), _lora_b(out2.adapter)
    assert any(not torch.equal(b1[k], b2[k]) for k in b1)
    if VARIANTS[name].get("importance", {}).get("kind") == "mask":
        # a3po weight = exp(alpha (log pi_theta - log pi_behav)): first tokens exp(0.2 * 2.2) = 1.55 > 1.5;
        # even rows' geometric means >= exp(0.5 * (2.2 - 0.2) / 6) = 1.18 > 1.1 (odd rows' <= exp(0.5 * 0.2 / 3))
        assert out2.metrics["tis_trunc_frac"] > 0


def _count_forwards(engine):
    """Count forward passes of the base network (a hook on it: every pass of the engine runs it)."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1

    return calls, engine.base.register_forward_pre_hook(hook, with_kwargs=True)


def test_a3po_skips_the_proximal_forward_pass(engine):
    a3po = {"loss": {"kind": "decoupled_ppo", "prox": "a3po", "alpha": 0.5}}
    cases = [
        ("fw-recompute-dropout", _spec(dropout=0.1), 2),  # pi_prox pass + gradient pass
        ("fw-a3po-dropout", _spec(dropout=0.1, **a3po), 1),  # gradient pass only
        ("fw-ppo-dropout", _spec(dropout=0.1, loss={"kind": "ppo"}), 1),
        ("fw-recompute", _spec(), 1),  # no dropout: the gradient pass IS pi_prox
        ("fw-a3po", _spec(**a3po), 1),
    ]
    counts = {}
    for job, spec, want in cases:
        step(engine, job, 0, spec, _samples(engine, None, 3), None)
        samples = _samples(engine, job, 4)
        calls, handle = _count_forwards(engine)
        try:
            step(engine, job, 1, spec, samples, None)
        finally:
            handle.remove()
        counts[job] = calls[0]
        assert calls[0] == want, (job, calls[0])
    assert counts["fw-a3po-dropout"] == counts["fw-recompute-dropout"] - 1


def test_recompute_with_dropout_gives_the_exact_proximal_weight(engine):
    # On-policy samples (behaviour = the eval-mode policy) at version 1, where LoRA B != 0 so dropout
    # changes the training pass: the recomputed pi_prox equals pi_behav, so every weight is exactly 1.
    spec = _spec(dropout=0.3)
    step(engine, "exact-prox", 0, spec, _samples(engine, None, 5), None)
    samples = _samples(engine, "exact-prox", 6)
    lps = engine.completion_logprobs("exact-prox", samples)
    on_policy = [TrainSample(s.prompt, s.completion_ids, lp, s.advantage) for s, lp in zip(samples, lps)]
    out = step(engine, "exact-prox", 1, spec, on_policy, None)
    assert out.metrics["tis_mean"] == pytest.approx(1.0, abs=1e-5)
    assert out.metrics["tis_trunc_frac"] == 0.0
    # The training pass itself is perturbed by dropout (else this test could not fail without the pass).
    assert abs(out.metrics["prox_minus_behav"]) > 1e-6
