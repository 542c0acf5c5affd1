"""POST /v1/files: upload a JSONL or parquet dataset as the raw request body (streamed).

Invariants: the body is never read whole: it streams to the Service, which counts the bytes against
the app's `max_file_bytes` (413 past it, nothing kept); the operator credential has no files (403).
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
from fastapi import APIRouter, Depends, Query, Request

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import FileOut
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service

PATH = "/v1/files"
router = APIRouter(tags=["files"], route_class=Declared, responses=errors(*AUTHENTICATED, 403))


BODY = {"requestBody": {"required": True, "description": "The file's bytes (JSONL or parquet), streamed",
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post(PATH, status_code=201, response_model=FileOut, openapi_extra=BODY)
def upload(request: Request, filename: str | None = Query(None, max_length=255, description=(
               "The file's name; its suffix (.jsonl, .parquet) gives the format, else the content does.")),
           p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Upload a JSONL or parquet dataset as the raw request body (streamed; 413 past the limit)."""
    namespace = svc.file_namespace(p)
    stream = request.stream().__aiter__()

    def chunks() -> Iterator[bytes]:
        while True:
            try:
                yield anyio.from_thread.run(stream.__anext__)
            except StopAsyncIteration:
                return

    return {"id": svc.put_file(namespace, chunks(), request.app.state.settings.max_file_bytes, filename)}
