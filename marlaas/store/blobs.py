"""Large bytes through the store: objects in the artifact store (`marlaas.store.artifacts`), references
and each tenant's running total of stored bytes in Redis.

Owners (the object key's prefix, one per thing that holds bytes): `t/{tenant}/jobs/{job}` (adapter
versions, optimizer states), `t/{tenant}/tinker/{model}` (live weights, checkpoints, sampler
snapshots), `t/{tenant}/tmp/{request}` (Tinker request bodies and results too large for a Redis value),
`t/{tenant}/files` (uploads), `base/{hash}` (the pushed base). The single-user mode's tenant is `_`.

Invariants:
- An object is written completely (`Artifacts.put`) before any reference to it is stored.
- `m:tenant:{t}:stored` is the tenant's bytes in the artifact store: raised when `put` created an
  object, lowered when `drop` deleted one; `sweep` recounts it from the listing (so a crash between a
  write and the count heals) and deletes orphans: objects older than `grace_s` that no reference names
  (written by a process killed before its publish, or whose Redis reference expired).
- An object is deleted only when no reference of its owner names it (`live_keys`): two versions with
  the same bytes share one object, so dropping the older one never takes the newer's bytes.
"""

from __future__ import annotations

import json
import time

from marlaas.store.artifacts import Artifacts, Listed, Ref
from marlaas.store.keys import (
    SWEEP_LOCK,
    adapter_key,
    ckpt_key,
    files_key,
    job_key,
    live_key,
    model_key,
    optim_key,
    state_key,
    stored_key,
)

INLINE_MAX = 256 * 1024
"""A Tinker payload up to this many bytes stays in its Redis hash; a larger one becomes an object."""


def tenant_part(tenant: str | None) -> str:
    return tenant or "_"


def job_owner(tenant: str | None, jid: str) -> str:
    return f"t/{tenant_part(tenant)}/jobs/{jid}"


def tinker_owner(tenant: str | None, mid: str) -> str:
    return f"t/{tenant_part(tenant)}/tinker/{mid}"


def tmp_owner(tenant: str | None, name: str) -> str:
    """A payload's own owner (one per Tinker request: dropping one request's object never takes
    another's, even with the same bytes)."""
    return f"t/{tenant_part(tenant)}/tmp/{name}"


def files_owner(tenant: str | None) -> str:
    return f"t/{tenant_part(tenant)}/files"


def _tenant_of(key: str) -> str | None:
    parts = key.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "t" else None


def ref_or_none(raw) -> Ref | None:
    return Ref.parse(raw) if raw else None


class BlobOps:
    """Objects, references and storage accounting (mixed into marlaas.store.Store; needs `self.r` and
    `self.artifacts`)."""

    artifacts: Artifacts

    def put_blob(self, owner: str, data: bytes) -> Ref:
        """Store `data` under `owner` and count its bytes against the owner's tenant when new."""
        put = self.artifacts.put(owner, data)
        if put.new:
            self._count(put.ref.key, put.ref.size)
        return put.ref

    def put_blob_file(self, owner: str, path, sha256: str | None = None) -> Ref:
        put = self.artifacts.put_file(owner, path, sha256)
        if put.new:
            self._count(put.ref.key, put.ref.size)
        return put.ref

    def blob(self, ref: Ref | str | bytes) -> bytes:
        return self.artifacts.get(ref if isinstance(ref, Ref) else Ref.parse(ref))

    def _count(self, key: str, delta: int) -> None:
        t = _tenant_of(key)
        if t is not None:
            self.r.incrby(stored_key(t), delta)

    def stored_bytes(self, tenant: str | None) -> int:
        return int(self.r.get(stored_key(tenant_part(tenant))) or 0)

    def drop(self, refs: list[Ref], keep: set[str] = frozenset()) -> int:
        """Delete these objects (those whose key is not in `keep`) and lower their tenants' totals;
        returns the bytes freed."""
        gone = {r.key: r.size for r in refs if r is not None and r.key not in keep}
        if not gone:
            return 0
        present = {k: s for k, s in gone.items() if self.artifacts.size(k) is not None}
        self.artifacts.delete(list(present))
        for k, s in present.items():
            self._count(k, -s)
        return sum(present.values())

    def drop_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix` (a job's, a Tinker model's or a tenant's bytes); returns
        the bytes freed."""
        objs = list(self.artifacts.list(prefix))
        self.artifacts.delete([o.key for o in objs])
        for o in objs:
            self._count(o.key, -o.size)
        return sum(o.size for o in objs)

    # ---------------------------------------------------------------- payloads (Tinker bodies, results)
    def spill(self, owner: str, text: str) -> tuple[str, str]:
        """(field suffix, value): the text itself when small, else `_ref` and a reference to an object
        of `owner` (`tmp_owner`)."""
        raw = text.encode()
        if len(raw) <= INLINE_MAX:
            return "", text
        return "_ref", str(self.put_blob(owner, raw))

    def unspill(self, h: dict, field: str) -> str | None:
        if h.get(field + "_ref"):
            return self.blob(h[field + "_ref"]).decode()
        return h.get(field)

    # ---------------------------------------------------------------- uploaded files
    def put_file_record(self, tenant: str, fid: str, path, kind: str, name: str | None) -> None:
        """An upload as an object of the tenant's, then its record (file id -> reference)."""
        ref = self.put_blob_file(files_owner(tenant), path)
        self.r.hset(files_key(tenant_part(tenant)), fid, json.dumps({"ref": str(ref), "kind": kind, "name": name}))

    def file_record(self, tenant: str, fid: str) -> dict | None:
        raw = self.r.hget(files_key(tenant_part(tenant)), fid)
        return json.loads(raw) if raw is not None else None

    def fetch_file(self, rec: dict, dest) -> None:
        self.artifacts.fetch_to(Ref.parse(rec["ref"]), dest)

    def file_live_keys(self, tenant: str) -> set[str]:
        return {Ref.parse(json.loads(v)["ref"]).key for v in self.r.hvals(files_key(tenant))}

    # ---------------------------------------------------------------- checks (chaos runs, benchmarks)
    def missing_objects(self, jid: str) -> list[str]:
        """References of the job (adapter versions, optimizer state) that name no object: always []
        when writes come before their references (`publish`) and deletions after them."""
        return sorted(k for k in self.job_live_keys(jid) if self.artifacts.size(k) is None)

    def sweep_job(self, jid: str, grace_s: float) -> dict:
        """`sweep` over one job's objects only (another deployment's objects in the same place are
        never judged by this Redis's references)."""
        tenant = self.r.hget(job_key(jid), "tenant")
        return self.sweep(grace_s=grace_s, prefix=job_owner(tenant.decode() if tenant else None, jid) + "/")

    # ---------------------------------------------------------------- garbage collection
    def live_keys(self, owner: str) -> set[str] | None:
        """Object keys a reference of `owner` names (None: every object of this owner is kept)."""
        parts = owner.split("/")
        if len(parts) == 4 and parts[2] == "jobs":
            return self.job_live_keys(parts[3])
        if len(parts) == 4 and parts[2] == "tinker":
            return self.tinker_live_keys(parts[3])
        if len(parts) == 3 and parts[2] == "files":
            return self.file_live_keys(parts[1])
        if len(parts) == 2 and parts[0] == "base":
            m = self.base_manifest()
            return None if m is not None and m.get("hash") == parts[1] else set()
        return None

    def tinker_live_keys(self, mid: str) -> set[str]:
        """The object keys the model's references name: live state, checkpoints, sampler snapshots."""
        raw_v = self.r.hget(model_key(mid), "sampler_v")
        names = [(k.decode() if isinstance(k, bytes) else k) for k in self.r.hkeys(ckpt_key(mid))]
        p = self.r.pipeline(transaction=False)
        p.hmget(live_key(mid), "weights", "optimizer")
        for ck in names:
            if ck.startswith("weights/"):
                p.hmget(state_key(mid, ck.split("/", 1)[1]), "weights", "optimizer")
        for v in range(1, int(raw_v or 0) + 1):
            p.hmget(adapter_key(mid, v), "ref")
        return {Ref.parse(x).key for row in p.execute() for x in row if x}

    def sweep_once(self, grace_s: float, lock_s: float) -> dict:
        """`migrate_legacy`, then `sweep`, unless another process is sweeping (one at a time, however
        many control workers)."""
        if not self.r.set(SWEEP_LOCK, "1", nx=True, ex=max(1, int(lock_s))):
            return {"skipped": "another sweep runs"}
        try:
            return {"migrated": self.migrate_legacy(), **self.sweep(grace_s=grace_s)}
        finally:
            self.r.delete(SWEEP_LOCK)

    def migrate_legacy(self) -> int:
        """Move job adapter versions and optimizer states written by an earlier marlaas (bytes in the
        Redis hash: `weights`, `data`) into the artifact store, leaving references; returns how many.
        Until then `adapter` and `optimizer_state` read the old fields."""
        n = 0
        for pattern, field in ((adapter_key("*", "*"), "weights"), (optim_key("*"), "data")):
            for key in self.r.scan_iter(match=pattern, count=1000):
                raw = self.r.hget(key, field)
                if raw is None:
                    continue
                jid = key.decode().split(":")[2]
                tenant = self.r.hget(job_key(jid), "tenant")
                ref = self.put_blob(job_owner(tenant.decode() if tenant else None, jid), raw)
                p = self.r.pipeline(transaction=True)
                p.hset(key, "ref", str(ref))
                p.hdel(key, field)
                p.execute()
                n += 1
        return n

    def sweep(self, now: float | None = None, grace_s: float = 3600.0, tmp_age_s: float = 2 * 86400.0,
              prefix: str = "") -> dict:
        """Delete orphans older than `grace_s` (tmp payloads older than `tmp_age_s`) and recount every
        tenant's stored bytes from the listing. Returns {orphans, bytes_freed, tenants}."""
        now = time.time() if now is None else now
        by_owner: dict[str, list[Listed]] = {}
        for o in self.artifacts.list(prefix):
            by_owner.setdefault(o.key.rsplit("/", 1)[0], []).append(o)
        dead: list[Listed] = []
        totals: dict[str, int] = {}
        for owner, objs in by_owner.items():
            if owner.split("/")[2:3] == ["tmp"]:
                dead += [o for o in objs if o.mtime < now - tmp_age_s]
            else:
                old = [o for o in objs if o.mtime < now - grace_s]
                live = self.live_keys(owner) if old else None
                if live is not None:
                    dead += [o for o in old if o.key not in live]
        gone = {o.key for o in dead}
        self.artifacts.delete(list(gone))
        for objs in by_owner.values():
            for o in objs:
                t = _tenant_of(o.key)
                if t is not None and o.key not in gone:
                    totals[t] = totals.get(t, 0) + o.size
        if not prefix:
            p = self.r.pipeline()
            for k in self.r.scan_iter(match=stored_key("*"), count=1000):
                p.delete(k)
            for t, n in totals.items():
                p.set(stored_key(t), n)
            p.execute()
        return {"orphans": len(dead), "bytes_freed": sum(o.size for o in dead), "tenants": totals}

