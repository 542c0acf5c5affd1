"""Conformance: the unmodified Tinker SDK against the embedded stack (real Redis, real workers, the API).

Capabilities, a LoRA training client, sampling with logprobs and prompt logprobs, forward_backward with
importance_sampling, optim_step, new sampler weights whose outputs differ, save_state then
load_state_with_optimizer reproducing the continued run, the checkpoint list, the archive loaded by
plain PEFT, and the SDK's own error types for a bad key (401) and an unknown model (404).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time

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


def _post(url: str, **kw) -> httpx.Response:
    """A raw request as a client would send it: a 429 (this token's rate, which the SDK's own calls of
    the same test share) is retried after its Retry-After, as the SDK itself does."""
    for _ in range(20):
        r = httpx.post(url, timeout=30, **kw)
        if r.status_code != 429:
            return r
        time.sleep(float(r.headers.get("retry-after", "1")))
    return r


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


def test_another_tenants_objects_answer_as_missing_ones(worker_stack, api_key, home):
    """Another tenant's model, sampler, checkpoint and future are 404 with the message of an unknown id;
    the operator credential cannot train (403)."""
    from marlaas.api import tenancy
    from marlaas.api.service import operator_token
    from marlaas.store import Store

    url = os.environ["MARLAAS_API_URL"] + "/api/v1/"
    own = {"X-API-Key": api_key}
    other = {"X-API-Key": "tml-" + tenancy.add_tenant(Store(), "tinker-peer")}

    def call(method: str, path: str, body: dict | None, headers: dict) -> httpx.Response:
        return httpx.request(method, url + path, json=body, headers=headers, timeout=60)

    base = call("GET", "get_server_capabilities", None, own).json()["supported_models"][0]["model_name"]
    sid = call("POST", "create_session", {}, own).json()["session_id"]
    made = call("POST", "create_model", {"session_id": sid, "base_model": base, "lora_config": {"rank": 2}},
                own).json()
    mid, rid = made["model_id"], made["request_id"]
    ss = call("POST", "create_sampling_session", {"base_model": base}, own).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    cases = [  # (method, path, body) with {m} the model, {s} the sampler, {r} the request, {x} the session
        ("POST", "get_info", {"model_id": "{m}"}),
        ("GET", "training_runs/{m}", None),
        ("GET", "training_runs/{m}/checkpoints", None),
        ("GET", "training_runs/{m}/checkpoints/weights/ck/archive", None),
        ("POST", "optim_step", {"model_id": "{m}", "adam_params": {"learning_rate": 1e-3}}),
        ("POST", "create_sampling_session", {"model_path": "tinker://{m}/sampler_weights/s0"}),
        ("GET", "samplers/{s}", None),
        ("POST", "asample", {"sampling_session_id": "{s}", "prompt": prompt, "num_samples": 1}),
        ("POST", "retrieve_future", {"request_id": "{r}"}),
        ("POST", "cancel_future", {"request_id": "{r}"}),
        ("POST", "session_heartbeat", {"session_id": "{x}"}),
    ]
    real = {"{m}": mid, "{s}": ss, "{r}": rid, "{x}": sid}
    fake = {"{m}": "tk999999", "{s}": "ss999999", "{r}": "r999999", "{x}": "ts999999"}

    def fill(text: str, ids: dict) -> str:
        for k, v in ids.items():
            text = text.replace(k, v)
        return text

    def send(method: str, path: str, body: dict | None, ids: dict) -> httpx.Response:
        filled = None if body is None else json.loads(fill(json.dumps(body), ids))
        return call(method, fill(path, ids), filled, other)

    for method, path, body in cases:
        theirs, unknown = send(method, path, body, real), send(method, path, body, fake)
        assert (theirs.status_code, unknown.status_code) == (404, 404), (path, theirs.text, unknown.text)
        assert theirs.json()["error"]["type"] == unknown.json()["error"]["type"] == "NotFound"
        assert fill(unknown.json()["error"]["message"], {v: k for k, v in fake.items()}) == \
            fill(theirs.json()["error"]["message"], {v: k for k, v in real.items()}), path
    assert call("GET", f"training_runs/{mid}", None, own).status_code == 200  # the owner still sees it
    assert call("GET", f"samplers/{ss}", None, own).status_code == 200

    operator = {"X-API-Key": "tml-" + operator_token(home)}
    r = call("POST", "create_session", {}, operator)
    assert r.status_code == 403 and r.json()["error"]["type"] == "Forbidden", r.text


def test_session_lifecycle_resume_and_checkpoints(worker_stack, tiny_base, api_key):
    """A `with ServiceClient()` block that raises shows the block's own error (finish answers, never a
    404 in its place); the finished session's heartbeat is 410 and its model takes no more ops;
    create_training_client_from_state_with_optimizer resumes with the id the SDK derives; checkpoints
    list with their TTL, delete frees them; training runs list the tenant's own only."""
    from tinker import types

    from marlaas.store import Store
    from marlaas.store.keys import queue_key, state_key
    from marlaas.store.tinker import TinkerStore

    url = os.environ["MARLAAS_API_URL"]
    own = {"X-API-Key": api_key}
    probe = [_datum(types, [1, 2, 3], [4, 5], [-1.0, -1.0], 1.0)]
    with pytest.raises(ValueError, match="the run's own error"):
        with tinker.ServiceClient(base_url=url, api_key=api_key) as sc:
            base = sc.get_server_capabilities().supported_models[0].model_name
            tc = sc.create_lora_training_client(base_model=base, rank=2, seed=1).result()
            mid = tc.get_info().model_id
            sid = sc.holder.get_session_id()
            assert mid == f"{sid}:train:0"  # the SDK's own derivation, for create_model too
            tc.forward_backward(probe, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            ck = tc.save_state("ck", ttl_seconds=3600).result().path
            tc.save_state("gone").result()
            at_ck = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            raise ValueError("the run's own error")
    r = _post(f"{url}/api/v1/session_heartbeat", json={"session_id": sid}, headers=own)
    assert r.status_code == 410 and "ended (errored)" in r.text, r.text
    r = _post(f"{url}/api/v1/optim_step", json={"model_id": mid, "adam_params": {}}, headers=own)
    assert r.status_code == 410 and "create a new ServiceClient" in r.text, r.text

    with tinker.ServiceClient(base_url=url, api_key=api_key) as sc2:
        tc2 = sc2.create_training_client_from_state_with_optimizer(ck).result()
        sid2 = sc2.holder.get_session_id()
        assert tc2.get_info().model_id == f"{sid2}:train:0" and tc2.get_info().lora_rank == 2
        resumed = tc2.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert resumed == pytest.approx(at_ck, abs=1e-5)
        rest = tinker.RestClient(base_url=url, api_key=api_key)
        cks = {c.checkpoint_id: c for c in rest.list_checkpoints(mid).result().checkpoints}
        assert cks["weights/ck"].expires_at is not None and cks["weights/gone"].expires_at is None
        rest.delete_checkpoint(mid, "weights/gone").result()
        assert "weights/gone" not in {c.checkpoint_id for c in rest.list_checkpoints(mid).result().checkpoints}
        assert not Store().r.exists(state_key(mid, "gone"))  # the bytes are freed
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint(mid, "weights/gone").result()
        runs = rest.list_training_runs(limit=100).result()
        ids = {run.training_run_id for run in runs.training_runs}
        assert {mid, tc2.get_info().model_id} <= ids and runs.cursor.total_count == len(ids)
        other = "tml-" + __import__("marlaas.api.tenancy", fromlist=["x"]).add_tenant(Store(), "tinker-runs")
        assert mid not in {x.training_run_id for x in tinker.RestClient(base_url=url, api_key=other)
                           .list_training_runs().result().training_runs}

    # queued work: cancel_future removes it; an expired session's queued ops fail with the reason
    ts = TinkerStore(Store())
    r = _post(f"{url}/api/v1/create_session", json={}, headers=own)
    assert r.status_code == 200, r.text
    sid3 = r.json()["session_id"]
    made = _post(f"{url}/api/v1/create_model", headers=own, json={
        "session_id": sid3, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 2}}).json()
    m3 = made["model_id"]
    tenant = ts.model(None, m3)["tenant"]
    rids = [ts.new_future(tenant, "optim_step", m3, i, {"adam": {}}) for i in (1, 2)]
    ts.r.zadd(queue_key(m3), {r: i for i, r in enumerate(rids)})  # queued, not yet offered to the tick
    r = _post(f"{url}/api/v1/cancel_future", json={"request_id": rids[0]}, headers=own)
    assert r.status_code == 200, r.text
    assert r.json()["cancelled"] is True and ts.queue_length(m3) == 1
    assert "cancelled" in ts.future(None, rids[0])["error"]
    ts.mark_pending(m3)
    assert m3 not in dict(ts.lane_candidates(now=time.time() + 10_000))  # no heartbeat for too long
    f = ts.future(None, rids[1])
    assert f["status"] == "failed" and "expired" in f["error"], f
    assert ts.queue_length(m3) == 0


def test_unsupported_calls_fail_fast_with_a_clear_message(worker_stack, api_key):
    """Every call docs/tinker.md lists as unsupported fails through the unmodified SDK within a second,
    saying it is not served (the supported ones are the calls of the two tests above). "Fast" means not
    retried: the SDK retries a retryable answer (5xx, 408, 429) with backoff for far longer than the
    bound here, which is loose because a loaded 2-core machine took 1.01 s for one answer."""
    url = os.environ["MARLAAS_API_URL"]
    rest = tinker.RestClient(base_url=url, api_key=api_key)
    path = "tinker://tk1/weights/ck"
    calls = {
        "publish_checkpoint_from_tinker_path": lambda: rest.publish_checkpoint_from_tinker_path(path).result(),
        "unpublish_checkpoint_from_tinker_path": lambda: rest.unpublish_checkpoint_from_tinker_path(path).result(),
        "get_weights_info_by_tinker_path": lambda: rest.get_weights_info_by_tinker_path(path).result(),
        "list_user_checkpoints": lambda: rest.list_user_checkpoints().result(),
        "list_sessions": lambda: rest.list_sessions().result(),
        "copy_weights": lambda: rest.copy_weights(path, destination_project_id="p").result(),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(tinker.NotFoundError, match="not served by marlaas"):
            call()
        assert time.monotonic() - t0 < 5.0, name


SDK_CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")


def _documented_supported_calls() -> set[str]:
    """The SDK methods docs/tinker.md's "Supported" table names in its first column."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "tinker.md").read_text()
    table = doc[doc.index("## Supported"):doc.index("## Not supported")]
    names = {n.split(".")[-1] for line in table.splitlines() if line.startswith("| ")
             for n in re.findall(r"`([A-Za-z_][\w.]*)", line.split("|")[1])}
    return {n for n in names if any(hasattr(getattr(tinker, c), n) for c in SDK_CLIENTS)}


def test_every_supported_call_of_the_docs_works_through_the_sdk(worker_stack, tiny_base, api_key):
    """The probe of the supported side: the calls the other tests of this file do not make (a run's
    and a session's record, a checkpoint's TTL set after the fact, every documented loss function)
    answer through the unmodified SDK; and every SDK method the docs' "Supported" table names is
    called by a test of the Tinker door (so the table cannot list a call nobody checks)."""
    from pathlib import Path

    from tinker import types

    url = os.environ["MARLAAS_API_URL"]
    with tinker.ServiceClient(base_url=url, api_key=api_key) as sc:
        base = sc.get_server_capabilities().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=base, rank=2, seed=5).result()
        mid = tc.get_info().model_id
        rest = sc.create_rest_client()
        assert rest.get_training_run(mid).result().training_run_id == mid
        assert rest.get_session(sc.holder.get_session_id()).result() is not None
        path = tc.save_state("ttl-later").result().path
        rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(mid).result().checkpoints}
        assert listed["weights/ttl-later"].expires_at is not None
        data = [_datum(types, [1, 2, 3], [4, 5], [-1.0, -1.0], 1.0)]
        for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo", "stable_reinforce", "dro", "gspo"):
            out = tc.forward_backward(data, loss).result()
            assert "loss:sum" in out.metrics, loss
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        at_ck = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        path2 = tc.save_state("weights-only").result().path
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        tc.load_state(path2).result()  # weights only: the same log-probs as at the checkpoint
        assert tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == \
            pytest.approx(at_ck, abs=1e-5)
        fresh = sc.create_training_client_from_state(path2).result()
        assert fresh.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == \
            pytest.approx(at_ck, abs=1e-5)

    tests = Path(__file__).resolve().parents[1]
    called = "".join(p.read_text() for p in (*tests.glob("integration/test_tinker*.py"),
                                              *tests.glob("e2e/test_tinker*.py")))
    documented = _documented_supported_calls()
    assert {"forward_backward", "sample", "get_training_run", "set_checkpoint_ttl_from_tinker_path"} <= documented
    assert sorted(n for n in documented if f".{n}(" not in called) == []
