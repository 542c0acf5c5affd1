"""The store's hygiene: a finished job's bulk data is deleted after the retention period, or sooner
(oldest ended first) while the store is over its admission share: by the control tick and by a
submit that finds the store full (`marlaas.api.admission.make_room`).

Kept for good: the job record, its metrics, its evaluations (scores and outputs) and the adapters a
tenant may download (the final version and every evaluated one). Deleted: its prompt rows, rollouts
and evaluation rollouts left over, the optimizer state, other adapter versions, its lease index.
Jobs are found through `m:jobs:ended` (set when a job reaches a terminal status), a few per call, so
a collection costs O(jobs collected), never a keyspace scan.
"""

from __future__ import annotations

from marlaas.store.keys import (
    ENDED,
    adapter_key,
    eval_key,
    job_key,
    lease_index_key,
    optim_key,
    roll_key,
    rows_key,
    verified_key,
)
from marlaas.types import eval_versions


class HygieneOps:
    """Garbage collection of ended jobs (mixed into marlaas.store.Store)."""

    def collect_garbage(self, now: float, retention_s: float, limit: int = 50) -> list[str]:
        """Delete the bulk data of up to `limit` jobs that ended more than `retention_s` ago; returns
        their ids."""
        due = [x.decode() for x in self.r.zrangebyscore(ENDED, "-inf", now - retention_s, start=0, num=limit)]
        for jid in due:
            raw = self.r.hmget(job_key(jid), "spec", "version", "dispatched")
            p = self.r.pipeline(transaction=True)
            if raw[0] is not None:
                from marlaas.store.jobs import spec_from_json

                try:
                    spec = spec_from_json(raw[0].decode())
                except ValueError:
                    spec = None
                version, dispatched = int(raw[1] or 0), int(raw[2] or 0)
                if spec is not None:
                    keep = set(eval_versions(spec.steps, spec.eval_every)) | {version}
                    for v in range(1, version + 1):
                        if v not in keep:
                            p.delete(adapter_key(jid, v))
                    for v in eval_versions(spec.steps, spec.eval_every):
                        p.delete(eval_key(jid, v))
                    first = max(0, (version - spec.max_staleness - 1) * spec.prompts_per_step)
                    for g in range(first, dispatched):
                        p.delete(roll_key(jid, g))
                p.delete(rows_key(jid, "train"), rows_key(jid, "eval"), optim_key(jid), verified_key(jid),
                         lease_index_key(jid))
                p.hset(job_key(jid), "collected", 1)
            p.zrem(ENDED, jid)
            p.execute()
        return due
