"""Tenants: POST /v1/tenants registers one and DELETE /v1/tenants/{name} deletes one with all it stored
(operator credential only; 403 otherwise); GET /v1/usage is the caller's use of its plan."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import TenantDeleted, TenantIn, TenantOut, Usage
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service

router = APIRouter(prefix="/v1", tags=["tenants"], route_class=Declared,
                   responses=errors(*AUTHENTICATED))


@router.post("/tenants", status_code=201, response_model=TenantOut, responses=errors(403))
def add_tenant(body: TenantIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Register a tenant (operator credential only); its token is shown once."""
    quotas = body.quotas.model_dump() if body.quotas is not None else None
    return {"tenant": body.name, "token": svc.add_tenant(p, body.name, quotas)}


@router.delete("/tenants/{name}", response_model=TenantDeleted, responses=errors(403, 404, 409))
def delete_tenant(name: str, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Delete a tenant with no active job: its jobs, token, checkpoints and every stored byte (operator)."""
    return svc.delete_tenant(p, name)


@router.get("/usage", response_model=Usage, responses=errors(404))
def usage(tenant: str | None = Query(None, max_length=64, description="The tenant (operator only)."),
          p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """The caller's use of its plan: bytes stored in the artifact store and active jobs, with the bounds."""
    return svc.usage(p, tenant)
