"""The training engine on a tiny random model: learning direction, persistence, PEFT format, isolation."""

from __future__ import annotations

import io
import random

import pytest
import torch
from safetensors.torch import load as st_load

from marlaas.adapters import write_adapter_dir
from marlaas.errors import TrainStateError
from marlaas.spec import JobSpec, LoraSpec, RLSpec
from marlaas.train.engine import TrainingEngine, TrainSample, TrainState
from marlaas.train.step import ensure_job, step

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def random_base(tmp_path_factory):
    """An untrained test-preset model directory (weights random but deterministic)."""
    from marlaas.base.tiny import init_model, save

    model, tok = init_model("test", seed=0)
    return save(model, tok, tmp_path_factory.mktemp("random-base"))


@pytest.fixture(scope="session")
def engine(random_base):
    return TrainingEngine(random_base, threads=1, cache_size=8)


def _spec(rank: int = 4, seed: int = 0, **rl) -> JobSpec:
    # model_construct: the engine reads only lora/rl/learning_rate/temperature/seed, and this keeps the
    # test independent of the task/verifier registries that full validation consults.
    return JobSpec.model_construct(
        task="sort", lora=LoraSpec(rank=rank, alpha=2.0 * rank), rl=RLSpec(**rl), learning_rate=1e-2,
        temperature=1.0, seed=seed,
    )  # fmt: skip


def _samples(seed: int, n: int = 6) -> list[TrainSample]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = "".join(rnd.choice("abcdef0123:") for _ in range(rnd.randint(3, 9)))
        comp = [rnd.randint(4, 60) for _ in range(rnd.randint(1, 5))] + [1]  # 1 = EOS
        out.append(TrainSample(prompt, comp, [-4.0] * len(comp), advantage=1.0 if i % 2 == 0 else -1.0))
    return out


def _on_policy(engine: TrainingEngine, samples, job=None) -> list[TrainSample]:
    """The samples with behaviour log-probs equal to the current policy's (as an on-policy sampler gives)."""
    lps = engine.completion_logprobs(job, samples)
    return [TrainSample(s.prompt, s.completion_ids, lp, s.advantage) for s, lp in zip(samples, lps)]


def _weights(blob) -> dict[str, torch.Tensor]:
    return st_load(blob.weights)


def _assert_same_weights(a, b, exact=False):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:
            assert torch.allclose(wa[k], wb[k], atol=1e-6), k


def _opt(out) -> dict:
    return torch.load(io.BytesIO(out.optimizer), weights_only=True)["optimizer"]


def test_step_moves_logprobs_with_the_advantage_sign(engine):
    samples = _on_policy(engine, _samples(1))
    before = engine.completion_logprobs(None, samples)
    out = step(engine, "learn", 0, _spec(), samples, None)
    after = engine.completion_logprobs("learn", samples)
    for s, b, a in zip(samples, before, after):
        if s.advantage > 0:
            assert sum(a) > sum(b)
        else:
            assert sum(a) < sum(b)
    m = out.metrics
    assert m["n_samples"] == 6 and m["n_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert m["tis_mean"] == pytest.approx(1.0, abs=1e-4)  # behaviour = policy: weight 1
    assert m["clip_frac"] == 0.0 and m["grad_norm"] > 0 and not m["noop"]
    assert engine.cached()["learn"] == 1


def test_state_round_trip_equals_continuous_training(engine, random_base):
    spec = _spec(seed=3)
    s1, s2 = _on_policy(engine, _samples(2)), _on_policy(engine, _samples(3))
    out1 = step(engine, "rt", 0, spec, s1, None)
    out2 = step(engine, "rt", 1, spec, s2, None)  # from the cache
    assert int(_opt(out1)["state"][0]["step"]) == 1

    other = TrainingEngine(random_base, threads=1, cache_size=2)
    out2b = step(other, "rt", 1, spec, s2, TrainState(1, out1.adapter, out1.optimizer))
    _assert_same_weights(out2.adapter, out2b.adapter)
    o2, o2b = _opt(out2), _opt(out2b)
    assert len(o2["state"]) == len(o2b["state"]) > 0
    for i in o2["state"]:
        assert int(o2["state"][i]["step"]) == int(o2b["state"][i]["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(o2["state"][i][moment], o2b["state"][i][moment], atol=1e-7)
    # Without the optimiser state the same step differs: the moments matter.
    fresh_opt = TrainingEngine(random_base, threads=1, cache_size=2)
    ensure_job(fresh_opt, "rt", 1, spec, TrainState(1, out1.adapter, None))  # no optimizer: fresh moments
    out2c = step(fresh_opt, "rt", 1, spec, s2, None)
    w2, w2c = _weights(out2.adapter), _weights(out2c.adapter)
    assert any(not torch.allclose(w2[k], w2c[k], atol=1e-6) for k in w2)


def test_blob_loads_in_plain_peft_with_equal_logits(engine, random_base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples = _on_policy(engine, _samples(4))
    out = step(engine, "peft", 0, _spec(rank=8), samples, None)
    d = write_adapter_dir(out.adapter, tmp_path / "adapter")
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(random_base), d).eval()
    base = AutoModelForCausalLM.from_pretrained(random_base).eval()
    ids = torch.tensor([engine.tokenizer("abc:")["input_ids"] + [5, 6, 7]])
    with torch.no_grad():
        got = torch.log_softmax(plain(input_ids=ids).logits[0, -4:-1], -1)[torch.arange(3), ids[0, -3:]]
        base_lp = torch.log_softmax(base(input_ids=ids).logits[0, -4:-1], -1)[torch.arange(3), ids[0, -3:]]
    want = torch.tensor(engine.completion_logprobs("peft", [TrainSample("abc:", [5, 6, 7], [0.0] * 3, 0.0)])[0])
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, base_lp, atol=1e-4)  # the adapter is not a no-op


def test_jobs_with_different_ranks_do_not_disturb_each_other(engine):
    sa, sb = _on_policy(engine, _samples(5)), _on_policy(engine, _samples(6))
    base_lp = engine.completion_logprobs(None, sa)
    a1 = step(engine, "iso-a", 0, _spec(rank=4), sa, None)
    lp_a = engine.completion_logprobs("iso-a", sa)
    b1 = step(engine, "iso-b", 0, _spec(rank=8), sb, None)
    step(engine, "iso-b", 1, _spec(rank=8), sb, None)
    _assert_same_weights(engine.adapter_blob("iso-a"), a1.adapter, exact=True)
    assert engine.completion_logprobs("iso-a", sa) == lp_a
    b2 = engine.adapter_blob("iso-b")
    step(engine, "iso-a", 1, _spec(rank=4), sa, None)
    _assert_same_weights(engine.adapter_blob("iso-b"), b2, exact=True)
    assert engine.completion_logprobs(None, sa) == base_lp  # the base never changes
    assert {w.shape[0] for k, w in _weights(a1.adapter).items() if "lora_A" in k} == {4}
    assert {w.shape[0] for k, w in _weights(b1.adapter).items() if "lora_A" in k} == {8}


def test_fresh_adapter_is_deterministic_from_the_seed(random_base):
    samples = _samples(7)
    e1 = TrainingEngine(random_base, threads=1, cache_size=4)
    first = step(e1, "det", 0, _spec(seed=11), samples, None)
    e2 = TrainingEngine(random_base, threads=1, cache_size=4)
    step(e2, "other", 0, _spec(seed=5), samples, None)  # consumes RNG and adds an adapter first
    second = step(e2, "det", 0, _spec(seed=11), samples, None)
    _assert_same_weights(first.adapter, second.adapter)


def test_lru_eviction_then_reload_from_state(random_base):
    eng = TrainingEngine(random_base, threads=1, cache_size=1)
    sa, sb = _samples(8), _samples(9)
    a1 = step(eng, "lru-a", 0, _spec(), sa, None)
    step(eng, "lru-b", 0, _spec(), sb, None)
    assert eng.cached() == {"lru-b": 1}
    with pytest.raises(TrainStateError):
        step(eng, "lru-a", 1, _spec(), sa, None)  # evicted and no state given
    with pytest.raises(TrainStateError):
        step(eng, "lru-a", 2, _spec(), sa, TrainState(1, a1.adapter, a1.optimizer))  # wrong version
    with pytest.raises(TrainStateError):
        step(eng, "lru-a", 1, _spec(rank=8), sa, TrainState(1, a1.adapter, a1.optimizer))  # spec mismatch
    a2 = step(eng, "lru-a", 1, _spec(), sa, TrainState(1, a1.adapter, a1.optimizer))
    assert eng.cached() == {"lru-a": 2}
    assert int(_opt(a2)["state"][0]["step"]) == 2


def test_all_zero_advantages_publish_a_noop_version(engine):
    samples = [TrainSample(s.prompt, s.completion_ids, s.behav_logprobs, 0.0) for s in _samples(10)]
    out = step(engine, "noop", 0, _spec(), samples, None)
    assert out.metrics["noop"] and out.metrics["n_samples"] == 0 and out.metrics["n_skipped"] == 6
    assert _opt(out)["state"] == {}
    assert all(torch.count_nonzero(w) == 0 for k, w in _weights(out.adapter).items() if "lora_B" in k)
    assert engine.cached()["noop"] == 1


def test_skipped_zero_advantage_rows_count_in_the_normaliser_unless_dropped(engine):
    # On-policy, one optimiser step: ratio = 1 and w = 1, so each token contributes -A.
    # Sample 0: A = +1 with n0 tokens; sample 1: A = 0 with n1 tokens (skipped from the forward).
    #   drop_zero_advantage=True : loss = -n0 / n0 = -1
    #   drop_zero_advantage=False: loss = -n0 / (n0 + n1)
    s = _samples(11, n=2)
    s[0].advantage, s[1].advantage = 1.0, 0.0
    samples = _on_policy(engine, s)
    n0, n1 = len(s[0].completion_ids), len(s[1].completion_ids)
    dropped = step(engine, "skip-d", 0, _spec(drop_zero_advantage=True), samples, None)
    kept = step(engine, "skip-k", 0, _spec(drop_zero_advantage=False), samples, None)
    assert dropped.metrics["loss"] == pytest.approx(-1.0, abs=1e-5)
    assert kept.metrics["loss"] == pytest.approx(-n0 / (n0 + n1), abs=1e-5)
    assert dropped.metrics["n_samples"] == 1 and dropped.metrics["n_skipped"] == 1


def test_kl_term_uses_the_base_with_the_adapter_disabled(engine):
    spec = _spec(kl_coef=0.5)
    samples = _on_policy(engine, _samples(12))
    out0 = step(engine, "kl", 0, spec, samples, None)
    assert out0.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # version 0 is the base
    out1 = step(engine, "kl", 1, spec, _on_policy(engine, samples, "kl"), None)
    assert out1.metrics["kl"] > 0


def test_nonfinite_gradient_leaves_the_adapter_unchanged(engine):
    good = step(engine, "nan", 0, _spec(), _samples(13), None)
    bad = [TrainSample(s.prompt, s.completion_ids, [float("nan")] * len(s.completion_ids), s.advantage)
           for s in _samples(14)]  # fmt: skip
    out = step(engine, "nan", 1, _spec(), bad, None)
    assert out.metrics["nonfinite_grad"] and out.metrics["noop"]
    assert out.metrics["loss"] is None  # NaN is not JSON
    _assert_same_weights(out.adapter, good.adapter, exact=True)
    assert int(_opt(out)["state"][0]["step"]) == 1


def test_schedule_sets_each_steps_rate_by_the_version_trained_from(random_base):
    """Adam's first step moves each weight by about lr * sign(grad): with a 2-step warm-up the first
    step moves half as far as at the peak, and each step's rate follows the schedule of its version."""
    samples = _samples(7)
    peak = TrainingEngine(random_base, threads=1)
    warm = TrainingEngine(random_base, threads=1)
    sched = _spec().model_copy(update={"steps": 4, "lr_schedule": "linear", "warmup_steps": 2})
    w0 = _weights(step(peak, "p", 0, _spec(), _on_policy(peak, samples), None).adapter)
    w1 = _weights(step(warm, "w", 0, sched, _on_policy(warm, samples), None).adapter)
    init = _weights(step(TrainingEngine(random_base, threads=1), "z", 0, _spec(), [], None).adapter)
    moved_peak = sum(float((w0[k] - init[k]).abs().sum()) for k in w0)
    moved_warm = sum(float((w1[k] - init[k]).abs().sum()) for k in w1)
    assert moved_peak > 0 and moved_warm / moved_peak == pytest.approx(0.5, rel=1e-3)
    rates = []
    for v in range(4):
        out = step(warm, "w2", v, sched, _on_policy(warm, samples, "w2" if v else None), None)
        rates.append(out.metrics["lr"])
        assert _opt(out)["param_groups"][0]["lr"] == pytest.approx(out.metrics["lr"])
    # steps 4, W 2: warm-up 1/2, 2/2; then linear to 0 over the remaining 2: p = 0, 1/2.
    assert rates == pytest.approx([0.5e-2, 1e-2, 1e-2, 0.5e-2])


def test_forward_backward_accumulates_until_optim_step(engine):
    """The engine's Tinker-shaped primitives: two forward_backward calls leave the gradient of one call
    over both halves; optim_step steps, reports the clipped norm and clears them."""
    from marlaas.adapters import lora_config_from_spec
    from marlaas.train.engine import AdamParams

    def nll(f):
        return -(f.logp_B_T * f.mask_B_T).sum(), {}

    samples, cfg = _samples(21, 4), lora_config_from_spec(LoraSpec(rank=4))
    engine.adapter("acc-a", cfg, seed=3)
    engine.adapter("acc-b", cfg, seed=3)
    engine.forward_backward("acc-a", samples[:2], nll)
    res = engine.forward_backward("acc-a", samples[2:], nll)
    engine.forward_backward("acc-b", samples, nll)
    assert [len(r) for r in res.forward.rows()] == [len(s.completion_ids) for s in samples[2:]]
    grads = [(a.grad, b.grad) for a, b in zip(engine.parameters("acc-a"), engine.parameters("acc-b"))]
    assert any(float(a.abs().max()) > 0 for a, _ in grads)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in grads)
    out = engine.optim_step("acc-a", AdamParams(lr=1e-2, clip=1.0))
    assert out["stepped"] and out["grad_norm"] > 0
    assert all(p.grad is None for p in engine.parameters("acc-a"))
    assert engine.optim_step("acc-a", AdamParams(lr=1e-2)) == {"stepped": False}  # nothing accumulated


def test_a_pinned_adapter_keeps_its_gradients_while_others_come_and_go(random_base):
    """A Tinker model between its forward_backward and its optim_step is pinned: job adapters passing
    through a full cache never evict it (its accumulated gradients survive, the others make room);
    unpinned, the least recently used goes first as before."""
    small = TrainingEngine(random_base, threads=1, cache_size=2)
    from marlaas.adapters import lora_config_from_spec

    config = lora_config_from_spec(_spec().lora)
    small.adapter("tk", config, seed=1)
    small.forward_backward("tk", _samples(5, 2), lambda f: (sum(r.sum() for r in f.rows()), {}))
    grads = [p.grad.clone() for p in small.parameters("tk") if p.grad is not None]
    assert grads
    small.pin("tk")
    for k in ("a", "b", "c"):
        small.adapter(k, config, seed=2)
    assert set(small.cached()) == {"tk", "c"}  # a and b went, though tk was the least recently used
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, [p for p in small.parameters("tk")
                                                                if p.grad is not None]))
    small.unpin("tk")
    for k in ("d", "e"):
        small.adapter(k, config, seed=2)
    assert set(small.cached()) == {"d", "e"}  # unpinned, it goes like any other


def test_gradient_checkpointing_trains_the_same_weights(random_base):
    """The trainer's gradient checkpointing (activations recomputed in backward instead of kept)
    changes memory, not the step: the same samples and seed give the same adapter and loss."""
    samples = _samples(12)
    plain = step(TrainingEngine(random_base, threads=1, cache_size=2), "ckpt", 0, _spec(seed=3), samples, None)
    eng = TrainingEngine(random_base, threads=1, cache_size=2, checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in eng.base.modules())
    ckpt = step(eng, "ckpt", 0, _spec(seed=3), samples, None)
    assert ckpt.metrics["loss"] == pytest.approx(plain.metrics["loss"], rel=1e-5, abs=1e-7)
    _assert_same_weights(plain.adapter, ckpt.adapter)
