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
    """A job's progress (what `Job.status()` returns)."""

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
    base_exact: float | None
    """Version 0 (the base): share of held-out prompts whose greedy completion gets full reward."""
    final_exact: float | None
    """The same for the final version (once evaluated)."""
    base_mean_reward: float | None
    """Version 0: mean reward of the held-out greedy completions (counts partial credit)."""
    final_mean_reward: float | None
    """The same for the final version (once evaluated)."""
    base_acc: float | None
    """Deprecated alias of `base_exact` (the same number)."""
    final_acc: float | None
    """Deprecated alias of `final_exact` (the same number)."""
    regenerated: int
    """Groups generated again (lost or too stale)."""
    grader_errors: dict[str, int]
    """Completions the grader could not score (scored 0): {"train": in training groups, "eval": in
    held-out evaluations}; each is also a `grader_error` event naming the row."""
    verify_errors: int
    """The same as grader_errors["train"] (kept for older readers)."""
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
    """'step' (a published version's metrics), 'eval' (a held-out evaluation), 'task' (a station task),
    'grader_error' (the grader could not score a row: phase, version, row, errors, error) or 'warning'
    (message: e.g. the grader errs on many rows; the job fails past its limits)."""
    at: float
    """When it happened (Unix seconds); the cursor of pagination."""
    data: dict[str, Any]
    """The metrics row, the evaluation row, {station, start, end}, or the notice's fields."""


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
    """Whether its adapter can be downloaded: the newest versions (the last KEEP_VERSIONS_EXTRA + 1)
    and every evaluated version stay; the others are deleted as the job publishes."""
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


class TenantDeleted(BaseModel):
    """A deleted tenant."""

    tenant: str
    """Its name."""
    jobs: int
    """Its jobs deleted."""
    bytes_freed: int
    """Bytes freed in the artifact store."""


class Usage(BaseModel):
    """A tenant's use of its plan."""

    tenant: str
    """The tenant."""
    stored_bytes: int
    """Bytes it keeps in the artifact store: adapter versions, optimizer states, checkpoints, uploads."""
    storage_bytes: int
    """Its plan's bound on them (new jobs, uploads and checkpoints are refused at or past it)."""
    active_jobs: int
    """Its jobs that have not ended."""
    max_active_jobs: int
    """Its plan's bound on them."""
    quotas: dict
    """Its whole plan."""


class JobDeleted(BaseModel):
    """A deleted job."""

    id: str
    """The job's id."""
    deleted: bool
    """Always true."""
    bytes_freed: int
    """Bytes freed in the artifact store."""


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
