"""The Redis store: the only module that knows key names.

Everything a job needs lives here, namespaced by job (and the job records its tenant): the spec,
its prompt rows, rollouts with the adapter version that sampled them, rewards, published adapter
versions and optimizer state, metrics and evaluations. Celery messages carry only IDs.

Key schema (prefix `m:`):
  m:seq                         INCR counter for job ids
  m:jobs:active                 set of job ids the scheduler looks at
  m:jobs:all                    zset job id -> created time
  m:tenant:{t}:jobs             set of a tenant's job ids
  m:job:{j}                     hash: spec, tenant, status, version, dispatched, pass, created, ...
  m:job:{j}:rows:{split}        list of JSON rows (split = train | eval)
  m:job:{j}:roll:{g}            hash of group g: attempt, version, data | r_attempt, rewards |
                                cont = 1 while a tool episode awaits its next model turn
  m:job:{j}:verified            set of group indices verified and not yet trained
  m:job:{j}:eval:{v}            hash of the held-out evaluation of version v (like a rollout)
  m:job:{j}:evals               hash v -> JSON {acc, n, k, pass_at_k, ...} (marlaas.evaluation.summarize)
  m:job:{j}:adapter:{v}         hash: config (JSON), weights (safetensors bytes)
  m:job:{j}:optim               hash: version, data (optimizer state bytes)
  m:job:{j}:metrics             list of JSON, one per published step
  m:leases                      zset work item -> deadline (re-dispatched when expired)
  m:job:{j}:leases              set: the job's lease index, every item it ever leased (a superset of
                                its live leases; set_status drops them without walking m:leases)
  m:gen:inflight                zset generate batch id -> deadline
  m:trainer:lease               JSON {token, job, version, until}: the single trainer lane
  m:events                      list of JSON task events {station, start, end, jobs, worker}
  m:worker:{name}               heartbeat with TTL (dead when the key has expired)
  m:workers                     set of worker names that beat (the registry; dead names pruned on read)
  m:tenants                     hash tenant -> JSON {token_sha256, quotas}  (empty = single-user mode)
  m:tokens                      hash sha256(token) -> tenant
  m:sched:lock / m:sched:kick   scheduler mutex / pending-kick flag
  m:sched:wake                  list (at most one element): a new job asks the control worker for a
                                tick now instead of at the next beat (workers/control.py waits on it)
  m:job:{id}:end                list holding the job's terminal status once it ends (1 h TTL):
                                Job.wait blocks on it instead of polling
  m:sched:vt                    virtual time of the weighted round-robin
  m:sched:jobs                  hash active job -> its status, version, dispatched, pass, created
                                (tab-separated): the scheduling table, re-derived by every write of
                                those fields (store_tick.py)
  m:sched:changes               zset job -> sequence number of its table row's last change
  m:sched:epoch                 the table's epoch (new when the table was rebuilt or the DB flushed)
  m:base:manifest               JSON manifest of the pushed base model {hash, name, files, url}
  m:base:{hash}:file:{path}     list of byte chunks of one base file (absent when pushed by URL)

Invariants kept here: publishing version t+1 is one Lua compare-and-set on t (exactly-once steps);
rewards are accepted only for the rollout attempt they were computed on.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

import redis

from marlaas import store_tick
from marlaas.engines.types import AdapterBlob, AdapterRef
from marlaas.errors import NotFound, StoreUnavailable
from marlaas.settings import get_settings
from marlaas.spec import JobSpec
from marlaas.store_keys import (  # noqa: F401  (re-exported: the store layer's key names)
    ACTIVE,
    ALL,
    BASE_MANIFEST,
    DEPLOYMENT,
    EVAL_KINDS,
    EVENTS,
    GEN_INFLIGHT,
    GROUP_KINDS,
    KICK,
    LEASES,
    LOCK,
    SCHED_CHANGES,
    SCHED_EPOCH,
    SCHED_JOBS,
    TENANTS,
    TOKENS,
    TRAINER,
    VT,
    WAKE,
    WORKERS,
    P,
    adapter_key,
    base_file_key,
    eval_key,
    evals_key,
    item_name,
    job_end_key,
    job_key,
    lease_index_key,
    metrics_key,
    optim_key,
    parse_item,
    roll_key,
    rows_key,
    tenant_key,
    verified_key,
    worker_key,
)
from marlaas.store_tick import TickOps

EVENTS_CAP = 200_000
# Adapter versions kept in the store besides the newest (older ones are deleted on publish);
# the job's final version and version 0 (the base) are always available.
KEEP_VERSIONS_EXTRA = 2


def resolve_url(url: str | None = None) -> str:
    """The Redis URL: explicit, else MARLAAS_REDIS_URL, else the embedded server's recorded URL."""
    if url:
        return url
    s = get_settings()
    if s.redis_url:
        return s.redis_url
    f = s.embedded_dir / "redis.url"
    if f.is_file():
        return f.read_text().strip()
    raise StoreUnavailable(
        "no Redis: start the embedded stack with `marlaas up` or set MARLAAS_REDIS_URL"
    )


@lru_cache(maxsize=8)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)


_PUBLISH = store_tick.SYNC_FN + """
-- KEYS: job, adapter(v+1), optim, trainer lease, verified, metrics, old adapter (or ''),
--       scheduling table, active set, its change log
-- ARGV: t, config, weights, optim, metrics json, lease token, now, n_groups, g1..gn, job id
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if cur ~= tonumber(ARGV[1]) then return 0 end
local nv = cur + 1
redis.call('HSET', KEYS[1], 'version', nv, 'updated', ARGV[7])
redis.call('HSET', KEYS[2], 'config', ARGV[2], 'weights', ARGV[3])
redis.call('HSET', KEYS[3], 'version', nv, 'data', ARGV[4])
redis.call('RPUSH', KEYS[6], ARGV[5])
local n = tonumber(ARGV[8])
for i = 1, n do
  local g = ARGV[8 + i]
  redis.call('SREM', KEYS[5], g)
  redis.call('DEL', KEYS[1] .. ':roll:' .. g)
end
if KEYS[7] ~= '' then redis.call('DEL', KEYS[7]) end
local lease = redis.call('GET', KEYS[4])
if lease and string.find(lease, ARGV[6], 1, true) then redis.call('DEL', KEYS[4]) end
sync_row(KEYS[8], KEYS[9], KEYS[10], KEYS[1], ARGV[9 + n])
return 1
"""

_ACCEPT_REWARDS = """
-- KEYS: roll hash, verified set, leases ; ARGV: attempt, rewards json, g, lease member
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'r_attempt', ARGV[1], 'rewards', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[4])
return 1
"""

_REPLACE_ATTEMPT = """
-- Multi-turn tool episodes: replace a group's data under a new attempt iff it is still at the
-- attempt the caller read (and, if ARGV[4] is set, its cont flag equals it); move its lease.
-- KEYS: roll hash, leases ; ARGV: read attempt, new attempt, data, required cont ('' = any),
--       new cont ('1' or ''), lease to drop, lease to add, its deadline
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'cont') ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], 'attempt', ARGV[2], 'data', ARGV[3])
redis.call('HDEL', KEYS[1], 'r_attempt', 'rewards')
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'cont', '1') else redis.call('HDEL', KEYS[1], 'cont') end
redis.call('ZREM', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[8], ARGV[7])
return 1
"""

_DROP_CONT = """
-- KEYS: roll hash, leases ; ARGV: cont lease. Drop it iff the group awaits no continuation.
if redis.call('HGET', KEYS[1], 'cont') == '1' then return 0 end
return redis.call('ZREM', KEYS[2], ARGV[1])
"""

_CLAIM = """
-- KEYS: trainer lease ; ARGV: token, worker. Adds the worker to the lease, keeping its TTL.
local v = redis.call('GET', KEYS[1])
if not v or not string.find(v, ARGV[1], 1, true) then return 0 end
local d = cjson.decode(v)
d['worker'] = ARGV[2]
redis.call('SET', KEYS[1], cjson.encode(d), 'KEEPTTL')
return 1
"""

_RELEASE = """
local v = redis.call('GET', KEYS[1])
if v and string.find(v, ARGV[1], 1, true) then return redis.call('DEL', KEYS[1]) end
return 0
"""


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


class Store(TickOps):
    """Typed access to the Redis store. Every method is one or a few round trips."""

    def __init__(self, url: str | None = None):
        self.url = resolve_url(url)
        self.r = _client(self.url)
        self._publish = self.r.register_script(_PUBLISH)
        self._accept = self.r.register_script(_ACCEPT_REWARDS)
        self._release = self.r.register_script(_RELEASE)
        self._claim = self.r.register_script(_CLAIM)
        self._replace = self.r.register_script(_REPLACE_ATTEMPT)
        self._drop_cont = self.r.register_script(_DROP_CONT)
        self._init_tick_scripts()

    # ---------------------------------------------------------------- connectivity
    def ping(self) -> bool:
        try:
            return bool(self.r.ping())
        except redis.ConnectionError:
            return False

    def check(self) -> None:
        if not self.ping():
            raise StoreUnavailable(f"Redis at {self.url} does not answer: is the stack up (`marlaas up`)?")

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
        self.sync_rows([jid], pipe=p)  # the scheduling table (store_tick.py)
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
        if status in ("done", "cancelled", "failed"):
            p.srem(ACTIVE, jid)
            self.drop_job_leases(jid, pipe=p)
            p.lpush(job_end_key(jid), status)  # wakes Job.wait (wait_end)
            p.expire(job_end_key(jid), 3600)
        self.sync_rows([jid], pipe=p)  # the scheduling table (store_tick.py)
        p.execute()

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

    # ---------------------------------------------------------------- leases and dispatch
    def lease(self, items: list[str], seconds: float, now: float | None = None, pipe=None) -> None:
        """Lease work items until now + seconds (recorded in each job's lease index too); with
        `pipe`, only queue the writes on that pipeline."""
        if items:
            until = (now or time.time()) + seconds
            p = pipe if pipe is not None else self.r.pipeline(transaction=False)
            p.zadd(LEASES, {i: until for i in items})
            by_job: dict[str, list[str]] = {}
            for i in items:
                by_job.setdefault(i.split("|", 2)[1], []).append(i)
            for j, names in by_job.items():
                p.sadd(lease_index_key(j), *names)
            if pipe is None:
                p.execute()

    def expired_leases(self, now: float) -> list[str]:
        return [x.decode() for x in self.r.zrangebyscore(LEASES, "-inf", now)]

    def leased(self, items: list[str]) -> list[bool]:
        if not items:
            return []
        return [s is not None for s in self.r.zmscore(LEASES, items)]

    def drop_lease(self, *items: str) -> None:
        if items:
            self.r.zrem(LEASES, *items)

    def gen_inflight(self, now: float) -> int:
        self.r.zremrangebyscore(GEN_INFLIGHT, "-inf", now)
        return int(self.r.zcard(GEN_INFLIGHT))

    def add_gen_batch(self, batch_id: str, seconds: float) -> None:
        self.r.zadd(GEN_INFLIGHT, {batch_id: time.time() + seconds})

    def end_gen_batch(self, batch_id: str) -> None:
        self.r.zrem(GEN_INFLIGHT, batch_id)

    def advance_dispatched(self, jid: str, new_total: int) -> None:
        p = self.r.pipeline(transaction=True)
        p.hset(job_key(jid), "dispatched", new_total)
        self.sync_rows([jid], pipe=p)
        p.execute()

    # ---------------------------------------------------------------- rollouts
    def _put_attempt(self, key: str, version: int, data: dict, done: str, next_lease: str, *extra) -> str:
        """Store a (re)generated result under a fresh attempt id: its lease moves from generation
        (`done`) to verification (`next_lease`); `extra` are more pipeline calls to run atomically."""
        attempt = uuid.uuid4().hex
        p = self.r.pipeline(transaction=True)
        p.delete(key)
        p.hset(key, mapping={"attempt": attempt, "version": version, "data": json.dumps(data)})
        for method, *args in extra:
            getattr(p, method)(*args)
        p.zrem(LEASES, done)
        p.zadd(LEASES, {next_lease: time.time() + get_settings().lease_s})
        p.sadd(lease_index_key(parse_item(next_lease)[1]), next_lease)
        p.execute()
        return attempt

    def put_rollout(self, jid: str, g: int, version: int, data: dict) -> str:
        """Store a (re)generated group; invalidates rewards of any earlier attempt. Returns the attempt id."""
        return self._put_attempt(roll_key(jid, g), version, data, item_name("gen", jid, g),
                                 item_name("ver", jid, g), ("srem", verified_key(jid), g))

    def rollout(self, jid: str, g: int) -> dict | None:
        h = self.r.hgetall(roll_key(jid, g))
        if not h:
            return None
        d = {k.decode(): v for k, v in h.items()}
        out = json.loads(d["data"])
        out["attempt"] = d["attempt"].decode()
        out["version"] = int(d["version"])
        if b"rewards" in h and d.get("r_attempt") == d["attempt"]:
            out["rewards"] = json.loads(d["rewards"])
        out["awaiting_cont"] = d.get("cont") == b"1"
        return out

    # Tool episodes (marlaas.agentic): verify hands a group back to generate for its next model turn
    # ("cont" item, dispatched by the scheduler as an expired lease: deadline 0), generate stores the
    # continued group and hands it to verify again. Both are compare-and-set on the attempt read.
    def request_continuation(self, jid: str, g: int, attempt: str, data: dict) -> bool:
        """Verify side: store the group with its tool results pending; lease ver -> cont (due now)."""
        return bool(self._replace(
            keys=[roll_key(jid, g), LEASES],
            args=[attempt, uuid.uuid4().hex, json.dumps(data), "", "1", item_name("ver", jid, g),
                  item_name("cont", jid, g), 0],
        ))

    def put_continuation(self, jid: str, g: int, attempt: str, data: dict) -> bool:
        """Generate side: store the continued group iff it still awaits this continuation; lease
        cont -> ver. False: a duplicate or stale continuation (nothing written)."""
        return bool(self._replace(
            keys=[roll_key(jid, g), LEASES],
            args=[attempt, uuid.uuid4().hex, json.dumps(data), "1", "", item_name("cont", jid, g),
                  item_name("ver", jid, g), time.time() + get_settings().lease_s],
        ))

    def drop_cont_lease(self, jid: str, g: int) -> bool:
        """Drop a continuation's lease iff the group awaits none (a late duplicate or a regenerated
        group); atomic, so a continuation requested meanwhile is never lost."""
        return bool(self._drop_cont(keys=[roll_key(jid, g), LEASES], args=[item_name("cont", jid, g)]))

    def has_adapter(self, ref: AdapterRef) -> bool:
        return ref.version == 0 or bool(self.r.exists(adapter_key(ref.job_id, ref.version)))

    def accept_rewards(self, jid: str, g: int, attempt: str, rewards: dict) -> bool:
        ok = self._accept(
            keys=[roll_key(jid, g), verified_key(jid), LEASES],
            args=[attempt, json.dumps(rewards), g, item_name("ver", jid, g)],
        )
        return bool(ok)

    def verified(self, jid: str, groups: list[int]) -> list[bool]:
        if not groups:
            return []
        return [bool(x) for x in self.r.smismember(verified_key(jid), groups)]

    def invalidate_group(self, jid: str, g: int) -> None:
        """Throw a group away so that it is generated again (counted as regenerated)."""
        p = self.r.pipeline(transaction=True)
        p.delete(roll_key(jid, g))
        p.srem(verified_key(jid), g)
        p.zrem(LEASES, item_name("cont", jid, g))
        p.zadd(LEASES, {item_name("gen", jid, g): 0})
        p.sadd(lease_index_key(jid), item_name("gen", jid, g))
        p.hincrby(job_key(jid), "regenerated", 1)
        p.execute()

    # ---------------------------------------------------------------- evaluation
    def put_eval_rollout(self, jid: str, v: int, data: dict) -> str:
        return self._put_attempt(eval_key(jid, v), v, data, item_name("eval", jid, v), item_name("evalver", jid, v))

    def eval_rollout(self, jid: str, v: int) -> dict | None:
        h = self.r.hgetall(eval_key(jid, v))
        if not h:
            return None
        out = json.loads(h[b"data"])
        out["attempt"] = h[b"attempt"].decode()
        return out

    def put_eval_result(self, jid: str, v: int, result: dict) -> None:
        p = self.r.pipeline(transaction=True)
        p.hset(evals_key(jid), str(v), json.dumps(result))
        p.delete(eval_key(jid, v))
        p.zrem(LEASES, item_name("evalver", jid, v))
        p.execute()

    def evals(self, jid: str) -> dict[int, dict]:
        return {int(k): json.loads(v) for k, v in self.r.hgetall(evals_key(jid)).items()}

    def has_evals(self, jid: str, versions: list[int]) -> list[bool]:
        return [bool(x) for x in self.r.hmget(evals_key(jid), [str(v) for v in versions])]

    # ---------------------------------------------------------------- adapters and training state
    def adapter(self, ref: AdapterRef) -> AdapterBlob:
        cfg, w = self.r.hmget(adapter_key(ref.job_id, ref.version), ["config", "weights"])
        if cfg is None or w is None:
            raise NotFound(f"job {ref.job_id} has no stored adapter version {ref.version}")
        return AdapterBlob(config=json.loads(cfg), weights=w)

    def optimizer_state(self, jid: str) -> tuple[int, bytes] | None:
        v, data = self.r.hmget(optim_key(jid), ["version", "data"])
        if v is None:
            return None
        return int(v), data

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

        The adapter KEEP_VERSIONS_EXTRA + 1 versions back is deleted, unless it is one the job
        evaluates (a multiple of `eval_every`, or the final one): its held-out evaluation may
        still be queued, and it stays downloadable next to its scores."""
        old = t + 1 - KEEP_VERSIONS_EXTRA - 1
        evaluated = old == steps or (eval_every > 0 and old % eval_every == 0)
        old_key = adapter_key(jid, old) if old >= 1 and not evaluated else ""
        ok = self._publish(
            keys=[job_key(jid), adapter_key(jid, t + 1), optim_key(jid), TRAINER, verified_key(jid),
                  metrics_key(jid), old_key, SCHED_JOBS, ACTIVE, SCHED_CHANGES],
            args=[t, json.dumps(adapter.config), adapter.weights, optimizer, json.dumps(metrics),
                  lease_token, time.time(), len(trained_groups), *trained_groups, jid],
        )
        return bool(ok)

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

    # ---------------------------------------------------------------- the tick (heartbeats, workers, the
    # scheduling table, the tick's scripts: store_tick.TickOps)
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
                    _SPECS[k] = spec_from_json(raw.decode())
        return {k[1]: _SPECS[k] for k in key if k in _SPECS}

    # ---------------------------------------------------------------- tenants and tokens
    def add_tenant(self, name: str, token_sha256: str, quotas: dict) -> bool:
        """Register a tenant with its hashed token; False if the name exists."""
        rec = json.dumps({"token_sha256": token_sha256, "quotas": quotas, "created": time.time()})
        if not self.r.hsetnx(TENANTS, name, rec):
            return False
        self.r.hset(TOKENS, token_sha256, name)
        return True

    def tenant_for_token(self, token_sha256: str) -> str | None:
        v = self.r.hget(TOKENS, token_sha256)
        return v.decode() if v is not None else None

    def tenant(self, name: str) -> dict | None:
        v = self.r.hget(TENANTS, name)
        return json.loads(v) if v is not None else None

    def auth_enabled(self) -> bool:
        return bool(self.r.hlen(TENANTS))

    def count_active(self, tenant: str) -> int:
        ids = [x.decode() for x in self.r.smembers(tenant_key(tenant))]
        if not ids:
            return 0
        p = self.r.pipeline(transaction=False)
        for j in ids:
            p.sismember(ACTIVE, j)
        return sum(bool(x) for x in p.execute())

    def set_deployment(self, **info) -> None:
        self.r.hset(DEPLOYMENT, mapping={k: str(v) for k, v in info.items()})

    def deployment(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(DEPLOYMENT).items()}

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

    # ---------------------------------------------------------------- the base model (marlaas/basestore.py)
    def base_manifest(self) -> dict | None:
        raw = self.r.get(BASE_MANIFEST)
        return json.loads(raw) if raw else None

    def set_base_manifest(self, manifest: dict) -> None:
        """Set last, after every file is stored: a worker that sees the manifest finds the files."""
        self.r.set(BASE_MANIFEST, json.dumps(manifest))

    def put_base_file(self, content_hash: str, path: str, chunks) -> None:
        key = base_file_key(content_hash, path)
        self.r.delete(key)
        for chunk in chunks:
            self.r.rpush(key, chunk)

    def base_file_chunks(self, content_hash: str, path: str):
        """The file's chunks one round trip each (a large file never sits in memory whole)."""
        key = base_file_key(content_hash, path)
        for i in range(int(self.r.llen(key))):
            yield self.r.lindex(key, i)

    def delete_base_files(self, content_hash: str) -> int:
        keys = list(self.r.scan_iter(match=f"{P}base:{content_hash}:file:*", count=1000))
        return int(self.r.delete(*keys)) if keys else 0


# (url, job id, created) -> spec: the tick reads each job's spec once per process (Store.job_specs).
_SPECS: dict[tuple[str, str, str], JobSpec] = {}


@lru_cache(maxsize=4096)
def spec_from_json(raw: str) -> JobSpec:
    """Specs are immutable once stored: parse each distinct one once per process."""
    return JobSpec.model_construct(**_revalidate(raw))


def _revalidate(raw: str) -> dict:
    # Stored specs were validated at submit; re-validating here would re-check dataset paths
    # that only the submitting machine has. Rebuild nested models without validation.
    from marlaas.spec import LoraSpec, RLSpec

    d = json.loads(raw)
    d["lora"] = LoraSpec.model_construct(**d["lora"])
    # The rl section checks no paths; validating it builds its tagged unions (loss, importance) and
    # reads specs stored before them (legacy `tis_cap`).
    d["rl"] = RLSpec.model_validate(d["rl"])
    return d
