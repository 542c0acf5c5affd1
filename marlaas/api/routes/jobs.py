"""The job routes under /v1/jobs: submit, list, get, cancel / pause / resume, events (SSE or pages),
metrics, evaluations, checkpoints and adapter downloads.

Invariants: every route is authenticated and rate limited (`deps.Caller`) and goes through the
`Service`, whose visibility is `marlaas.api.access`'s: another tenant's job or listing is 404.
An event stream ends with `end` once the job has ended; an error after it started is an `error` event.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from typing import Any

from fastapi import APIRouter, Body, Depends, Header, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from marlaas.api import preflight, tenancy
from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import CheckpointList, EventPage, JobDeleted, JobList, JobOut
from marlaas.api.ratelimit import SharedCap
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service
from marlaas.errors import MarlaasError, RateLimited, SpecError, StoreUnavailable
from marlaas.types import TERMINAL_STATUSES
from marlaas.verify import evaluation

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=Declared,
                   responses=errors(*AUTHENTICATED, 404))
Svc = Depends(service)
CURSOR = r"^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$"
"""An event's cursor (its `id:`, Unix seconds)."""


@router.post("", status_code=201, response_model=JobOut,
             responses={202: {"model": JobOut, "description": "A preflight still running after `wait` seconds"},
                        **errors(403)})
async def submit(response: Response,
                 spec: dict[str, Any] = Body(..., description="A job spec (marlaas.spec.JobSpec); `dataset` and "
                                             "`eval_dataset` are lists of rows or uploaded file ids."),
                 wait: float = Query(preflight.MAX_WAIT_S, ge=0, le=preflight.MAX_WAIT_S,
                                     description="With `\"preflight\": true`: seconds to wait for the result."),
                 p: Principal = Caller, svc: Service = Svc) -> dict:
    """Submit a job. With `"preflight": true`, a learnability check instead (nothing is trained): the
    answer carries its result (`preflight`) once done, or is 202 with the id to poll after `wait` s."""
    out = await run_in_threadpool(svc.submit, p, spec)
    if preflight.wanted(spec):
        out = await preflight.wait(svc, p, out["id"], wait)
        if out["status"] not in TERMINAL_STATUSES:
            response.status_code = 202
    return out


@router.get("", response_model=JobList)
def list_jobs(tenant: str | None = Query(None, description="Only this tenant's jobs (operator)."),
              limit: int = Query(1000, ge=1, le=100_000), p: Principal = Caller, svc: Service = Svc) -> dict:
    return {"jobs": svc.list(p, tenant, limit)}


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    return svc.get(p, job_id)


@router.delete("/{job_id}", response_model=JobDeleted, responses=errors(409))
def delete_job(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    """Delete an ended job: its record, data, adapter versions and optimizer state (409 while it runs:
    cancel it first); answers the bytes freed in the artifact store."""
    return svc.delete(p, job_id)


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    return svc.cancel(p, job_id)


@router.post("/{job_id}/pause", response_model=JobOut, responses=errors(409))
def pause(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    return svc.pause(p, job_id)


@router.post("/{job_id}/resume", response_model=JobOut, responses=errors(409))
def resume(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    return svc.resume(p, job_id)


@router.get("/{job_id}/events", response_model=EventPage, responses={200: {"content": {"text/event-stream": {}}}})
async def events(request: Request, job_id: str, after: float | None = Query(None, allow_inf_nan=False),
                 limit: int = Query(500, ge=1, le=10_000), p: Principal = Caller, svc: Service = Svc,
                 last_event_id: str = Header(None, pattern=CURSOR, description="The `id:` of the last "
                                                    "event received: the stream resumes after it")):
    """A server-sent event stream (`event: step|eval|task|status|end`, `id:` the cursor) until the
    job ends; with `Accept: application/json`, one page of events after `after` instead."""
    if after is None and last_event_id:
        try:
            after = float(last_event_id)
        except ValueError:
            raise SpecError(f"invalid request: Last-Event-ID {last_event_id!r} is not a cursor") from None
    accept = request.headers.get("accept", "")
    if "application/json" in accept and "text/event-stream" not in accept:
        return await run_in_threadpool(svc.events, p, job_id, after, limit)
    hold, first = await run_in_threadpool(_open_stream, request, svc, p, job_id, after, limit)
    stream = _sse(request, svc, p, job_id, first, request.app.state.settings.sse_poll_s, hold)
    weakref.finalize(stream, hold.release)  # a stream never started (the client left first) closes too
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


STREAM_HOLD_S = 60.0
"""An open event stream's place in its tenant's `max_event_streams` lasts this long unless renewed;
the stream renews it every poll, so a killed API process frees its streams' places within this time."""


class _StreamHold:
    """One event stream's place among its tenant's (`max_event_streams`, across every API process);
    `release` frees it once, however often it is called."""

    def __init__(self, caps: SharedCap | None, tenant: str | None, hold: str | None):
        self.caps, self.tenant, self.hold, self.renewed = caps, tenant, hold, time.monotonic()

    def due(self) -> bool:
        """Whether the hold's time limit should be moved on now (a quarter of it has passed)."""
        return self.hold is not None and time.monotonic() - self.renewed > STREAM_HOLD_S / 4

    def renew(self) -> None:
        self.renewed = time.monotonic()
        self.caps.renew(self.tenant, self.hold)

    def release(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            try:
                self.caps.release(self.tenant, hold)
            except StoreUnavailable:
                pass  # the place frees itself within STREAM_HOLD_S


def _stream_caps(request: Request, svc: Service) -> SharedCap:
    caps = getattr(request.app.state, "stream_caps", None)
    if caps is None:
        caps = request.app.state.stream_caps = SharedCap(svc.store.r, "event-streams", STREAM_HOLD_S)
    return caps


def _open_stream(request: Request, svc: Service, p: Principal, job_id: str, after: float | None,
                 limit: int) -> tuple[_StreamHold, dict]:
    """Hold a place for an event stream (RateLimited past the tenant's plan's `max_event_streams`,
    counted over every API process; no cap for the open single user or the operator), then read its
    first page: a refused stream costs the place's one Redis call, never a page."""
    plan = None if p.tenant is None else tenancy.plan_of(svc.store, p.tenant)
    if plan is None:
        return _StreamHold(None, p.tenant, None), svc.events(p, job_id, after, limit)
    caps = _stream_caps(request, svc)
    hold = caps.take(p.tenant, plan.max_event_streams)
    if hold is None:
        raise RateLimited(f"at most {plan.max_event_streams} event streams open at once (your plan's "
                          "max_event_streams): close one, or read pages with Accept: application/json", 5.0)
    held = _StreamHold(caps, p.tenant, hold)
    try:
        return held, svc.events(p, job_id, after, limit)
    except BaseException:
        held.release()
        raise


@router.get("/{job_id}/metrics")
def metrics(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    """{"steps": [per-step metrics], "evals": {version: evaluation with outputs}}."""
    return svc.metrics(p, job_id)


@router.get("/{job_id}/evals")
def evals(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    """{"evals": [one row per evaluated version, ascending, without outputs]}: exact (share of held-out
    prompts whose greedy completion gets full reward), mean_reward (greedy), pass_at ({k: pass@k on
    full-reward samples}), grader_errors (held-out rows the grader could not score), and train_reward
    (the mean training reward of the step that published the version) beside them."""
    m = svc.metrics(p, job_id)
    return {"evals": evaluation.table(m["evals"], m["steps"])}


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def checkpoints(job_id: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    return {"checkpoints": svc.checkpoints(p, job_id)}


@router.get("/{job_id}/checkpoints/{version}/adapter", responses={200: {"content": {"application/gzip": {}}}})
def adapter(job_id: str, version: str = Path(description="A version number or 'latest'",
                                              json_schema_extra={"pattern": "^(latest|[0-9]+)$"}),
            p: Principal = Caller, svc: Service = Svc) -> Response:
    """The adapter of `version` ('latest' = the newest) as a tar.gz of a PEFT directory."""
    if version == "latest":
        v = None
    elif version.isascii() and version.isdigit():  # not '²', which isdigit() takes
        v = int(version)
    else:
        raise SpecError(f"invalid request: version {version!r}: give a number or 'latest'")
    v, data = svc.adapter_archive(p, job_id, v)
    return Response(data, media_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{job_id}-v{v}.tar.gz"', "X-Marlaas-Version": str(v)})


def _sse_message(event: str, data: Any, cursor: float | None = None) -> str:
    head = f"id: {cursor!r}\n" if cursor is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _sse(request: Request, svc: Service, p: Principal, job_id: str, page: dict, poll_s: float,
               hold: _StreamHold | None = None):
    """The event stream: each timeline event, a `status` event whenever status or version changes,
    and `end` (the final summary) once the job has ended; a comment line every 15 s keeps proxies open.
    An error after the stream started is sent as an `error` event, then the stream ends. `hold` (its
    place among the tenant's streams) is renewed while it lasts and released once it ends, however it
    ends."""
    seen, quiet_since = None, time.monotonic()
    try:
        while True:
            for ev in page["events"]:
                yield _sse_message(ev["type"], ev["data"], ev["at"])
            if (page["status"], page["version"]) != seen:
                seen = (page["status"], page["version"])
                summary = await run_in_threadpool(svc.get, p, job_id)
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
            if hold is not None and hold.due():  # a Redis call, off the event loop, every STREAM_HOLD_S / 4
                await run_in_threadpool(hold.renew)
            page = await run_in_threadpool(svc.events, p, job_id, page["next"], 1000)
    except MarlaasError as e:
        yield _sse_message("error", {"type": type(e).__name__, "message": str(e)})
    finally:
        if hold is not None:
            hold.release()
