"""The Tinker wire protocol (/api/v1/..., as the Tinker SDK 0.38 sends it) on the marlaas API server.

    app.include_router(marlaas.api.routes.tinker.router)      # done by marlaas.api.app.create_app

Authentication is the API's one (`marlaas.api.deps.Caller`): the SDK sends its API key as `X-API-Key`,
`tml-` + a marlaas tenant token (the SDK refuses keys without the `tml-` prefix), e.g. `tml-mt_...`;
`Authorization: Bearer <token>` works too; both are rate limited per token like every route. The
operator credential cannot train (401 would hide why: it gets 403, `access.trainer`).

Every training op (forward, forward_backward, optim_step, save_state, load_state, save_weights_for_sampler)
and every sample becomes a future (`marlaas.store.tinker`): the route stores the request and answers
{request_id} at once; a worker writes the result. `retrieve_future` long-polls it (`tinker.futures`).
Ops of one model run in the client's seq_id order. Errors use the API's JSON envelope and status codes
(401 bad key, 404 unknown or another tenant's model / checkpoint / sampler / request, 422 a body this
server does not serve). A new model's LoRA alpha is the job spec's default (`LoraSpec.alpha`); its
largest rank is the deployment's (`access.max_lora_rank`), as for jobs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from marlaas.api import access, tenancy
from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.responses import AUTHENTICATED, Declared, allowed_methods, errors, json_body
from marlaas.api.service import Service
from marlaas.api.tinker import checkpoints, futures, models, wire
from marlaas.errors import Gone, NotFound, RateLimited, SpecError
from marlaas.spec import LoraSpec
from marlaas.store.tinker import TinkerStore, parse_path

router = APIRouter(prefix="/api/v1", tags=["tinker"])
api = APIRouter(route_class=Declared, responses=errors(*AUTHENTICATED, 403, 404, 410))
"""Every authenticated Tinker route (all but /healthz and the catch-all), included into `router` below."""
Svc = Depends(service)
LORA_FIELDS = ("rank", "seed", "train_attn", "train_mlp", "train_unembed", "alpha")
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                 "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": False}


def trainer(p: Principal = Caller) -> str:
    """The tenant the request acts for (Forbidden for the operator credential)."""
    return access.trainer(p)


def tinker_store(svc: Service = Svc) -> TinkerStore:
    return TinkerStore(svc.store)


Tenant = Depends(trainer)
# What the routes check beyond the body models (`wire.checkpoint_name`, `wire.ttl`, `load_weights`), declared.
NAME = {"pattern": wire.NAME.pattern}
TTL = {"minimum": 1, "maximum": wire.MAX_TTL_S}
STATE_PATH = {"pattern": r"^tinker://[A-Za-z0-9_.:-]+/weights/[A-Za-z0-9_.-]+$"}
Tk = Depends(tinker_store)


# ---------------------------------------------------------------- the deployment's base model
def base_info(svc: Service) -> tuple[str, str, int | None]:
    """(served name, path, context length or None) of the deployment's base model."""
    d = svc.store.deployment()
    base = d.get("base") or ""
    name = d.get("base_name") or Path(base).name
    try:
        ctx = json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        ctx = None  # the API host may not hold the base files: the context is then unknown
    return name, base, ctx


def check_base(svc: Service, name: str | None) -> str:
    """The served base's name when the client asks for it (or for none); NotFound for another base."""
    bname, bpath, _ = base_info(svc)
    if not bname:
        raise SpecError("this deployment has no base model registered yet (start a worker first)")
    if name not in (None, bname, bpath):
        raise NotFound(f"base model {name!r} is not served here: this deployment serves {bname!r}")
    return bname


def check_data(svc: Service, t: str, payload: dict) -> None:
    """The plan's bounds on one forward / forward_backward, before it is queued: datums per op, tokens
    per op, and tokens per datum <= the base's context (SpecError, 422)."""
    plan, (_, _, ctx) = tenancy.plan_of(svc.store, t), base_info(svc)
    lengths = [len(d["tokens"]) for d in payload["data"]]
    if ctx and lengths and max(lengths) > ctx:
        raise SpecError(f"invalid request: a datum of {max(lengths)} tokens is longer than the base's "
                        f"context of {ctx} tokens")
    if len(lengths) > plan.tinker_max_data_per_op:
        raise SpecError(f"invalid request: {len(lengths)} datums in one op, over this plan's "
                        f"{plan.tinker_max_data_per_op} (tinker_max_data_per_op): split the batch")
    if sum(lengths) > plan.tinker_max_tokens_per_op:
        raise SpecError(f"invalid request: {sum(lengths)} tokens in one op, over this plan's "
                        f"{plan.tinker_max_tokens_per_op} (tinker_max_tokens_per_op): split the batch")


def check_open(svc: Service, ts: TinkerStore, t: str, kind: str) -> None:
    """RateLimited (429: waiting helps) when the tenant already has its plan's queued ops or pending samples."""
    plan = tenancy.plan_of(svc.store, t)
    bound, what = ((plan.tinker_max_pending_samples, "pending samples (tinker_max_pending_samples)")
                   if kind == "sample" else (plan.tinker_max_queued_ops, "queued ops (tinker_max_queued_ops)"))
    if ts.open_count(t, kind) >= bound:
        raise RateLimited(f"too many requests: this tenant has {bound} {what} already; retry once some "
                          "have finished", 2.0)


def queue(ts: TinkerStore, t: str, mid: str, seq: int | None, kind: str, payload: dict,
          svc: Service | None = None) -> dict:
    """Queue an op of model `mid` (NotFound unless the tenant owns it, Gone once its session ended;
    429 past the plan's queued ops)."""
    ts.model(t, mid)
    if svc is not None:
        check_open(svc, ts, t, kind)
    rid = ts.enqueue_op(t, mid, kind, int(seq or 0), payload)
    return {"request_id": rid, "model_id": mid}


# ---------------------------------------------------------------- service
@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@api.post("/client/config")
def client_config(t: str = Tenant) -> dict:
    return CLIENT_CONFIG


@api.post("/client/dynamic_config")
def dynamic_config(t: str = Tenant) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@api.post("/telemetry")
def telemetry(t: str = Tenant) -> dict:
    return {"status": "accepted"}  # the SDK's telemetry is accepted and dropped


@api.get("/get_server_capabilities")
def capabilities(t: str = Tenant, svc: Service = Svc) -> dict:
    name, _, ctx = base_info(svc)
    return {"supported_models": [{"model_name": name, "max_context_length": ctx, "trainable": True,
                                  "sampleable": True, "max_lora_rank": svc.max_lora_rank()}] if name else []}


@api.post("/create_session", openapi_extra=json_body(models.CreateSessionRequest))
async def create_session(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    await wire.body(request, models.CreateSessionRequest)
    return {"type": "create_session", "session_id": ts.create_session(t)}


@api.post("/session_heartbeat", openapi_extra=json_body(models.SessionHeartbeatRequest))
async def session_heartbeat(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    """A heartbeat; 410 once the session has ended (the SDK then stops its heartbeat loop)."""
    sid = (await wire.body(request, models.SessionHeartbeatRequest)).session_id
    if (why := ts.heartbeat(t, sid)) is not None:
        raise Gone(f"session {sid} has ended ({why})")
    return {"type": "session_heartbeat"}


@api.post("/sessions/{sid}/finish", openapi_extra=json_body(models.SessionFinishRequest))
async def finish_session(sid: str, request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    """ServiceClient.close: the session ends with the client's reason (the first reason wins, so a
    finish after expiry or a second close still succeeds: it never masks the run's own error); its
    models' queued ops are released."""
    req = await wire.body(request, models.SessionFinishRequest)
    ts.session(t, sid)
    reason = str(req.reason.get("type") or "success")
    return {"session_id": sid, "reason": ts.end_session(sid, reason, req.detail or "")}


@api.get("/sessions/{sid}")
def get_session(sid: str, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    ts.session(t, sid)
    return {"training_run_ids": ts.session_models(sid), "sampler_ids": []}


# ---------------------------------------------------------------- models
@api.post("/create_model", openapi_extra=json_body(models.CreateModelRequest))
async def create_model(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.CreateModelRequest)
    base = check_base(svc, req.base_model)
    lora = wire.lora_request(req, svc.max_lora_rank())
    mid = ts.create_model(t, req.session_id, base, {**lora, "alpha": LoraSpec().alpha}, req.model_seq_id,
                          req.user_metadata)
    rid = ts.new_future(t, "create_model", mid, 0, result={"model_id": mid, "type": "create_model"})
    return {"request_id": rid, "model_id": mid}


@api.post("/get_info", openapi_extra=json_body(models.GetInfoRequest))
async def get_info(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    mid = (await wire.body(request, models.GetInfoRequest)).model_id
    m = ts.model(t, mid)
    return {"type": "get_info", "model_id": mid, "model_name": m["base"], "is_lora": True,
            "lora_rank": int(m["rank"]), "optimizer_config": {"type": "adamw"},
            "model_data": {"arch": "marlaas-lora", "model_name": m["base"], "tokenizer_id": m["base"]}}


@api.get("/training_runs")
def list_training_runs(t: str = Tenant, ts: TinkerStore = Tk, limit: int = Query(20, ge=1, le=10_000),
                       offset: int = Query(0, ge=0, le=2**31)) -> dict:
    """The tenant's own training runs (models), oldest first, a page of them."""
    mids = ts.models(t)
    return {"training_runs": [checkpoints.training_run(ts, t, m) for m in mids[offset:offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(mids)}}


@api.get("/training_runs/{mid}")
def training_run(mid: str, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    return checkpoints.training_run(ts, t, mid)


# ---------------------------------------------------------------- training ops (queued)
@api.post("/forward_backward", openapi_extra=json_body(models.ForwardBackwardRequest))
async def forward_backward(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    head, payload = wire.fwdbwd_request(await request.body(), request.headers.get("content-type", ""),
                                        request.headers.get("content-encoding", "identity"))
    check_data(svc, t, payload)
    return queue(ts, t, head["model_id"], head["seq_id"], "forward" if payload["forward_only"] else
                 "forward_backward", payload, svc)


@api.post("/forward", openapi_extra=json_body(models.ForwardRequest))
async def forward(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.ForwardRequest)
    payload = wire.json_fwdbwd(req.forward_input, forward_only=True)
    check_data(svc, t, payload)
    return queue(ts, t, req.model_id, req.seq_id, "forward", payload, svc)


@api.post("/optim_step", openapi_extra=json_body(models.OptimStepRequest))
async def optim_step(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.OptimStepRequest)
    return queue(ts, t, req.model_id, req.seq_id, "optim_step", {"adam": req.optim_params.model_dump()}, svc)


@api.post("/save_weights", openapi_extra=json_body(models.SaveWeightsRequest, path=NAME, ttl_seconds=TTL))
async def save_weights(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.SaveWeightsRequest)
    name = wire.checkpoint_name(req.path or f"state-{int(time.time() * 1000)}")
    ts.model(t, req.model_id)
    tenancy.check_storage(ts.store, t)
    ts.want_ttl(req.model_id, f"weights/{name}", wire.ttl(req.ttl_seconds))
    return queue(ts, t, req.model_id, req.seq_id, "save_weights", {"name": name})


@api.post("/save_weights_for_sampler",
          openapi_extra=json_body(models.SaveWeightsForSamplerRequest, path=NAME, ttl_seconds=TTL))
async def save_for_sampler(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.SaveWeightsForSamplerRequest)
    name = None if req.path is None else wire.checkpoint_name(req.path)
    ts.model(t, req.model_id)
    tenancy.check_storage(ts.store, t)
    if name is not None:
        ts.want_ttl(req.model_id, f"sampler_weights/{name}", wire.ttl(req.ttl_seconds))
    return queue(ts, t, req.model_id, req.seq_id, "save_weights_for_sampler", {"name": name})


@api.post("/load_weights", openapi_extra=json_body(models.LoadWeightsRequest, path=STATE_PATH))
async def load_weights(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    """load_state into a model, or (no model_id: ServiceClient.create_training_client_from_state*) a
    new model of the session with the checkpoint's LoRA config, whose id is the one the SDK derives
    from session_id + model_seq_id ('{session}:train:{seq}')."""
    req = await wire.body(request, models.LoadWeightsRequest)
    src, kind, name = parse_path(req.path)
    if kind != "weights":
        raise SpecError("load_state needs a training checkpoint (tinker://<model>/weights/<name>)")
    ts.state(t, src, name)  # NotFound before anything is queued
    mid = req.model_id
    if not mid:
        if not req.session_id:
            raise SpecError("invalid LoadWeightsRequest body: model_id or session_id is required")
        wire.optimizer(req.optimizer_config)
        m = ts.model(t, src)
        base = check_base(svc, req.base_model or m["base"])
        mid = ts.create_model(t, req.session_id, base, {k: m[k] for k in LORA_FIELDS}, req.model_seq_id,
                              req.user_metadata)
    return queue(ts, t, mid, req.seq_id, "load_weights", {"path": req.path, "optimizer": req.optimizer})


# ---------------------------------------------------------------- sampling
def resolve_sampler(svc: Service, ts: TinkerStore, t: str, model_path: str | None,
                    base_model: str | None) -> tuple[str, str | None, int | None]:
    """(base, model or None, sampler version or None) a sampler of these arguments serves."""
    if model_path:
        mid, kind, name = parse_path(model_path)
        if kind != "sampler_weights":
            raise SpecError("sample from sampler weights (tinker://<model>/sampler_weights/<name>)")
        m = ts.model(t, mid)
        return m["base"], mid, ts.sampler_version(t, mid, name)
    return check_base(svc, base_model), None, None


@api.post("/create_sampling_session", openapi_extra=json_body(models.CreateSamplingSessionRequest))
async def create_sampling_session(request: Request, t: str = Tenant, svc: Service = Svc,
                                  ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.CreateSamplingSessionRequest)
    base, mid, v = resolve_sampler(svc, ts, t, req.model_path, req.base_model)
    sid = ts.create_sampler(t, base, req.model_path, mid, v)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@api.get("/samplers/{sid}")
def get_sampler(sid: str, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    s = ts.sampler(t, sid)
    return {"sampler_id": sid, "base_model": s["base"], "model_path": s["model_path"]}


@api.post("/asample", openapi_extra=json_body(models.SampleRequest))
async def asample(request: Request, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> dict:
    req = await wire.body(request, models.SampleRequest)
    if req.sampling_session_id:
        s = ts.sampler(t, req.sampling_session_id)
        mid, v = s["model"], s["version"]
    else:
        _, mid, v = resolve_sampler(svc, ts, t, req.model_path, req.base_model)
    payload = wire.sample_payload(req, mid, v)
    if (last_n := req.prompt_logprobs_last_n) is not None:  # served by the engine's prompt_logprobs(last_n)
        if not (req.prompt_logprobs and 1 <= last_n <= len(payload["tokens"]) - 1):
            raise SpecError(f"invalid request: prompt_logprobs_last_n needs prompt_logprobs and must be in "
                            f"1..{len(payload['tokens']) - 1} (the prompt's length - 1), got {last_n}")
        payload["prompt_logprobs_last_n"] = last_n
    if (ctx := base_info(svc)[2]) is not None:  # max_tokens <= context - prompt, refused before any work
        room, want = ctx - len(payload["tokens"]), req.sampling_params.max_tokens
        if room < 1 or (want is not None and want > room):
            raise SpecError(f"invalid request: max_tokens {want} with a prompt of {len(payload['tokens'])} "
                            f"tokens does not fit the base's context of {ctx} tokens (at most {max(room, 0)})")
    check_open(svc, ts, t, "sample")
    rid = ts.enqueue_sample(t, payload)
    return {"request_id": rid, "model_id": None, "sample_sequence_ids": [f"{rid}-{i}" for i in range(payload["n"])]}


# ---------------------------------------------------------------- futures
@api.post("/retrieve_future", openapi_extra=json_body(models.FutureRetrieveRequest))
async def retrieve_future(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> Response:
    rid = (await wire.body(request, models.FutureRetrieveRequest)).request_id
    f = await futures.wait(ts, t, rid)
    return futures.response(f, rid, proto=wire.PROTO in request.headers.get("accept", ""))


@api.post("/cancel_future", openapi_extra=json_body(models.CancelFutureRequest))
async def cancel_future(request: Request, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    """Queued work is removed (its future fails 'cancelled'); work already running runs to its end."""
    rid = (await wire.body(request, models.CancelFutureRequest)).request_id
    return {"request_id": rid, "cancelled": ts.cancel(t, rid)}


# ---------------------------------------------------------------- checkpoints
class TtlIn(BaseModel):
    """The body of a checkpoint's TTL (its schema; the route checks the body itself, `wire.ttl`)."""

    ttl_seconds: int | None = Field(None, ge=1, le=wire.MAX_TTL_S)


@api.get("/training_runs/{mid}/checkpoints")
def list_checkpoints(mid: str, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    return checkpoints.listing(ts, t, mid)


@api.delete("/training_runs/{mid}/checkpoints/{kind}/{name}")
def delete_checkpoint(mid: str, kind: str, name: str, t: str = Tenant, ts: TinkerStore = Tk) -> dict:
    """RestClient.delete_checkpoint: the checkpoint is gone and its bytes freed."""
    ts.delete_checkpoint(t, mid, f"{kind}/{name}")
    return {}


@api.put("/training_runs/{mid}/checkpoints/{kind}/{name}/ttl", openapi_extra=json_body(TtlIn))
async def checkpoint_ttl(mid: str, kind: str, name: str, request: Request, t: str = Tenant,
                         ts: TinkerStore = Tk) -> dict:
    """RestClient.set_checkpoint_ttl_from_tinker_path ({"ttl_seconds": n | null}; null: never expires)."""
    body = await wire.body_json(request)
    ttl = body.get("ttl_seconds")
    if ttl is not None and not isinstance(ttl, int):
        raise SpecError("invalid request: ttl_seconds must be an integer or null")
    ts.set_checkpoint_ttl(t, mid, f"{kind}/{name}", wire.ttl(ttl))
    return {}


@api.get("/training_runs/{mid}/checkpoints/{kind}/{name}/archive",
            responses={200: {"content": {"application/gzip": {}}}})
def archive(mid: str, kind: str, name: str, t: str = Tenant, svc: Service = Svc, ts: TinkerStore = Tk) -> Response:
    """A checkpoint's LoRA adapter as a tar.gz of a PEFT directory (adapter_config.json +
    adapter_model.safetensors): `PeftModel.from_pretrained(base, dir)` loads it. A marlaas extension."""
    blob = checkpoints.adapter_blob(ts, t, mid, kind, name)
    return Response(access.archive(blob, svc.store.deployment().get("base")), media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{mid}-{kind}-{name}.tar.gz"'})


router.include_router(api)


# ---------------------------------------------------------------- everything else: one clear line
@router.api_route("/{rest:rest}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
def unsupported(rest: str, request: Request, t: str = Tenant) -> dict:
    """A Tinker call this server does not serve (publish, copy_weights, save_weights_external, ...):
    404 at once with what it was (the SDK raises NotFoundError), never a hang or a bare 'Not Found';
    a served path with another method is 405 naming the methods it allows."""
    if allowed := allowed_methods(request):
        raise StarletteHTTPException(405, headers={"Allow": ", ".join(allowed)})
    raise NotFound(f"{request.method} /api/v1/{rest} is not served by marlaas (docs/tinker.md lists the "
                   "supported Tinker calls)")
