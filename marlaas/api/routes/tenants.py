"""POST /v1/tenants: register a tenant (operator credential only; 403 otherwise)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import TenantIn, TenantOut
from marlaas.api.service import Service

router = APIRouter(prefix="/v1", tags=["tenants"])


@router.post("/tenants", status_code=201, response_model=TenantOut)
def add_tenant(body: TenantIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Register a tenant (operator credential only); its token is shown once."""
    quotas = body.quotas.model_dump() if body.quotas is not None else None
    return {"tenant": body.name, "token": svc.add_tenant(p, body.name, quotas)}
