"""The store's tenants, tokens (hashed) and the deployment record."""

from __future__ import annotations

import json
import time

from marlaas.store.keys import (
    DEPLOYMENT,
    TENANTS,
    TOKENS,
    tenant_active_key,
)

DEFAULT_PLAN_WEIGHT = 1.0
"""The trainer-lane weight of the default plan (single-user mode, or a plan that sets none): the
default of marlaas.api.tenancy.Quotas.weight (tests/unit/test_scheduler.py checks they agree)."""


class TenantOps:
    """Tenants, tokens and the deployment (mixed into marlaas.store.Store)."""

    # ---------------------------------------------------------------- tenants and tokens
    def add_tenant(self, name: str, token_sha256: str, quotas: dict) -> bool:
        """Register a tenant with its hashed token; False if the name exists."""
        rec = json.dumps({"token_sha256": token_sha256, "quotas": quotas, "created": time.time()})
        if not self.r.hsetnx(TENANTS, name, rec):
            return False
        self.r.hset(TOKENS, token_sha256, name)
        return True

    def tenant_for_token(self, token_sha256: str) -> str | None:
        v = self.r.hget(TOKENS, token_sha256)
        return v.decode() if v is not None else None

    def tenant(self, name: str) -> dict | None:
        v = self.r.hget(TENANTS, name)
        return json.loads(v) if v is not None else None

    def tenant_weight(self, name: str | None) -> float:
        """The trainer-lane weight of the tenant's plan (the default plan's in single-user mode, or
        for a tenant not registered): what the scheduler tick charges a Tinker model of the tenant."""
        rec = self.tenant(name) if name is not None else None
        return float(((rec or {}).get("quotas") or {}).get("weight", DEFAULT_PLAN_WEIGHT))

    def auth_enabled(self) -> bool:
        return bool(self.r.hlen(TENANTS))

    def count_active(self, tenant: str) -> int:
        """The tenant's jobs that have not ended: one SCARD, however many jobs it ever ran."""
        return int(self.r.scard(tenant_active_key(tenant)))

    def set_deployment(self, **info) -> None:
        self.r.hset(DEPLOYMENT, mapping={k: str(v) for k, v in info.items()})

    def deployment(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(DEPLOYMENT).items()}


