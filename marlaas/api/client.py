"""The Python API: submit jobs, follow them, fetch adapters.

    from marlaas import Client, JobSpec
    client = Client()                      # the embedded stack, or MARLAAS_REDIS_URL
    job = client.submit(JobSpec(tenant="alice", task="sort", steps=40))
    job.wait(progress=True)
    job.download_adapter("alice-sort")

Submitting validates the spec and the rows before anything is stored: an invalid job raises one
clear `MarlaasError` and leaves no trace. The scheduler picks a new job up on its next tick.
Visibility, version bounds and deployment limits are `marlaas.api.access`'s, as over HTTP: another
tenant's job (or listing) is simply not found. The client is a process edge: it reads the settings.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from marlaas.api import access, admission, tenancy
from marlaas.api.http_client import progress_bar
from marlaas.errors import MarlaasError
from marlaas.settings import get_settings
from marlaas.spec import JobSpec
from marlaas.store import JobRecord, Store
from marlaas.types import TERMINAL_STATUSES


class Client:
    """A connection to one marlaas deployment (its Redis)."""

    def __init__(self, url: str | None = None, token: str | None = None):
        self.store = Store(url)
        self.store.check()
        self.tenant = tenancy.resolve(self.store, token or os.environ.get("MARLAAS_TOKEN"))
        """The caller's tenant; None in the single-user default (no tenants registered)."""
        self.limits = access.Limits.from_settings(get_settings())

    def submit(self, spec: JobSpec | dict) -> Job:
        """Validate and enqueue a job; returns its handle."""
        return Job(self, admission.admit(self.store, self.tenant, spec, self.limits))

    def job(self, job_id: str) -> Job:
        self.record(job_id)
        return Job(self, job_id)

    def jobs(self, tenant: str | None = None) -> list[Job]:
        """The caller's jobs (with a token: only its own tenant's; another tenant is not found)."""
        return [Job(self, j) for j in access.job_ids(self.store, self.tenant, tenant)]

    def record(self, job_id: str) -> JobRecord:
        """The job's record if the caller may see it; another tenant's job is simply not found."""
        return access.job(self.store, self.tenant, job_id)


class Job:
    """Handle to one submitted job."""

    def __init__(self, client: Client, job_id: str):
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    @property
    def store(self) -> Store:
        return self.client.store

    def status(self) -> dict:
        """Progress in one dict, the API's job summary (`marlaas.api.access.summary`): `id`, status,
        version/steps, last mean reward and staleness, base/final `exact` and `mean_reward`,
        `grader_errors`, the error; `job` is a deprecated alias of `id`."""
        s = access.summary(self.store, self.client.record(self.id))
        return {**s, "job": s["id"]}

    def wait(self, progress: bool = False, timeout: float | None = None, poll: float = 0.5) -> dict:
        """Block until the job ends; with progress, show a live bar. Returns the final status."""
        deadline = None if timeout is None else time.time() + timeout
        bar = None
        try:
            while True:
                st = self.status()
                if progress:
                    bar = progress_bar(bar, st)
                if st["status"] in TERMINAL_STATUSES:
                    return st
                if deadline is not None and time.time() > deadline:
                    raise MarlaasError(f"job {self.id} still {st['status']} after {timeout:.0f} s")
                self.store.wait_end(self.id, poll)  # returns as soon as the job ends
        finally:
            if bar is not None:
                bar.close()

    def cancel(self) -> None:
        """Stop the job; work in flight for it is dropped."""
        access.cancel(self.store, self.client.record(self.id))

    def metrics(self) -> dict:
        """Per-step training metrics and held-out evaluations by version: `evals[v]` holds exact
        (share of prompts whose greedy completion gets full reward), mean_reward (greedy), n
        (prompts), k (samples per prompt), pass1_sampled, pass_at_k, pass_at ({k: pass@k on
        full-reward samples}), grader_errors, acc (= exact, deprecated), at, and the greedy outputs
        (see `marlaas.verify.evaluation`)."""
        self.client.record(self.id)
        return {"steps": self.store.metrics(self.id), "evals": self.store.evals(self.id)}

    def evals(self) -> list[dict]:
        """The held-out evaluations so far, one row per evaluated version (ascending), without
        outputs: version, exact, mean_reward, pass1_sampled, pass_at_k, k, n, pass_at, grader_errors,
        train_reward (the training curve beside them), acc (= exact, deprecated), at."""
        from marlaas.verify.evaluation import table

        self.client.record(self.id)
        return table(self.store.evals(self.id), self.store.metrics(self.id))

    def download_adapter(self, out_dir: str | Path, version: int | None = None) -> Path:
        """Write a published adapter version (default: the newest) as a PEFT adapter directory."""
        from marlaas.adapters import write_adapter_dir

        _, blob = access.adapter_blob(self.store, self.client.record(self.id), version)
        base = self.store.deployment().get("base")
        return write_adapter_dir(blob, out_dir, base_path=base)
