"""The one access policy of every door (the direct `Client`, the HTTP `Service`, the Tinker routes).

Invariants:
- Visibility: a caller with a tenant sees only that tenant's jobs; another tenant's job, and a listing
  of another tenant's jobs, is answered exactly as a missing one (`NotFound`, the same message), so
  ids and tenant names leak nothing. A caller without a tenant (the operator, the single user of a
  deployment without tenants) sees every job.
- Versions: version 0 is the base model (no adapter); a version outside 1..job.version is NotFound.
- Deployment limits come from one place: the deployment record the workers write from their settings
  (`max_lora_rank`), else the value the process edge passed down (`Limits`), read from the same setting.
- The operator credential cannot train through the Tinker door (Forbidden: it has no tenant).
Pure policy over the store's records: no HTTP, no settings read here.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from marlaas.adapters import CONFIG_NAME, WEIGHTS_NAME, write_adapter_dir
from marlaas.errors import Forbidden, NotFound, SpecError
from marlaas.settings import Settings
from marlaas.store import JobRecord, Store
from marlaas.types import TERMINAL_STATUSES, AdapterRef
from marlaas.verify.evaluation import figures


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (its token), the operator, or the open single user (tenant None)."""

    tenant: str | None
    operator: bool = False

    def sees(self, rec: JobRecord) -> bool:
        return visible(self.tenant, rec)


@dataclass(frozen=True)
class Limits:
    """Deployment limits read at a process edge (settings) and passed down to admission and the API."""

    max_lora_rank: int
    """Largest LoRA rank when the deployment record has none yet (MARLAAS_MAX_LORA_RANK)."""
    admission_memory_fraction: float
    """Share of the store's memory cap past which admission refuses new jobs."""

    @classmethod
    def from_settings(cls, s: Settings) -> Limits:
        return cls(max_lora_rank=s.max_lora_rank, admission_memory_fraction=s.admission_memory_fraction)


# ---------------------------------------------------------------- visibility
def visible(tenant: str | None, rec: JobRecord) -> bool:
    """Whether a caller of this tenant (None: every tenant) may see the job."""
    return tenant is None or rec.tenant == tenant


def job(store: Store, tenant: str | None, job_id: str) -> JobRecord:
    """The job's record if the caller may see it; another tenant's job is not found, with the same message."""
    rec = store.job(job_id)  # NotFound(f"no job {job_id!r}")
    if not visible(tenant, rec):
        raise NotFound(f"no job {job_id!r}")
    return rec


def listed_tenant(tenant: str | None, asked: str | None) -> str | None:
    """Whose jobs a listing shows: the caller's own tenant; asking for another is an unknown tenant."""
    if tenant is None:
        return asked
    if asked not in (None, tenant):
        raise NotFound(f"no tenant {asked!r}")
    return tenant


def job_ids(store: Store, tenant: str | None, asked: str | None = None, limit: int | None = None) -> list[str]:
    """The ids of the jobs the caller lists, oldest first (the newest `limit` ones, if given)."""
    ids = store.job_ids(listed_tenant(tenant, asked))
    if limit is None:
        return ids
    return ids[-limit:] if limit > 0 else []


def cancel(store: Store, rec: JobRecord) -> None:
    """Stop a visible job (work in flight is dropped); a job that already ended is left as it is."""
    if rec.status not in TERMINAL_STATUSES:
        store.set_status(rec.id, "cancelled")


def trainer(principal: Principal) -> str:
    """The tenant a Tinker training client acts for ('default' for the open single user)."""
    if principal.operator:
        raise Forbidden("the operator credential cannot train: use a tenant's token as the API key")
    return principal.tenant or "default"


# ---------------------------------------------------------------- versions and archives
def version(rec: JobRecord, v: int | None = None) -> int:
    """A published adapter version of the job (default: the newest); NotFound outside 1..version."""
    v = rec.version if v is None else v
    if v == 0 or rec.version == 0:
        raise NotFound(f"job {rec.id} has no trained adapter yet (version 0 is the base model itself)")
    if v < 0 or v > rec.version:
        raise NotFound(f"job {rec.id} has versions 1..{rec.version}, not {v}")
    return v


def adapter_blob(store: Store, rec: JobRecord, v: int | None = None) -> tuple[int, bytes]:
    """(version, stored adapter blob) of a published version of a visible job."""
    v = version(rec, v)
    return v, store.adapter(AdapterRef(rec.id, v))


def archive(blob: bytes, base: str | None) -> bytes:
    """An adapter blob as tar.gz bytes of a PEFT directory (adapter_config.json and
    adapter_model.safetensors at the archive's top level). The archive leaves the server: its
    `base_model_name_or_path` is the base's name (the last part of `base`, e.g.
    "smollm2-135m-instruct"), never the server's path."""
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="marlaas-adapter-") as tmp:
        name = Path(base).name if base else None
        out = write_adapter_dir(blob, Path(tmp) / "adapter", base_path=name)
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name in (CONFIG_NAME, WEIGHTS_NAME):
                tar.add(out / name, arcname=name)
    return buf.getvalue()


# ---------------------------------------------------------------- deployment limits
def max_lora_rank(store: Store, fallback: int | None = None) -> int:
    """The largest LoRA rank this deployment serves: the deployment record's (written by the workers
    from MARLAAS_MAX_LORA_RANK), else `fallback` (the same setting, read at the caller's edge), else
    that setting's declared default."""
    recorded = store.deployment().get("max_lora_rank")
    if recorded:
        return int(recorded)
    return int(fallback if fallback is not None else Settings.model_fields["max_lora_rank"].default)


def check_lora_rank(store: Store, rank: int, fallback: int | None = None, what: str = "lora.rank") -> None:
    """SpecError when `rank` is over the deployment's largest LoRA rank."""
    top = max_lora_rank(store, fallback)
    if rank > top:
        raise SpecError(f"invalid job spec: {what}: {rank} exceeds the maximum {top}")


# ---------------------------------------------------------------- summaries
def summary(store: Store, rec: JobRecord) -> dict:
    """A job's progress in one dict: status, version/steps, last mean reward and staleness, the base's
    and the final version's held-out `exact` and `mean_reward` (`marlaas.verify.evaluation`; base_acc
    and final_acc are deprecated aliases of the exact figures), error counts (`grader_errors`: the
    completions the grader could not score, in training and in evaluations), the error, times."""
    last = store.last_metrics(rec.id) or {}
    spec = rec.spec
    evals = store.evals_of(rec.id, [0, spec.steps])  # not every evaluation's outputs: a list reads one per job
    base_exact, base_mean = figures(evals.get(0, {}))
    final_exact, final_mean = figures(evals.get(spec.steps, {}))
    train_errors, eval_errors = int(rec.extra.get("verify_errors", 0)), int(rec.extra.get("eval_verify_errors", 0))
    return {
        "id": rec.id,
        "tenant": rec.tenant,
        "task": spec.task or "dataset",
        "status": rec.status,
        "version": rec.version,
        "steps": spec.steps,
        "reward_mean": last.get("reward_mean"),
        "staleness": max(last.get("staleness") or [0]),
        "max_staleness": spec.max_staleness,
        "base_exact": base_exact,
        "final_exact": final_exact,
        "base_mean_reward": base_mean,
        "final_mean_reward": final_mean,
        "base_acc": base_exact,
        "final_acc": final_exact,
        "regenerated": int(rec.extra.get("regenerated", 0)),
        "grader_errors": {"train": train_errors, "eval": eval_errors},
        "verify_errors": train_errors,
        "tool_calls": int(rec.extra.get("tool_calls", 0)),
        "tool_errors": int(rec.extra.get("tool_errors", 0)),
        "error": rec.extra.get("error"),
        "preflight": json.loads(rec.extra["preflight"]) if rec.extra.get("preflight") else None,
        "created": rec.created,
        "updated": float(rec.extra.get("updated") or rec.created),
    }
