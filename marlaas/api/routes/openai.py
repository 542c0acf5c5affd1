"""The OpenAI-compatible serving door (`/v1/models`, `/v1/chat/completions`, `/v1/completions`) and
promotion (`/v1/jobs/{id}/promote`) on the marlaas API server.

    client = openai.OpenAI(base_url="http://HOST:8400/v1", api_key=TENANT_TOKEN)
    client.chat.completions.create(model="j12@best", messages=[{"role": "user", "content": "12+3="}])

Authentication and rate limit are the API's one (`marlaas.api.deps.Caller`: the SDK sends the tenant
token as `Authorization: Bearer`); then a tenant's plan bounds its serving (`Quotas.
serve_requests_per_minute`, `serve_tokens_per_minute`: n x max_tokens reserved per prompt), checked
in the shared store before anything is queued (429 with Retry-After). Model names:
`marlaas.api.openai.names` (another tenant's model is a 404 exactly like an unknown one).

Serving reuses the sampling path of the Tinker door: each request becomes a sample request in the
store's sample queue (`TinkerStore.enqueue_sample`, body `serve`); a generate worker takes it FIRST into
its next engine call (ahead of training generation, within MARLAAS_SERVE_SHARE of the call's rows while
training work waits, `marlaas.generate.station`), renders and samples it with the resident base and
the named adapter version, and writes the future. The route awaits the future without holding a
thread (async, the store read in the thread pool, `marlaas.api.tinker.futures.wait`). `stream: true`
answers OpenAI's server-sent-event chunks once the generation is done (no token-by-token streaming).
The sha256 of the adapter weights sampled is the `x-marlaas-adapter-sha256` header and the body's
`system_fingerprint`.

Invariants: every error of the /v1/models and completion routes (authentication and validation
included) is OpenAI's error shape with the status the official SDK maps to its exceptions
(`OpenAIRoute`); the promotion routes are marlaas routes and answer the marlaas envelope.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from marlaas.api import access
from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.middleware import hold
from marlaas.api.models import ErrorOut
from marlaas.api.openai import names, wire
from marlaas.api.responses import AUTHENTICATED, Declared, errors, json_body, openai_errors
from marlaas.api.service import Service
from marlaas.api.tenancy import plan_of
from marlaas.api.tinker import futures
from marlaas.errors import ApiUnavailable, MarlaasError, RateLimited, ServerError, SpecError
from marlaas.store.tinker import TinkerStore

SERVE_TIMEOUT_S = 600.0
"""How long a serving request may wait for its generation before it is cancelled (503)."""

Svc = Depends(service)


def _validation_message(e: ValidationError | RequestValidationError) -> str:
    first = (e.errors() or [{}])[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "extra_forbidden":
        return f"invalid request: {where} is not served by marlaas"
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return f"invalid request: {where + ': ' if where else ''}{msg}"


def openai_error(err: MarlaasError | str, status: int | None = None, param: str | None = None) -> JSONResponse:
    code, body, headers = wire.error(err, status, param)
    return JSONResponse(body, status_code=code, headers=headers)


class OpenAIRoute(Declared):
    """A route whose every error (its dependencies' too: authentication, rate limit) leaves in
    OpenAI's error shape instead of the marlaas envelope; but for what the app answers before any route
    runs (`BEFORE`: the body limit's 413 and the JSON body check's 422, in the marlaas envelope)."""

    BEFORE = {413: {"model": ErrorOut, "description": "The request body is over the limit (the marlaas envelope)"},
              422: {"model": ErrorOut, "description": "A JSON body nested too deeply, holding NaN, Infinity, an "
                    "integer past 64 bits or a lone surrogate (refused before the route: the marlaas envelope)"}}

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return openai_error(_validation_message(e), 400)
            except MarlaasError as e:
                await hold(e)
                return openai_error(e)

        return guarded


v1 = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute,
               responses=openai_errors(400, 401, 404, 429, 503))
promotion = APIRouter(prefix="/v1/jobs", tags=["serving"], route_class=Declared,
                      responses=errors(*AUTHENTICATED, 404))


async def _body(request: Request, model: type[BaseModel]):
    try:
        data = json.loads(await request.body() or b"null")
    except ValueError:
        raise SpecError("invalid request: the body is not JSON") from None
    if not isinstance(data, dict):
        raise SpecError("invalid request: the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(_validation_message(e)) from None


def _owner(p: Principal) -> str:
    """The tenant a serving request is queued for (the open single user's and the operator's: 'default')."""
    return p.tenant or "default"


def charge(request: Request, svc: Service, p: Principal, bodies: list[dict]) -> None:
    """Take a serving request from the tenant's plan budgets (requests, completion tokens per minute),
    or refuse it before anything is queued. The open single user and the operator are not bounded."""
    if p.tenant is None:
        return
    q, limiter = plan_of(svc.store, p.tenant), request.app.state.plan_limiter
    tokens = sum(b["n"] * b["params"]["max_tokens"] for b in bodies)
    if tokens > q.serve_tokens_per_minute:
        raise SpecError(f"invalid request: n x max_tokens asks for {tokens} tokens, more than the "
                        f"{q.serve_tokens_per_minute} per minute of your plan (serve_tokens_per_minute)")
    refused = limiter.take(p.tenant, [("serve_requests", q.serve_requests_per_minute, 1),
                                      ("serve_tokens", q.serve_tokens_per_minute, tokens)])
    if refused is not None:
        name, wait = refused
        raise RateLimited(f"over your plan's {name}_per_minute ({getattr(q, name + '_per_minute')}): "
                          f"retry in {wait:.1f} s", wait)


async def _serve(ts: TinkerStore, owner: str, bodies: list[dict]) -> tuple[str, list[dict]]:
    """Queue the sample requests and await their futures; (first request id, results in order)."""
    rids = [await run_in_threadpool(ts.enqueue_sample, owner, b) for b in bodies]
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    results = []
    for rid in rids:
        while True:
            f = await futures.wait(ts, owner, rid, long_poll_s=max(0.0, min(30.0, deadline - time.monotonic())))
            if f["status"] != "pending":
                break
            if time.monotonic() >= deadline:
                for r in rids:
                    await run_in_threadpool(ts.cancel, owner, r)
                raise ApiUnavailable(f"the generation did not finish within {SERVE_TIMEOUT_S:g} s: retry later")
        if f["status"] == "failed":
            raise (SpecError if f["category"] == "user" else ServerError)(f["error"])
        results.append(f["result"])
    return rids[0], results


def _answer(body: dict, sha: str | None, stream: bool, chunks, stream_options: dict | None) -> Response:
    headers = {wire.HEADER: sha or "none"}
    if not stream:
        return JSONResponse(body, headers=headers)
    events = chunks(body, bool((stream_options or {}).get("include_usage")))
    return StreamingResponse(iter(events), media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache"})


STREAM = {200: {"content": {"text/event-stream": {}}, "description": "The completion; with `stream: true`, "
              "its server-sent-event chunks"}}


@v1.get("/models")
async def list_models(p: Principal = Caller, svc: Service = Svc) -> dict:
    """The models the caller may call: the base, its jobs (`JOB`) and their `JOB@best`."""
    return {"object": "list", "data": await run_in_threadpool(names.listing, svc.store, p.tenant)}


@v1.get("/models/{model:rest}")
async def get_model(model: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    target = await run_in_threadpool(names.resolve, svc.store, TinkerStore(svc.store), p.tenant, model)
    return {"id": model, "object": "model", "created": 0,
            "owned_by": "marlaas" if target.ref is None else (p.tenant or "marlaas")}


@v1.post("/chat/completions", openapi_extra=json_body(wire.ChatRequest), responses=STREAM)
async def chat_completions(request: Request, p: Principal = Caller, svc: Service = Svc) -> Response:
    req = await _body(request, wire.ChatRequest)
    ts = TinkerStore(svc.store)
    target = await run_in_threadpool(names.resolve, svc.store, ts, p.tenant, req.model)
    ref = target.ref
    bodies = [req.body(ref.job_id if ref else None, ref.version if ref else 0)]
    await run_in_threadpool(charge, request, svc, p, bodies)
    rid, (result,) = await _serve(ts, _owner(p), bodies)
    body = wire.chat_body(rid, req.model, result, bool(req.logprobs))
    return _answer(body, result["adapter_sha256"], req.stream, wire.chat_chunks, req.stream_options)


@v1.post("/completions", openapi_extra=json_body(wire.CompletionRequest), responses=STREAM)
async def completions(request: Request, p: Principal = Caller, svc: Service = Svc) -> Response:
    req = await _body(request, wire.CompletionRequest)
    ts = TinkerStore(svc.store)
    target = await run_in_threadpool(names.resolve, svc.store, ts, p.tenant, req.model)
    ref = target.ref
    bodies = req.bodies(ref.job_id if ref else None, ref.version if ref else 0)
    await run_in_threadpool(charge, request, svc, p, bodies)
    rid, results = await _serve(ts, _owner(p), bodies)
    body = wire.completion_body(rid, req.model, results, req.logprobs is not None)
    return _answer(body, results[0]["adapter_sha256"], req.stream, wire.completion_chunks, req.stream_options)


# ---------------------------------------------------------------- promotion (marlaas routes)
class PromoteIn(BaseModel):
    """The version to pin as `@best`."""

    model_config = ConfigDict(extra="forbid")

    version: int


def _best(svc: Service, jid: str) -> dict:
    b = svc.store.best(jid)
    return {"job": jid, "best": b["version"], "auto": b["auto"], "pinned": b["pinned"],
            "exact": {str(v): x for v, x in b["exact"].items()}}


@promotion.get("/{job_id}/promote")
def get_promotion(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    """The job's `@best`: the pinned version, else the evaluated version with the highest held-out exact."""
    access.job(svc.store, p.tenant, job_id)
    return _best(svc, job_id)


@promotion.post("/{job_id}/promote", responses=errors(409))
def promote(job_id: str, req: PromoteIn, p: Principal = Caller, svc: Service = Svc) -> dict:
    """Pin `@best` to an evaluated, stored version (a rollback, or a choice by hand)."""
    access.job(svc.store, p.tenant, job_id)
    svc.store.pin_best(job_id, req.version)
    return _best(svc, job_id)


@promotion.delete("/{job_id}/promote")
def unpin(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    """Drop the pin: `@best` follows the held-out evaluations again."""
    access.job(svc.store, p.tenant, job_id)
    svc.store.unpin_best(job_id)
    return _best(svc, job_id)


router = APIRouter()
router.include_router(v1)
router.include_router(promotion)
