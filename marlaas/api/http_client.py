"""The Python API over HTTP: the surface of `marlaas.api.client` (Client, Job), talking to `marlaas.api.app`.

    from marlaas.api.http_client import Client
    client = Client()                      # MARLAAS_API_URL, else http://127.0.0.1:$MARLAAS_API_PORT
    job = client.submit({"task": "sort", "steps": 40})
    job.wait(progress=True)
    job.download_adapter("alice-sort")

The token is `token=` or MARLAAS_TOKEN (a tenant's, or the operator's). Every error the server sends
is raised as the same class it names (NotFound, SpecError, Unauthorized, RateLimited, ...) with the
server's one-line message. A spec whose `dataset` / `eval_dataset` is a local .jsonl or .parquet
file is uploaded first (POST /v1/files) and sent as the file's id. Adapter archives are extracted
only when every member is a plain file at a relative path without '..'.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

from marlaas.api.settings import ApiSettings
from marlaas.errors import ApiUnavailable, MarlaasError, RateLimited, ServerError, SpecError, by_name
from marlaas.spec import JobSpec
from marlaas.types import TERMINAL_STATUSES

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")  # as marlaas.api.service (the client does not import the server)


class Client:
    """A connection to one marlaas API server."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("MARLAAS_API_URL") or ApiSettings().default_url).rstrip("/")
        self.token = token or os.environ.get("MARLAAS_TOKEN") or None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """One request; an error response is raised as its marlaas error class."""
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ApiUnavailable(f"no marlaas API answers at {self.url} ({type(e).__name__}): start it "
                                 "(`marlaas api`) or set MARLAAS_API_URL") from None
        if r.status_code >= 400:
            raise error_of(r)
        return r

    # ---------------------------------------------------------------- jobs
    def submit(self, spec: JobSpec | dict) -> Job:
        """Validate (server side) and enqueue a job; returns its handle. Local dataset files are
        uploaded first."""
        data = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        for key in ("dataset", "eval_dataset"):
            value = data.get(key)
            if isinstance(value, str | os.PathLike) and not FILE_ID.match(str(value)):
                data[key] = self.upload_file(value)
        return Job(self, self.request("POST", "/v1/jobs", json=data).json()["id"])

    def preflight(self, spec: JobSpec | dict, wait: float = 60.0) -> dict:
        """A learnability check of `spec` instead of training it (the server samples the base on a
        few dozen training prompts and scores them): the status of the preflight record, whose
        `preflight` holds exact, mean_reward, signal and a verdict once done. If it takes over `wait`
        s (at most 60) it is still running: `job(st["id"]).wait()` follows it."""
        data = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        for key in ("dataset", "eval_dataset"):
            value = data.get(key)
            if isinstance(value, str | os.PathLike) and not FILE_ID.match(str(value)):
                data[key] = self.upload_file(value)
        r = self.request("POST", "/v1/jobs", json={**data, "preflight": True}, params={"wait": min(wait, 60.0)},
                         timeout=httpx.Timeout(30.0, read=min(wait, 60.0) + 30.0))
        return _as_status(r.json())

    def job(self, job_id: str) -> Job:
        """The handle of a job the caller may see (NotFound otherwise)."""
        self.request("GET", f"/v1/jobs/{job_id}")
        return Job(self, job_id)

    def jobs(self, tenant: str | None = None) -> list[Job]:
        """The caller's jobs, oldest first (the operator: every tenant's, or `tenant`'s)."""
        params = {"tenant": tenant} if tenant is not None else {}
        return [Job(self, j["id"]) for j in self.request("GET", "/v1/jobs", params=params).json()["jobs"]]

    # ---------------------------------------------------------------- files and tenants
    def upload_file(self, path: str | os.PathLike) -> str:
        """Upload a local .jsonl or .parquet dataset (streamed); returns its file id."""
        p = Path(path)
        if p.is_dir():
            raise SpecError(f"{p.name}: a directory cannot be uploaded; export it to .jsonl or .parquet")
        if not p.is_file():
            raise SpecError(f"dataset file not found: {path}")
        with open(p, "rb") as f:
            r = self.request("POST", "/v1/files", params={"filename": p.name}, content=f,
                             headers={"Content-Type": "application/octet-stream"})
        return r.json()["id"]

    # ---------------------------------------------------------------- graders
    def validate_grader(self, grader: dict) -> dict:
        """The grader as it will run (defaults filled in); SpecError with the first problem otherwise
        (POST /v1/graders/validate)."""
        return self.request("POST", "/v1/graders/validate", json={"grader": grader}).json()["grader"]

    def run_grader(self, grader: dict, output_text: str, item: dict | None = None) -> dict:
        """A dry run of a grader on one completion of one dataset row (POST /v1/graders/run):
        {"reward", "error" (one line or None), "sub_rewards" (a multi grader's, by name)}."""
        body = {"grader": grader, "sample": {"output_text": output_text}, "item": item or {}}
        return self.request("POST", "/v1/graders/run", json=body).json()

    def add_tenant(self, name: str, quotas: dict | None = None) -> str:
        """Register a tenant (operator token only); returns its token."""
        return self.request("POST", "/v1/tenants", json={"name": name, "quotas": quotas}).json()["token"]

    def health(self) -> dict:
        return self.request("GET", "/v1/health").json()


class Job:
    """Handle to one submitted job."""

    def __init__(self, client: Client, job_id: str):
        self.client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _call(self, method: str, what: str = "", **kw) -> Any:
        return self.client.request(method, f"/v1/jobs/{self.id}{what}", **kw).json()

    def status(self) -> dict:
        """Progress in one dict, the API's `GET /v1/jobs/{id}` (`id` names the job; `job` is a
        deprecated alias of it), as `marlaas.api.client.Job.status`."""
        return _as_status(self._call("GET"))

    def cancel(self) -> dict:
        """Stop the job; work in flight for it is dropped."""
        return _as_status(self._call("POST", "/cancel"))

    def pause(self) -> dict:
        """Stop scheduling the job; nothing done so far is lost."""
        return _as_status(self._call("POST", "/pause"))

    def resume(self) -> dict:
        """Schedule a paused job again, from the version it had."""
        return _as_status(self._call("POST", "/resume"))

    def metrics(self) -> dict:
        """{"steps": per-step metrics, "evals": {version: evaluation}} (as `marlaas.api.client.Job.metrics`)."""
        m = self._call("GET", "/metrics")
        return {"steps": m["steps"], "evals": {int(v): e for v, e in m["evals"].items()}}

    def evals(self) -> list[dict]:
        """The held-out evaluations so far, one row per version (ascending), without outputs: exact,
        mean_reward, pass_at / pass_at_k (on full-reward samples), grader_errors, train_reward, ...
        (`marlaas.verify.evaluation.table_row`)."""
        return self._call("GET", "/evals")["evals"]

    def checkpoints(self) -> list[dict]:
        """Versions with a downloadable adapter or an evaluation: {version, adapter, eval}."""
        return self._call("GET", "/checkpoints")["checkpoints"]

    def events(self, after: float | None = None, limit: int = 500) -> dict:
        """One page of the job's timeline after the cursor `after` (see the server's events route)."""
        params: dict[str, Any] = {"limit": limit} | ({"after": after} if after is not None else {})
        return self._call("GET", "/events", params=params, headers={"Accept": "application/json"})

    def wait(self, progress: bool = False, timeout: float | None = None, poll: float = 0.5) -> dict:
        """Block until the job ends, following its event stream (polling every `poll` s while the
        stream cannot be held); with progress, show a live bar. Returns the final status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None

        def show(st: dict) -> None:
            nonlocal bar
            if progress:
                bar = progress_bar(bar, st)

        try:
            while True:
                st = self.status()
                show(st)
                if st["status"] in TERMINAL_STATUSES:
                    return st
                if deadline is not None and time.monotonic() > deadline:
                    raise MarlaasError(f"job {self.id} still {st['status']} after {timeout:.0f} s")
                try:
                    end = self._follow(deadline, show)
                except (httpx.TransportError, ApiUnavailable):
                    time.sleep(poll)  # the stream broke or timed out: poll, then follow again
                    continue
                if end is not None:
                    show(end)
                    return end
        finally:
            if bar is not None:
                bar.close()

    def _follow(self, deadline: float | None, show: Callable[[dict], None]) -> dict | None:
        """Follow the event stream until `end` (returns the final status), the deadline or the stream's
        end (returns None)."""
        left = 20.0 if deadline is None else max(0.5, min(20.0, deadline - time.monotonic()))
        with self.client.http.stream("GET", f"/v1/jobs/{self.id}/events", headers={"Accept": "text/event-stream"},
                                     timeout=httpx.Timeout(10.0, read=left)) as r:
            if r.status_code >= 400:
                r.read()
                raise error_of(r)
            for event, data in _sse_events(r.iter_lines()):
                if event == "error":
                    raise by_name(str(data.get("type")))(data.get("message", "stream error"))
                if event in ("status", "end"):
                    st = _as_status(data)
                    if event == "end":
                        return st
                    show(st)
                if deadline is not None and time.monotonic() > deadline:
                    return None
        return None

    def download_adapter(self, out_dir: str | Path, version: int | None = None) -> Path:
        """Write a published adapter version (default: the newest) as a PEFT adapter directory."""
        v = "latest" if version is None else str(version)
        r = self.client.request("GET", f"/v1/jobs/{self.id}/checkpoints/{v}/adapter")
        return extract_archive(r.content, out_dir)


def extract_archive(data: bytes, out_dir: str | Path) -> Path:
    """Extract a tar.gz into out_dir, refusing any member that is not a plain file at a relative path
    without '..' (nothing is written then)."""
    out = Path(out_dir)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = PurePosixPath(m.name).parts
            if not m.isfile() or m.name.startswith(("/", "\\")) or ".." in parts or not parts \
                    or any(":" in p or "\\" in p for p in parts):
                raise MarlaasError(f"unsafe member {m.name!r} in the adapter archive: nothing extracted")
        out.mkdir(parents=True, exist_ok=True)
        for m in members:
            dest = out.joinpath(*PurePosixPath(m.name).parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            if src is None:
                raise MarlaasError(f"adapter archive member {m.name!r} has no data")
            dest.write_bytes(src.read())
    return out


def error_of(r: httpx.Response) -> MarlaasError:
    """The marlaas error an error response stands for (its envelope's type and message)."""
    try:
        err = r.json()["error"]
        cls, msg = by_name(str(err["type"])), str(err["message"])
    except (ValueError, KeyError, TypeError):
        cls, msg = MarlaasError, f"HTTP {r.status_code} from {r.request.url} (not a marlaas error body)"
    if cls is RateLimited:
        return RateLimited(msg, float(r.headers.get("Retry-After") or 1))
    if cls is MarlaasError and r.status_code >= 500:
        cls = ServerError
    return cls(msg)


def _as_status(d: dict) -> dict:
    """The API's job summary as is (`id` names the job), plus `job`: a deprecated alias of `id`."""
    return {**d, "job": d["id"]}


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    """(event, data) of a server-sent event stream (comments skipped; data is JSON)."""
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


def progress_bar(bar, st: dict):
    """Draw (or start) a job's tqdm bar from its status dict; returns the bar."""
    from tqdm import tqdm

    if bar is None:
        bar = tqdm(total=st["steps"], desc=f"{st['id']} {st['task']}", unit="step")
    bar.n = st["version"]
    r = st["reward_mean"]
    bar.set_postfix_str(
        f"{st['status']} reward={r:.2f} staleness={st['staleness']}" if r is not None else st["status"],
        refresh=False,
    )
    bar.refresh()
    return bar
