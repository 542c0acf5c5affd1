"""The API's body limit and error handlers: every error leaves the app as one JSON envelope.

Invariants:
- Every error is JSON `{"error": {"type", "message"}}`: the type is the error class (`NotFound`,
  `SpecError`, ...), the message its first line, the HTTP status the class's `status`
  (`marlaas.errors`); RateLimited adds Retry-After (at least 1 s); one with a hold (the per-token rate)
  is answered only after it, on the event loop. Unhandled exceptions are logged and answered 500
  without their text.
- Request bodies are bounded before they are read whole: a Content-Length over the limit gets 413
  unread; a body without one is counted while it arrives. Uploads (`upload_path`) stream to the route,
  which counts the bytes itself under its own, larger limit.
- A JSON body (any body but protobuf, multipart, form and octet-stream ones) is refused with 422 before
  the app sees it when it is nested too deeply for the parser, holds NaN / Infinity, a non-finite number,
  an integer past 64 bits or a lone UTF-16 surrogate (`json_hygiene`): every door, one check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from marlaas.errors import Forbidden, MarlaasError, NotFound, RateLimited, SpecError, TooLarge, Unauthorized

log = logging.getLogger("marlaas.api")
# A JSON escape or raw UTF-8 bytes of a UTF-16 surrogate: the body may hold a lone one (checked precisely).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_MAX_INT = 2**63 - 1
_NOT_JSON = (b"protobuf", b"multipart", b"x-www-form-urlencoded", b"octet-stream")


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _int(text: str) -> int:
    if len(text) > 20 or abs(int(text)) > _MAX_INT:
        raise ValueError(f"the integer {text[:12]}... is out of range (64-bit)")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:12]} is out of range")
    return v


def json_hygiene(body: bytes) -> str | None:
    """Why a JSON body must be refused before any route reads it, or None: nesting deeper than the parser
    takes, NaN / Infinity, non-finite floats or integers past 64 bits, lone UTF-16 surrogates (not
    Unicode: they fail later when the text is encoded). A body that is not JSON at all is left to the
    route (its own 422)."""
    try:
        obj = json.loads(body, parse_constant=_constant, parse_int=_int, parse_float=_float)
    except RecursionError:
        return "the JSON body is nested too deeply"
    except json.JSONDecodeError:
        return None
    except (ValueError, UnicodeError) as e:
        return f"the JSON body holds an invalid value: {str(e).splitlines()[0][:120]}"
    if _SURROGATE.search(body):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "the JSON body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode text"
    return None


# Starlette's own HTTP errors (no route, wrong method) named as the envelope's type.
_HTTP_TYPES = {c.status: c.__name__ for c in (NotFound, Unauthorized, Forbidden)} | {405: "MethodNotAllowed"}


def error_response(err: MarlaasError, status: int | None = None, type_: str | None = None) -> JSONResponse:
    """The JSON envelope of an error (status: the class's unless given)."""
    msg = (str(err).strip().splitlines() or [type(err).__name__])[0]
    headers = {}
    if isinstance(err, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return JSONResponse({"error": {"type": type_ or type(err).__name__, "message": msg}},
                        status_code=status or err.status, headers=headers)


async def hold(err: MarlaasError) -> None:
    """Wait out a refusal's hold (RateLimited.hold_s) before it is answered: on the event loop, no
    thread, so a flood that ignores Retry-After gets one refusal per connection per hold and costs the
    API little CPU (other tenants' share). Its Retry-After is what is left of the wait."""
    if isinstance(err, RateLimited) and err.hold_s > 0:
        await asyncio.sleep(err.hold_s)
        err.retry_after, err.hold_s = max(err.retry_after - err.hold_s, 0.0), 0.0


def install_error_handlers(app: FastAPI) -> None:
    """Map MarlaasError, request validation, Starlette HTTP errors and anything else to the envelope."""

    @app.exception_handler(MarlaasError)
    async def marlaas_error(request: Request, exc: MarlaasError) -> JSONResponse:
        await hold(exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return error_response(SpecError(f"invalid request: {where + ': ' if where else ''}{msg}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return error_response(MarlaasError(message), exc.status_code, _HTTP_TYPES.get(exc.status_code, "HTTPError"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(MarlaasError("internal server error (see the server log)"), 500, "ServerError")


class BodyLimit:
    """ASGI middleware: 413 for a request body over the limit, before the app reads it whole.
    Bodies of ordinary routes (at most `max_body` bytes) are read here and replayed to the app; an
    upload to `upload_path` passes through streaming once its Content-Length (if any) fits `max_file`."""

    def __init__(self, app: ASGIApp, max_body: int, max_file: int, upload_path: str):
        self.app, self.max_body, self.max_file, self.upload_path = app, max_body, max_file, upload_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        upload = scope["path"].rstrip("/") == self.upload_path
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
        body = b"".join(chunks)
        ctype = dict(scope["headers"]).get(b"content-type", b"").lower()
        if body and not any(t in ctype for t in _NOT_JSON) and (why := json_hygiene(body)):
            await error_response(SpecError(f"invalid request: {why}"))(scope, receive, send)
            return
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
    resp = error_response(TooLarge(f"request body over the limit of {limit} bytes"))
    resp.headers["Connection"] = "close"
    await resp(scope, receive, send)
