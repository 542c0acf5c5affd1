"""Grader routes under /v1/graders (authenticated and rate limited like every route).

- `POST /v1/graders/validate` {"grader": {...}}: the grader as it will run (defaults filled in), or
  422 with one line naming the first problem; a `builtin` name must be built in or registered.
- `POST /v1/graders/run` {"grader", "sample": {"output_text"}, "item": {...}}: a dry run on one sample
  and one item: {"reward", "error", "sub_rewards"} (sub_rewards: each sub-grader of a `multi`, from the
  same single run). A python grader runs in the sandbox under its limits, as in a job; the whole dry
  run runs in a child process under a memory and time limit, awaited without holding a request
  thread (`marlaas.api.dryruns`): past the tenant's `max_concurrent_dry_runs` or the process's slots,
  429.
Invariant: a grader is checked exactly as at submit (`marlaas.verify.boundary.check_submit`).
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from marlaas.api import tenancy
from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.dryruns import WALL_S, DryRuns
from marlaas.api.models import GraderIn, RunIn, RunOut
from marlaas.api.ratelimit import SharedCap
from marlaas.api.responses import AUTHENTICATED, Declared, errors
from marlaas.api.service import Service
from marlaas.verify import boundary
from marlaas.verify import graders as g

router = APIRouter(prefix="/v1/graders", tags=["graders"], route_class=Declared,
                   responses=errors(*AUTHENTICATED))
_MADE = threading.Lock()


def checked(svc: Service, principal: Principal, data: dict) -> Any:
    """The parsed grader, if the caller may submit it (SpecError otherwise)."""
    grader = g.parse_grader(data)
    boundary.check_submit(svc.store, principal.tenant, grader, None)
    return grader


@router.post("/validate")
def validate(body: GraderIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """The grader as it will run, or 422 with the first problem."""
    return {"grader": checked(svc, p, body.grader).model_dump()}


def dry_runs(request: Request, svc: Service) -> DryRuns:
    """The app's dry-run slots (made on first use, with the service's home hidden from the sandbox)."""
    with _MADE:
        runs = getattr(request.app.state, "dry_runs", None)
        if runs is None:
            caps = SharedCap(svc.store.r, "dry-runs", ttl_s=WALL_S + 30)  # a dry run ends within WALL_S
            runs = request.app.state.dry_runs = DryRuns(home=str(svc.home), caps=caps)
        return runs


def _admit(svc: Service, principal: Principal, data: dict) -> tuple[dict, dict, int]:
    """(the grader as it will run, registered verifiers, the caller's cap of dry runs at once)."""
    grader = checked(svc, principal, data)
    cap = tenancy.plan_of(svc.store, principal.tenant).max_concurrent_dry_runs
    return grader.model_dump(), svc.store.registered_verifiers(), cap


@router.post("/run", response_model=RunOut)
async def run(body: RunIn, request: Request, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Grade one sample of one item in a limited child process (429 past the dry-run caps)."""
    grader, registered, cap = await run_in_threadpool(_admit, svc, p, body.grader)
    return await dry_runs(request, svc).run(p.tenant, cap, grader, body.item, body.sample.output_text, registered)
