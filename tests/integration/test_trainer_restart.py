"""A restarted trainer resumes each job from the store: adapter weights and AdamW state (step, moments).

Real parts throughout: rollouts from the transformers+PEFT engine, rewards from the verifier, the
train station's own code path, and a real Redis.
"""

import io

import pytest
import torch
from safetensors.torch import load as st_load

from marlaas.api.rows import job_rows
from marlaas.generate.factory import make_engine
from marlaas.generate.station import run_generate
from marlaas.spec import JobSpec
from marlaas.train.engine import TrainingEngine
from marlaas.train.station import run_train, train_batch
from marlaas.train.step import step
from marlaas.types import AdapterRef
from marlaas.verify.station import run_verify

pytestmark = pytest.mark.integration


def one_step(st, gen, trainer, jid, t, P):
    run_generate(st, gen, [["gen", jid, g] for g in range(t * P, (t + 1) * P)])
    run_verify(st, jid, "ver", list(range(t * P, (t + 1) * P)))
    token = st.take_trainer(jid, t, 60)
    return run_train(st, trainer, jid, t, token)


def test_restarted_trainer_resumes_adapter_and_optimizer_from_store(st, tiny_base):
    # temperature 2 and a fixed seed: enough reward variance in tiny groups to get non-zero gradients
    spec = JobSpec(task="max", steps=3, prompts_per_step=4, group_size=8, temperature=2.0, seed=1,
                   max_staleness=0, eval_size=2, rl={"drop_zero_advantage": False})
    train, held = job_rows(spec)
    jid = st.create_job(spec, train, held)
    gen = make_engine("hf", tiny_base, st.adapter, threads=1)
    first = TrainingEngine(tiny_base, threads=1)
    m0 = one_step(st, gen, first, jid, 0, spec.prompts_per_step)
    assert m0["step"] == 1 and st.job(jid).version == 1

    v, opt_bytes = st.optimizer_state(jid)
    saved = torch.load(io.BytesIO(opt_bytes), weights_only=True)["optimizer"]
    assert v == 1
    states = list(saved["state"].values())
    assert states and all(int(s["step"]) == 1 for s in states)
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in states)

    # The next step's rollouts; its batch is captured before the restarted trainer consumes it.
    run_generate(st, gen, [["gen", jid, g] for g in range(4, 8)])
    run_verify(st, jid, "ver", list(range(4, 8)))
    samples, _, _ = train_batch(spec, 1, [st.rollout(jid, g) for g in range(4, 8)])
    assert samples

    # Restart: a fresh trainer process knows nothing; it must load version 1 and Adam from the store.
    restarted = TrainingEngine(tiny_base, threads=1)
    token = st.take_trainer(jid, 1, 60)
    assert run_train(st, restarted, jid, 1, token)["step"] == 2
    resumed = st_load(st.adapter(AdapterRef(jid, 2)).weights)
    v2, opt2 = st.optimizer_state(jid)
    assert v2 == 2 and all(int(s["step"]) == 2 for s in torch.load(io.BytesIO(opt2), weights_only=True)
                           ["optimizer"]["state"].values())

    # The first trainer, still holding version 1 in its cache, takes the same step without the store:
    # the restarted one must have produced exactly the same adapter.
    assert first.cached().get(jid) == 1
    continuous = st_load(step(first, jid, 1, spec, samples, None).adapter.weights)
    assert continuous.keys() == resumed.keys()
    for k in continuous:
        torch.testing.assert_close(resumed[k], continuous[k], rtol=0, atol=1e-6)
    # and the step really moved the weights (the comparison is not vacuous)
    v1 = st_load(st.adapter(AdapterRef(jid, 1)).weights)
    assert any(not torch.equal(v1[k], resumed[k]) for k in v1)


def test_a_trained_out_job_leaves_the_trainer_cache(st, tiny_base):
    # Its last version published, a job's adapter and Adam moments leave the trainer's cache (a
    # long-lived trainer keeps only live jobs); a job that ended early goes at its next train task.
    spec = JobSpec(task="max", steps=2, prompts_per_step=2, group_size=4, temperature=2.0, seed=1,
                   max_staleness=0, eval_size=2)
    gen = make_engine("hf", tiny_base, st.adapter, threads=1)
    trainer = TrainingEngine(tiny_base, threads=1, cache_size=8)  # as on a GPU: live jobs stay cached
    done = st.create_job(spec, *job_rows(spec))
    ended = st.create_job(spec, *job_rows(spec))
    assert one_step(st, gen, trainer, done, 0, 2)["step"] == 1
    assert one_step(st, gen, trainer, ended, 0, 2)["step"] == 1
    assert trainer.cached() == {done: 1, ended: 1}
    assert one_step(st, gen, trainer, done, 1, 2)["step"] == 2
    assert done not in trainer.cached() and st.job(done).status == "evaluating"
    st.set_status(ended, "cancelled")
    assert "skipped" in run_train(st, trainer, ended, 1, "no-lease")
    assert trainer.cached() == {}


def test_a_trainer_that_keeps_one_job_reloads_the_others_from_their_published_state(st, tiny_base):
    # The CPU trainer's cache holds one job (its default): two jobs taking turns are each loaded from
    # the state they published, and train exactly as a trainer that kept them both.
    spec = JobSpec(task="max", steps=3, prompts_per_step=4, group_size=8, temperature=2.0, seed=1,
                   max_staleness=0, eval_size=2, rl={"drop_zero_advantage": False})
    gen = make_engine("hf", tiny_base, st.adapter, threads=1)
    trainer, keeper = TrainingEngine(tiny_base, threads=1), TrainingEngine(tiny_base, threads=1, cache_size=8)
    assert trainer.cache_size == 1
    a, b = st.create_job(spec, *job_rows(spec)), st.create_job(spec, *job_rows(spec))
    batches = []
    for t in range(2):
        for jid in (a, b):
            groups = list(range(4 * t, 4 * t + 4))
            run_generate(st, gen, [["gen", jid, g] for g in groups])
            run_verify(st, jid, "ver", groups)
            if jid == a:
                batches.append(train_batch(spec, t, [st.rollout(a, g) for g in groups])[0])
            assert run_train(st, trainer, jid, t, st.take_trainer(jid, t, 60))["step"] == t + 1
            assert trainer.cached() == {jid: t + 1}
    kept = [step(keeper, a, t, spec, batches[t], None) for t in range(2)]
    published = st_load(st.adapter(AdapterRef(a, 2)).weights)
    reference = st_load(kept[1].adapter.weights)
    assert published.keys() == reference.keys()
    for k in published:
        torch.testing.assert_close(published[k], reference[k], rtol=0, atol=1e-6)
    assert any(not torch.equal(published[k], st_load(st.adapter(AdapterRef(a, 1)).weights)[k]) for k in published)
    states = torch.load(io.BytesIO(st.optimizer_state(a)[1]), weights_only=True)["optimizer"]["state"].values()
    assert all(int(s["step"]) == 2 for s in states)  # Adam's moments went on from the store, not afresh
