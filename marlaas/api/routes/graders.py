"""Grader routes under /v1/graders (authenticated and rate limited like every route).

- `POST /v1/graders/validate` {"grader": {...}}: the grader as it will run (defaults filled in), or
  422 with one line naming the first problem; a `builtin` name must be built in or registered.
- `POST /v1/graders/run` {"grader", "sample": {"output_text"}, "item": {...}}: a dry run on one sample
  and one item: {"reward", "error", "sub_rewards"} (sub_rewards: each sub-grader of a `multi`). A
  python grader runs in the sandbox under its limits, as in a job.
Invariant: a grader is checked exactly as at submit (`marlaas.verify.boundary.check_submit`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from marlaas.api.access import Principal
from marlaas.api.deps import Caller, service
from marlaas.api.models import GraderIn, RunIn, RunOut
from marlaas.api.service import Service
from marlaas.errors import GraderLoadError, SpecError
from marlaas.verify import boundary
from marlaas.verify import graders as g

router = APIRouter(prefix="/v1/graders", tags=["graders"])


def checked(svc: Service, principal: Principal, data: dict) -> Any:
    """The parsed grader, if the caller may submit it (SpecError otherwise)."""
    grader = g.parse_grader(data)
    boundary.check_submit(svc.store, principal.tenant, grader, None)
    return grader


@router.post("/validate")
def validate(body: GraderIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """The grader as it will run, or 422 with the first problem."""
    return {"grader": checked(svc, p, body.grader).model_dump()}


@router.post("/run", response_model=RunOut)
def run(body: RunIn, p: Principal = Caller, svc: Service = Depends(service)) -> dict:
    """Grade one sample of one item (python graders in the sandbox)."""
    grader = checked(svc, p, body.grader)
    registered = svc.store.registered_verifiers()
    item, comps = dict(body.item), [body.sample.output_text]
    try:
        score = g.grade_group(grader, item, comps, registered)
        subs = {}
        if isinstance(grader, g.MultiGrader):
            for name, sub in grader.graders.items():
                s = g.grade_group(sub, item, comps, registered)
                subs[name] = None if s.errors else s.rewards[0]
    except GraderLoadError as e:
        raise SpecError(f"invalid grader: {e}") from None
    return {"reward": score.rewards[0], "error": score.error, "sub_rewards": subs}
