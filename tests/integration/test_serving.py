"""The OpenAI-compatible door over HTTP against the worker stack (real Redis, real workers, the API):
chat and text completions of the base (usage counts, seeds, n, stop, stream, logprobs), a Tinker
sampler snapshot by its tinker:// path (same greedy tokens as the Tinker door, its adapter's sha256 in
the header), and the errors in OpenAI's shape (bad key, unknown and another tenant's model, an
unserved parameter)."""

from __future__ import annotations

import hashlib
import json
import os

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def door(worker_stack):
    from marlaas.api import tenancy
    from marlaas.store import Store

    url = os.environ["MARLAAS_API_URL"]
    a, b = tenancy.add_tenant(Store(), "serve-a"), tenancy.add_tenant(Store(), "serve-b")
    with httpx.Client(base_url=url + "/v1", headers={"Authorization": f"Bearer {a}"}, timeout=300) as http:
        yield http, url, a, b


def _base(http) -> str:
    models = http.get("/models").json()
    assert models["object"] == "list"
    return models["data"][0]["id"]


def test_the_base_serves_chat_and_text_completions(door, tiny_base):
    from marlaas.base.tiny import load_tokenizer

    http, _, _, _ = door
    base = _base(http)
    tok = load_tokenizer(tiny_base)
    r = http.post("/chat/completions", json={"model": base, "messages": [{"role": "user", "content": "12+3="}],
                                             "temperature": 0, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == base and body["system_fingerprint"] == "base"
    assert r.headers["x-marlaas-adapter-sha256"] == "none"
    greedy = body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == len(tok("12+3=")["input_ids"])  # no template: the raw prompt
    assert 1 <= body["usage"]["completion_tokens"] <= 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]

    same = http.post("/completions", json={"model": base, "prompt": "12+3=", "temperature": 0, "max_tokens": 6,
                                           "logprobs": 0}).json()
    assert same["object"] == "text_completion" and same["choices"][0]["text"] == greedy  # same text, same tokens
    lp = same["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == greedy and all(x <= 0 for x in lp["token_logprobs"])

    args = {"model": base, "prompt": ["12+3=", "7+1="], "temperature": 1.0, "max_tokens": 5, "n": 3, "seed": 11}
    one, two = http.post("/completions", json=args).json(), http.post("/completions", json=args).json()
    assert [c["index"] for c in one["choices"]] == list(range(6))
    assert [c["text"] for c in one["choices"]] == [c["text"] for c in two["choices"]]  # seeded

    if greedy[1:]:
        stop = greedy[1]
        cut = http.post("/completions", json={"model": base, "prompt": "12+3=", "temperature": 0, "max_tokens": 6,
                                              "stop": [stop]}).json()["choices"][0]
        assert cut["text"] == greedy[:greedy.index(stop)] and cut["finish_reason"] == "stop"

    with http.stream("POST", "/chat/completions", json={
            "model": base, "messages": [{"role": "user", "content": "12+3="}], "temperature": 0, "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == greedy
    assert chunks[-1]["usage"] == body["usage"]


def test_errors_take_openai_shape_and_status(door):
    from marlaas.api.http_client import Client

    http, url, _, other = door
    base = _base(http)
    msg = [{"role": "user", "content": "1+1="}]

    def err(r, status):
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and "\n" not in e["message"]
        return e

    assert err(httpx.post(f"{url}/v1/chat/completions", json={"model": base, "messages": msg},
                          headers={"Authorization": "Bearer nope"}), 401)["code"] == "invalid_api_key"
    assert err(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    job = Client(url, token=other).submit({"task": "sort", "steps": 1, "prompts_per_step": 1, "group_size": 2,
                                           "eval_size": 1})
    try:
        theirs = err(http.post("/chat/completions", json={"model": job.id, "messages": msg}), 404)
        unknown = err(http.post("/chat/completions", json={"model": "j999999", "messages": msg}), 404)
        assert theirs["message"].replace(job.id, "J") == unknown["message"].replace("j999999", "J")
        assert theirs["code"] == "model_not_found"
        assert job.id not in [m["id"] for m in http.get("/models").json()["data"]]
        assert err(http.get("/models/j1%0Ax"), 404)["code"] == "model_not_found"  # a newline in the name too
    finally:
        job.cancel()
    assert "tools" in err(http.post("/chat/completions", json={"model": base, "messages": msg, "tools": []}),
                          400)["message"]
    assert err(http.post("/completions", json={"model": base, "prompt": "x", "n": 99}), 400)
    assert err(http.post("/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)


def test_a_tinker_sampler_snapshot_by_its_path(door, tiny_base):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    from marlaas.base.tiny import load_tokenizer
    from marlaas.store import Store
    from marlaas.store.tinker import TinkerStore
    from marlaas.types import AdapterRef

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    http, url, token, _ = door
    sc = tinker.ServiceClient(base_url=url, api_key="tml-" + token)
    tc = sc.create_lora_training_client(base_model=_base(http), rank=4, seed=2).result()
    path = tc.save_weights_for_sampler("s1").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/s1")
    tok = load_tokenizer(tiny_base)
    prompt = tok("12+3=")["input_ids"]
    ref = sc.create_sampling_client(model_path=path).result().sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=0)).result().sequences[0].tokens

    r = http.post("/completions", json={"model": path, "prompt": "12+3=", "temperature": 0, "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    mid = path.removeprefix("tinker://").split("/")[0]
    v = TinkerStore(Store()).sampler_version(None, mid, "s1")
    sha = hashlib.sha256(Store().adapter(AdapterRef(mid, v)).weights).hexdigest()
    assert r.headers["x-marlaas-adapter-sha256"] == sha == r.json()["system_fingerprint"]
    other = httpx.post(f"{url}/v1/completions", json={"model": path, "prompt": "1", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {door[3]}"}, timeout=60)
    assert other.status_code == 404
