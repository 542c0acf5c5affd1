"""Tenants, API tokens and quotas.

A deployment with no registered tenant is the embedded single-user default: no token is asked for.
Once `marlaas tenant add NAME` has registered one, every client call needs a token; the token is
shown once and stored only as its SHA-256. A token's tenant sees and changes only its own jobs
(another tenant's job is reported as not found, so job ids leak nothing).
"""

from __future__ import annotations

import hashlib
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field

from marlaas.errors import Forbidden, SpecError
from marlaas.spec import JobSpec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Quotas(BaseModel):
    """Per-tenant limits, checked at submit."""

    model_config = ConfigDict(extra="forbid")

    max_active_jobs: int = Field(8, ge=1, le=10_000)
    """Jobs of the tenant running at once."""
    max_steps: int = Field(10_000, ge=1)
    """Largest `steps` of one job."""
    max_group_size: int = Field(64, ge=2)
    """Largest `group_size` of one job."""
    max_prompts_per_step: int = Field(256, ge=1)
    """Largest `prompts_per_step` of one job."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def add_tenant(store, name: str, quotas: Quotas | None = None) -> str:
    """Register a tenant; returns its token (shown once, stored hashed)."""
    if not _NAME.match(name):
        raise SpecError(f"tenant name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    token = "mt_" + secrets.token_urlsafe(32)
    if not store.add_tenant(name, hash_token(token), (quotas or Quotas()).model_dump()):
        raise SpecError(f"tenant {name!r} exists already")
    return token


def resolve(store, token: str | None) -> str | None:
    """The caller's tenant, or None in single-user mode; Forbidden for a missing or unknown token."""
    if not store.auth_enabled():
        if token:
            raise Forbidden("this deployment has no tenants: unknown token")
        return None
    if not token:
        raise Forbidden("this deployment needs a tenant token: pass token= or set MARLAAS_TOKEN")
    tenant = store.tenant_for_token(hash_token(token))
    if tenant is None:
        raise Forbidden("invalid token")
    return tenant


def check_submit(store, tenant: str | None, spec: JobSpec) -> JobSpec:
    """The spec as the caller may submit it (tenant filled in), or a one-line refusal."""
    if tenant is None:
        return spec
    if spec.tenant == "default":
        spec = spec.model_copy(update={"tenant": tenant})
    elif spec.tenant != tenant:
        raise Forbidden(f"a token of tenant {tenant!r} cannot submit jobs for tenant {spec.tenant!r}")
    q = Quotas(**(store.tenant(tenant) or {}).get("quotas", {}))
    for field, limit, value in (
        ("steps", q.max_steps, spec.steps),
        ("group_size", q.max_group_size, spec.group_size),
        ("prompts_per_step", q.max_prompts_per_step, spec.prompts_per_step),
    ):
        if value > limit:
            raise SpecError(f"over quota: {field} {value} > {limit} for tenant {tenant!r}")
    active = store.count_active(tenant)
    if active >= q.max_active_jobs:
        raise SpecError(f"over quota: tenant {tenant!r} already runs {active} jobs (max {q.max_active_jobs})")
    return spec
