"""The serving door's model names (pure parsing) and wire format (validation, bodies, chunks, errors),
and the share of a generate call's rows serving may take."""

import json
import math

import pytest
from pydantic import ValidationError

from marlaas.api.openai import names, wire
from marlaas.errors import NotFound, RateLimited, SpecError, Unauthorized
from marlaas.generate.tinker_sample import serving_rows

pytestmark = pytest.mark.unit
BASE = ("base-test", "/models/base-test")


@pytest.mark.parametrize("name, kind, job, version", [
    ("base-test", "base", None, None),
    ("/models/base-test", "base", None, None),
    ("j12", "job", "j12", None),
    ("j12/3", "version", "j12", 3),
    ("j12/0", "version", "j12", 0),
    ("j12@best", "best", "j12", None),
    ("tinker://ts1:train:0/sampler_weights/s1", "tinker", None, None),
])
def test_parse_names_each_kind(name, kind, job, version):
    m = names.parse(name, BASE)
    assert (m.kind, m.job, m.version) == (kind, job, version)
    if kind == "tinker":
        assert m.path == name


@pytest.mark.parametrize("name", ["", "j12@latest", "j12/x", "j12/-1", "j12/\u00b2", "j12/\u0661", "a b", "j1/2/3",
                                  "@best", "x" * 65])
def test_a_name_of_no_kind_is_not_found_naming_it(name):
    with pytest.raises(NotFound) as e:
        names.parse(name, BASE)
    assert "does not exist" in str(e.value)


def test_base_names_from_the_deployment_record():
    assert names.base_names({"base": "/m/tiny", "base_name": "tiny-x"}) == ("tiny-x", "/m/tiny")
    assert names.base_names({"base": "/m/tiny"}) == ("tiny", "/m/tiny")
    assert names.base_names({}) == ()


def test_chat_request_validation_refuses_what_is_not_served():
    ok = wire.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                          "stop": "\n", "temperature": 0, "n": 2, "seed": 3})
    body = ok.body("j1", 2)
    assert body["serve"] == "chat" and body["model"] == "j1" and body["version"] == 2 and body["n"] == 2
    assert body["params"]["stop"] == ["\n"] and body["params"]["temperature"] == 0
    assert body["params"]["max_tokens"] == wire.DEFAULT_CHAT_MAX_TOKENS
    for bad in ({"tools": []}, {"top_logprobs": 3}, {"presence_penalty": 0.5}, {"n": 0}, {"stop": [""]},
                {"temperature": 3}):
        with pytest.raises(ValidationError):
            wire.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **bad})
    parts = wire.ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert parts.body(None, 0)["messages"][0]["content"] == "ab"
    image = wire.ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(SpecError):
        image.body(None, 0)


def test_completion_request_bodies_one_per_prompt():
    req = wire.CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 0})
    bodies = req.bodies(None, 0)
    assert [b["prompt"] for b in bodies] == ["a", "b"] and all(b["logprobs"] and b["n"] == 2 for b in bodies)
    assert bodies[0]["params"]["max_tokens"] == wire.DEFAULT_COMPLETION_MAX_TOKENS
    for bad in ({"echo": True}, {"suffix": "x"}, {"logprobs": 2}, {"prompt": []}, {"prompt": [1, 2]}):
        with pytest.raises(ValidationError):
            wire.CompletionRequest.model_validate({"model": "m", "prompt": "x", **bad})


def _result(sha="ab" * 32):
    return {"prompt_tokens": 5, "adapter_sha256": sha, "choices": [
        {"text": "15", "tokens": [7, 8, 1], "logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop",
         "completion_tokens": 3, "token_texts": ["1", "5"]}]}


def test_bodies_usage_fingerprint_and_logprobs():
    chat = wire.chat_body("r1", "j1@best", _result(), logprobs=True)
    assert chat["choices"][0]["message"]["content"] == "15" and chat["system_fingerprint"] == "ab" * 32
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert [t["token"] for t in chat["choices"][0]["logprobs"]["content"]] == ["1", "5"]
    comp = wire.completion_body("r2", "base-test", [_result(None), _result(None)], logprobs=True)
    assert [c["index"] for c in comp["choices"]] == [0, 1] and comp["system_fingerprint"] == "base"
    assert comp["usage"]["total_tokens"] == 16
    assert comp["choices"][0]["logprobs"]["text_offset"] == [0, 1]


def test_stream_chunks_end_with_done_and_carry_the_text_and_usage():
    events = wire.chat_chunks(wire.chat_body("r1", "m", _result(), logprobs=False), include_usage=True)
    assert events[-1] == "data: [DONE]\n\n" and all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "15"
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    texts = [json.loads(e[6:]) for e in wire.completion_chunks(wire.completion_body("r", "m", [_result()], False),
                                                                False)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in texts) == "15"


def test_errors_take_the_openai_shape_and_the_sdk_status():
    status, body, _ = wire.error(NotFound("the model 'j9' does not exist or you do not have access to it"))
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "model_not_found"
    assert wire.error(SpecError("invalid request: n: too big"))[0] == 400  # marlaas' 422 is OpenAI's 400
    assert wire.error(Unauthorized("unknown token"))[1]["error"]["code"] == "invalid_api_key"
    status, body, headers = wire.error(RateLimited("slow down", 2.5))
    assert status == 429 and headers["Retry-After"] == "3"


def test_serving_share_bounds_the_rows_while_training_waits():
    assert serving_rows(0, 0.5) == math.inf  # nothing training: no bound
    assert serving_rows(64, 1.0) == math.inf
    assert serving_rows(64, 0.5) == 64  # half of the call's rows
    assert serving_rows(60, 0.25) == 20  # 20 / (20 + 60) = 0.25
    assert serving_rows(64, 0.0) == 0
