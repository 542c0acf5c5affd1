"""The Tinker door at the token level, through the unmodified SDK against the worker stack (real Redis,
real workers, the API): LoRA ranks up to the deployment's maximum (shown by get_server_capabilities,
a rank-32 model trains and samples, a larger rank is refused in one line), prompts sampled as token
ids, top_k, stop strings spanning tokens, prompt_logprobs_last_n, and sample requests riding in the
jobs' generate batches.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
tinker = pytest.importorskip("tinker")
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module")
def door(worker_stack):
    from marlaas.api import tenancy
    from marlaas.store import Store

    token = tenancy.add_tenant(Store(), "tinker-tokens")
    url = os.environ["MARLAAS_API_URL"]
    sc = tinker.ServiceClient(base_url=url, api_key="tml-" + token)
    return sc, url, token


def test_rank_32_trains_and_samples_and_a_rank_over_the_maximum_is_refused(door, tiny_base):
    from tinker import types

    from marlaas.api import access
    from marlaas.base.tiny import load_tokenizer
    from marlaas.store import Store

    sc, url, token = door
    caps = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-" + token}, timeout=30)
    top = caps.json()["supported_models"][0]["max_lora_rank"]
    assert top == access.max_lora_rank(Store()) == 64  # the hf engine's default, recorded by the generate worker
    base = sc.get_server_capabilities().supported_models[0].model_name

    tc = sc.create_lora_training_client(base_model=base, rank=32, seed=1).result()
    assert tc.get_info().lora_rank == 32
    prompt = load_tokenizer(tiny_base)("12+3=")["input_ids"]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    out = tc.save_weights_and_get_sampling_client().sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    data = []
    for seq, adv in zip(out.sequences, (1.0, -1.0)):
        full, pad = prompt + seq.tokens, len(prompt) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[len(full) - 1]),
            "logprobs": types.TensorData(data=[0.0] * pad + seq.logprobs, dtype="float32", shape=[len(full) - 1]),
            "advantages": types.TensorData(data=[0.0] * pad + [adv] * len(seq.tokens), dtype="float32",
                                           shape=[len(full) - 1])}))
    fb = tc.forward_backward(data, "stable_reinforce").result()  # the cookbook's default loss
    for seq, o in zip(out.sequences, fb.loss_fn_outputs):  # the rank-32 sampler and trainer agree
        assert o["logprobs"].tolist()[len(prompt) - 1:] == pytest.approx(seq.logprobs, abs=2e-3)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = tc.save_weights_and_get_sampling_client().sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params,
        include_prompt_logprobs=True).result()
    assert after.sequences[0].tokens and after.prompt_logprobs[0] is None

    with pytest.raises(tinker.UnprocessableEntityError) as err:
        sc.create_lora_training_client(base_model=base, rank=2 * top).result()
    msg = str(err.value)
    assert f"LoRA rank {2 * top} over this deployment's maximum {top}" in msg and "\n" not in msg


def test_token_level_sampling_through_the_sdk(door, tiny_base):
    from tinker import types

    from marlaas.base.tiny import load_tokenizer

    sc, _, _ = door
    tok = load_tokenizer(tiny_base)
    base = sc.get_server_capabilities().supported_models[0].model_name
    s = sc.create_sampling_client(base_model=base)
    spelled = [tok.convert_tokens_to_ids(c) for c in "<pad>"]
    prompt = tok("12+3=")["input_ids"] + spelled
    assert tok(tok.decode(prompt))["input_ids"] != prompt  # refused before: it does not survive decode -> encode
    mi = types.ModelInput.from_ints(prompt)

    greedy = s.sample(prompt=mi, num_samples=1, sampling_params=types.SamplingParams(max_tokens=10, temperature=0),
                      include_prompt_logprobs=True).result()
    top1 = s.sample(prompt=mi, num_samples=3, sampling_params=types.SamplingParams(
        max_tokens=10, temperature=1.0, top_k=1, seed=3)).result()
    assert all(q.tokens == greedy.sequences[0].tokens for q in top1.sequences)

    last = s.sample(prompt=mi, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2, temperature=0),
                    include_prompt_logprobs=True, prompt_logprobs_last_n=3).result()
    assert last.prompt_logprobs[:-3] == [None] * (len(prompt) - 3)
    assert last.prompt_logprobs[-3:] == pytest.approx(greedy.prompt_logprobs[-3:], abs=1e-5)

    toks = greedy.sequences[0].tokens
    if len(toks) >= 6 and toks[-1] != tok.eos_token_id:
        stop = tok.decode(toks[2:5])  # three tokens of the char tokenizer
        cut = s.sample(prompt=mi, num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=10, temperature=0, stop=[stop])).result().sequences[0]
        text = tok.decode(toks)
        assert tok.decode(cut.tokens) == text[:text.index(stop) + len(stop)]
        assert cut.stop_reason == "stop"


def test_samples_ride_in_the_jobs_generate_batches(door):
    from tinker import types

    from marlaas.api.http_client import Client
    from marlaas.store import Store

    sc, url, token = door
    # A job long enough to keep generating for the whole probe (cancelled at the end): with a short one
    # the samples could arrive after its last batch, with nothing left to ride in.
    job = Client(url, token=token).submit({"task": "sort", "steps": 500, "prompts_per_step": 2, "group_size": 4,
                                           "eval_size": 2, "eval_every": 0, "max_staleness": 2})
    base = sc.get_server_capabilities().supported_models[0].model_name
    s = sc.create_sampling_client(base_model=base)
    since, shared = time.time(), []
    deadline = time.time() + 240
    try:
        while not shared and time.time() < deadline:
            futures = [s.sample(prompt=types.ModelInput.from_ints([14, 15, 16]), num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=4)) for _ in range(4)]
            assert all(f.result().sequences[0].tokens for f in futures)
            shared = [e for e in Store().events(since) if e["station"] == "generate"
                      and e.get("items", 0) > 0 and e.get("tinker", 0) > 0]
    finally:
        job.cancel()
    assert shared, "no sample rode in a job's generate batch"
