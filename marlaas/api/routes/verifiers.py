"""Registered verifier routes under /v1/verifiers.

- `GET /v1/verifiers`: the registered verifier names (the operator also sees their import paths).
- `PUT /v1/verifiers/{name}` {"path": "package.module:function"} and `DELETE /v1/verifiers/{name}`:
  operator only (403 otherwise); the path is checked and imported on the server before it is stored.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import VerifierIn
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service
from marlaas.errors import Forbidden, NotFound, SpecError, VerifierError
from marlaas.verify import boundary

router = APIRouter(prefix="/v1/verifiers", tags=["verifiers"], route_class=Declared,
                   responses=errors(*AUTHENTICATED))


@router.get("")
def list_verifiers(p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Registered verifier names (with their import paths for the operator)."""
    reg = svc.store.registered_verifiers()
    if p.operator:
        return {"verifiers": [{"name": k, "path": v} for k, v in sorted(reg.items())]}
    return {"verifiers": [{"name": k} for k in sorted(reg)]}


@router.put("/{name}", responses=errors(403))
def register(name: str, body: VerifierIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Register (or replace) a verifier name (operator only)."""
    if not p.operator:
        raise Forbidden("only the operator credential can register verifiers")
    try:
        boundary.register(svc.store, name, body.path)
    except VerifierError as e:
        raise SpecError(str(e)) from None
    return {"name": name, "path": body.path}


@router.delete("/{name}", responses=errors(403, 404))
def unregister(name: str, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Remove a registered verifier name (operator only)."""
    if not p.operator:
        raise Forbidden("only the operator credential can remove verifiers")
    if not svc.store.unregister_verifier(name):
        raise NotFound(f"no verifier {name!r}")
    return {"name": name, "removed": True}
