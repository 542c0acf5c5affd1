"""The store's job records: create, read, status, rows, and the tick's per-process spec cache."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache

import redis

from marlaas.errors import NotFound
from marlaas.spec import JobSpec
from marlaas.store import slots
from marlaas.store.keys import (
    ACTIVE,
    ALL,
    ENDED,
    VT,
    WAKE,
    P,
    job_end_key,
    job_key,
    rows_key,
    tenant_active_key,
    tenant_key,
)
from marlaas.types import TERMINAL_STATUSES


@dataclass
class JobRecord:
    """A job as the store holds it (the spec plus mutable progress)."""

    id: str
    spec: JobSpec
    tenant: str
    status: str
    version: int
    dispatched: int
    created: float
    extra: dict = field(default_factory=dict)

log = logging.getLogger("marlaas.store")

MAX_FAILURES = 3
"""A station error counted this many times on one job fails that job (and only it)."""


class JobOps:
    """Jobs and their rows (mixed into marlaas.store.Store)."""

    # ---------------------------------------------------------------- jobs
    def create_job(self, spec: JobSpec, train_rows: list[dict], eval_rows: list[dict],
                   info: dict[str, str] | None = None) -> str:
        """Store a validated job with its rows atomically; returns the job id. `info`: extra
        string fields of the job record (e.g. how its prompts were rendered), shown in `extra`."""
        jid = f"j{self.r.incr(P + 'seq')}"
        now = time.time()
        vt = float(self.r.get(VT) or 0.0)
        p = self.r.pipeline(transaction=True)
        p.hset(
            job_key(jid),
            mapping={
                "spec": spec.model_dump_json(exclude={"dataset", "eval_dataset"}),
                "tenant": spec.tenant,
                "status": "running",
                "version": 0,
                "dispatched": 0,
                "pass": vt,
                "created": now,
                "updated": now,
                "regenerated": 0,
                "verify_errors": 0,
                **(info or {}),
            },
        )
        p.rpush(rows_key(jid, "train"), *[json.dumps(r) for r in train_rows])
        p.rpush(rows_key(jid, "eval"), *[json.dumps(r) for r in eval_rows])
        p.sadd(ACTIVE, jid)
        p.zadd(ALL, {jid: now})
        p.sadd(tenant_key(spec.tenant), jid)
        p.sadd(tenant_active_key(spec.tenant), jid)
        self.sync_rows([jid], pipe=p)  # the scheduling table (tick.py)
        p.lpush(WAKE, jid)  # the control worker ticks now (a new job waits for no beat)
        p.ltrim(WAKE, 0, 0)
        p.execute()
        return jid

    def job_ids(self, tenant: str | None = None) -> list[str]:
        if tenant is not None:
            ids = [x.decode() for x in self.r.smembers(tenant_key(tenant))]
            return sorted(ids, key=lambda s: int(s[1:]))
        return [x.decode() for x in self.r.zrange(ALL, 0, -1)]

    def active_job_ids(self) -> list[str]:
        return sorted((x.decode() for x in self.r.smembers(ACTIVE)), key=lambda s: int(s[1:]))

    def job(self, jid: str) -> JobRecord:
        h = self.r.hgetall(job_key(jid))
        if not h:
            raise NotFound(f"no job {jid!r}")
        d = {k.decode(): v.decode() for k, v in h.items()}
        return JobRecord(
            id=jid,
            spec=spec_from_json(d.pop("spec")),
            tenant=d.pop("tenant"),
            status=d.pop("status"),
            version=int(d.pop("version")),
            dispatched=int(d.pop("dispatched")),
            created=float(d.pop("created")),
            extra=d,
        )

    def spec(self, jid: str) -> JobSpec:
        raw = self.r.hget(job_key(jid), "spec")
        if raw is None:
            raise NotFound(f"no job {jid!r}")
        return spec_from_json(raw.decode())

    def job_fields(self, jid: str, *names: str) -> list[str | None]:
        vals = self.r.hmget(job_key(jid), names)
        return [v.decode() if v is not None else None for v in vals]

    def set_status(self, jid: str, status: str, error: str | None = None) -> None:
        m = {"status": status, "updated": time.time()}
        if error:
            m["error"] = error[:500]
        p = self.r.pipeline()
        p.hset(job_key(jid), mapping=m)
        if status in TERMINAL_STATUSES:
            tenant = self.r.hget(job_key(jid), "tenant")
            if tenant is not None:
                p.srem(tenant_active_key(tenant.decode()), jid)
            p.srem(ACTIVE, jid)
            p.zadd(ENDED, {jid: time.time()}, nx=True)  # its bulk data goes after the retention period
            self.drop_job_leases(jid, pipe=p)
            p.lpush(job_end_key(jid), status)  # wakes Job.wait (wait_end)
            p.expire(job_end_key(jid), 3600)
        self.sync_rows([jid], pipe=p)  # the scheduling table (tick.py)
        p.execute()
        if status in TERMINAL_STATUSES and tenant is not None and not self.r.scard(tenant_active_key(tenant.decode())):
            slots.forget(self.r, tenant.decode())

    def transition_status(self, jid: str, allowed: tuple[str, ...], status: str) -> str | None:
        """Set a non-terminal `status` iff the job's current one is in `allowed` (compare-and-set,
        WATCH/MULTI); returns the status it had before (unchanged when not in `allowed`), None when
        there is no such job. Pause and resume use it, so they never revive a job that ended meanwhile."""
        key = job_key(jid)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(key)
                    cur = p.hget(key, "status")
                    if cur is None or cur.decode() not in allowed:
                        p.unwatch()
                        return None if cur is None else cur.decode()
                    p.multi()
                    p.hset(key, mapping={"status": status, "updated": time.time()})
                    self.sync_rows([jid], pipe=p)  # the scheduling table (tick.py)
                    p.execute()
                    return cur.decode()
                except redis.WatchError:
                    continue  # the job changed between the read and the write: read it again

    def wait_end(self, jid: str, timeout: float) -> str | None:
        """Block up to `timeout` s for the job's terminal status (set_status announces it); None if
        it has not ended. The marker is put back, so every waiter sees it."""
        got = self.r.blpop([job_end_key(jid)], timeout=max(timeout, 0.01))
        if got is None:
            return None
        p = self.r.pipeline()
        p.lpush(job_end_key(jid), got[1])
        p.expire(job_end_key(jid), 3600)
        p.execute()
        return got[1].decode()

    def wait_wake(self, timeout: float) -> bool:
        """Block up to `timeout` s for a new job's wake-up call (create_job); True if one came."""
        return self.r.blpop([WAKE], timeout=max(timeout, 0.01)) is not None

    def incr_field(self, jid: str, name: str, by: int = 1) -> int:
        return int(self.r.hincrby(job_key(jid), name, by))

    def count_failure(self, jid: str, station: str, err: BaseException) -> None:
        """Count a station error for one job; after MAX_FAILURES the job (only that job) fails, with
        the reason in its status."""
        n = self.incr_field(jid, f"{station}_errors")
        log.error("job %s: %s error %d/%d: %s", jid, station, n, MAX_FAILURES, err)
        if n >= MAX_FAILURES:
            self.set_status(jid, "failed", f"{station} failed {n} times: {type(err).__name__}: {err}")

    # ---------------------------------------------------------------- rows
    def row(self, jid: str, split: str, idx: int) -> dict:
        raw = self.r.lindex(rows_key(jid, split), idx)
        if raw is None:
            raise NotFound(f"job {jid} has no {split} row {idx}")
        return json.loads(raw)

    def rows(self, jid: str, split: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(rows_key(jid, split), 0, -1)]

    def n_rows(self, jid: str, split: str) -> int:
        return int(self.r.llen(rows_key(jid, split)))

    # ---------------------------------------------------------------- the tick (heartbeats, workers, the
    # scheduling table, the tick's scripts: tick.TickOps)
    def job_specs(self, jobs: list[tuple[str, str]]) -> dict[str, JobSpec]:
        """Specs of (job id, created) pairs; each is read from Redis once per process (a spec never
        changes; `created` tells a job apart from an earlier one of the same id in a flushed DB)."""
        key = [(self.url, j, c) for j, c in jobs]
        missing = [k for k in key if k not in _SPECS]
        if missing:
            p = self.r.pipeline(transaction=False)
            for _, j, _ in missing:
                p.hget(job_key(j), "spec")
            for k, raw in zip(missing, p.execute()):
                if raw is not None:
                    if len(_SPECS) >= 100_000:
                        _SPECS.clear()
                    try:
                        _SPECS[k] = spec_from_json(raw.decode())
                    except (ValueError, TypeError, KeyError) as e:  # forged or corrupt: skip, never fatal
                        why = " ".join(str(e).split())[:300]
                        log.error("job %s: stored spec is invalid, not scheduled: %s", k[1], why)
        return {k[1]: _SPECS[k] for k in key if k in _SPECS}


# (url, job id, created) -> spec: the tick reads each job's spec once per process (Store.job_specs).
_SPECS: dict[tuple[str, str, str], JobSpec] = {}


@lru_cache(maxsize=4096)
def spec_from_json(raw: str) -> JobSpec:
    """A stored spec, validated again (workers never trust what they read from the store: a spec
    written past the API is refused here); specs are immutable, so each distinct one is parsed once
    per process. The rows were stored apart at submit (the spec keeps no `dataset`): validation runs
    with a stand-in row so a dataset job's spec passes the task-or-dataset rule, and the result keeps
    no dataset. Raises ValueError on an invalid spec."""
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("a stored spec must be a JSON object")
    probe = dict(d)
    if probe.get("task") is None:  # a stand-in row in the job's own column names
        probe["dataset"] = [{probe.get("prompt_field") or "prompt": "-", probe.get("answer_field") or "answer": "-"}]
    spec = JobSpec.model_validate(probe)
    return spec if d.get("task") is not None else spec.model_copy(update={"dataset": None})
