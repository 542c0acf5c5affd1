"""What the routes declare in /openapi.json beyond their success: error responses from one table, and
the JSON request bodies of routes that parse their body themselves.

    router = APIRouter(prefix="/v1/jobs", route_class=Declared, responses=errors(*AUTHENTICATED, 404))
    @router.post("/x", openapi_extra=json_body(SomeRequest), responses=errors(409))

Invariants:
- A marlaas route's error is the envelope `ErrorOut` ({"error": {"type", "message"}}) with the status of
  its class (`marlaas.errors`); the OpenAI-compatible routes answer OpenAI's shape (`openai_errors`).
- Every authenticated route can answer `AUTHENTICATED`: 401 (no or unknown token), 422 (an invalid
  parameter), 429 (over the rate, with Retry-After) and 503 (the store does not answer). Routers declare
  what all their routes answer, a route adds its own (403, 404, 409, ...).
- What the app answers before any route runs is declared by the route class (`Declared`): a POST, PUT or
  PATCH can be refused 413 by the body limit (`middleware.BodyLimit`), whatever the route.
- Every integer of a JSON body is at most 64 bits: the body check refuses bigger ones before any route
  (`middleware.json_hygiene`), so the schema of every body says so (`bound_integers`).
- A 405 names in `Allow` the methods of every documented route of the path (`allowed_methods`).
- `json_body` documents a body a route reads with its own parser (the Tinker and OpenAI doors): the
  parser's pydantic model, so the schema is the one the body is validated against.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel

from marlaas.api.models import ErrorOut
from marlaas.api.openai.wire import OpenAIErrorOut

WHY = {
    400: "The request is invalid",
    401: "No token, a malformed Authorization header or an unknown token",
    403: "The credential may not do this (e.g. only the operator may, or the operator may not)",
    404: "No such resource visible to the caller (another tenant's is the same 404)",
    409: "The resource's state does not allow it (e.g. the job is still running)",
    410: "The resource has ended",
    413: "The request body is over the limit, or the tenant's storage is full",
    422: "An invalid parameter or body: one line naming the first problem",
    429: "Over the rate or the plan's budget: retry after Retry-After seconds",
    503: "The store or the generation did not answer: retry later",
}
AUTHENTICATED = (401, 422, 429, 503)
"""What every authenticated route can answer."""
INT64 = (-(2**63 - 1), 2**63 - 1)
"""The integers a JSON body may hold (`middleware.json_hygiene`)."""
BODY_METHODS = {"POST", "PUT", "PATCH"}
"""The methods whose body the app checks before the route (`middleware.BodyLimit`)."""
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}


def errors(*codes: int, model: type[BaseModel] = ErrorOut) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` declaring these error statuses with the body `model` (the marlaas envelope)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted(set(codes)):
        out[code] = {"model": model, "description": WHY[code]}
        if code == 429:
            out[code]["headers"] = _RETRY_AFTER
    return out


def json_body(model: type[BaseModel], **checks: dict[str, Any]) -> dict[str, Any]:
    """FastAPI `openapi_extra=` declaring a JSON request body parsed by `model` (its schema inlined; an
    empty body counts as {}, so the body is optional when the model needs no field). `checks`: what the
    route checks beyond the model, per field (JSON Schema keywords for its non-null value)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    for name, keywords in checks.items():
        field = schema["properties"][name]
        for branch in field.get("anyOf", [field]):
            if branch.get("type") != "null":
                branch.update(keywords)
    return {"requestBody": {"required": bool(schema.get("required")),
                            "content": {"application/json": {"schema": _inline(schema, defs)}}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every local `#/$defs/X` reference replaced by its definition (the models are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline({**defs[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items() if k != "$ref"}},
                           defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def openai_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`errors` in OpenAI's error shape (the OpenAI-compatible routes; a marlaas 422 is a 400 there)."""
    return errors(*codes, model=OpenAIErrorOut)


def bound_integers(openapi: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with every integer of the request bodies and of the shared schemas bounded to
    64 bits where it has no tighter bound (in place; parameters are left as they are)."""
    for ops in openapi.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict) and "requestBody" in op:
                _bound(op["requestBody"])
    _bound(openapi.get("components", {}).get("schemas", {}))
    return openapi


def _bound(node: Any) -> None:
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            node.setdefault("minimum", INT64[0])
            node.setdefault("maximum", INT64[1])
        for v in node.values():
            _bound(v)
    elif isinstance(node, list):
        for v in node:
            _bound(v)


def allowed_methods(request: Request) -> list[str]:
    """The methods the documented routes of the request's path serve (sorted; empty: none matches)."""
    path = request.url.path
    return sorted({m for r in request.app.routes if isinstance(r, APIRoute) and r.include_in_schema
                   and r.path_regex.match(path) for m in r.methods or ()})


class Declared(APIRoute):
    """A route that also declares what the app answers before it runs (`BEFORE`, on a method with a body:
    the body limit's 413). Routers take it as `route_class`."""

    BEFORE: dict[int | str, dict[str, Any]] = errors(413)

    def __init__(self, path: str, endpoint: Any, *, methods: Any = None, responses: dict | None = None,
                 **kw: Any) -> None:
        if {m.upper() for m in methods or ()} & BODY_METHODS:
            responses = dict(sorted({**self.BEFORE, **(responses or {})}.items(), key=lambda kv: str(kv[0])))
        super().__init__(path, endpoint, methods=methods, responses=responses, **kw)
