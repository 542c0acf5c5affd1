"""The store's observability: task events, a job's notices to its tenant, metrics reads, queue
depths, base model files."""

from __future__ import annotations

import json
import time

from marlaas.store.keys import (
    BASE_MANIFEST,
    EVENTS,
    job_key,
    metrics_key,
    notices_key,
)

EVENTS_CAP = 200_000
NOTICES_CAP = 1000
"""A job keeps at most this many notices (the newest)."""

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
        p.execute()

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

    def notices(self, jid: str, since: float = 0.0) -> list[dict]:
        """The job's notices after time `since`, oldest first."""
        return [n for n in (json.loads(x) for x in self.r.lrange(notices_key(jid), 0, -1)) if n["at"] > since]

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



