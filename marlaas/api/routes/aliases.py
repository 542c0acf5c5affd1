"""Tenant-defined model names for the OpenAI-compatible door: `GET /v1/aliases`, `PUT /v1/aliases/{name}`
(body `{"model": "j12@best"}`), `DELETE /v1/aliases/{name}`.

An alias stands for any model name the caller may call (`marlaas.api.openai.names`: the base, `JOB`,
`JOB/V`, `JOB@best`, a Tinker sampler path) and is resolved at each request, so `prod -> j12@best`
follows the promotion. Invariants: a tenant sees and changes only its own aliases (another tenant's
alias of the same name is another alias); the target is resolved through the access policy when the
alias is set (a model the caller may not call is the same 404 as an unknown one); at most
`MAX_ALIASES` per tenant. Errors are the marlaas envelope (these are marlaas routes).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.openai import names
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service
from marlaas.errors import NotFound
from marlaas.store.blobs import tenant_part
from marlaas.store.tinker import TinkerStore

Svc = Depends(service)
router = APIRouter(prefix="/v1/aliases", tags=["serving"], route_class=Declared, responses=errors(*AUTHENTICATED))


class AliasIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=300)


@router.get("")
def list_aliases(p: Principal = Caller, svc: Service = Svc) -> dict:
    """The caller's aliases: alias -> the model name it stands for."""
    return {"aliases": svc.store.aliases(tenant_part(p.tenant))}


@router.put("/{name}", responses=errors(404, 409))
async def set_alias(name: str, body: AliasIn, p: Principal = Caller, svc: Service = Svc) -> dict:
    """Point an alias at a model name (created or moved); answers what it resolves to now."""
    def put() -> dict:
        target = names.check_alias(svc.store, TinkerStore(svc.store), p.tenant, name, body.model)
        svc.store.set_alias(tenant_part(p.tenant), name, body.model)
        ref = target.ref
        return {"alias": name, "model": body.model,
                "resolves_to": None if ref is None else {"job": ref.job_id, "version": ref.version}}

    return await run_in_threadpool(put)


@router.delete("/{name}", responses=errors(404))
def drop_alias(name: str, p: Principal = Caller, svc: Service = Svc) -> dict:
    if not svc.store.drop_alias(tenant_part(p.tenant), name):
        raise NotFound(f"no alias {name!r}")
    return {"alias": name, "deleted": True}
