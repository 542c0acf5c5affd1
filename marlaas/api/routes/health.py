"""GET /v1/health: whether the server and its store answer (not authenticated, not rate limited)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from marlaas.api.deps import service
from marlaas.api.models import Health
from marlaas.api.service import Service

router = APIRouter(prefix="/v1", tags=["health"])


@router.get("/health", response_model=Health,
            responses={503: {"model": Health, "description": "The store does not answer"}})
def health(svc: Service = Depends(service)) -> JSONResponse:
    """200 with store true, or 503 when Redis does not answer."""
    ok = svc.store.ping()
    return JSONResponse({"status": "ok" if ok else "store unavailable", "store": ok},
                        status_code=200 if ok else 503)
