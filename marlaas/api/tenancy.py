"""Tenants, API tokens and quotas.

A deployment with no registered tenant is the embedded single-user default: no token is asked for.
Once `marlaas tenant add NAME` has registered one, every client call needs a token; the token is
shown once and stored only as its SHA-256. A token's tenant sees and changes only its own jobs
(another tenant's job is reported as not found, so job ids leak nothing).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field

from marlaas.errors import Forbidden, SpecError, StorageQuotaExceeded
from marlaas.spec import JobSpec
from marlaas.types import eval_versions
from marlaas.verify.grader_fields import ref_of
from marlaas.verify.job_scoring import GRADER_S_PER_EVAL, GRADER_S_PER_STEP

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Quotas(BaseModel):
    """A tenant's plan, set by the operator: its trainer share and a bound on every cost one of its
    jobs can cause, checked at submit (the API's admission). The single-user default (no tenants)
    is held to the default plan's cost bounds too, except for the count of jobs."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(1.0, gt=0, le=100)
    """The tenant's share of the one trainer lane, split over its training jobs: two tenants of equal
    weight get equal shares however many jobs each runs. A job's own `weight` is ignored for tenants."""
    max_active_jobs: int = Field(8, ge=1, le=10_000)
    """Jobs of the tenant running at once."""
    max_steps: int = Field(10_000, ge=1)
    """Largest `steps` of one job."""
    max_group_size: int = Field(64, ge=2)
    """Largest `group_size` of one job."""
    max_prompts_per_step: int = Field(256, ge=1)
    """Largest `prompts_per_step` of one job."""
    max_tokens_per_step: int = Field(65_536, ge=1)
    """Largest prompts_per_step x group_size x max_new_tokens: the generated tokens of one step."""
    max_eval_rows: int = Field(2_048, ge=1)
    """Largest eval_size x (1 + eval_k): completions of one evaluation (one generate task's worth)."""
    max_eval_rows_total: int = Field(65_536, ge=1)
    """Largest completions over all of a job's evaluations (versions evaluated x max_eval_rows)."""
    max_staleness: int = Field(8, ge=0)
    """Largest `max_staleness` (rollouts in flight per job grow with it)."""
    max_row_bytes: int = Field(65_536, ge=64)
    """Largest row (prompt, answer and any fields, as JSON)."""
    max_dataset_bytes: int = Field(64 << 20, ge=1024)
    """Largest dataset (training plus held-out rows, as JSON)."""
    max_concurrent_dry_runs: int = Field(2, ge=1, le=64)
    """Grader dry runs (`POST /v1/graders/run`) of the tenant running at once over every API process;
    past it, 429. Each runs in a child process limited in memory and time (`marlaas.api.dryruns`)."""
    max_event_streams: int = Field(4, ge=1, le=1_000)
    """Job event streams (`GET /v1/jobs/{id}/events` as server-sent events) of the tenant open at once
    over every API process; past it, 429 until one closes (a page of events as JSON is not a stream)."""
    tinker_max_data_per_op: int = Field(256, ge=1)
    """Largest number of datums in one Tinker forward / forward_backward (422 past it)."""
    tinker_max_tokens_per_op: int = Field(131_072, ge=1)
    """Largest total tokens over the datums of one Tinker forward / forward_backward (422 past it).
    Each datum is also bounded by the base's context length."""
    tinker_max_queued_ops: int = Field(32, ge=1)
    """Tinker training ops of the tenant queued or running at once, over all its models (429 past it)."""
    tinker_max_pending_samples: int = Field(64, ge=1)
    """Tinker sample requests of the tenant pending at once (429 past it); each asks at most 128
    samples of at most context - prompt tokens."""
    max_grader_s_per_step: float = Field(GRADER_S_PER_STEP, gt=0)
    """Sandbox seconds of the job's python graders per training step (its batches run under what is
    left): past it the step's remaining calls score as errors, with a warning notice."""
    max_grader_s_per_eval: float = Field(GRADER_S_PER_EVAL, gt=0)
    """Sandbox seconds of the job's python graders per evaluation, the same way."""
    serve_requests_per_minute: int = Field(600, ge=1)
    """OpenAI-door requests (`/v1/chat/completions`, `/v1/completions`) of the tenant in any 60 s,
    over every API process (429 with Retry-After past it), before anything is queued."""
    serve_tokens_per_minute: int = Field(200_000, ge=1)
    """Completion tokens the tenant's serving requests may ask for in any 60 s: each request reserves
    n x max_tokens (per prompt) at the door, whatever it then generates (429 past it; one request
    asking for more than the whole minute's budget is a 400)."""
    storage_bytes: int = Field(20 << 30, ge=0)
    """Bytes the tenant keeps in the artifact store (adapter versions, optimizer states, Tinker
    checkpoints, uploads): at or past it, new jobs, uploads and Tinker checkpoints are refused (413)
    until it deletes ended jobs (`DELETE /v1/jobs/{id}`) or checkpoints. Running jobs keep going."""


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


def plan_of(store, tenant: str | None) -> Quotas:
    """The tenant's plan (the default plan in single-user mode)."""
    return Quotas(**((store.tenant(tenant) or {}).get("quotas", {}) if tenant is not None else {}))


def check_storage(store, tenant: str | None) -> None:
    """StorageQuotaExceeded when the tenant's stored bytes reached its plan's `storage_bytes` (no bound
    in single-user mode: the machine is the user's)."""
    if tenant is None:
        return
    used, limit = store.stored_bytes(tenant), plan_of(store, tenant).storage_bytes
    if used >= limit:
        raise StorageQuotaExceeded(
            f"over quota: tenant {tenant!r} stores {used} bytes (plan: {limit}); delete ended jobs "
            f"(DELETE /v1/jobs/ID) or checkpoints to free some")


def usage(store, tenant: str) -> dict:
    """What the tenant uses of its plan: stored bytes and active jobs, next to their bounds."""
    q = plan_of(store, tenant)
    return {"tenant": tenant, "stored_bytes": store.stored_bytes(tenant), "storage_bytes": q.storage_bytes,
            "active_jobs": store.count_active(tenant), "max_active_jobs": q.max_active_jobs,
            "quotas": q.model_dump()}


def check_submit(store, tenant: str | None, spec: JobSpec) -> JobSpec:
    """The spec as the caller may submit it (tenant filled in, trainer weight from the plan), or a
    one-line refusal naming the quota."""
    q = plan_of(store, tenant)
    if tenant is not None:
        if spec.tenant == "default":
            spec = spec.model_copy(update={"tenant": tenant})
        elif spec.tenant != tenant:
            raise Forbidden(f"a token of tenant {tenant!r} cannot submit jobs for tenant {spec.tenant!r}")
        spec = spec.model_copy(update={"weight": q.weight})  # the share comes from the plan, not the spec
    who = f"tenant {tenant!r}" if tenant is not None else "this deployment's default plan"
    n_evals = len(eval_versions(spec.steps, spec.eval_every))
    eval_rows = spec.eval_size * (1 + spec.eval_k)
    for field, limit, value in (
        ("steps", q.max_steps, spec.steps),
        ("group_size", q.max_group_size, spec.group_size),
        ("prompts_per_step", q.max_prompts_per_step, spec.prompts_per_step),
        ("tokens per step (prompts_per_step x group_size x max_new_tokens)", q.max_tokens_per_step,
         spec.prompts_per_step * spec.group_size * spec.max_new_tokens),
        ("evaluation rows (eval_size x (1 + eval_k))", q.max_eval_rows, eval_rows),
        ("evaluation rows over the job (evaluations x eval_size x (1 + eval_k))", q.max_eval_rows_total,
         n_evals * eval_rows),
        ("max_staleness", q.max_staleness, spec.max_staleness),
    ):
        if value > limit:
            raise SpecError(f"over quota: {field} {value} > {limit} for {who}")
    check_storage(store, tenant)
    if tenant is not None:
        active = store.count_active(tenant)
        if active >= q.max_active_jobs:
            raise SpecError(f"over quota: tenant {tenant!r} already runs {active} jobs (max {q.max_active_jobs})")
    return spec


def check_rows(store, tenant: str | None, train: list[dict], held: list[dict]) -> None:
    """Row and dataset sizes within the plan (rows are stored, and copied into rollouts)."""
    q = plan_of(store, tenant)
    total = 0
    for split, rows in (("dataset", train), ("eval_dataset", held)):
        for i, row in enumerate(rows):
            n = len(json.dumps(row))
            if n > q.max_row_bytes:
                raise SpecError(f"over quota: {ref_of(row, f'{split} row {i + 1}')} has {n} bytes > {q.max_row_bytes}")
            total += n
    if total > q.max_dataset_bytes:
        raise SpecError(f"over quota: the dataset has {total} bytes > {q.max_dataset_bytes}")
