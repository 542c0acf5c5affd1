"""The HTTP API: a FastAPI app over `marlaas.api.service.Service` (routes under /v1).

    marlaas.api.server.serve("127.0.0.1", 8400)          # or: uvicorn via create_app()

Invariants:
- Every error is JSON `{"error": {"type", "message"}}`: the type is the error class (`NotFound`,
  `SpecError`, ...), the message its one line. 401 no or unknown token, 403 a token that may not do
  this (operator-only routes), 404 an unknown job or file or another tenant's (the same message),
  409 a state that forbids the action, 413 too large, 422 an invalid spec or request, 429 over the
  token's rate (with Retry-After), 503 no Redis.
- Request bodies are bounded before they are read whole: a Content-Length over the limit gets 413
  unread; a body without one is counted while it arrives. Uploads (POST /v1/files) stream to disk
  under their own, larger limit.
- Each token (each peer address, for requests without one) has an in-process token bucket of
  MARLAAS_API_RATE requests/s and MARLAAS_API_BURST at once; /v1/health, /docs and /openapi.json
  are not limited. With several server processes, each has its own buckets.
- The operator credential is $MARLAAS_HOME/operator_token (made on first use, mode 0600). An open
  server (`open=True`: no token needed while no tenant exists) is refused on a non-loopback bind,
  and even then only loopback peers are let in without a token.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marlaas.api.access import Limits
from marlaas.api.errors import status_of
from marlaas.api.graders_api import graders_router
from marlaas.api.service import Principal, Service
from marlaas.api.settings import ApiSettings
from marlaas.api.tenancy import Quotas
from marlaas.api.tinker.routes import tinker_router
from marlaas.errors import MarlaasError, RateLimited, SpecError, TooLarge, Unauthorized
from marlaas.settings import get_settings
from marlaas.store import Store
from marlaas.types import TERMINAL_STATUSES

log = logging.getLogger("marlaas.api")
FILES_PATH = "/v1/files"


# ---------------------------------------------------------------- boundary models
class ErrorDetail(BaseModel):
    """One error."""

    type: str
    """The error class: Unauthorized, Forbidden, NotFound, Conflict, TooLarge, SpecError, RateLimited, ..."""
    message: str
    """One line for the user."""


class ErrorOut(BaseModel):
    """The body of every error response."""

    error: ErrorDetail
    """What went wrong."""


class JobOut(BaseModel):
    """A job's progress (what `Job.status()` returns, with `id` for `job`)."""

    id: str
    """The job id (j<number>)."""
    tenant: str
    """The tenant that owns the job."""
    task: str
    """The built-in task family, or 'dataset' for the tenant's own data."""
    status: str
    """running, evaluating, paused, done, failed or cancelled."""
    version: int
    """The newest published adapter version (0 = the base model)."""
    steps: int
    """Versions the job publishes in all."""
    reward_mean: float | None
    """Mean reward of the newest step's rollouts."""
    staleness: int
    """Largest staleness among the newest step's rollouts."""
    max_staleness: int
    """The job's staleness bound."""
    base_acc: float | None
    """Held-out greedy accuracy of version 0."""
    final_acc: float | None
    """Held-out greedy accuracy of the final version (once evaluated)."""
    regenerated: int
    """Groups generated again (lost or too stale)."""
    verify_errors: int
    """Verifier calls that raised (scored 0)."""
    tool_calls: int
    """Tool calls of tool tasks."""
    tool_errors: int
    """Tool calls that failed."""
    error: str | None
    """Why the job failed, if it did."""
    created: float
    """Submission time (Unix seconds)."""
    updated: float
    """Time of the last status or version change (Unix seconds)."""


class JobList(BaseModel):
    """A list of jobs, oldest first."""

    jobs: list[JobOut]
    """The jobs."""


class Event(BaseModel):
    """One entry of a job's timeline."""

    type: str
    """'step' (a published version's metrics), 'eval' (a held-out evaluation) or 'task' (a station task)."""
    at: float
    """When it happened (Unix seconds); the cursor of pagination."""
    data: dict[str, Any]
    """The metrics row, the evaluation row, or {station, start, end}."""


class EventPage(BaseModel):
    """A page of a job's timeline."""

    job: str
    """The job id."""
    status: str
    """The job's status when the page was read."""
    version: int
    """The job's version when the page was read."""
    events: list[Event]
    """Events after the cursor, oldest first."""
    next: float
    """Pass as `after` to get the following page."""
    more: bool
    """Whether more events were already there than the page holds."""


class Checkpoint(BaseModel):
    """A version with a stored adapter or an evaluation."""

    version: int
    """The adapter version."""
    adapter: bool
    """Whether its adapter can be downloaded (older versions are deleted unless evaluated)."""
    eval: dict[str, Any] | None
    """Its held-out evaluation row, if evaluated."""


class CheckpointList(BaseModel):
    """A job's checkpoints, ascending."""

    checkpoints: list[Checkpoint]
    """The versions."""


class FileOut(BaseModel):
    """An uploaded dataset file."""

    id: str
    """Its id (file-...): use it as a job spec's `dataset` or `eval_dataset`."""


class TenantIn(BaseModel):
    """A tenant to register."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    """Letters, digits, '_', '.' or '-'."""
    quotas: Quotas | None = None
    """Its limits; default: the standard quotas."""


class TenantOut(BaseModel):
    """A registered tenant and its token (shown once, stored hashed)."""

    tenant: str
    """The tenant's name."""
    token: str
    """Its bearer token."""


class Health(BaseModel):
    """Whether the server and its store answer."""

    status: str
    """'ok' or 'store unavailable'."""
    store: bool
    """Whether Redis answers."""


# ---------------------------------------------------------------- rate limit and body limit
class RateLimiter:
    """Token buckets keyed by caller (thread-safe; the least recently used keys beyond `max_keys` are
    forgotten, which only ever gives a caller a full bucket back)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 65_536):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str, now: float | None = None) -> float:
        """0 when the caller may go on (one token taken), else the seconds until a token is back."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait


class BodyLimit:
    """ASGI middleware: 413 for a request body over the limit, before the app reads it whole.
    Bodies of ordinary routes (at most `max_body` bytes) are read here and replayed to the app; an
    upload to FILES_PATH passes through streaming once its Content-Length (if any) fits `max_file`
    (the upload route counts the bytes itself)."""

    def __init__(self, app: ASGIApp, max_body: int, max_file: int):
        self.app, self.max_body, self.max_file = app, max_body, max_file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        upload = scope["path"].rstrip("/") == FILES_PATH
        limit = self.max_file if upload else self.max_body
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _too_large(scope, receive, send, limit)
            return
        if upload:
            await self.app(scope, receive, send)
            return
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            n += len(body)
            if n > limit:
                await _too_large(scope, receive, send, limit)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
    resp = _error(TooLarge(f"request body over the limit of {limit} bytes"))
    resp.headers["Connection"] = "close"
    await resp(scope, receive, send)


# ---------------------------------------------------------------- errors
def _error(err: MarlaasError, status: int | None = None, type_: str | None = None) -> JSONResponse:
    msg = (str(err).strip().splitlines() or [type(err).__name__])[0]
    headers = {}
    if isinstance(err, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return JSONResponse({"error": {"type": type_ or type(err).__name__, "message": msg}},
                        status_code=status or status_of(err), headers=headers)


_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed", 401: "Unauthorized", 403: "Forbidden"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MarlaasError)
    async def marlaas_error(request: Request, exc: MarlaasError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return _error(SpecError(f"invalid request: {where + ': ' if where else ''}{msg}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return _error(MarlaasError(message), exc.status_code, _HTTP_TYPES.get(exc.status_code, "HTTPError"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(MarlaasError("internal server error (see the server log)"), 500, "ServerError")


# ---------------------------------------------------------------- the app
def _loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def create_app(store_url: str | None = None, home: Path | None = None, *, open: bool | None = None,
               settings: ApiSettings | None = None) -> FastAPI:
    """The API app over the store at `store_url` (default: MARLAAS_REDIS_URL or the embedded one), with
    the operator token and uploaded files under `home` (default: MARLAAS_HOME). `open` (default
    MARLAAS_API_OPEN) lets loopback requests without a token in while no tenant exists."""
    s = settings or ApiSettings()
    is_open = s.open if open is None else open
    service = Service(Store(store_url), home or get_settings().home, Limits.from_settings(get_settings()),
                      open_single_user=is_open)
    limiter = RateLimiter(s.rate, s.burst)
    app = FastAPI(title="marlaas", version="0.1.0",
                  description="Multi-tenant asynchronous RL fine-tuning of LLMs with LoRA adapters.",
                  responses={code: {"model": ErrorOut} for code in (401, 404, 422, 429)})
    app.state.service, app.state.settings, app.state.limiter = service, s, limiter
    app.add_middleware(BodyLimit, max_body=s.max_body_bytes, max_file=s.max_file_bytes)
    _install_error_handlers(app)

    def principal(request: Request, authorization: str | None = Header(None)) -> Principal:
        token = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
            token = value.strip()
        peer = request.client.host if request.client else None
        key = "t:" + hashlib.sha256(token.encode()).hexdigest()[:32] if token else f"a:{peer}"
        wait = limiter.take(key)
        if wait > 0:
            raise RateLimited(f"too many requests: at most {s.rate:g}/s (burst {s.burst}); retry in {wait:.1f} s",
                              wait)
        return service.authenticate(token, loopback_peer=_loopback(peer))

    Caller = Depends(principal)
    app.include_router(tinker_router(service, limiter))  # the Tinker wire protocol under /api/v1

    @app.get("/v1/health", response_model=Health)
    def health() -> JSONResponse:
        ok = service.store.ping()
        return JSONResponse({"status": "ok" if ok else "store unavailable", "store": ok},
                            status_code=200 if ok else 503)

    @app.post("/v1/jobs", status_code=201, response_model=JobOut)
    def submit(spec: dict[str, Any] = Body(..., description="A job spec (marlaas.spec.JobSpec); `dataset` and "
                                           "`eval_dataset` are lists of rows or uploaded file ids."),
               p: Principal = Caller) -> dict:
        return service.submit(p, spec)

    @app.get("/v1/jobs", response_model=JobList)
    def list_jobs(tenant: str | None = Query(None, description="Only this tenant's jobs (operator)."),
                  limit: int = Query(1000, ge=1, le=100_000), p: Principal = Caller) -> dict:
        return {"jobs": service.list(p, tenant, limit)}

    @app.get("/v1/jobs/{job_id}", response_model=JobOut)
    def get_job(job_id: str, p: Principal = Caller) -> dict:
        return service.get(p, job_id)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobOut)
    def cancel(job_id: str, p: Principal = Caller) -> dict:
        return service.cancel(p, job_id)

    @app.post("/v1/jobs/{job_id}/pause", response_model=JobOut)
    def pause(job_id: str, p: Principal = Caller) -> dict:
        return service.pause(p, job_id)

    @app.post("/v1/jobs/{job_id}/resume", response_model=JobOut)
    def resume(job_id: str, p: Principal = Caller) -> dict:
        return service.resume(p, job_id)

    @app.get("/v1/jobs/{job_id}/events", response_model=EventPage,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def events(request: Request, job_id: str, after: float | None = Query(None),
                     limit: int = Query(500, ge=1, le=10_000), p: Principal = Caller,
                     last_event_id: str | None = Header(None)):
        """A server-sent event stream (`event: step|eval|task|status|end`, `id:` the cursor) until the
        job ends; with `Accept: application/json`, one page of events after `after` instead."""
        if after is None and last_event_id:
            try:
                after = float(last_event_id)
            except ValueError:
                raise SpecError(f"invalid request: Last-Event-ID {last_event_id!r} is not a cursor") from None
        first = await run_in_threadpool(service.events, p, job_id, after, limit)
        accept = request.headers.get("accept", "")
        if "application/json" in accept and "text/event-stream" not in accept:
            return first
        return StreamingResponse(_sse(request, service, p, job_id, first, s.sse_poll_s),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: str, p: Principal = Caller) -> dict:
        """{"steps": [per-step metrics], "evals": {version: evaluation with outputs}}."""
        return service.metrics(p, job_id)

    @app.get("/v1/jobs/{job_id}/evals")
    def evals(job_id: str, p: Principal = Caller) -> dict:
        """{"evals": [one row per evaluated version, ascending, without outputs]}."""
        return {"evals": service.evals(p, job_id)}

    @app.get("/v1/jobs/{job_id}/checkpoints", response_model=CheckpointList)
    def checkpoints(job_id: str, p: Principal = Caller) -> dict:
        return {"checkpoints": service.checkpoints(p, job_id)}

    @app.get("/v1/jobs/{job_id}/checkpoints/{version}/adapter",
             responses={200: {"content": {"application/gzip": {}}}})
    def adapter(job_id: str, version: str, p: Principal = Caller) -> Response:
        """The adapter of `version` ('latest' = the newest) as a tar.gz of a PEFT directory."""
        if version == "latest":
            v = None
        elif version.isdigit():
            v = int(version)
        else:
            raise SpecError(f"invalid request: version {version!r}: give a number or 'latest'")
        v, data = service.adapter_archive(p, job_id, v)
        return Response(data, media_type="application/gzip", headers={
            "Content-Disposition": f'attachment; filename="{job_id}-v{v}.tar.gz"', "X-Marlaas-Version": str(v)})

    @app.post(FILES_PATH, status_code=201, response_model=FileOut)
    def upload(request: Request, filename: str | None = Query(None, max_length=255, description=(
                   "The file's name; its suffix (.jsonl, .parquet) gives the format, else the content does.")),
               p: Principal = Caller) -> dict:
        """Upload a JSONL or parquet dataset as the raw request body (streamed; 413 past the limit)."""
        namespace = service.file_namespace(p)
        stream = request.stream().__aiter__()

        def chunks():
            while True:
                try:
                    yield anyio.from_thread.run(stream.__anext__)
                except StopAsyncIteration:
                    return

        return {"id": service.put_file(namespace, chunks(), s.max_file_bytes, filename)}

    @app.post("/v1/tenants", status_code=201, response_model=TenantOut)
    def add_tenant(body: TenantIn, p: Principal = Caller) -> dict:
        """Register a tenant (operator credential only); its token is shown once."""
        quotas = body.quotas.model_dump() if body.quotas is not None else None
        return {"tenant": body.name, "token": service.add_tenant(p, body.name, quotas)}

    app.include_router(graders_router(Caller))
    return app


def _sse_message(event: str, data: Any, cursor: float | None = None) -> str:
    head = f"id: {cursor!r}\n" if cursor is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse(request: Request, service: Service, p: Principal, job_id: str, page: dict, poll_s: float):
    """The event stream: each timeline event, a `status` event whenever status or version changes,
    and `end` (the final summary) once the job has ended; a comment line every 15 s keeps proxies open.
    An error after the stream started is sent as an `error` event, then the stream ends."""
    seen, quiet_since = None, time.monotonic()
    try:
        while True:
            for ev in page["events"]:
                yield _sse_message(ev["type"], ev["data"], ev["at"])
            if (page["status"], page["version"]) != seen:
                seen = (page["status"], page["version"])
                summary = await run_in_threadpool(service.get, p, job_id)
                yield _sse_message("status", summary)
                quiet_since = time.monotonic()
            if page["status"] in TERMINAL_STATUSES and not page["more"]:
                yield _sse_message("end", summary)
                return
            if not page["more"]:
                await asyncio.sleep(poll_s)
                if time.monotonic() - quiet_since > 15:
                    yield ": keep-alive\n\n"
                    quiet_since = time.monotonic()
            if await request.is_disconnected():
                return
            page = await run_in_threadpool(service.events, p, job_id, page["next"], 1000)
    except MarlaasError as e:
        yield _sse_message("error", {"type": type(e).__name__, "message": str(e)})


def serve(host: str = "127.0.0.1", port: int | None = None, *, open: bool | None = None,
          store_url: str | None = None) -> None:
    """Run the API with uvicorn (blocking). An open server is refused on a non-loopback bind."""
    import uvicorn

    s = ApiSettings()
    is_open = s.open if open is None else open
    if is_open and not _loopback(host):
        raise MarlaasError(f"refusing to serve without tokens (--open) on {host}: bind 127.0.0.1 or register "
                           "a tenant and drop --open")
    app = create_app(store_url, open=is_open, settings=s)
    uvicorn.run(app, host=host, port=port or s.port, log_level="info", proxy_headers=False)
