"""The tenant-scoped operations the HTTP server performs on the store (server-side code).

Every operation takes the caller's `Principal` (from `Service.authenticate`) and enforces:

- A tenant token sees and changes only its own tenant's jobs and files. Another tenant's job, listing
  or file is answered exactly as a missing one (`NotFound("no job 'j7'")`, `NotFound("no file
  'file-...'")`), so ids leak nothing: the jobs' policy is `marlaas.api.access`, shared with the direct
  client and the Tinker routes.
- The operator credential (a random token in $MARLAAS_HOME/operator_token, mode 0600, made on first
  use) sees every job and is the only one that may add tenants.
- With no tenant registered, a request without a token is the single user of the embedded default
  deployment (it owns every job, as the Python client does then) only when the server was started
  open (`MARLAAS_API_OPEN=1` / `--open`) and the peer is on loopback; otherwise it gets 401. Once a
  tenant exists, every request needs a token.
- A job spec's `dataset` / `eval_dataset` over the API is a list of rows or the id of a file the
  caller uploaded (`file-...`), never a path on the server.

Submitting validates everything before anything is stored (as `marlaas.api.client.Client.submit`):
tenancy and quotas, the base model, the LoRA rank, the rows, the chat template and the context.

Pause and resume (compare-and-set on the status, `Store.transition_status`): a paused job keeps its
place in the active set but the scheduler skips it (only "running" and "evaluating" rows are
scheduled), and stations drop its work in flight without releasing its leases. Nothing stored is
lost: rollouts, rewards, adapters and optimizer state stay, and the expired leases are dispatched
again once the job resumes, at the version it had ("evaluating" when its training was over).
A paused job still counts towards its tenant's active-job quota.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from marlaas.api import access, admission, tenancy
from marlaas.api.access import Limits, Principal
from marlaas.api.datasets_io import NAME_SUFFIX, SUFFIXES, check_upload, remember_name
from marlaas.errors import (
    Conflict,
    Forbidden,
    MarlaasError,
    NotFound,
    SpecError,
    TooLarge,
    Unauthorized,
)
from marlaas.store import KEEP_VERSIONS_EXTRA, JobRecord, Store
from marlaas.types import ACTIVE_STATUSES, JobStatus, eval_versions
from marlaas.verify.evaluation import table_row

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
OPERATOR_TOKEN_FILE = "operator_token"


def operator_token(home: Path) -> str:
    """The operator credential: read from home/operator_token, created there (mode 0600) on first use.
    A file that others can read is refused rather than trusted."""
    path = Path(home) / OPERATOR_TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MarlaasError(f"{path} is readable by others (mode {oct(mode & 0o777)}): chmod 600 it") from None
        token = path.read_text().strip()
        if not token:
            raise MarlaasError(f"{path} is empty: delete it to make a new operator token") from None
        return token
    token = "mo_" + secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class Service:
    """The store as one caller may see it. Stateless but for the operator token; thread-safe."""

    def __init__(self, store: Store, home: Path, limits: Limits, open_single_user: bool = False):
        self.store = store
        self.home = Path(home)
        self.limits = limits
        self.files_dir = self.home / "files"
        self.open_single_user = open_single_user
        self._operator = operator_token(self.home)

    # ---------------------------------------------------------------- who is calling
    def authenticate(self, token: str | None, loopback_peer: bool = True) -> Principal:
        """The caller of a request with this bearer token (None: none sent); Unauthorized otherwise."""
        if token:
            if hmac.compare_digest(token.encode(), self._operator.encode()):
                return Principal(None, operator=True)
            tenant = self.store.tenant_for_token(tenancy.hash_token(token))
            if tenant is None:
                raise Unauthorized("invalid token")
            return Principal(tenant)
        if self.open_single_user and loopback_peer and not self.store.auth_enabled():
            return Principal(None)
        raise Unauthorized("this server needs a token: send 'Authorization: Bearer <token>' "
                           "(a tenant's from `marlaas tenant add`, or the operator's)")

    def add_tenant(self, principal: Principal, name: str, quotas: dict | None = None) -> str:
        """Register a tenant (operator only); returns its token, shown once."""
        if not principal.operator:
            raise Forbidden("only the operator credential can add tenants")
        return tenancy.add_tenant(self.store, name, tenancy.Quotas(**(quotas or {})))

    def usage(self, principal: Principal, tenant: str | None = None) -> dict:
        """The caller's use of its plan (stored bytes, active jobs); the operator names a tenant."""
        name = tenant if principal.operator else principal.tenant
        if name is None or (principal.operator and self.store.tenant(name) is None):
            raise NotFound(f"no tenant {tenant!r}" if principal.operator else "single-user mode has no plan")
        return tenancy.usage(self.store, name)

    def delete_tenant(self, principal: Principal, name: str) -> dict:
        """Delete a tenant with no active job and everything it stored (operator only)."""
        if not principal.operator:
            raise Forbidden("only the operator credential can delete tenants")
        if self.store.tenant(name) is None:
            raise NotFound(f"no tenant {name!r}")
        out = {"tenant": name, **self.store.delete_tenant(name)}
        shutil.rmtree(self.files_dir / name, ignore_errors=True)  # this host's copies of its uploads
        return out

    # ---------------------------------------------------------------- jobs
    def delete(self, principal: Principal, job_id: str) -> dict:
        """Delete an ended job with its adapters, states and data (Conflict while it runs); returns the
        bytes freed in the artifact store."""
        self.record(principal, job_id)
        return {"id": job_id, "deleted": True, "bytes_freed": self.store.delete_job(job_id)}

    def record(self, principal: Principal, job_id: str) -> JobRecord:
        """The job if the caller may see it; another tenant's job is not found, with the same message."""
        return access.job(self.store, principal.tenant, job_id)

    def summary(self, rec: JobRecord) -> dict:
        """Progress in one dict (`access.summary`)."""
        return access.summary(self.store, rec)

    def max_lora_rank(self) -> int:
        """The largest LoRA rank this deployment serves (`access.max_lora_rank`)."""
        return access.max_lora_rank(self.store, self.limits.max_lora_rank)

    def submit(self, principal: Principal, spec_dict: dict) -> dict:
        """Validate and enqueue a job; returns its summary. Nothing is stored when it is refused."""
        if not isinstance(spec_dict, dict):
            raise SpecError("invalid job spec: expected a JSON object")
        spec_dict = dict(spec_dict)
        namespace = self._file_namespace(principal, str(spec_dict.get("tenant") or "default"))
        for key in ("dataset", "eval_dataset"):
            value = spec_dict.get(key)
            if isinstance(value, str):
                if not FILE_ID.match(value):
                    raise SpecError(f"invalid job spec: {key}: give a list of rows or the id of a file uploaded "
                                    "with POST /v1/files (file-...), not a path")
                spec_dict[key] = str(self._file_path(namespace, value))
        jid = admission.admit(self.store, principal.tenant, spec_dict, self.limits)  # the operator: no quotas
        return self.summary(self.store.job(jid))

    def get(self, principal: Principal, job_id: str) -> dict:
        return self.summary(self.record(principal, job_id))

    def list(self, principal: Principal, tenant: str | None = None, limit: int = 1000) -> list[dict]:
        """The caller's jobs, oldest first (at most `limit`, the newest ones); a tenant token asking for
        another tenant is answered as an unknown tenant."""
        out = []
        for jid in access.job_ids(self.store, principal.tenant, tenant, limit):
            try:
                out.append(self.summary(self.store.job(jid)))
            except NotFound:
                continue  # deleted between the listing and the read
        return out

    def cancel(self, principal: Principal, job_id: str) -> dict:
        """Stop the job (work in flight is dropped); a job that already ended is left as it is."""
        access.cancel(self.store, self.record(principal, job_id))
        return self.get(principal, job_id)

    def pause(self, principal: Principal, job_id: str) -> dict:
        """Stop scheduling the job, keeping all its work (see the module docstring); idempotent."""
        self.record(principal, job_id)
        was = self.store.transition_status(job_id, ACTIVE_STATUSES, JobStatus.PAUSED)
        if was is None:
            raise NotFound(f"no job {job_id!r}")
        if was not in (*ACTIVE_STATUSES, JobStatus.PAUSED):
            raise Conflict(f"job {job_id} is {was}: only a running or evaluating job can be paused")
        return self.get(principal, job_id)

    def resume(self, principal: Principal, job_id: str) -> dict:
        """Schedule a paused job again at the version it had; a job already running is left as it is."""
        rec = self.record(principal, job_id)
        to = "evaluating" if rec.version >= rec.spec.steps else "running"
        was = self.store.transition_status(job_id, (JobStatus.PAUSED,), to)
        if was is None:
            raise NotFound(f"no job {job_id!r}")
        if was not in (*ACTIVE_STATUSES, JobStatus.PAUSED):
            raise Conflict(f"job {job_id} is {was}: only a paused job can be resumed")
        return self.get(principal, job_id)

    # ---------------------------------------------------------------- progress
    def events(self, principal: Principal, job_id: str, after: float | None = None, limit: int = 500) -> dict:
        """The job's timeline after time `after` (default: its creation), oldest first, at most `limit`:
        `step` (a published version's metrics), `eval` (a held-out evaluation, without outputs) and
        `task` (a station task that worked on the job: station, start, end; batch-mates are not
        named). `next` is the cursor of the following page; `more` says whether one exists."""
        rec = self.record(principal, job_id)
        since = rec.created if after is None else float(after)
        # Each kind is read a page at a time (at most limit + 1 after `since`; evaluations through their
        # times, `Store.evals_after`): the page's cost does not grow with the job's length (its number of
        # evaluations included) or with other tenants' activity. The first `limit` of the merge
        # lie within the first `limit` of each kind.
        n = max(limit, 1)
        evs = [{"type": "step", "at": m["at"], "data": m} for m in self.store.metrics_after(job_id, since, n + 1)]
        evs += [{"type": "eval", "at": e.get("at") or 0, "data": table_row(v, e)}
                for v, e in self.store.evals_after(job_id, since, n + 1)]
        evs += [{"type": "task", "at": e["end"], "data": e} for e in self.store.job_tasks(job_id, since, n + 1)]
        evs += self.store.notices(job_id, since, n + 1)  # grader_error / warning: what the tenant must be told
        evs.sort(key=lambda e: e["at"])
        page = evs[:n]
        return {"job": job_id, "status": rec.status, "version": rec.version, "events": page,
                "next": page[-1]["at"] if page else since, "more": len(evs) > len(page)}

    def metrics(self, principal: Principal, job_id: str) -> dict:
        """Per-step metrics and the held-out evaluations by version (as `marlaas.api.client.Job.metrics`)."""
        self.record(principal, job_id)
        return {"steps": self.store.metrics(job_id), "evals": self.store.evals(job_id)}

    def evals(self, principal: Principal, job_id: str) -> list[dict]:
        self.record(principal, job_id)
        return [table_row(v, e) for v, e in sorted(self.store.evals(job_id).items())]

    def checkpoints(self, principal: Principal, job_id: str) -> list[dict]:
        """Versions with a stored adapter (the newest few and the evaluated ones: the store deletes the
        others on publish) or an evaluation, ascending: {version, adapter: bool, eval: row or None}."""
        rec = self.record(principal, job_id)
        evals = self.store.evals(job_id)
        newest = range(max(1, rec.version - KEEP_VERSIONS_EXTRA), rec.version + 1)
        scheduled = [v for v in eval_versions(rec.spec.steps, rec.spec.eval_every) if 1 <= v <= rec.version]
        candidates = sorted({*newest, *scheduled, *(v for v in evals if 1 <= v <= rec.version)})
        have = set(self.store.existing_adapters(job_id, candidates))
        return [{"version": v, "adapter": v in have, "eval": table_row(v, evals[v]) if v in evals else None}
                for v in sorted(have | set(evals))]

    def adapter_archive(self, principal: Principal, job_id: str, version: int | None = None) -> tuple[int, bytes]:
        """(version, tar.gz bytes) of a published adapter as a PEFT directory (adapter_config.json and
        adapter_model.safetensors at the archive's top level); default: the newest version."""
        rec = self.record(principal, job_id)
        v, blob = access.adapter_blob(self.store, rec, version)
        return v, access.archive(blob, self.store.deployment().get("base"))

    # ---------------------------------------------------------------- files
    def put_file(self, tenant: str, stream: Iterable[bytes], limit: int, filename: str | None = None) -> str:
        """Store an uploaded JSONL or parquet file and return its id: an object of the artifact store
        (counted in the tenant's stored bytes), recorded in the store, with a copy in this host's
        $MARLAAS_HOME/files/<tenant>/ (another API host fetches its own copy on first use). The size is
        checked while streaming (TooLarge past `limit`, nothing kept); the file must parse as rows
        (objects) whose JSON fits the plan's `max_dataset_bytes` (TooLarge otherwise), read in a
        memory-limited child process (`datasets_io.check_upload`); field names are checked when a
        job uses it."""
        owner = None if tenant == "default" else tenant
        tenancy.check_storage(self.store, owner)
        d = self.files_dir / tenant
        d.mkdir(parents=True, exist_ok=True)
        fid = "file-" + secrets.token_hex(12)
        part = d / f".{fid}.part"
        n, head = 0, b""
        try:
            with open(part, "wb") as f:
                for chunk in stream:
                    n += len(chunk)
                    if n > limit:
                        raise TooLarge(f"the file is over the upload limit of {limit} bytes")
                    if len(head) < 4:
                        head += chunk[:4 - len(head)]
                    f.write(chunk)
            if n == 0:
                raise SpecError("the uploaded file is empty")
            kind = _file_kind(filename, head)
            path = d / f"{fid}.{kind}"
            part.replace(path)
            remember_name(path, filename)  # errors name the file as its user knows it
        finally:
            part.unlink(missing_ok=True)
        try:  # in a memory-limited child, parquet measured by its footer first (datasets_io.check_upload)
            check_upload(path, kind, tenancy.plan_of(self.store, owner).max_dataset_bytes)
        except (SpecError, TooLarge):
            path.unlink(missing_ok=True)
            path.with_suffix(NAME_SUFFIX).unlink(missing_ok=True)
            raise
        self.store.put_file_record(tenant, fid, path, kind, filename)
        return fid

    def file_namespace(self, principal: Principal) -> str:
        """Whose files an upload goes to: the tenant's, or 'default' for the open single user."""
        if principal.operator:
            raise Forbidden("the operator credential has no files: upload with a tenant token")
        return principal.tenant or "default"

    def _file_namespace(self, principal: Principal, spec_tenant: str) -> str:
        # The operator submits for any tenant and may use that tenant's files.
        return spec_tenant if principal.operator else self.file_namespace(principal)

    def _file_path(self, namespace: str, file_id: str) -> Path:
        """The stored file of this id in this namespace; any other is not found, with the same message."""
        if FILE_ID.match(file_id) and re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", namespace):
            for kind in ("jsonl", "parquet"):
                p = self.files_dir / namespace / f"{file_id}.{kind}"
                if p.is_file():
                    return p
            rec = self.store.file_record(namespace, file_id)  # uploaded through another API host
            if rec is not None:
                p = self.files_dir / namespace / f"{file_id}.{rec['kind']}"
                self.store.fetch_file(rec, p)
                remember_name(p, rec.get("name"))
                return p
        raise NotFound(f"no file {file_id!r}")


def _file_kind(filename: str | None, head: bytes) -> str:
    """'jsonl' or 'parquet': by the upload's file name when it has a known suffix, else by content."""
    if filename:
        suffix = Path(filename).suffix.lower()
        if suffix in SUFFIXES:
            return SUFFIXES[suffix]
        if suffix:
            raise SpecError(f"file {Path(filename).name}: unknown format {suffix!r}; upload .jsonl or .parquet")
    return "parquet" if head == b"PAR1" else "jsonl"
