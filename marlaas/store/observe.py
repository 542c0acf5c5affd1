"""The store's observability: task events, a job's notices to its tenant, metrics reads, queue
depths, base model files."""

from __future__ import annotations

import json
import time

from marlaas.store.keys import (
    BASE_MANIFEST,
    EVENTS,
    job_key,
    job_tasks_key,
    metrics_key,
    notices_key,
)

EVENTS_CAP = 200_000
NOTICES_CAP = 1000
"""A job keeps at most this many notices (the newest)."""
JOB_TASKS_CAP = 5000
"""A job keeps the newest this many of its task events (its timeline's `task` entries)."""

class ObserveOps:
    """Events, reads for metrics and reports, the base model's files (mixed into marlaas.store.Store)."""

    # ---------------------------------------------------------------- events and workers
    def record_event(self, station: str, start: float, end: float, jobs: list[str], worker: str,
                     **info) -> None:
        ev = {"station": station, "start": start, "end": end, "jobs": sorted(set(jobs)), "worker": worker}
        ev.update(info)
        p = self.r.pipeline()
        p.rpush(EVENTS, json.dumps(ev))
        p.ltrim(EVENTS, -EVENTS_CAP, -1)
        # each job's own copy, so reading one job's timeline never walks every tenant's events
        mine = json.dumps({"station": station, "start": start, "end": end})
        for j in ev["jobs"]:
            p.rpush(job_tasks_key(j), mine)
            p.ltrim(job_tasks_key(j), -JOB_TASKS_CAP, -1)
        p.execute()

    def list_after(self, key: str, field: str, since: float, count: int) -> list[dict]:
        """The first `count` elements of the list `key` (JSON objects in ascending order of `field`)
        whose `field` is after `since`: O(log n + count) in one script call, whatever the list's length."""
        return [json.loads(x) for x in self._list_after(keys=[key], args=[since, field, count])]

    def job_tasks(self, jid: str, since: float, count: int) -> list[dict]:
        """The job's first `count` task events {station, start, end} that ended after `since`."""
        return self.list_after(job_tasks_key(jid), "end", since, count)

    def metrics_after(self, jid: str, since: float, count: int) -> list[dict]:
        """The job's first `count` published steps' metrics after time `since` (a page of the list)."""
        return self.list_after(metrics_key(jid), "at", since, count)

    def events(self, since: float = 0.0) -> list[dict]:
        evs = [json.loads(x) for x in self.r.lrange(EVENTS, 0, -1)]
        return [e for e in evs if e["end"] >= since]

    # ---------------------------------------------------------------- a job's notices to its tenant
    def add_notice(self, jid: str, kind: str, data: dict, phase: str | None = None, limit: int = 0) -> bool:
        """Tell the job's tenant something (a grader error, a warning): a timeline entry {type: kind,
        at, data}. With `phase`, at most `limit` notices per phase are kept (a counter in the job
        record, `notices:<phase>`): returns False for one over the limit (nothing written)."""
        if phase is not None and not self.claim_notice(jid, phase, limit):
            return False
        p = self.r.pipeline()
        p.rpush(notices_key(jid), json.dumps({"type": kind, "at": time.time(), "data": data}))
        p.ltrim(notices_key(jid), -NOTICES_CAP, -1)
        p.execute()
        return True

    def claim_notice(self, jid: str, phase: str, limit: int) -> bool:
        """Count one notice of `phase` (a counter in the job record, `notices:<phase>`): False once
        `limit` were counted, so a caller acts and tells at most `limit` times per phase."""
        return self.r.hincrby(job_key(jid), f"notices:{phase}", 1) <= limit

    def notices(self, jid: str, since: float = 0.0, count: int = NOTICES_CAP) -> list[dict]:
        """The job's first `count` notices after time `since`, oldest first."""
        return self.list_after(notices_key(jid), "at", since, count)

    # ---------------------------------------------------------------- observability (metrics, reports)
    def last_metrics(self, jid: str) -> dict | None:
        """The newest published step's metrics (one LINDEX, not the whole list)."""
        raw = self.r.lindex(metrics_key(jid), -1)
        return json.loads(raw) if raw else None

    def events_since(self, since: float, chunk: int = 1000) -> list[dict]:
        """Events that ended at or after `since`, read from the log's tail in chunks.

        Events are appended when a task ends, so the log is ordered by end time (up to clock skew
        between hosts): reading stops at the first chunk that starts more than a minute before `since`.
        An event appended between two reads may come back twice; busy fractions (a union) don't mind.
        """
        out: list[dict] = []
        hi = -1
        while True:
            raw = self.r.lrange(EVENTS, hi - chunk + 1, hi)
            if not raw:
                break
            evs = [json.loads(x) for x in raw]
            out = [e for e in evs if e["end"] >= since] + out
            if len(raw) < chunk or evs[0]["end"] < since - 60.0:
                break
            hi -= chunk
        return out

    def memory_use(self) -> tuple[int, int]:
        """(bytes used, the server's maxmemory; 0 = no cap)."""
        info = self.r.info("memory")
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    def over_share(self, share: float) -> tuple[bool, int, int]:
        """(whether the store uses more than `share` of its cap, bytes used, cap); never over without a cap."""
        used, cap = self.memory_use()
        return bool(cap) and used > share * cap, used, cap

    def queue_depths(self, queues: tuple[str, ...] = ("generate", "verify", "train", "control")) -> dict[str, int]:
        """Messages waiting in each Celery queue. Kombu's Redis transport keeps a queue as a Redis list
        named after it, plus one list per non-zero priority step named `queue + "\\x06\\x16" + step`."""
        sep, steps = "\x06\x16", (3, 6, 9)
        p = self.r.pipeline(transaction=False)
        for q in queues:
            p.llen(q)
            for s in steps:
                p.llen(f"{q}{sep}{s}")
        vals = p.execute()
        n = 1 + len(steps)
        return {q: int(sum(vals[i * n:(i + 1) * n])) for i, q in enumerate(queues)}

    # ---------------------------------------------------------------- the base model (marlaas/base/distribution.py)
    def base_manifest(self) -> dict | None:
        raw = self.r.get(BASE_MANIFEST)
        return json.loads(raw) if raw else None

    def set_base_manifest(self, manifest: dict) -> None:
        """Set last, after every file is stored: a worker that sees the manifest finds the files."""
        self.r.set(BASE_MANIFEST, json.dumps(manifest))



