"""The official OpenAI Python SDK (pinned in the test extra) against the embedded stack: model listing,
chat completions on the base and on `JOB@best`, streaming, `n > 1`, text completions of `JOB/VERSION`
whose greedy output equals plain transformers + PEFT on that version's stored adapter (its sha256 in
the response), promotion and rollback of `@best` over HTTP, and the SDK's own AuthenticationError /
NotFoundError / BadRequestError on a bad key, another tenant's model and an unserved parameter.
"""

from __future__ import annotations

import hashlib
import os
import time

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
openai = pytest.importorskip("openai")
STEPS = 4


@pytest.fixture(scope="module")
def trained(worker_stack):
    """(url, tenant token, another tenant's token, the tenant's finished job id)."""
    from marlaas.api import tenancy
    from marlaas.api.http_client import Client
    from marlaas.store import Store

    url = os.environ["MARLAAS_API_URL"]
    token, other = tenancy.add_tenant(Store(), "sdk-a"), tenancy.add_tenant(Store(), "sdk-b")
    t0 = time.time()
    job = Client(url, token=token).submit({"task": "max", "steps": STEPS, "eval_every": 2, "prompts_per_step": 4,
                                           "group_size": 4, "eval_size": 8, "eval_k": 0, "learning_rate": 1e-2,
                                           "seed": 3})
    st = job.wait(timeout=600)
    print(f"job {job.id}: {time.time() - t0:.1f} s")
    assert st["status"] == "done", st
    return url, token, other, job.id


def _client(url: str, key: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_models_chat_stream_and_n(trained):
    from marlaas.store import Store

    url, token, _, jid = trained
    client = _client(url, token)
    ids = [m.id for m in client.models.list()]
    best = Store().best_version(jid)
    assert best is not None and ids[1:] == [jid, f"{jid}@best"] and ids[0]  # the base first
    base = ids[0]

    msg = [{"role": "user", "content": "max of 3 9 4?"}]
    on_base = client.chat.completions.create(model=base, messages=msg, temperature=0, max_tokens=8)
    assert on_base.choices[0].message.role == "assistant" and on_base.system_fingerprint == "base"
    assert on_base.usage.completion_tokens >= 1 and on_base.choices[0].finish_reason in ("stop", "length")

    raw = client.chat.completions.with_raw_response.create(model=f"{jid}@best", messages=msg, temperature=0,
                                                            max_tokens=8)
    on_best = raw.parse()
    sha = raw.headers["x-marlaas-adapter-sha256"]
    assert on_best.system_fingerprint == sha and on_best.model == f"{jid}@best"
    if best > 0:
        from marlaas.types import AdapterRef

        assert sha == hashlib.sha256(Store().adapter(AdapterRef(jid, best)).weights).hexdigest()

    chunks = list(client.chat.completions.create(model=f"{jid}@best", messages=msg, temperature=0, max_tokens=8,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == on_best.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == on_best.choices[0].finish_reason

    many = client.chat.completions.create(model=jid, messages=msg, n=3, temperature=1.0, max_tokens=8, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    again = client.chat.completions.create(model=jid, messages=msg, n=3, temperature=1.0, max_tokens=8, seed=5)
    assert [c.message.content for c in many.choices] == [c.message.content for c in again.choices]


def test_the_sdk_raises_its_own_errors(trained):
    from marlaas.api.http_client import Client

    url, token, other, jid = trained
    msg = [{"role": "user", "content": "1"}]
    with pytest.raises(openai.AuthenticationError):
        _client(url, "not-a-token").chat.completions.create(model=jid, messages=msg)
    theirs = Client(url, token=other).submit({"task": "max", "steps": 1, "prompts_per_step": 1, "group_size": 2,
                                             "eval_size": 1})
    try:
        with pytest.raises(openai.NotFoundError) as e:
            _client(url, token).chat.completions.create(model=theirs.id, messages=msg)
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):  # and the other way round
            _client(url, other).chat.completions.create(model=f"{jid}@best", messages=msg)
    finally:
        theirs.cancel()
    with pytest.raises(openai.BadRequestError):
        _client(url, token).chat.completions.create(model=jid, messages=msg, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])


def test_greedy_of_a_version_equals_plain_peft_on_its_stored_adapter(trained, tiny_base, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marlaas.adapters import write_adapter_dir
    from marlaas.base.tiny import load_tokenizer
    from marlaas.families import rows
    from marlaas.store import Store
    from marlaas.types import AdapterRef

    url, token, _, jid = trained
    client = _client(url, token)
    tok = load_tokenizer(tiny_base)
    prompts = [r["prompt"] for r in rows("max", "eval", 6, seed=11)]
    for v in (2, STEPS):
        blob = Store().adapter(AdapterRef(jid, v))
        out = write_adapter_dir(blob, tmp_path / f"v{v}", base_path=str(tiny_base))
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32),
                                          str(out))
        model.eval()
        eos = model.generation_config.eos_token_id
        eos = sorted({*([eos] if isinstance(eos, int) else (eos or [])), tok.eos_token_id})
        raw = client.completions.with_raw_response.create(model=f"{jid}/{v}", prompt=prompts, temperature=0,
                                                          max_tokens=8)
        served = [c.text for c in raw.parse().choices]
        assert raw.headers["x-marlaas-adapter-sha256"] == hashlib.sha256(blob.weights).hexdigest()
        plain = []
        with torch.inference_mode():
            for p in prompts:
                enc = tok(p, return_tensors="pt")
                seq = model.generate(**enc, do_sample=False, max_new_tokens=8, eos_token_id=eos,
                                     pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
                plain.append(tok.decode(seq, skip_special_tokens=True))
        assert served == plain, (v, served, plain)


def test_promote_pins_best_and_unpin_rolls_it_forward(trained):
    from marlaas.store import Store
    from marlaas.types import AdapterRef

    url, token, _, jid = trained
    client = _client(url, token)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    state = http.get(f"/v1/jobs/{jid}/promote").json()
    assert set(state["exact"]) == {"0", "2", str(STEPS)} and state["pinned"] is None
    assert state["best"] == int(max(state["exact"], key=lambda v: (state["exact"][v], int(v))))  # ties: later

    def served_sha() -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=f"{jid}@best", messages=[{"role": "user", "content": "1"}], temperature=0, max_tokens=1)
        return raw.headers["x-marlaas-adapter-sha256"]

    pinned = http.post(f"/v1/jobs/{jid}/promote", json={"version": 2}).json()
    assert pinned["best"] == 2 and pinned["pinned"] == 2
    assert served_sha() == hashlib.sha256(Store().adapter(AdapterRef(jid, 2)).weights).hexdigest()
    assert http.post(f"/v1/jobs/{jid}/promote", json={"version": 1}).status_code == 404  # never evaluated
    back = http.delete(f"/v1/jobs/{jid}/promote").json()
    assert back["pinned"] is None and back["best"] == state["best"]
    other = httpx.post(f"{url}/v1/jobs/{jid}/promote", json={"version": 2}, timeout=60,
                       headers={"Authorization": "Bearer nope"})
    assert other.status_code == 401


def test_the_plan_bounds_serving_requests_and_tokens_per_minute(trained):
    """A tenant's plan caps its serving per minute over every API process: past the requests or the
    reserved tokens (n x max_tokens) the SDK gets its RateLimitError with a Retry-After, and a request
    asking for more than a whole minute's tokens is its BadRequestError; nothing refused is queued."""
    from marlaas.api import tenancy
    from marlaas.store import Store

    url = trained[0]
    plan = tenancy.Quotas(serve_requests_per_minute=2, serve_tokens_per_minute=40)
    client = _client(url, tenancy.add_tenant(Store(), "sdk-plan", plan))
    base = client.models.list().data[0].id
    msg = [{"role": "user", "content": "max of 1 2?"}]
    with pytest.raises(openai.BadRequestError, match="serve_tokens_per_minute"):
        client.chat.completions.create(model=base, messages=msg, max_tokens=41)
    client.chat.completions.create(model=base, messages=msg, max_tokens=8, n=2)  # 16 tokens reserved
    with pytest.raises(openai.RateLimitError, match="serve_tokens_per_minute") as e:  # 16 + 30 > 40
        client.completions.create(model=base, prompt=["a", "b", "c"], max_tokens=10)
    assert int(e.value.response.headers["retry-after"]) >= 1
    client.completions.create(model=base, prompt="max of 1 2?", max_tokens=8)  # the 2nd request: 24 tokens
    with pytest.raises(openai.RateLimitError, match="serve_requests_per_minute"):
        client.completions.create(model=base, prompt="max of 1 2?", max_tokens=1)


def test_an_alias_stands_for_a_model_of_its_tenant_only(trained):
    """`PUT /v1/aliases/prod {"model": "JOB@best"}`: the SDK calls `prod` and samples exactly the
    adapter `JOB@best` names (same sha256, same greedy text); /v1/models lists it; another tenant's
    `prod` is not this one; a bad alias, an alias of an alias and another tenant's model are refused."""
    url, token, other, jid = trained
    client = _client(url, token)
    with httpx.Client(base_url=url + "/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60) as h:
        r = h.put("/aliases/prod", json={"model": f"{jid}@best"})
        assert r.status_code == 200 and r.json()["model"] == f"{jid}@best", r.text
        assert h.get("/aliases").json() == {"aliases": {"prod": f"{jid}@best"}}
        for bad, why in (("j7", "not a job id"), ("9x", "a letter")):
            assert why in h.put(f"/aliases/{bad}", json={"model": jid}).json()["error"]["message"]
        assert "another alias" in h.put("/aliases/prod2", json={"model": "prod"}).json()["error"]["message"]
        msg = [{"role": "user", "content": "max of 3 9 4?"}]
        via = client.chat.completions.with_raw_response.create(model="prod", messages=msg, temperature=0,
                                                                max_tokens=8)
        best = client.chat.completions.with_raw_response.create(model=f"{jid}@best", messages=msg, temperature=0,
                                                                 max_tokens=8)
        assert via.headers["x-marlaas-adapter-sha256"] == best.headers["x-marlaas-adapter-sha256"]
        assert via.parse().choices[0].message.content == best.parse().choices[0].message.content
        assert via.parse().model == "prod" and "prod" in [m.id for m in client.models.list()]
        stranger = _client(url, other)
        with pytest.raises(openai.NotFoundError):
            stranger.chat.completions.create(model="prod", messages=msg, max_tokens=2)
        with httpx.Client(base_url=url + "/v1", headers={"Authorization": f"Bearer {other}"}, timeout=60) as o:
            assert o.put("/aliases/mine", json={"model": jid}).status_code == 404  # another tenant's job
        assert h.delete("/aliases/prod").json() == {"alias": "prod", "deleted": True}
        assert h.delete("/aliases/prod").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="prod", messages=msg, max_tokens=2)
