"""The store's side of the Tinker protocol: sessions, training models, futures, per-model op queues,
checkpoints and sampling sessions (part of the store layer; the key names are built in marlaas/store/keys.py).

Key schema (prefix `m:tk:`):
  (ids)                         session 'ts-', model 'tk-', sampler 'ss-' and request 'r-' + 16 random
                                URL-safe characters (`secrets`): unguessable, and they count nothing
  m:tk:open:{kind}:{tenant}     zset request id -> created: the tenant's pending futures, kind 'op'
                                (training ops) or 'sample'; bounded by the plan at the door
  m:tk:session:{s}              hash: tenant, created, beat (last heartbeat), ended (finish reason:
                                success|errored|interrupted|expired, first wins), detail
  m:tk:session:{s}:models       set of the session's model ids
  m:tk:model:{m}                hash: tenant, session, base, rank, seed, train_attn/mlp/unembed, alpha,
                                created, sampler_v (last sampler snapshot number), steps, last (last request
                                time); a model made with the SDK's model_seq_id is '{session}:train:{seq}',
                                the id the SDK derives itself, else 'tk-...'
  m:tk:q:{m}                    zset request id -> client seq_id: the model's ops not yet run
  m:tk:fut:{r}                  hash: tenant, model, kind, seq, body (JSON request), status
                                (pending|done|failed), result (JSON), error, category; 1 day TTL once ended
  m:tk:pending:train            set of models with queued ops (the tick sends one train task each)
  m:tk:pending:sample           list of sample request ids (the tick sends them to generate in one task)
  m:tk:live:{m}                 hash: weights, optimizer: the model's state after its last optimizer
                                step or load (any trainer process continues from it)
  m:tk:ckpt:{m}                 hash checkpoint id ("weights/<name>" | "sampler_weights/<name>") -> JSON
                                {type, time, size, version (sampler), expires (Unix time, TTL)}
  m:tk:ttl:{m}                  hash checkpoint id -> TTL seconds the client asked for (applied when stored)
  m:tk:state:{m}:{name}         hash: weights, optimizer (a save_state checkpoint)
  m:tk:sampler:{s}              hash: tenant, base, model_path, model, version ('' = the base model)
  m:job:{m}:adapter:{v}         sampler snapshot v of model m, in the jobs' adapter format, so the
                                generate engines serve it as AdapterRef(m, v)

Invariants: a session that has ended (finished by its client, or expired: no heartbeat for
SESSION_EXPIRY_S) takes no new ops, and its models' queued ops are failed with the reason and leave the
trainer lane's candidates; an expired checkpoint reads as a missing one and its bytes are deleted (the
Redis keys also carry the TTL, so they go even if never read); every read by a caller checks the
tenant, and another tenant's object is answered exactly as a missing one; a model's ops run in its
client's seq_id order (the zset); a future's result is written once (the status moves pending ->
done|failed only).
"""

from __future__ import annotations

import json
import re
import secrets
import time

from marlaas.adapters import default_alpha
from marlaas.errors import Gone, NotFound, SpecError
from marlaas.store.artifacts import Ref
from marlaas.store.blobs import tmp_owner
from marlaas.store.keys import TK, WAKE, future_key, model_key, queue_key, sampler_key, session_key, session_models_key
from marlaas.store.tinker_weights import TinkerWeights

OPEN = TK + "open:"
PENDING_TRAIN = TK + "pending:train"
PENDING_SAMPLE = TK + "pending:sample"
FUTURE_TTL_S = 86_400
SESSION_EXPIRY_S = 300.0  # the SDK heartbeats every 10 s and warns after 120 s without one
PATH = re.compile(r"^tinker://([A-Za-z0-9_.:-]+)/(weights|sampler_weights)/([A-Za-z0-9_.-]+)$")


def parse_path(path: str) -> tuple[str, str, str]:
    """(model id, 'weights'|'sampler_weights', name) of a tinker:// checkpoint path."""
    m = PATH.match(path or "")
    if not m:
        raise SpecError(f"invalid checkpoint path {path!r}: expected tinker://<model>/weights/<name> "
                        "or tinker://<model>/sampler_weights/<name>")
    return m.group(1), m.group(2), m.group(3)


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


class TinkerStore(TinkerWeights):
    """Typed access to the Tinker protocol's keys over a `marlaas.store.Store`'s connection (weights and
    checkpoints: `TinkerWeights`)."""

    def __init__(self, store):
        self.store = store
        self.r = store.r

    def _id(self, prefix: str) -> str:
        # Random, not a counter: a global counter would let one tenant count everyone's activity.
        return f"{prefix}-{secrets.token_urlsafe(12)}"

    @staticmethod
    def _open_key(kind: str, tenant: str) -> str:
        return f"{OPEN}{'sample' if kind == 'sample' else 'op'}:{tenant}"

    def open_count(self, tenant: str, kind: str) -> int:
        """How many of the tenant's futures of `kind` ('sample', or any op kind) are pending. Entries
        older than the futures' TTL are dropped first (a future a crashed worker never ended)."""
        key = self._open_key(kind, tenant)
        p = self.r.pipeline()
        p.zremrangebyscore(key, "-inf", time.time() - FUTURE_TTL_S)
        p.zcard(key)
        return int(p.execute()[1])

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

    def session(self, tenant: str | None, sid: str) -> dict[str, str]:
        """The session's record if `tenant` owns it; NotFound otherwise."""
        return self._owned(session_key(sid), tenant, f"session {sid!r}")

    def heartbeat(self, tenant: str, sid: str) -> str | None:
        """Record a heartbeat; the session's end reason instead when it has ended (no beat recorded)."""
        h = self.session(tenant, sid)
        if h.get("ended"):
            return h["ended"]
        self.r.hset(session_key(sid), "beat", time.time())
        return None

    def end_session(self, sid: str, reason: str, detail: str = "") -> str:
        """End the session (the first reason wins) and release its models' queued ops; the reason kept."""
        if self.r.hsetnx(session_key(sid), "ended", reason):
            self.r.hset(session_key(sid), mapping={"detail": detail[:500], "ended_at": time.time()})
        kept = _s(self.r.hget(session_key(sid), "ended")) or reason
        why = f"session {sid} has ended ({kept}{': ' + detail[:200] if detail else ''}): its queued work was released"
        for mid in sorted(_s(m) for m in self.r.smembers(session_models_key(sid))):
            self.release_model(mid, why)
        return kept

    def session_models(self, sid: str) -> list[str]:
        return sorted(_s(m) for m in self.r.smembers(session_models_key(sid)))

    def ended(self, sid: str) -> str | None:
        return _s(self.r.hget(session_key(sid), "ended"))

    def expire_sessions(self, sids: set[str], now: float | None = None,
                        expiry_s: float = SESSION_EXPIRY_S) -> list[str]:
        """End those of `sids` whose last heartbeat is older than `expiry_s` (reason 'expired')."""
        now = time.time() if now is None else now
        out = []
        for sid in sorted(sids):
            beat, ended = self.r.hmget(session_key(sid), "beat", "ended")
            if beat is not None and ended is None and now - float(beat) > expiry_s:
                self.end_session(sid, "expired", f"no heartbeat for {int(now - float(beat))} s")
                out.append(sid)
        return out

    def create_model(self, tenant: str, session: str, base: str, lora: dict, seq: int | None = None,
                     user_metadata: dict | None = None) -> str:
        """A new model of the session: '{session}:train:{seq}' with the SDK's model_seq_id (the id the
        SDK derives; asked again, the same model), else 'tk-' + random. The client's user_metadata (string
        values) is kept as JSON: its training run shows it (the cookbook records its renderer there)."""
        h = self.session(tenant, session)
        if h.get("ended"):
            raise Gone(f"session {session} has ended ({h['ended']}): create a new ServiceClient")
        mid = f"{session}:train:{int(seq)}" if seq is not None else self._id("tk")
        if seq is not None and self.r.exists(model_key(mid)):
            return mid
        now = time.time()
        p = self.r.pipeline()
        p.hset(model_key(mid), mapping={
            "tenant": tenant, "session": session, "base": base, "rank": int(lora["rank"]),
            "seed": int(lora.get("seed") or 0), "alpha": float(lora.get("alpha") or default_alpha()),
            "train_attn": int(bool(lora.get("train_attn", True))), "train_mlp": int(bool(lora.get("train_mlp", True))),
            "train_unembed": int(bool(lora.get("train_unembed", True))), "created": now, "last": now,
            "sampler_v": 0, "steps": 0,
            "user_metadata": json.dumps({str(k): str(v) for k, v in (user_metadata or {}).items()}),
        })
        p.sadd(session_models_key(session), mid)
        p.execute()
        return mid

    def model(self, tenant: str | None, mid: str) -> dict[str, str]:
        """The model's record if `tenant` owns it (None: any); NotFound otherwise."""
        return self._owned(model_key(mid), tenant, f"model {mid!r}")

    def count_step(self, mid: str) -> int:
        return int(self.r.hincrby(model_key(mid), "steps", 1))

    def models(self, tenant: str | None) -> list[str]:
        out = []
        for key in self.r.scan_iter(match=model_key("*"), count=1000):
            mid = key.decode()[len(model_key("")):]
            if tenant is None or _s(self.r.hget(key, "tenant")) == tenant:
                out.append(mid)
        return sorted(out, key=lambda m: float(_s(self.r.hget(model_key(m), "created")) or 0))

    # ---------------------------------------------------------------- futures
    def new_future(self, tenant: str, kind: str, model: str = "", seq: int = 0, body: dict | None = None,
                   result: dict | None = None) -> str:
        """A future; with `result` it is done at once, else pending (queued by the caller)."""
        rid = self._id("r")
        suffix, text = self.store.spill(tmp_owner(tenant, rid), json.dumps(body or {}))
        mapping = {"tenant": tenant, "kind": kind, "model": model, "seq": seq, "created": time.time(),
                   "body" + suffix: text, "status": "pending" if result is None else "done"}
        if result is not None:
            suffix, text = self.store.spill(tmp_owner(tenant, rid), json.dumps(result))
            mapping["result" + suffix] = text
        p = self.r.pipeline()
        p.hset(future_key(rid), mapping=mapping)
        if result is not None:
            p.expire(future_key(rid), FUTURE_TTL_S)
        else:
            p.zadd(self._open_key(kind, tenant), {rid: mapping["created"]})
            p.expire(self._open_key(kind, tenant), FUTURE_TTL_S)
        p.execute()
        return rid

    def future(self, tenant: str | None, rid: str) -> dict:
        """{status, kind, model, result (parsed) | error, category} if `tenant` owns it; NotFound otherwise."""
        h = self._owned(future_key(rid), tenant, f"request {rid!r}")
        out = {"status": h["status"], "kind": h["kind"], "model": h.get("model") or "", "created": float(h["created"])}
        if h["status"] == "done":
            out["result"] = json.loads(self.store.unspill(h, "result"))
        elif h["status"] == "failed":
            out["error"], out["category"] = h.get("error") or "failed", h.get("category") or "unknown"
        return out

    def request(self, rid: str) -> dict:
        """A pending request's {kind, model, seq, tenant, body} (workers)."""
        h = self._owned(future_key(rid), None, f"request {rid!r}")
        return {"kind": h["kind"], "model": h.get("model") or "", "seq": int(h.get("seq") or 0),
                "tenant": h["tenant"], "status": h["status"], "body": json.loads(self.store.unspill(h, "body") or "{}")}

    def _end(self, rid: str, mapping: dict) -> None:
        status, body_ref, tenant, kind = (_s(x) for x in self.r.hmget(future_key(rid), "status", "body_ref",
                                                                       "tenant", "kind"))
        if status != "pending":
            return  # written once: a cancelled or released future keeps its first end
        p = self.r.pipeline()
        p.zrem(self._open_key(kind or "", tenant or ""), rid)
        p.hset(future_key(rid), mapping=mapping)
        p.hdel(future_key(rid), "body", "body_ref")
        p.expire(future_key(rid), FUTURE_TTL_S)
        p.execute()
        if body_ref:
            self.store.drop([Ref.parse(body_ref)])

    def finish(self, rid: str, result: dict) -> None:
        tenant = _s(self.r.hget(future_key(rid), "tenant"))
        suffix, text = self.store.spill(tmp_owner(tenant, rid), json.dumps(result))
        self._end(rid, {"status": "done", "result" + suffix: text})

    def fail(self, rid: str, error: str, category: str = "user") -> None:
        self._end(rid, {"status": "failed", "error": error, "category": category})

    def cancel(self, tenant: str, rid: str) -> bool:
        """Cancel a queued op or sample (its future fails 'cancelled'); False when it already runs or ended."""
        f = self.future(tenant, rid)
        if f["status"] != "pending":
            return False
        removed = self.r.zrem(queue_key(f["model"]), rid) if f["model"] else self.r.lrem(PENDING_SAMPLE, 0, rid)
        if removed:
            self.fail(rid, "cancelled by the client (cancel_future) before it ran", "user")
        return bool(removed)

    # ---------------------------------------------------------------- queues
    def enqueue_op(self, tenant: str, mid: str, kind: str, seq: int, body: dict) -> str:
        """Queue an op of model `mid` in seq order and ask the control worker to dispatch it (Gone when
        the model's session has ended)."""
        sid = _s(self.r.hget(model_key(mid), "session")) or ""
        if sid and (why := self.ended(sid)):
            raise Gone(f"session {sid} has ended ({why}): model {mid} takes no more requests; "
                       "create a new ServiceClient (create_training_client_from_state resumes a checkpoint)")
        self.r.hset(model_key(mid), "last", time.time())
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

    def lane_candidates(self, now: float | None = None, expiry_s: float = SESSION_EXPIRY_S) -> list[tuple[str, str]]:
        """(model, tenant) of every model with queued training ops: candidates for the one trainer lane,
        in the same weighted round-robin as job steps (the tick picks among them and the jobs). Sessions
        without a heartbeat for `expiry_s` expire first: their models' queued work is released."""
        mids = sorted(_s(m) for m in self.r.smembers(PENDING_TRAIN))
        if not mids:
            return []
        p = self.r.pipeline(transaction=False)
        for m in mids:
            p.hmget(model_key(m), "tenant", "session")
        rows = [(m, _s(t), _s(sid)) for m, (t, sid) in zip(mids, p.execute())]
        self.expire_sessions({sid for _, t, sid in rows if sid}, now=now, expiry_s=expiry_s)
        live = set(_s(m) for m in self.r.smembers(PENDING_TRAIN))
        return [(m, t or "") for m, t, _ in rows if t is not None and m in live]

    def release_model(self, mid: str, why: str) -> int:
        """Fail every queued op of the model with `why` and take it off the candidates; how many."""
        p = self.r.pipeline()
        p.zrange(queue_key(mid), 0, -1)
        p.delete(queue_key(mid))
        p.srem(PENDING_TRAIN, mid)
        rids = p.execute()[0]
        for rid in rids:
            self.fail(_s(rid), why, "user")
        return len(rids)

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
