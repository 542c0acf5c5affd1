"""Conformance: the unmodified Tinker SDK against the embedded stack (real Redis, real workers, the API).

Capabilities, a LoRA training client, sampling with logprobs and prompt logprobs, forward_backward with
importance_sampling, optim_step, new sampler weights whose outputs differ, save_state then
load_state_with_optimizer reproducing the continued run, the checkpoint list, the archive loaded by
plain PEFT, and the SDK's own error types for a bad key (401) and an unknown model (404).
"""

from __future__ import annotations

import io
import os
import tarfile

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module")
def api_key(worker_stack) -> str:
    from marlaas.api import tenancy
    from marlaas.store import Store

    return "tml-" + tenancy.add_tenant(Store(), "tinker-conf")


def _datum(types, prompt: list[int], completion: list[int], logprobs: list[float], adv: float):
    full = prompt + completion
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[len(full) - 1]),
            "logprobs": types.TensorData(data=[0.0] * pad + logprobs, dtype="float32", shape=[len(full) - 1]),
            "advantages": types.TensorData(data=[0.0] * pad + [adv] * len(completion), dtype="float32",
                                           shape=[len(full) - 1]),
        })


def test_the_sdk_end_to_end(worker_stack, tiny_base, api_key, tmp_path):
    import torch
    from tinker import types

    from marlaas.api import tenancy
    from marlaas.base.tiny import load_tokenizer
    from marlaas.store import Store

    url = os.environ["MARLAAS_API_URL"]
    sc = tinker.ServiceClient(base_url=url, api_key=api_key)
    caps = sc.get_server_capabilities()
    base = caps.supported_models[0].model_name
    assert base and caps.supported_models[0].trainable

    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3, train_unembed=False).result()
    mid = tc.get_info().model_id
    assert tc.get_info().lora_rank == 4
    tok = load_tokenizer(tiny_base)
    prompt = tok("12+3=")["input_ids"]

    s0_path = tc.save_weights_for_sampler("s0").result().path
    s0 = sc.create_sampling_client(model_path=s0_path)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    out = s0.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params,
                    include_prompt_logprobs=True).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert seq.tokens and len(seq.logprobs) == len(seq.tokens)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)

    # importance_sampling: at the sampler's own weights the trainer's logprobs equal the sampler's
    data = [_datum(types, prompt, s.tokens, s.logprobs, adv) for s, adv in zip(out.sequences, (1.0, -1.0, 0.5))]
    fb = tc.forward_backward(data, "importance_sampling").result()
    assert "loss:sum" in fb.metrics
    for s, o in zip(out.sequences, fb.loss_fn_outputs):
        got = o["logprobs"].tolist()[len(prompt) - 1:]
        assert got == pytest.approx(s.logprobs, abs=2e-3)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    for _ in range(2):
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    # new sampler weights: the same prompt scores differently
    s1 = tc.save_weights_and_get_sampling_client()
    out1 = s1.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params,
                     include_prompt_logprobs=True).result()
    diff = max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], out1.prompt_logprobs[1:]))
    assert diff > 1e-4

    # save_state, one more step; then load_state_with_optimizer and the same step reproduces it
    ck = tc.save_state("ck1").result().path
    probe = data[:1]
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after_a = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    tc.load_state_with_optimizer(ck).result()
    at_ck = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after_b = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after_b == pytest.approx(after_a, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(after_a, at_ck)) > 1e-5

    # the checkpoint list and the archive, loaded by plain PEFT, give the trainer's logprobs at ck1
    ids = {c.checkpoint_id for c in sc.create_rest_client().list_checkpoints(mid).result().checkpoints}
    assert {"weights/ck1", "sampler_weights/s0"} <= ids
    r = httpx.get(f"{url}/api/v1/training_runs/{mid}/checkpoints/weights/ck1/archive",
                  headers={"X-API-Key": api_key}, timeout=60)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(tmp_path / "adapter", filter="data")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), tmp_path / "adapter").eval()
    full = probe[0].model_input.to_ints()
    target = probe[0].loss_fn_inputs["target_tokens"].tolist()
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].float(), -1)
    peft_lp = lp.gather(-1, torch.tensor(target).unsqueeze(-1)).squeeze(-1).tolist()
    assert peft_lp == pytest.approx(at_ck, abs=1e-4)

    # the SDK's own error types
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path="tinker://tk999999/sampler_weights/none").result()
    with pytest.raises(tinker.NotFoundError):  # another tenant's model is answered as a missing one
        other = "tml-" + tenancy.add_tenant(Store(), "tinker-other")
        tinker.ServiceClient(base_url=url, api_key=other).create_sampling_client(model_path=s0_path).result()
    with pytest.raises(tinker.AuthenticationError):  # the client connects on its first call
        tinker.ServiceClient(base_url=url, api_key="tml-not-a-token").get_server_capabilities()
