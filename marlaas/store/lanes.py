"""The store's adapters, optimizer state and the one trainer lane; the scheduler mutex and kicks.

Invariant kept here: publishing version t+1 is one Lua compare-and-set on t (exactly-once steps).
"""

from __future__ import annotations

import json
import time
import uuid

from marlaas.errors import NotFound
from marlaas.store.artifacts import Ref
from marlaas.store.blobs import job_owner, ref_or_none
from marlaas.store.keys import (
    ACTIVE,
    KICK,
    LOCK,
    SCHED_CHANGES,
    SCHED_JOBS,
    TRAINER,
    adapter_key,
    job_key,
    kept_key,
    metrics_key,
    optim_key,
    verified_key,
)
from marlaas.types import AdapterBlob, AdapterRef

# Adapter versions kept in the store besides the newest (older ones are deleted on publish);
# the job's final version and version 0 (the base) are always available.
KEEP_VERSIONS_EXTRA = 2

class LaneOps:
    """Adapters, publishing, the trainer lease and the scheduler lock (mixed into marlaas.store.Store)."""

    # ---------------------------------------------------------------- adapters and training state
    def adapter(self, ref: AdapterRef) -> AdapterBlob:
        """A stored adapter version: its config from Redis, its weights from the artifact store (checked
        against their sha256). `AdapterBlob.sha256` names exactly the bytes returned."""
        cfg, raw, legacy = self.r.hmget(adapter_key(ref.job_id, ref.version), ["config", "ref", "weights"])
        if cfg is not None and raw is None and legacy is not None:  # written by an earlier marlaas
            return AdapterBlob(config=json.loads(cfg), weights=legacy)
        if cfg is None or raw is None:
            raise NotFound(f"job {ref.job_id} has no stored adapter version {ref.version}")
        obj = Ref.parse(raw)
        return AdapterBlob(config=json.loads(cfg), weights=self.blob(obj), sha256=obj.sha256)

    def adapter_ref(self, ref: AdapterRef) -> Ref | None:
        """The object reference of a stored adapter version (None when not stored)."""
        return ref_or_none(self.r.hget(adapter_key(ref.job_id, ref.version), "ref"))

    def existing_adapters(self, jid: str, versions: list[int]) -> list[int]:
        """Those of `versions` whose adapter is still stored (one pipelined round trip)."""
        p = self.r.pipeline(transaction=False)
        for v in versions:
            p.exists(adapter_key(jid, v))
        return [v for v, ok in zip(versions, p.execute()) if ok]

    def optimizer_state(self, jid: str) -> tuple[int, bytes] | None:
        v, raw, legacy = self.r.hmget(optim_key(jid), ["version", "ref", "data"])
        if v is not None and raw is None and legacy is not None:  # written by an earlier marlaas
            return int(v), legacy
        if v is None or raw is None:
            return None
        return int(v), self.blob(raw)

    def job_live_keys(self, jid: str) -> set[str]:
        """The object keys the job's references name: every stored adapter version and its optimizer
        state. Reads only the versions still kept (`kept_key`), so a publish costs the same at version
        10,000 as at version 10."""
        self._seed_kept(jid)
        versions = self.r.zrange(kept_key(jid), 0, -1)
        p = self.r.pipeline(transaction=False)
        for v in versions:
            p.hget(adapter_key(jid, int(v)), "ref")
        p.hget(optim_key(jid), "ref")
        return {Ref.parse(x).key for x in p.execute() if x}

    def _seed_kept(self, jid: str) -> None:
        """A job published by an earlier marlaas has adapter records but no kept set: build it once
        from the records that exist (every later publish keeps it in step)."""
        version, has_set = self.r.hget(job_key(jid), "version"), self.r.exists(kept_key(jid))
        if has_set or not int(version or 0):
            return
        vs = list(range(1, int(version) + 1))
        kept = self.existing_adapters(jid, vs)
        if kept:
            self.r.zadd(kept_key(jid), {str(v): v for v in kept})

    def publish(
        self,
        jid: str,
        t: int,
        adapter: AdapterBlob,
        optimizer: bytes,
        metrics: dict,
        lease_token: str,
        trained_groups: list[int],
        steps: int,
        eval_every: int = 0,
    ) -> bool:
        """Atomically publish version t+1 iff the job is still at version t (exactly-once).

        The weights and optimizer state are written to the artifact store first; the publish stores
        only their references, in the same compare-and-set as the version. A publish that loses the
        compare-and-set leaves its objects to the sweep (another publish may name the same bytes).
        The adapter KEEP_VERSIONS_EXTRA + 1 versions back is deleted, unless it is one the job
        evaluates (a multiple of `eval_every`, or the final one): its held-out evaluation may
        still be queued, and it stays downloadable next to its scores. The objects the publish
        replaced are deleted once no reference of the job names them."""
        tenant = self.r.hget(job_key(jid), "tenant")
        owner = job_owner(tenant.decode() if tenant else None, jid)
        self._seed_kept(jid)
        w_ref = self.put_blob(owner, adapter.weights)
        o_ref = self.put_blob(owner, optimizer)
        old = t + 1 - KEEP_VERSIONS_EXTRA - 1
        evaluated = old == steps or (eval_every > 0 and old % eval_every == 0)
        old_key = adapter_key(jid, old) if old >= 1 and not evaluated else ""
        out = self._publish(
            keys=[job_key(jid), adapter_key(jid, t + 1), optim_key(jid), TRAINER, verified_key(jid),
                  metrics_key(jid), old_key, SCHED_JOBS, ACTIVE, SCHED_CHANGES, kept_key(jid)],
            args=[t, json.dumps(adapter.config), str(w_ref), str(o_ref), json.dumps(metrics),
                  lease_token, time.time(), len(trained_groups), *trained_groups, jid],
        )
        if not out or not int(out[0]):
            return False
        replaced = [ref_or_none(x) for x in out[1:]]
        if any(replaced):
            self.drop(replaced, keep=self.job_live_keys(jid))
        return True

    def metrics(self, jid: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(metrics_key(jid), 0, -1)]

    # ---------------------------------------------------------------- trainer lane
    def trainer_lease(self) -> dict | None:
        raw = self.r.get(TRAINER)
        return json.loads(raw) if raw else None

    def take_trainer(self, jid: str, version: int, seconds: float) -> str | None:
        token = uuid.uuid4().hex
        val = json.dumps({"token": token, "job": jid, "version": version, "since": time.time()})
        ok = self.r.set(TRAINER, val, nx=True, px=int(seconds * 1000))
        return token if ok else None

    def release_trainer(self, token: str) -> None:
        self._release(keys=[TRAINER], args=[token])

    def claim_trainer(self, token: str, worker: str) -> bool:
        """The train task names the worker holding the lane, so a dead worker's lease can be broken."""
        return bool(self._claim(keys=[TRAINER], args=[token, worker]))

    # ---------------------------------------------------------------- scheduler mutex and kicks
    def acquire_lock(self, seconds: float = 10.0) -> str | None:
        token = uuid.uuid4().hex
        return token if self.r.set(LOCK, token, nx=True, px=int(seconds * 1000)) else None

    def release_lock(self, token: str) -> None:
        self._release(keys=[LOCK], args=[token])

    def want_kick(self) -> bool:
        """True for the first caller since the last tick started: only that one sends a tick."""
        return bool(self.r.set(KICK, "1", nx=True, px=5000))

    def clear_kick(self) -> None:
        self.r.delete(KICK)


