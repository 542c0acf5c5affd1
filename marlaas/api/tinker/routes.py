"""The Tinker wire protocol (/api/v1/..., as the Tinker SDK 0.38 sends it) on the marlaas API server.

    app.include_router(tinker_router(service, limiter))      # done by marlaas.api.server.create_app

Authentication: the SDK sends its API key as `X-API-Key`; the key is `tml-` + a marlaas tenant token
(the SDK refuses keys without the `tml-` prefix), e.g. `tml-mt_...`. `Authorization: Bearer <token>`
works too. The operator credential cannot train (401 would hide why: it gets 403).

Every training op (forward, forward_backward, optim_step, save_state, load_state, save_weights_for_sampler)
and every sample becomes a future (`marlaas.store.tinker`): the route stores the request and answers
{request_id} at once; a worker writes the result. `retrieve_future` waits up to LONG_POLL_S for it, then
answers HTTP 408 with {"type": "try_again", "queue_state": "active"} (the SDK retries at once); a failed
op answers 200 with {"error", "category"} (the SDK raises RequestFailedError). ForwardBackwardOutput and
SampleResponse results are protobuf when the SDK asks for them (Accept: application/x-protobuf).
Ops of one model run in the client's seq_id order. Errors elsewhere use the API's JSON envelope and
status codes (401 bad key, 404 unknown or another tenant's model / checkpoint / sampler / request).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from marlaas.adapters import CONFIG_NAME, WEIGHTS_NAME, write_adapter_dir
from marlaas.api.tinker import protowire
from marlaas.errors import Forbidden, NotFound, RateLimited, SpecError, Unauthorized
from marlaas.store.tinker import TinkerStore, parse_path

LONG_POLL_S = 5.0
PROTO = "application/x-protobuf"
LORA_ALPHA = 32.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


def tinker_router(service, limiter) -> APIRouter:
    """The /api/v1 routes over a `marlaas.api.service.Service` (its store and authentication)."""
    ts = TinkerStore(service.store)
    router = APIRouter(prefix="/api/v1", tags=["tinker"])

    def tenant(request: Request, x_api_key: str | None = Header(None),
               authorization: str | None = Header(None)) -> str:
        token = None
        if x_api_key:
            token = x_api_key.strip().removeprefix("tml-")
        elif authorization and authorization.lower().startswith("bearer "):
            token = authorization[7:].strip()
        peer = request.client.host if request.client else None
        key = "t:" + hashlib.sha256(token.encode()).hexdigest()[:32] if token else f"a:{peer}"
        wait = limiter.take(key)
        if wait > 0:
            raise RateLimited(f"too many requests; retry in {wait:.1f} s", wait)
        if not token:
            raise Unauthorized("this server needs an API key: X-API-Key: tml-<your marlaas tenant token>")
        p = service.authenticate(token, loopback_peer=False)
        if p.operator:
            raise Forbidden("the operator credential cannot train: use a tenant's token as the API key")
        return p.tenant or "default"

    Caller = Depends(tenant)

    def base_info() -> tuple[str, str, int | None]:
        d = service.store.deployment()
        base = d.get("base") or ""
        name = d.get("base_name") or Path(base).name
        ctx = None
        try:
            ctx = json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError):
            ctx = None  # the API host may not hold the base files: the context is then unknown
        return name, base, ctx

    def check_base(name: str | None) -> str:
        bname, bpath, _ = base_info()
        if not bname:
            raise SpecError("this deployment has no base model registered yet (start a worker first)")
        if name not in (None, bname, bpath):
            raise NotFound(f"base model {name!r} is not served here: this deployment serves {bname!r}")
        return bname

    async def body_json(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise SpecError("invalid request: the body is not JSON") from None
        if not isinstance(body, dict):
            raise SpecError("invalid request: expected a JSON object")
        return body

    def future(rid: str, model: str | None = None, **extra) -> dict:
        return {"request_id": rid, "model_id": model, **extra}

    def queue(t: str, body: dict, kind: str, payload: dict) -> dict:
        mid = str(body.get("model_id") or "")
        ts.model(t, mid)
        seq = int(body.get("seq_id") or 0)
        return future(ts.enqueue_op(t, mid, kind, seq, payload), mid)

    # ---------------------------------------------------------------- service
    @router.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @router.post("/client/config")
    def client_config(t: str = Caller) -> dict:
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": False}

    @router.post("/client/dynamic_config")
    def dynamic_config(t: str = Caller) -> dict:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @router.post("/telemetry")
    def telemetry(t: str = Caller) -> dict:
        return {"status": "accepted"}  # the SDK's telemetry is accepted and dropped

    @router.get("/get_server_capabilities")
    def capabilities(t: str = Caller) -> dict:
        name, _, ctx = base_info()
        return {"supported_models": [{"model_name": name, "max_context_length": ctx, "trainable": True,
                                      "sampleable": True}] if name else []}

    @router.post("/create_session")
    async def create_session(request: Request, t: str = Caller) -> dict:
        await body_json(request)
        return {"type": "create_session", "session_id": ts.create_session(t)}

    @router.post("/session_heartbeat")
    async def session_heartbeat(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        ts.heartbeat(t, str(body.get("session_id")))
        return {"type": "session_heartbeat"}

    # ---------------------------------------------------------------- models
    @router.post("/create_model")
    async def create_model(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        base = check_base(body.get("base_model"))
        lora = body.get("lora_config")
        if not isinstance(lora, dict) or int(lora.get("rank") or 0) < 1:
            raise SpecError("invalid request: only LoRA training models are served (lora_config.rank >= 1)")
        if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
            raise SpecError("invalid request: only the adamw optimizer is supported")
        max_rank = int(service.store.deployment().get("max_lora_rank") or 64)
        if int(lora["rank"]) > max_rank:
            raise SpecError(f"invalid request: LoRA rank {lora['rank']} over this deployment's maximum {max_rank}")
        mid = ts.create_model(t, str(body.get("session_id")), base, {**lora, "alpha": LORA_ALPHA})
        rid = ts.new_future(t, "create_model", mid, 0, result={"model_id": mid, "type": "create_model"})
        return future(rid, mid)

    def info(t: str, mid: str) -> dict:
        m = ts.model(t, mid)
        return {"type": "get_info", "model_id": mid, "model_name": m["base"], "is_lora": True,
                "lora_rank": int(m["rank"]), "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": "marlaas-lora", "model_name": m["base"], "tokenizer_id": m["base"]}}

    @router.post("/get_info")
    async def get_info(request: Request, t: str = Caller) -> dict:
        return info(t, str((await body_json(request)).get("model_id")))

    @router.get("/training_runs/{mid}")
    def training_run(mid: str, t: str = Caller) -> dict:
        m = ts.model(t, mid)
        return {"training_run_id": mid, "base_model": m["base"], "model_owner": t, "is_lora": True,
                "lora_rank": int(m["rank"]), "last_request_time": _iso(float(m["created"]))}

    # ---------------------------------------------------------------- training ops (queued)
    @router.post("/forward_backward")
    async def forward_backward(request: Request, t: str = Caller) -> dict:
        raw = await request.body()
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise SpecError("compressed request bodies are not supported (this server turns zstd off)")
        if PROTO in request.headers.get("content-type", ""):
            try:
                fb = protowire.read_forward_backward(raw)
            except protowire.WireError as e:
                raise SpecError(f"invalid forward_backward body: {e}") from None
            body = {"model_id": fb.model_id, "seq_id": fb.seq_id}
            payload = {"loss_fn": fb.loss_fn, "loss_fn_config": fb.loss_fn_config, "data": fb.data,
                       "forward_only": fb.forward_only}
        else:
            body = json.loads(raw or b"{}")
            payload = _json_fwdbwd(body, forward_only=False)
        return queue(t, body, "forward" if payload["forward_only"] else "forward_backward", payload)

    @router.post("/forward")
    async def forward(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        return queue(t, body, "forward", _json_fwdbwd(body, forward_only=True))

    @router.post("/optim_step")
    async def optim_step(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        params = body.get("adam_params") or body.get("optim_params")
        if not isinstance(params, dict):
            raise SpecError("invalid request: optim_step needs adam_params (only Adam is supported)")
        return queue(t, body, "optim_step", {"adam": params})

    @router.post("/save_weights")
    async def save_weights(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        name = str(body.get("path") or f"state-{int(time.time() * 1000)}")
        if not re.match(r"^[A-Za-z0-9_.-]+$", name):
            raise SpecError(f"invalid checkpoint name {name!r}: letters, digits, '_', '.', '-'")
        return queue(t, body, "save_weights", {"name": name})

    @router.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        name = body.get("path")
        if name is not None and not re.match(r"^[A-Za-z0-9_.-]+$", str(name)):
            raise SpecError(f"invalid checkpoint name {name!r}: letters, digits, '_', '.', '-'")
        return queue(t, body, "save_weights_for_sampler", {"name": name})

    @router.post("/load_weights")
    async def load_weights(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        src, kind, name = parse_path(str(body.get("path")))
        if kind != "weights":
            raise SpecError("load_state needs a training checkpoint (tinker://<model>/weights/<name>)")
        ts.state(t, src, name)  # NotFound before anything is queued
        if not body.get("model_id"):  # create-via-load: a new model with the checkpoint's LoRA config
            m = ts.model(t, src)
            lora = {k: m[k] for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed", "alpha")}
            body["model_id"] = ts.create_model(t, str(body.get("session_id")), m["base"], lora)
        return queue(t, body, "load_weights", {"path": body["path"], "optimizer": bool(body.get("optimizer"))})

    # ---------------------------------------------------------------- sampling
    def resolve_sampler(t: str, model_path: str | None, base_model: str | None) -> tuple[str, str | None, int | None]:
        if model_path:
            mid, kind, name = parse_path(model_path)
            if kind != "sampler_weights":
                raise SpecError("sample from sampler weights (tinker://<model>/sampler_weights/<name>)")
            m = ts.model(t, mid)
            return m["base"], mid, ts.sampler_version(t, mid, name)
        return check_base(base_model), None, None

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        base, mid, v = resolve_sampler(t, body.get("model_path"), body.get("base_model"))
        sid = ts.create_sampler(t, base, body.get("model_path"), mid, v)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @router.get("/samplers/{sid}")
    def get_sampler(sid: str, t: str = Caller) -> dict:
        s = ts.sampler(t, sid)
        return {"sampler_id": sid, "base_model": s["base"], "model_path": s["model_path"]}

    @router.post("/asample")
    async def asample(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        if body.get("sampling_session_id"):
            s = ts.sampler(t, str(body["sampling_session_id"]))
            mid, v = s["model"], s["version"]
        else:
            _, mid, v = resolve_sampler(t, body.get("model_path"), body.get("base_model"))
        n = int(body.get("num_samples") or 1)
        if not 1 <= n <= 128:
            raise SpecError("invalid request: num_samples must be in 1..128")
        for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(unsupported):
                raise SpecError(f"invalid request: {unsupported} is not supported by this server")
        if body.get("target_prompt_logprobs") is not None:
            raise SpecError("invalid request: target_prompt_logprobs is not supported by this server")
        tokens = [tok for c in (body.get("prompt") or {}).get("chunks") or [] for tok in _chunk_tokens(c)]
        if not tokens:
            raise SpecError("invalid request: the prompt has no tokens")
        payload = {"model": mid, "version": v, "tokens": tokens, "n": n,
                   "params": body.get("sampling_params") or {}, "prompt_logprobs": bool(body.get("prompt_logprobs"))}
        rid = ts.enqueue_sample(t, payload)
        return future(rid, None, sample_sequence_ids=[f"{rid}-{i}" for i in range(n)])

    # ---------------------------------------------------------------- futures
    @router.post("/retrieve_future")
    async def retrieve_future(request: Request, t: str = Caller) -> Response:
        body = await body_json(request)
        rid = str(body.get("request_id"))
        deadline = time.monotonic() + LONG_POLL_S
        while True:
            f = await run_in_threadpool(ts.future, t, rid)
            if f["status"] != "pending" or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if f["status"] == "pending":
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408)
        if f["status"] == "failed":
            return JSONResponse({"error": f["error"], "category": f["category"]})
        result = f["result"]
        proto = PROTO in request.headers.get("accept", "")
        if f["kind"] in ("forward", "forward_backward"):
            outs = [{k: tuple(v) for k, v in o.items()} for o in result["outputs"]]
            if proto:
                return Response(protowire.write_forward_backward_output(outs, result["metrics"]), media_type=PROTO)
            return JSONResponse({"loss_fn_output_type": "ArrayRecord", "metrics": result["metrics"],
                                 "loss_fn_outputs": [{k: {"data": v[1], "dtype": v[0], "shape": [len(v[1])]}
                                                      for k, v in o.items()} for o in outs]})
        if f["kind"] == "sample":
            if proto:
                return Response(protowire.write_sample_response(result["sequences"], result.get("prompt_logprobs")),
                                media_type=PROTO)
            return JSONResponse({"type": "sample", **result})
        return JSONResponse(result)

    @router.post("/cancel_future")
    async def cancel_future(request: Request, t: str = Caller) -> dict:
        body = await body_json(request)
        ts.future(t, str(body.get("request_id")))
        return {}  # work already queued runs to its end; its result is simply never fetched

    # ---------------------------------------------------------------- checkpoints
    @router.get("/training_runs/{mid}/checkpoints")
    def checkpoints(mid: str, t: str = Caller) -> dict:
        return {"checkpoints": [{"checkpoint_id": c["checkpoint_id"], "checkpoint_type": c["type"],
                                 "time": _iso(c["time"]), "tinker_path": f"tinker://{mid}/{c['checkpoint_id']}",
                                 "size_bytes": c.get("size")} for c in ts.checkpoints(t, mid)]}

    @router.get("/training_runs/{mid}/checkpoints/{kind}/{name}/archive",
                responses={200: {"content": {"application/gzip": {}}}})
    def archive(mid: str, kind: str, name: str, t: str = Caller) -> Response:
        """A checkpoint's LoRA adapter as a tar.gz of a PEFT directory (adapter_config.json +
        adapter_model.safetensors): `PeftModel.from_pretrained(base, dir)` loads it. A marlaas extension."""
        from marlaas.train.tinker_ops import blob_from_state

        m = ts.model(t, mid)
        if kind == "weights":
            weights, _ = ts.state(t, mid, name)
            blob = blob_from_state(m, weights)
        elif kind == "sampler_weights":
            from marlaas.types import AdapterRef

            blob = service.store.adapter(AdapterRef(mid, ts.sampler_version(t, mid, name)))
        else:
            raise NotFound(f"no checkpoint 'tinker://{mid}/{kind}/{name}'")
        buf = io.BytesIO()
        with tempfile.TemporaryDirectory(prefix="marlaas-tinker-") as tmp:
            out = write_adapter_dir(blob, Path(tmp) / "adapter", base_path=service.store.deployment().get("base"))
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                for f in (CONFIG_NAME, WEIGHTS_NAME):
                    tar.add(out / f, arcname=f)
        return Response(buf.getvalue(), media_type="application/gzip",
                        headers={"Content-Disposition": f'attachment; filename="{mid}-{kind}-{name}.tar.gz"'})

    return router


def _chunk_tokens(chunk: Any) -> list[int]:
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
        raise SpecError("invalid request: only token (encoded_text) chunks are supported, not images or audio")
    return [int(x) for x in chunk.get("tokens") or []]


def _json_fwdbwd(body: dict, forward_only: bool) -> dict:
    """The queued payload of a JSON forward / forward_backward request (the SDK's JSON shape)."""
    inp = body.get("forward_backward_input") or body.get("forward_input") or {}
    data = []
    for d in inp.get("data") or []:
        tokens = [tok for c in (d.get("model_input") or {}).get("chunks") or [] for tok in _chunk_tokens(c)]
        inputs = {k: (v.get("data") if isinstance(v, dict) else v) for k, v in (d.get("loss_fn_inputs") or {}).items()}
        data.append({"tokens": tokens, "inputs": inputs})
    return {"loss_fn": inp.get("loss_fn") or "cross_entropy", "loss_fn_config": inp.get("loss_fn_config") or {},
            "data": data, "forward_only": forward_only}
