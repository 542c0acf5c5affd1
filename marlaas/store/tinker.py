"""The store's side of the Tinker protocol: sessions, training models, futures, per-model op queues,
checkpoints and sampling sessions (part of the store layer: the only code that spells these keys).

Key schema (prefix `m:tk:`):
  m:tk:seq                      INCR counter for session, model, sampler and request ids
  m:tk:session:{s}              hash: tenant, created, beat (last heartbeat)
  m:tk:model:{m}                hash: tenant, session, base, rank, seed, train_attn/mlp/unembed, alpha,
                                created, sampler_v (last sampler snapshot number), steps
  m:tk:q:{m}                    zset request id -> client seq_id: the model's ops not yet run
  m:tk:fut:{r}                  hash: tenant, model, kind, seq, body (JSON request), status
                                (pending|done|failed), result (JSON), error, category; 1 day TTL once ended
  m:tk:pending:train            set of models with queued ops (the tick sends one train task each)
  m:tk:pending:sample           list of sample request ids (the tick sends them to generate in one task)
  m:tk:live:{m}                 hash: weights, optimizer: the model's state after its last optimizer
                                step or load (any trainer process continues from it)
  m:tk:ckpt:{m}                 hash checkpoint id ("weights/<name>" | "sampler_weights/<name>") -> JSON
                                {type, time, size, version (sampler)}
  m:tk:state:{m}:{name}         hash: weights, optimizer (a save_state checkpoint)
  m:tk:sampler:{s}              hash: tenant, base, model_path, model, version ('' = the base model)
  m:job:{m}:adapter:{v}         sampler snapshot v of model m, in the jobs' adapter format, so the
                                generate engines serve it as AdapterRef(m, v)

Invariants: every read by a caller checks the tenant, and another tenant's object is answered exactly
as a missing one; a model's ops run in its client's seq_id order (the zset); a future's result is
written once (the status moves pending -> done|failed only).
"""

from __future__ import annotations

import json
import re
import time

from marlaas.adapters import default_alpha
from marlaas.errors import NotFound, SpecError
from marlaas.store.keys import WAKE, P, adapter_key
from marlaas.types import AdapterBlob

TK = P + "tk:"
SEQ = TK + "seq"
PENDING_TRAIN = TK + "pending:train"
PENDING_SAMPLE = TK + "pending:sample"
FUTURE_TTL_S = 86_400
PATH = re.compile(r"^tinker://([A-Za-z0-9_.-]+)/(weights|sampler_weights)/([A-Za-z0-9_.-]+)$")


def parse_path(path: str) -> tuple[str, str, str]:
    """(model id, 'weights'|'sampler_weights', name) of a tinker:// checkpoint path."""
    m = PATH.match(path or "")
    if not m:
        raise SpecError(f"invalid checkpoint path {path!r}: expected tinker://<model>/weights/<name> "
                        "or tinker://<model>/sampler_weights/<name>")
    return m.group(1), m.group(2), m.group(3)


def session_key(s: str) -> str:
    return f"{TK}session:{s}"


def model_key(m: str) -> str:
    return f"{TK}model:{m}"


def queue_key(m: str) -> str:
    return f"{TK}q:{m}"


def future_key(r: str) -> str:
    return f"{TK}fut:{r}"


def live_key(m: str) -> str:
    return f"{TK}live:{m}"


def ckpt_key(m: str) -> str:
    return f"{TK}ckpt:{m}"


def state_key(m: str, name: str) -> str:
    return f"{TK}state:{m}:{name}"


def sampler_key(s: str) -> str:
    return f"{TK}sampler:{s}"


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class TinkerStore:
    """Typed access to the Tinker protocol's keys over a `marlaas.store.Store`'s connection."""

    def __init__(self, store):
        self.store = store
        self.r = store.r

    def _id(self, prefix: str) -> str:
        return f"{prefix}{self.r.incr(SEQ)}"

    def _owned(self, key: str, tenant: str | None, what: str) -> dict[str, str]:
        h = {k.decode(): _s(v) for k, v in self.r.hgetall(key).items()}
        if not h or (tenant is not None and h.get("tenant") != tenant):
            raise NotFound(f"no {what}")
        return h

    # ---------------------------------------------------------------- sessions and models
    def create_session(self, tenant: str) -> str:
        sid = self._id("ts")
        now = time.time()
        self.r.hset(session_key(sid), mapping={"tenant": tenant, "created": now, "beat": now})
        return sid

    def heartbeat(self, tenant: str, sid: str) -> None:
        self._owned(session_key(sid), tenant, f"session {sid!r}")
        self.r.hset(session_key(sid), "beat", time.time())

    def create_model(self, tenant: str, session: str, base: str, lora: dict) -> str:
        self._owned(session_key(session), tenant, f"session {session!r}")
        mid = self._id("tk")
        self.r.hset(model_key(mid), mapping={
            "tenant": tenant, "session": session, "base": base, "rank": int(lora["rank"]),
            "seed": int(lora.get("seed") or 0), "alpha": float(lora.get("alpha") or default_alpha()),
            "train_attn": int(bool(lora.get("train_attn", True))), "train_mlp": int(bool(lora.get("train_mlp", True))),
            "train_unembed": int(bool(lora.get("train_unembed", True))), "created": time.time(),
            "sampler_v": 0, "steps": 0,
        })
        return mid

    def model(self, tenant: str | None, mid: str) -> dict[str, str]:
        """The model's record if `tenant` owns it (None: any); NotFound otherwise."""
        return self._owned(model_key(mid), tenant, f"model {mid!r}")

    def count_step(self, mid: str) -> int:
        return int(self.r.hincrby(model_key(mid), "steps", 1))

    def models(self, tenant: str | None) -> list[str]:
        out = []
        for key in self.r.scan_iter(match=model_key("*"), count=1000):
            mid = key.decode().rsplit(":", 1)[1]
            if tenant is None or _s(self.r.hget(key, "tenant")) == tenant:
                out.append(mid)
        return sorted(out, key=lambda m: int(m[2:]) if m[2:].isdigit() else 0)

    # ---------------------------------------------------------------- futures
    def new_future(self, tenant: str, kind: str, model: str = "", seq: int = 0, body: dict | None = None,
                   result: dict | None = None) -> str:
        """A future; with `result` it is done at once, else pending (queued by the caller)."""
        rid = self._id("r")
        mapping = {"tenant": tenant, "kind": kind, "model": model, "seq": seq, "created": time.time(),
                   "body": json.dumps(body or {}), "status": "pending" if result is None else "done"}
        if result is not None:
            mapping["result"] = json.dumps(result)
        p = self.r.pipeline()
        p.hset(future_key(rid), mapping=mapping)
        if result is not None:
            p.expire(future_key(rid), FUTURE_TTL_S)
        p.execute()
        return rid

    def future(self, tenant: str | None, rid: str) -> dict:
        """{status, kind, model, result (parsed) | error, category} if `tenant` owns it; NotFound otherwise."""
        h = self._owned(future_key(rid), tenant, f"request {rid!r}")
        out = {"status": h["status"], "kind": h["kind"], "model": h.get("model") or "", "created": float(h["created"])}
        if h["status"] == "done":
            out["result"] = json.loads(h["result"])
        elif h["status"] == "failed":
            out["error"], out["category"] = h.get("error") or "failed", h.get("category") or "unknown"
        return out

    def request(self, rid: str) -> dict:
        """A pending request's {kind, model, seq, tenant, body} (workers)."""
        h = self._owned(future_key(rid), None, f"request {rid!r}")
        return {"kind": h["kind"], "model": h.get("model") or "", "seq": int(h.get("seq") or 0),
                "tenant": h["tenant"], "status": h["status"], "body": json.loads(h.get("body") or "{}")}

    def _end(self, rid: str, mapping: dict) -> None:
        p = self.r.pipeline()
        p.hset(future_key(rid), mapping=mapping)
        p.hdel(future_key(rid), "body")
        p.expire(future_key(rid), FUTURE_TTL_S)
        p.execute()

    def finish(self, rid: str, result: dict) -> None:
        self._end(rid, {"status": "done", "result": json.dumps(result)})

    def fail(self, rid: str, error: str, category: str = "user") -> None:
        self._end(rid, {"status": "failed", "error": error, "category": category})

    # ---------------------------------------------------------------- queues
    def enqueue_op(self, tenant: str, mid: str, kind: str, seq: int, body: dict) -> str:
        """Queue an op of model `mid` in seq order and ask the control worker to dispatch it."""
        rid = self.new_future(tenant, kind, mid, seq, body)
        p = self.r.pipeline()
        p.zadd(queue_key(mid), {rid: seq})
        p.sadd(PENDING_TRAIN, mid)
        p.lpush(WAKE, "tinker")
        p.ltrim(WAKE, 0, 0)
        p.execute()
        return rid

    def enqueue_sample(self, tenant: str, body: dict) -> str:
        rid = self.new_future(tenant, "sample", "", 0, body)
        p = self.r.pipeline()
        p.rpush(PENDING_SAMPLE, rid)
        p.lpush(WAKE, "tinker")
        p.ltrim(WAKE, 0, 0)
        p.execute()
        return rid

    def take_samples(self, max_samples: int = 64) -> list[str]:
        """Pending sample request ids, removed from the pending list atomically."""
        p = self.r.pipeline()
        p.lrange(PENDING_SAMPLE, 0, max_samples - 1)
        p.ltrim(PENDING_SAMPLE, max_samples, -1)
        samples, _ = p.execute()
        return [_s(s) for s in samples]

    def lane_candidates(self) -> list[tuple[str, str]]:
        """(model, tenant) of every model with queued training ops: candidates for the one trainer lane,
        in the same weighted round-robin as job steps (the tick picks among them and the jobs)."""
        mids = sorted(_s(m) for m in self.r.smembers(PENDING_TRAIN))
        if not mids:
            return []
        p = self.r.pipeline(transaction=False)
        for m in mids:
            p.hget(model_key(m), "tenant")
        return [(m, _s(t) or "") for m, t in zip(mids, p.execute()) if t is not None]

    def take_model(self, mid: str) -> None:
        """The tick gave the lane to this model: off the pending set until its task puts it back."""
        self.r.srem(PENDING_TRAIN, mid)

    def mark_pending(self, mid: str) -> None:
        self.r.sadd(PENDING_TRAIN, mid)

    def next_op(self, mid: str) -> str | None:
        """Pop the model's op with the lowest seq_id (None when its queue is empty)."""
        got = self.r.zpopmin(queue_key(mid), 1)
        return _s(got[0][0]) if got else None

    def queue_length(self, mid: str) -> int:
        return int(self.r.zcard(queue_key(mid)))

    # ---------------------------------------------------------------- weights
    def put_live(self, mid: str, weights: bytes, optimizer: bytes) -> None:
        self.r.hset(live_key(mid), mapping={"weights": weights, "optimizer": optimizer})

    def live(self, mid: str) -> tuple[bytes, bytes] | None:
        w, o = self.r.hmget(live_key(mid), "weights", "optimizer")
        return (w, o) if w is not None else None

    def put_state(self, mid: str, name: str, weights: bytes, optimizer: bytes) -> str:
        ck = f"weights/{name}"
        p = self.r.pipeline()
        p.hset(state_key(mid, name), mapping={"weights": weights, "optimizer": optimizer})
        p.hset(ckpt_key(mid), ck, json.dumps({"type": "training", "time": time.time(),
                                              "size": len(weights) + len(optimizer)}))
        p.execute()
        return ck

    def state(self, tenant: str | None, mid: str, name: str) -> tuple[bytes, bytes]:
        self.model(tenant, mid)
        w, o = self.r.hmget(state_key(mid, name), "weights", "optimizer")
        if w is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/weights/{name}'")
        return w, o

    def put_sampler_weights(self, mid: str, blob: AdapterBlob, name: str | None) -> int:
        """Store a sampler snapshot as adapter version v of `mid` (served like a job's); returns v."""
        v = int(self.r.hincrby(model_key(mid), "sampler_v", 1))
        p = self.r.pipeline()
        p.hset(adapter_key(mid, v), mapping={"config": json.dumps(blob.config), "weights": blob.weights})
        if name is not None:
            p.hset(ckpt_key(mid), f"sampler_weights/{name}",
                   json.dumps({"type": "sampler", "time": time.time(), "size": len(blob.weights), "version": v}))
        p.execute()
        return v

    def sampler_version(self, tenant: str | None, mid: str, name: str) -> int:
        self.model(tenant, mid)
        raw = self.r.hget(ckpt_key(mid), f"sampler_weights/{name}")
        if raw is None:
            raise NotFound(f"no checkpoint 'tinker://{mid}/sampler_weights/{name}'")
        return int(json.loads(raw)["version"])

    def checkpoints(self, tenant: str | None, mid: str) -> list[dict]:
        self.model(tenant, mid)
        out = [{"checkpoint_id": _s(k), **json.loads(v)} for k, v in self.r.hgetall(ckpt_key(mid)).items()]
        return sorted(out, key=lambda c: c["time"])

    # ---------------------------------------------------------------- sampling sessions
    def create_sampler(self, tenant: str, base: str, model_path: str | None, model: str | None,
                       version: int | None) -> str:
        sid = self._id("ss")
        self.r.hset(sampler_key(sid), mapping={"tenant": tenant, "base": base, "model_path": model_path or "",
                                               "model": model or "", "version": "" if version is None else version})
        return sid

    def sampler(self, tenant: str | None, sid: str) -> dict:
        h = self._owned(sampler_key(sid), tenant, f"sampler {sid!r}")
        return {"base": h["base"], "model_path": h.get("model_path") or None, "model": h.get("model") or None,
                "version": int(h["version"]) if h.get("version") else None}
