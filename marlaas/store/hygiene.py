"""The store's hygiene: a finished job's bulk data is deleted after the retention period, or sooner
(oldest ended first) while the store is over its admission share: by the control tick and by a
submit that finds the store full (`marlaas.api.admission.make_room`).

Kept for good: the job record, its metrics, its evaluations (scores and outputs) and the adapters a
tenant may download (the final version and every evaluated one). Deleted: its prompt rows, rollouts
and evaluation rollouts left over, the optimizer state, other adapter versions, its lease index.
Jobs are found through `m:jobs:ended` (set when a job reaches a terminal status), a few per call, so
a collection costs O(jobs collected), never a keyspace scan. The objects of the adapters and optimizer
state deleted go from the artifact store with them (after the Redis transaction: a crash in between
leaves orphans for the sweep, never a reference to a missing object).

A tenant deletes an ended job (`delete_job`: every key and object of it, the bytes freed reported);
the operator deletes a tenant (`delete_tenant`: its jobs, record, token and every object under its prefix).
"""

from __future__ import annotations

from marlaas.errors import Conflict, NotFound
from marlaas.store.blobs import job_owner, ref_or_none, tenant_part
from marlaas.store.keys import (
    ACTIVE,
    ALL,
    ENDED,
    TENANTS,
    TOKENS,
    adapter_key,
    aliases_key,
    ckpt_key,
    eval_key,
    files_key,
    job_key,
    kept_key,
    lease_index_key,
    live_key,
    model_key,
    optim_key,
    queue_key,
    roll_key,
    rows_key,
    state_key,
    stored_key,
    tenant_active_key,
    tenant_key,
    ttl_key,
    verified_key,
)
from marlaas.types import TERMINAL_STATUSES, eval_versions


class HygieneOps:
    """Garbage collection of ended jobs (mixed into marlaas.store.Store)."""

    def collect_garbage(self, now: float, retention_s: float, limit: int = 50) -> list[str]:
        """Delete the bulk data of up to `limit` jobs that ended more than `retention_s` ago; returns
        their ids."""
        due = [x.decode() for x in self.r.zrangebyscore(ENDED, "-inf", now - retention_s, start=0, num=limit)]
        for jid in due:
            gone = [ref_or_none(self.r.hget(optim_key(jid), "ref"))]
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
                            gone.append(ref_or_none(self.r.hget(adapter_key(jid, v), "ref")))
                            p.delete(adapter_key(jid, v))
                            p.zrem(kept_key(jid), str(v))
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
            self.drop(gone, keep=self.job_live_keys(jid))
        return due

    def delete_job(self, jid: str) -> int:
        """Delete an ended job: its record, every key under it and every object it stored; returns the
        bytes freed in the artifact store (Conflict while it has not ended)."""
        status, tenant = (x.decode() if x else None for x in self.r.hmget(job_key(jid), "status", "tenant"))
        if status is None:
            raise NotFound(f"no job {jid!r}")
        if status not in TERMINAL_STATUSES or self.r.sismember(ACTIVE, jid):
            raise Conflict(f"job {jid} has not ended ({status}): cancel it first")
        keys = [job_key(jid), *self.r.scan_iter(match=f"{job_key(jid)}:*", count=1000)]
        p = self.r.pipeline(transaction=True)
        p.delete(*keys)
        p.zrem(ALL, jid)
        p.zrem(ENDED, jid)
        if tenant:
            p.srem(tenant_key(tenant), jid)
            p.srem(tenant_active_key(tenant), jid)
        p.execute()
        return self.drop_prefix(job_owner(tenant, jid) + "/")

    def delete_tenant(self, name: str) -> dict:
        """Delete a tenant with no active job: its jobs, record, token, uploads and every object under
        its prefix. Returns {jobs, bytes_freed}."""
        import json

        if self.r.scard(tenant_active_key(name)):
            raise Conflict(f"tenant {name!r} has active jobs: cancel them first")
        jobs = [x.decode() for x in self.r.smembers(tenant_key(name))]
        freed = sum(self.delete_job(jid) for jid in jobs)
        from marlaas.store.tinker import TinkerStore

        for mid in TinkerStore(self).models(name):
            doomed = [model_key(mid), live_key(mid), ckpt_key(mid), ttl_key(mid), queue_key(mid),
                      *self.r.scan_iter(match=state_key(mid, "*"), count=1000),
                      *self.r.scan_iter(match=f"{job_key(mid)}:*", count=1000)]
            self.r.delete(*doomed)
        rec = self.r.hget(TENANTS, name)
        p = self.r.pipeline(transaction=True)
        if rec is not None:
            p.hdel(TOKENS, json.loads(rec)["token_sha256"])
        p.hdel(TENANTS, name)
        p.delete(tenant_key(name), tenant_active_key(name), stored_key(tenant_part(name)),
                 files_key(tenant_part(name)), aliases_key(tenant_part(name)))
        p.execute()
        freed += self.drop_prefix(f"t/{tenant_part(name)}/")
        self.r.delete(stored_key(tenant_part(name)))
        return {"jobs": len(jobs), "bytes_freed": freed}
