"""A corpus of malformed requests through every door (the HTTP API's jobs, files, graders, verifiers and
tenants routes, and the Tinker routes) against a real uvicorn server on a real Redis: every one is a
clear one-line 4xx in the API's JSON envelope, never a 500.

The kinds the issue names are all here: a lone surrogate in a prompt or a name (JSON "\\ud800", and
its raw UTF-8 bytes), a 100,000-deep JSON body and JSONL line, wrong types, missing fields, huge
numbers, NaN / Infinity, and malformed Tinker bodies (JSON and protobuf).
"""

from __future__ import annotations

import json

import httpx
import pytest
from tinker.proto import tinker_public_pb2 as pb

from marlaas.api.app import create_app
from marlaas.api.service import operator_token
from marlaas.api.settings import ApiSettings
from marlaas.api.tenancy import add_tenant
from marlaas.store.tinker import TinkerStore
from tests.integration.test_api import Server

pytestmark = pytest.mark.integration

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJ = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
PROTO = {"Content-Type": "application/x-protobuf"}
JSONL = {"Content-Type": "application/octet-stream"}


def _proto_fwdbwd(model_id: str, tokens: bytes = b"", dense: bytes = b"", shape=(), dtype=pb.DTYPE_FLOAT32) -> bytes:
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = tokens
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dtype=dtype, dense=dense, shape=list(shape)))
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy", data=[d]).SerializeToString()


def _fb(data) -> bytes:
    body = {"model_id": "{mid}", "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}
    return json.dumps(body).encode()


# (id, method, path, body, headers, who): path/body may name {mid} (a model of the tenant) and {sid}
# (its session); who is "tenant" or "op" (the operator credential).
CORPUS = [
    # ---- the HTTP API: jobs
    ("job-lone-surrogate-prompt", "POST", "/v1/jobs", b'{"dataset": [{"prompt": "\\ud800", "answer": "1"}]}', {},
     "tenant"),
    ("job-lone-low-surrogate", "POST", "/v1/jobs", b'{"task": "sort", "name": "x\\udc00y"}', {}, "tenant"),
    ("job-raw-surrogate-bytes", "POST", "/v1/jobs", b'{"task": "sort", "name": "\xed\xa0\x80"}', {}, "tenant"),
    ("job-invalid-utf8", "POST", "/v1/jobs", b'{"task": "\xff\xfe"}', {}, "tenant"),
    ("job-deep-array", "POST", "/v1/jobs", DEEP, {}, "tenant"),
    ("job-deep-object", "POST", "/v1/jobs", DEEP_OBJ, {}, "tenant"),
    ("job-deep-in-field", "POST", "/v1/jobs", b'{"task": "sort", "grader": ' + DEEP + b"}", {}, "tenant"),
    ("job-not-json", "POST", "/v1/jobs", b"steps=3", {}, "tenant"),
    ("job-truncated", "POST", "/v1/jobs", b'{"task": "sort", "steps": ', {}, "tenant"),
    ("job-array-body", "POST", "/v1/jobs", b"[1, 2, 3]", {}, "tenant"),
    ("job-null-body", "POST", "/v1/jobs", b"null", {}, "tenant"),
    ("job-string-body", "POST", "/v1/jobs", b'"sort"', {}, "tenant"),
    ("job-empty-object", "POST", "/v1/jobs", b"{}", {}, "tenant"),
    ("job-steps-string", "POST", "/v1/jobs", b'{"task": "sort", "steps": "many"}', {}, "tenant"),
    ("job-steps-huge", "POST", "/v1/jobs", b'{"task": "sort", "steps": 1' + b"0" * 5000 + b"}", {}, "tenant"),
    ("job-steps-1e400", "POST", "/v1/jobs", b'{"task": "sort", "steps": 1e400}', {}, "tenant"),
    ("job-lr-nan", "POST", "/v1/jobs", b'{"task": "sort", "learning_rate": NaN}', {}, "tenant"),
    ("job-lr-infinity", "POST", "/v1/jobs", b'{"task": "sort", "learning_rate": -Infinity}', {}, "tenant"),
    ("job-dataset-wrong-type", "POST", "/v1/jobs", b'{"dataset": 7}', {}, "tenant"),
    ("job-rows-not-objects", "POST", "/v1/jobs", b'{"dataset": [1, "two", null]}', {}, "tenant"),
    ("job-lora-wrong-type", "POST", "/v1/jobs", b'{"task": "sort", "lora": "big"}', {}, "tenant"),
    ("job-wait-nan", "POST", "/v1/jobs?wait=nan", b'{"task": "sort"}', {}, "tenant"),
    ("jobs-limit-huge", "GET", "/v1/jobs?limit=1" + "0" * 400, b"", {}, "tenant"),
    ("job-id-surrogate-bytes", "GET", "/v1/jobs/%ED%A0%80", b"", {}, "tenant"),
    ("job-events-after-nan", "GET", "/v1/jobs/j1/events?after=nan", b"", {}, "tenant"),
    # ---- files
    ("file-not-jsonl", "POST", "/v1/files?filename=x.jsonl", b"\x00\x01\x02 not json\n", JSONL, "tenant"),
    ("file-bad-parquet", "POST", "/v1/files?filename=x.parquet", b"PAR1garbagePAR1", JSONL, "tenant"),
    # ---- graders
    ("grader-surrogate-name", "POST", "/v1/graders/validate",
     b'{"grader": {"type": "string_check", "name": "\\ud800", "input": "{{sample.output_text}}",'
     b' "reference": "a", "operation": "eq"}}', {}, "tenant"),
    ("grader-deep", "POST", "/v1/graders/validate", b'{"grader": ' + DEEP_OBJ + b"}", {}, "tenant"),
    ("grader-wrong-type", "POST", "/v1/graders/validate", b'{"grader": "string_check"}', {}, "tenant"),
    ("grader-missing", "POST", "/v1/graders/validate", b"{}", {}, "tenant"),
    ("grader-run-surrogate-output", "POST", "/v1/graders/run",
     b'{"grader": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "a",'
     b' "operation": "eq"}, "sample": {"output_text": "\\ud800"}, "item": {}}', {}, "tenant"),
    ("grader-run-wrong-sample", "POST", "/v1/graders/run",
     b'{"grader": {"type": "string_check", "input": "x", "reference": "a", "operation": "eq"}, "sample": 3}',
     {}, "tenant"),
    # ---- verifiers and tenants (operator)
    ("verifier-surrogate-path", "PUT", "/v1/verifiers/v1", b'{"path": "\\ud800:f"}', {}, "op"),
    ("verifier-wrong-type", "PUT", "/v1/verifiers/v1", b'{"path": 5}', {}, "op"),
    ("verifier-missing", "PUT", "/v1/verifiers/v1", b"{}", {}, "op"),
    ("tenant-surrogate-name", "POST", "/v1/tenants", b'{"name": "\\ud800"}', {}, "op"),
    ("tenant-deep", "POST", "/v1/tenants", DEEP, {}, "op"),
    ("tenant-weight-nan", "POST", "/v1/tenants", b'{"name": "zed", "weight": NaN}', {}, "op"),
    # ---- Tinker: JSON bodies
    ("tk-session-deep", "POST", "/api/v1/create_session", DEEP_OBJ, {}, "tenant"),
    ("tk-session-surrogate-tag", "POST", "/api/v1/create_session", b'{"tags": ["\\ud800"]}', {}, "tenant"),
    ("tk-session-metadata-surrogate", "POST", "/api/v1/create_session", b'{"user_metadata": {"\\udfff": "x"}}', {},
     "tenant"),
    ("tk-heartbeat-missing", "POST", "/api/v1/session_heartbeat", b"{}", {}, "tenant"),
    ("tk-heartbeat-wrong-type", "POST", "/api/v1/session_heartbeat", b'{"session_id": [1]}', {}, "tenant"),
    ("tk-finish-surrogate-detail", "POST", "/api/v1/sessions/{sid}/finish",
     b'{"reason": {"type": "success"}, "detail": "\\ud800"}', {}, "tenant"),
    ("tk-finish-reason-wrong-type", "POST", "/api/v1/sessions/{sid}/finish", b'{"reason": "done"}', {}, "tenant"),
    ("tk-model-surrogate-base", "POST", "/api/v1/create_model",
     b'{"session_id": "{sid}", "base_model": "\\ud800", "lora_config": {"rank": 4}}', {}, "tenant"),
    ("tk-model-metadata-surrogate", "POST", "/api/v1/create_model",
     b'{"session_id": "{sid}", "lora_config": {"rank": 4}, "user_metadata": {"k": "\\ud800"}}', {}, "tenant"),
    ("tk-model-rank-huge", "POST", "/api/v1/create_model",
     b'{"session_id": "{sid}", "lora_config": {"rank": 99999999999999999999999}}', {}, "tenant"),
    ("tk-model-seed-huge", "POST", "/api/v1/create_model",
     b'{"session_id": "{sid}", "lora_config": {"rank": 4, "seed": 99999999999999999999999}}', {}, "tenant"),
    ("tk-model-seq-huge", "POST", "/api/v1/create_model",
     b'{"session_id": "{sid}", "model_seq_id": 99999999999999999999999, "lora_config": {"rank": 4}}', {},
     "tenant"),
    ("tk-model-lora-wrong-type", "POST", "/api/v1/create_model", b'{"session_id": "{sid}", "lora_config": 4}', {},
     "tenant"),
    ("tk-fb-data-not-objects", "POST", "/api/v1/forward_backward", _fb([1, 2]), {}, "tenant"),
    ("tk-fb-model-input-int", "POST", "/api/v1/forward_backward", _fb([{"model_input": 5}]), {}, "tenant"),
    ("tk-fb-chunks-wrong", "POST", "/api/v1/forward_backward", _fb([{"model_input": {"chunks": "abc"}}]), {},
     "tenant"),
    ("tk-fb-tokens-strings", "POST", "/api/v1/forward_backward",
     _fb([{"model_input": {"chunks": [{"tokens": ["a"]}]}}]), {}, "tenant"),
    ("tk-fb-token-huge", "POST", "/api/v1/forward_backward",
     _fb([{"model_input": {"chunks": [{"tokens": [2 ** 70]}]}}]), {}, "tenant"),
    ("tk-fb-loss-inputs-wrong", "POST", "/api/v1/forward_backward",
     _fb([{"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": 3}]), {}, "tenant"),
    ("tk-fb-loss-input-nan", "POST", "/api/v1/forward_backward",
     _fb([{"model_input": {"chunks": [{"tokens": [1, 2]}]},
           "loss_fn_inputs": {"weights": {"data": [1.0, 1.0], "dtype": "float32"}}}]).replace(b"1.0]", b"NaN]"),
     {}, "tenant"),
    ("tk-fb-missing-input", "POST", "/api/v1/forward_backward", b'{"model_id": "{mid}"}', {}, "tenant"),
    ("tk-fb-deep", "POST", "/api/v1/forward_backward", DEEP, {}, "tenant"),
    ("tk-forward-data-wrong", "POST", "/api/v1/forward", b'{"model_id": "{mid}", "forward_input": {"data": "x"}}',
     {}, "tenant"),
    ("tk-optim-lr-nan", "POST", "/api/v1/optim_step", b'{"model_id": "{mid}", "adam_params": {"learning_rate": NaN}}',
     {}, "tenant"),
    ("tk-optim-missing", "POST", "/api/v1/optim_step", b'{"model_id": "{mid}"}', {}, "tenant"),
    ("tk-optim-seq-huge", "POST", "/api/v1/optim_step",
     b'{"model_id": "{mid}", "seq_id": 1e400, "adam_params": {"learning_rate": 0.1}}', {}, "tenant"),
    ("tk-save-surrogate-path", "POST", "/api/v1/save_weights", b'{"model_id": "{mid}", "path": "\\ud800"}', {},
     "tenant"),
    ("tk-save-ttl-huge", "POST", "/api/v1/save_weights",
     b'{"model_id": "{mid}", "path": "a", "ttl_seconds": 1' + b"0" * 40 + b"}", {}, "tenant"),
    ("tk-save-metadata-surrogate", "POST", "/api/v1/save_weights_for_sampler",
     b'{"model_id": "{mid}", "path": "a", "user_metadata": {"k": "\\ud800"}}', {}, "tenant"),
    ("tk-load-path-wrong-type", "POST", "/api/v1/load_weights", b'{"model_id": "{mid}", "path": 5}', {}, "tenant"),
    ("tk-load-path-surrogate", "POST", "/api/v1/load_weights", b'{"model_id": "{mid}", "path": "tinker://\\ud800"}',
     {}, "tenant"),
    ("tk-sampler-surrogate-path", "POST", "/api/v1/create_sampling_session",
     b'{"session_id": "{sid}", "model_path": "\\ud800"}', {}, "tenant"),
    ("tk-sample-prompt-wrong", "POST", "/api/v1/asample", b'{"prompt": "hello", "num_samples": 1}', {}, "tenant"),
    ("tk-sample-chunk-image", "POST", "/api/v1/asample",
     b'{"prompt": {"chunks": [{"type": "image", "data": "x"}]}}', {}, "tenant"),
    ("tk-sample-stop-surrogate", "POST", "/api/v1/asample",
     b'{"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"stop": ["\\ud800"]}}', {}, "tenant"),
    ("tk-sample-temperature-nan", "POST", "/api/v1/asample",
     b'{"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"temperature": NaN}}', {}, "tenant"),
    ("tk-sample-max-tokens-huge", "POST", "/api/v1/asample",
     b'{"prompt": {"chunks": [{"tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 1' + b"0" * 30 + b"}}",
     {}, "tenant"),
    ("tk-sample-n-string", "POST", "/api/v1/asample", b'{"prompt": {"chunks": [{"tokens": [1]}]}, "num_samples": "x"}',
     {}, "tenant"),
    ("tk-retrieve-missing", "POST", "/api/v1/retrieve_future", b"{}", {}, "tenant"),
    ("tk-retrieve-surrogate", "POST", "/api/v1/retrieve_future", b'{"request_id": "\\ud800"}', {}, "tenant"),
    ("tk-cancel-wrong-type", "POST", "/api/v1/cancel_future", b'{"request_id": {"a": 1}}', {}, "tenant"),
    ("tk-ttl-wrong-type", "PUT", "/api/v1/training_runs/{mid}/checkpoints/weights/a/ttl", b'{"ttl_seconds": "x"}',
     {}, "tenant"),
    ("tk-ttl-deep", "PUT", "/api/v1/training_runs/{mid}/checkpoints/weights/a/ttl", DEEP, {}, "tenant"),
    ("tk-runs-limit-huge", "GET", "/api/v1/training_runs?limit=" + "9" * 400, b"", {}, "tenant"),
    # ---- Tinker: protobuf bodies
    ("tk-proto-garbage", "POST", "/api/v1/forward_backward", b"\xff\xff\xff\xff", PROTO, "tenant"),
    ("tk-proto-odd-tokens", "POST", "/api/v1/forward_backward", "PROTO:odd-tokens", PROTO, "tenant"),
    ("tk-proto-odd-tensor", "POST", "/api/v1/forward_backward", "PROTO:odd-tensor", PROTO, "tenant"),
    ("tk-proto-bad-shape", "POST", "/api/v1/forward_backward", "PROTO:bad-shape", PROTO, "tenant"),
    ("tk-proto-json-body", "POST", "/api/v1/forward_backward", b'{"model_id": "{mid}"}', PROTO, "tenant"),
]


@pytest.fixture()
def door(scratch_url, tmp_path, st):
    """(base URL, {"tenant": headers, "op": headers}, model id, session id) of a fresh server."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    st.set_deployment(base=str(base))
    home = tmp_path / "home"
    s = ApiSettings(rate=1000.0, burst=1000, max_body_bytes=4 << 20, max_file_bytes=4 << 20)
    srv = Server(create_app(scratch_url, home, settings=s))
    token = add_tenant(st, "alice")
    ts = TinkerStore(st)
    sid = ts.create_session("alice")
    mid = ts.create_model("alice", sid, "base", {"rank": 4}, None)
    yield srv.url, {"tenant": {"Authorization": f"Bearer {token}"},
                    "op": {"Authorization": f"Bearer {operator_token(home)}"}}, mid, sid
    srv.stop()


def _body(body, mid: str) -> bytes:
    if body == "PROTO:odd-tokens":
        return _proto_fwdbwd(mid, tokens=b"\x01\x02\x03", dense=b"\x00" * 8, shape=[2])
    if body == "PROTO:odd-tensor":
        return _proto_fwdbwd(mid, tokens=b"\x01\x00\x00\x00" * 2, dense=b"\x00" * 7, shape=[2])
    if body == "PROTO:bad-shape":
        return _proto_fwdbwd(mid, tokens=b"\x01\x00\x00\x00" * 2, dense=b"\x00" * 8, shape=[3, 5])
    return body


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_request_is_a_clear_4xx(door, case):
    url, auth, mid, sid = door
    _, method, path, body, headers, who = case
    body = _body(body, mid).replace(b"{mid}", mid.encode()).replace(b"{sid}", sid.encode())
    path = path.replace("{mid}", mid).replace("{sid}", sid)
    headers = {"Content-Type": "application/json", **headers, **auth[who]}
    r = httpx.request(method, url + path, content=body or None, headers=headers, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"type", "message"} and err["message"] and "\n" not in err["message"], err


def test_the_corpus_is_large_and_covers_every_door():
    doors = {c[2].split("?")[0].split("/")[2] if c[2].startswith("/v1") else "tinker" for c in CORPUS}
    assert len(CORPUS) >= 40 and {"jobs", "files", "graders", "verifiers", "tenants", "tinker"} <= doors


# ---------------------------------------------------------------- Tinker cost bounds at the door
def test_tinker_cost_bounds_are_refused_up_front(door, st):
    from marlaas.api.tenancy import Quotas

    url, _, _, _ = door
    token = add_tenant(st, "bob", Quotas(tinker_max_data_per_op=2, tinker_max_tokens_per_op=20,
                                         tinker_max_queued_ops=2, tinker_max_pending_samples=1))
    ts = TinkerStore(st)
    mid = ts.create_model("bob", ts.create_session("bob"), "base", {"rank": 4}, None)
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def fb(*lengths: int) -> httpx.Response:
        data = [{"model_input": {"chunks": [{"tokens": [1] * n}]}, "loss_fn_inputs": {}} for n in lengths]
        return c.post("/api/v1/forward_backward", json={"model_id": mid, "forward_backward_input": {"data": data}})

    def sample(max_tokens: int, prompt: int = 10) -> httpx.Response:
        return c.post("/api/v1/asample", json={"prompt": {"chunks": [{"tokens": [1] * prompt}]},
                                                "sampling_params": {"max_tokens": max_tokens}})

    def optim() -> httpx.Response:
        return c.post("/api/v1/optim_step", json={"model_id": mid, "adam_params": {"learning_rate": 0.1}})

    assert "context of 64" in fb(65).json()["error"]["message"]  # tokens per datum <= the base's context
    assert "tinker_max_data_per_op" in fb(1, 1, 1).json()["error"]["message"]
    assert "tinker_max_tokens_per_op" in fb(15, 15).json()["error"]["message"]
    r = sample(60)
    assert r.status_code == 422 and "at most 54" in r.json()["error"]["message"]  # max_tokens <= ctx - prompt
    assert ts.open_count("bob", "op") == 0 and ts.open_count("bob", "sample") == 0  # nothing was queued
    assert fb(10, 10).status_code == 200 and optim().status_code == 200
    r = optim()
    assert r.status_code == 429 and "tinker_max_queued_ops" in r.json()["error"]["message"], r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert sample(8).status_code == 200
    r = sample(8)
    assert r.status_code == 429 and "tinker_max_pending_samples" in r.json()["error"]["message"], r.text
    rid = ts.take_samples(10)[0]
    ts.fail(rid, "done here")  # once a sample ends, the tenant may ask again
    assert sample(8).status_code == 200
    c.close()
