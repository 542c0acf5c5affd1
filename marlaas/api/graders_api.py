"""HTTP routes for graders and registered verifiers (an APIRouter the server mounts under /v1).

    app.include_router(graders_router(Caller))   # in create_app, with its authenticated dependency

Routes (every one authenticated and rate limited like the others, through `caller`):

- `POST /v1/graders/validate` {"grader": {...}}: the grader as it will run (defaults filled in), or
  422 with one line naming the first problem; a `builtin` name must be built in or registered.
- `POST /v1/graders/run` {"grader", "sample": {"output_text"}, "item": {...}}: a dry run on one sample
  and one item: {"reward", "error", "sub_rewards"} (sub_rewards: each sub-grader of a `multi`). A
  python grader runs in the sandbox under its limits, as in a job.
- `GET /v1/verifiers`: the registered verifier names (the operator also sees their import paths).
- `PUT /v1/verifiers/{name}` {"path": "package.module:function"} and `DELETE /v1/verifiers/{name}`:
  operator only (403 otherwise); the path is checked and imported on the server before it is stored.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from marlaas.api.service import Principal
from marlaas.errors import Forbidden, NotFound, SpecError, VerifierError
from marlaas.verify import boundary
from marlaas.verify import graders as g


class GraderIn(BaseModel):
    """A grader to validate."""

    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any]
    """The grader's JSON (type string_check, text_similarity, python, multi or builtin)."""


class Sample(BaseModel):
    """One model output."""

    model_config = ConfigDict(extra="forbid")

    output_text: str = Field(max_length=g.MAX_TEXT)
    """The completion text ({{sample.output_text}}; `sample["output_text"]` in a python grader)."""


class RunIn(BaseModel):
    """A dry run of a grader on one sample and one item."""

    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any]
    """The grader's JSON."""
    sample: Sample
    """The model output graded."""
    item: dict[str, Any] = Field(default_factory=dict)
    """The dataset row ({{item.FIELD}}; `item` in a python grader)."""


class RunOut(BaseModel):
    """The result of a dry run."""

    reward: float
    """The reward (0.0 when the grader erred)."""
    error: str | None
    """Why the grader could not score the sample (one line), else None."""
    sub_rewards: dict[str, float | None]
    """For a multi grader: each sub-grader's reward (None where it erred); else empty."""


class VerifierIn(BaseModel):
    """An import path to register."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=3, max_length=300)
    """'package.module:function' (one function name, defined in that module)."""


def _checked(service, principal: Principal, data: dict) -> Any:
    grader = g.parse_grader(data)
    boundary.check_submit(service.store, principal.tenant, grader, None)
    return grader


def graders_router(caller) -> APIRouter:
    """The routes, authenticated by `caller` (the server's `Depends(principal)`)."""
    router = APIRouter()

    @router.post("/v1/graders/validate")
    def validate(body: GraderIn, request: Request, p: Principal = caller) -> dict:
        """The grader as it will run, or 422 with the first problem."""
        grader = _checked(request.app.state.service, p, body.grader)
        return {"grader": grader.model_dump()}

    @router.post("/v1/graders/run", response_model=RunOut)
    def run(body: RunIn, request: Request, p: Principal = caller) -> dict:
        """Grade one sample of one item (python graders in the sandbox)."""
        service = request.app.state.service
        grader = _checked(service, p, body.grader)
        registered = service.store.registered_verifiers()
        item, comps = dict(body.item), [body.sample.output_text]
        try:
            score = g.grade_group(grader, item, comps, registered)
            subs = {}
            if isinstance(grader, g.MultiGrader):
                for name, sub in grader.graders.items():
                    s = g.grade_group(sub, item, comps, registered)
                    subs[name] = None if s.errors else s.rewards[0]
        except g.GraderLoadError as e:
            raise SpecError(f"invalid grader: {e}") from None
        return {"reward": score.rewards[0], "error": score.error, "sub_rewards": subs}

    @router.get("/v1/verifiers")
    def list_verifiers(request: Request, p: Principal = caller) -> dict:
        """Registered verifier names (with their import paths for the operator)."""
        reg = request.app.state.service.store.registered_verifiers()
        if p.operator:
            return {"verifiers": [{"name": k, "path": v} for k, v in sorted(reg.items())]}
        return {"verifiers": [{"name": k} for k in sorted(reg)]}

    @router.put("/v1/verifiers/{name}")
    def register(name: str, body: VerifierIn, request: Request, p: Principal = caller) -> dict:
        """Register (or replace) a verifier name (operator only)."""
        if not p.operator:
            raise Forbidden("only the operator credential can register verifiers")
        try:
            boundary.register(request.app.state.service.store, name, body.path)
        except VerifierError as e:
            raise SpecError(str(e)) from None
        return {"name": name, "path": body.path}

    @router.delete("/v1/verifiers/{name}")
    def unregister(name: str, request: Request, p: Principal = caller) -> dict:
        """Remove a registered verifier name (operator only)."""
        if not p.operator:
            raise Forbidden("only the operator credential can remove verifiers")
        if not request.app.state.service.store.unregister_verifier(name):
            raise NotFound(f"no verifier {name!r}")
        return {"name": name, "removed": True}

    return router
