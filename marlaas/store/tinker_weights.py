"""The Tinker models' weights and checkpoints in the store (a mixin of `marlaas.store.tinker.TinkerStore`,
whose docstring holds the key schema): live state, save_state checkpoints, sampler snapshots, their TTLs
and deletion.

The bytes are objects of the artifact store under `t/{tenant}/tinker/{model}` (marlaas/store/blobs.py);
the Redis hashes hold their references.

Invariants: an expired checkpoint reads as a missing one and is deleted when read; its Redis keys carry
the same TTL, so its reference goes even if never read (the sweep then deletes the orphaned object); a
deleted checkpoint's bytes are deleted with it, unless another reference of the model names the same
bytes (`Store.tinker_live_keys`): a state saved from unchanged weights shares the live state's object.
"""

from __future__ import annotations

import json
import time

from marlaas.errors import NotFound
from marlaas.store.blobs import ref_or_none, tinker_owner
from marlaas.store.keys import adapter_key, ckpt_key, live_key, model_key, state_key, ttl_key
from marlaas.types import AdapterBlob


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class TinkerWeights:
    """Needs `self.r` (Redis) and `self.model(tenant, mid)` (NotFound unless the tenant owns it)."""

    r: object
    store: object  # the marlaas.store.Store: its artifact store and accounting (put_blob, blob, drop)

    def model(self, tenant: str | None, mid: str) -> dict[str, str]:
        raise NotImplementedError

    def _owner(self, mid: str) -> str:
        return tinker_owner(_s(self.r.hget(model_key(mid), "tenant")), mid)

    def _put_pair(self, mid: str, weights: bytes, optimizer: bytes) -> dict[str, str]:
        owner = self._owner(mid)
        put = self.store.put_blob
        return {"weights": str(put(owner, weights)), "optimizer": str(put(owner, optimizer))}

    def _pair(self, key: str) -> tuple[bytes, bytes] | None:
        w, o = self.r.hmget(key, "weights", "optimizer")
        return (self.store.blob(w), self.store.blob(o)) if w is not None and o is not None else None

    def put_live(self, mid: str, weights: bytes, optimizer: bytes) -> None:
        """The model's state after an op; the objects of the state it replaced are dropped."""
        old = self.r.hmget(live_key(mid), "weights", "optimizer")
        self.r.hset(live_key(mid), mapping=self._put_pair(mid, weights, optimizer))
        if any(old):
            self.store.drop([ref_or_none(x) for x in old], keep=self.store.tinker_live_keys(mid))

    def live(self, mid: str) -> tuple[bytes, bytes] | None:
        return self._pair(live_key(mid))

    def want_ttl(self, mid: str, ck: str, ttl_s: int | None) -> None:
        """The TTL the client asked for checkpoint `ck` (applied when the op stores it; None: none)."""
        if ttl_s is None:
            self.r.hdel(ttl_key(mid), ck)
        else:
            self.r.hset(ttl_key(mid), ck, int(ttl_s))

    def _ttl(self, mid: str, ck: str) -> int | None:
        raw = self.r.hget(ttl_key(mid), ck)
        return int(raw) if raw is not None else None

    def _record(self, p, mid: str, ck: str, meta: dict, data_key: str) -> None:
        ttl = self._ttl(mid, ck)
        if ttl is not None:
            meta["expires"] = time.time() + ttl
            p.expire(data_key, ttl)
        else:
            p.persist(data_key)
        p.hset(ckpt_key(mid), ck, json.dumps(meta))

    def put_state(self, mid: str, name: str, weights: bytes, optimizer: bytes) -> str:
        ck = f"weights/{name}"
        refs = self._put_pair(mid, weights, optimizer)
        p = self.r.pipeline()
        p.hset(state_key(mid, name), mapping=refs)
        self._record(p, mid, ck, {"type": "training", "time": time.time(), "size": len(weights) + len(optimizer)},
                     state_key(mid, name))
        p.execute()
        return ck

    def _entry(self, mid: str, ck: str) -> dict | None:
        """Checkpoint `ck` of `mid`, None when missing or expired (an expired one is deleted here)."""
        raw = self.r.hget(ckpt_key(mid), ck)
        if raw is None:
            return None
        meta = json.loads(raw)
        if meta.get("expires") is not None and meta["expires"] <= time.time():
            self._delete(mid, ck, meta)
            return None
        return meta

    def state(self, tenant: str | None, mid: str, name: str) -> tuple[bytes, bytes]:
        self.model(tenant, mid)
        pair = self._pair(state_key(mid, name))
        if pair is None or self._entry(mid, f"weights/{name}") is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/weights/{name}'")
        return pair

    def put_sampler_weights(self, mid: str, blob: AdapterBlob, name: str | None) -> int:
        """Store a sampler snapshot as adapter version v of `mid` (served like a job's); returns v."""
        ref = self.store.put_blob(self._owner(mid), blob.weights)
        v = int(self.r.hincrby(model_key(mid), "sampler_v", 1))
        p = self.r.pipeline()
        p.hset(adapter_key(mid, v), mapping={"config": json.dumps(blob.config), "ref": str(ref)})
        if name is not None:
            self._record(p, mid, f"sampler_weights/{name}",
                         {"type": "sampler", "time": time.time(), "size": len(blob.weights), "version": v},
                         adapter_key(mid, v))
        p.execute()
        return v

    def sampler_version(self, tenant: str | None, mid: str, name: str) -> int:
        self.model(tenant, mid)
        meta = self._entry(mid, f"sampler_weights/{name}")
        if meta is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/sampler_weights/{name}'")
        return int(meta["version"])

    def checkpoints(self, tenant: str | None, mid: str) -> list[dict]:
        self.model(tenant, mid)
        out = []
        for k in self.r.hkeys(ckpt_key(mid)):
            meta = self._entry(mid, _s(k))
            if meta is not None:
                out.append({"checkpoint_id": _s(k), **meta})
        return sorted(out, key=lambda c: c["time"])

    def delete_checkpoint(self, tenant: str | None, mid: str, ck: str) -> None:
        """Delete checkpoint `ck` ('weights/<name>' | 'sampler_weights/<name>') and free its bytes."""
        self.model(tenant, mid)
        meta = self._entry(mid, ck)
        if meta is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/{ck}'")
        self._delete(mid, ck, meta)

    def set_checkpoint_ttl(self, tenant: str | None, mid: str, ck: str, ttl_s: int | None) -> None:
        """Expire checkpoint `ck` `ttl_s` seconds from now (None: never)."""
        self.model(tenant, mid)
        meta = self._entry(mid, ck)
        if meta is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/{ck}'")
        data = self._data_key(mid, ck, meta)
        p = self.r.pipeline()
        if ttl_s is None:
            meta.pop("expires", None)
            p.persist(data)
        else:
            meta["expires"] = time.time() + ttl_s
            p.expire(data, ttl_s)
        p.hset(ckpt_key(mid), ck, json.dumps(meta))
        p.execute()

    @staticmethod
    def _data_key(mid: str, ck: str, meta: dict) -> str:
        kind, name = ck.split("/", 1)
        return state_key(mid, name) if kind == "weights" else adapter_key(mid, int(meta["version"]))

    def _delete(self, mid: str, ck: str, meta: dict) -> None:
        data = self._data_key(mid, ck, meta)
        refs = [ref_or_none(x) for x in self.r.hmget(data, "weights", "optimizer", "ref")]
        p = self.r.pipeline()
        p.hdel(ckpt_key(mid), ck)
        p.hdel(ttl_key(mid), ck)
        p.delete(data)
        p.execute()
        self.store.drop(refs, keep=self.store.tinker_live_keys(mid))
