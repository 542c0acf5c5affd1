"""The HTTP API's request and response models (what /docs and /openapi.json show).

Invariants: plain pydantic models, no behaviour; every field has a docstring for the schema. A route
returns a dict of this shape and FastAPI validates it against the model (`response_model`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from marlaas.api.tenancy import Quotas
from marlaas.verify.graders import MAX_TEXT


class ErrorDetail(BaseModel):
    """One error."""

    type: str
    """The error class: Unauthorized, Forbidden, NotFound, Conflict, TooLarge, SpecError, RateLimited, ..."""
    message: str
    """One line for the user."""


class ErrorOut(BaseModel):
    """The body of every error response."""

    error: ErrorDetail
    """What went wrong."""


class JobOut(BaseModel):
    """A job's progress (what `Job.status()` returns, with `id` for `job`)."""

    id: str
    """The job id (j<number>)."""
    tenant: str
    """The tenant that owns the job."""
    task: str
    """The built-in task family, or 'dataset' for the tenant's own data."""
    status: str
    """running, evaluating, paused, done, failed or cancelled."""
    version: int
    """The newest published adapter version (0 = the base model)."""
    steps: int
    """Versions the job publishes in all."""
    reward_mean: float | None
    """Mean reward of the newest step's rollouts."""
    staleness: int
    """Largest staleness among the newest step's rollouts."""
    max_staleness: int
    """The job's staleness bound."""
    base_acc: float | None
    """Held-out greedy accuracy of version 0."""
    final_acc: float | None
    """Held-out greedy accuracy of the final version (once evaluated)."""
    regenerated: int
    """Groups generated again (lost or too stale)."""
    verify_errors: int
    """Verifier calls that raised (scored 0)."""
    tool_calls: int
    """Tool calls of tool tasks."""
    tool_errors: int
    """Tool calls that failed."""
    error: str | None
    """Why the job failed, if it did."""
    preflight: dict | None = None
    """A preflight's result once it is done (exact, mean_reward, signal, verdict: `marlaas.verify.preflight`)."""
    created: float
    """Submission time (Unix seconds)."""
    updated: float
    """Time of the last status or version change (Unix seconds)."""


class JobList(BaseModel):
    """A list of jobs, oldest first."""

    jobs: list[JobOut]
    """The jobs."""


class Event(BaseModel):
    """One entry of a job's timeline."""

    type: str
    """'step' (a published version's metrics), 'eval' (a held-out evaluation) or 'task' (a station task)."""
    at: float
    """When it happened (Unix seconds); the cursor of pagination."""
    data: dict[str, Any]
    """The metrics row, the evaluation row, or {station, start, end}."""


class EventPage(BaseModel):
    """A page of a job's timeline."""

    job: str
    """The job id."""
    status: str
    """The job's status when the page was read."""
    version: int
    """The job's version when the page was read."""
    events: list[Event]
    """Events after the cursor, oldest first."""
    next: float
    """Pass as `after` to get the following page."""
    more: bool
    """Whether more events were already there than the page holds."""


class Checkpoint(BaseModel):
    """A version with a stored adapter or an evaluation."""

    version: int
    """The adapter version."""
    adapter: bool
    """Whether its adapter can be downloaded (older versions are deleted unless evaluated)."""
    eval: dict[str, Any] | None
    """Its held-out evaluation row, if evaluated."""


class CheckpointList(BaseModel):
    """A job's checkpoints, ascending."""

    checkpoints: list[Checkpoint]
    """The versions."""


class FileOut(BaseModel):
    """An uploaded dataset file."""

    id: str
    """Its id (file-...): use it as a job spec's `dataset` or `eval_dataset`."""


class TenantIn(BaseModel):
    """A tenant to register."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    """Letters, digits, '_', '.' or '-'."""
    quotas: Quotas | None = None
    """Its limits; default: the standard quotas."""


class TenantOut(BaseModel):
    """A registered tenant and its token (shown once, stored hashed)."""

    tenant: str
    """The tenant's name."""
    token: str
    """Its bearer token."""


class Health(BaseModel):
    """Whether the server and its store answer."""

    status: str
    """'ok' or 'store unavailable'."""
    store: bool
    """Whether Redis answers."""


class GraderIn(BaseModel):
    """A grader to validate."""

    model_config = ConfigDict(extra="forbid")

    grader: dict[str, Any]
    """The grader's JSON (type string_check, text_similarity, python, multi or builtin)."""


class Sample(BaseModel):
    """One model output."""

    model_config = ConfigDict(extra="forbid")

    output_text: str = Field(max_length=MAX_TEXT)
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
