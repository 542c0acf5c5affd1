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
  m:job:{j}:evals               hash v -> JSON {exact, mean_reward, n, k, pass_at_k, ...} (evaluation.summarize)
  m:job:{j}:evaltimes           zset v -> when its evaluation was stored (`at`): evals paged by time
  m:job:{j}:adapter:{v}         hash: config (JSON), ref (the safetensors bytes' object, artifacts.Ref)
  m:job:{j}:optim               hash: version, ref (the optimizer state's object)
  m:job:{j}:metrics             list of JSON, one per published step
  m:job:{j}:notices             list of JSON {type, at, data}: what the job's tenant is told (grader errors,
                                warnings), capped; kept with the metrics
  m:job:{j}:tasks               list of JSON {station, start, end}: the station tasks that worked on the
                                job (its own copy of m:events, capped), read a page at a time
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
  m:verifiers                   hash registered verifier name -> package.module:function (operator's)
  m:sched:lock / m:sched:kick   scheduler mutex / pending-kick flag
  m:sched:wake                  list (at most one element): a new job asks the control worker for a
                                tick now instead of at the next beat (workers/control.py waits on it)
  m:job:{id}:end                list holding the job's terminal status once it ends (1 h TTL):
                                Job.wait blocks on it instead of polling
  m:sched:vt                    virtual time of the weighted round-robin
  m:sched:jobs                  hash active job -> its status, version, dispatched, pass, created
                                (tab-separated): the scheduling table, re-derived by every write of
                                those fields (tick.py)
  m:sched:changes               zset job -> sequence number of its table row's last change
  m:sched:epoch                 the table's epoch (new when the table was rebuilt or the DB flushed)
  m:base:manifest               JSON manifest of the pushed base model {hash, name, files: {path: {sha256,
                                size, ref}}, url}: the files are objects of the artifact store
  m:tenant:{t}:stored           the tenant's bytes in the artifact store (blobs.py)
  m:tenant:{t}:files            hash file id -> JSON {ref, kind, name}: the tenant's uploads

Bytes never ride in Redis: adapter weights, optimizer states, Tinker weights and large payloads, base
files and uploads are objects of the artifact store (`self.artifacts`, marlaas/store/artifacts.py),
written completely before the reference naming them is stored; no Redis value is over 1 MiB.

Invariants kept here: publishing version t+1 is one Lua compare-and-set on t (exactly-once steps);
rewards are accepted only for the rollout attempt they were computed on.
"""

from __future__ import annotations

from functools import lru_cache

import redis

from marlaas.errors import StoreUnavailable, redact_url
from marlaas.settings import get_settings
from marlaas.store import scripts
from marlaas.store.artifacts import Artifacts, open_artifacts
from marlaas.store.blobs import BlobOps
from marlaas.store.hygiene import HygieneOps
from marlaas.store.jobs import JobOps, JobRecord, spec_from_json  # noqa: F401  (re-exported)
from marlaas.store.keys import (  # noqa: F401  (re-exported: the store layer's key names)
    ACTIVE,
    ALL,
    BASE_MANIFEST,
    DEPLOYMENT,
    ENDED,
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
    eval_key,
    eval_times_key,
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
    tenant_active_key,
    tenant_key,
    verified_key,
    worker_key,
)
from marlaas.store.lanes import KEEP_VERSIONS_EXTRA, LaneOps  # noqa: F401  (re-exported)
from marlaas.store.observe import ObserveOps
from marlaas.store.serving import ServingOps
from marlaas.store.tenants import TenantOps
from marlaas.store.tick import TickOps
from marlaas.store.verifier_registry import VerifierRegistryOps
from marlaas.store.work import WorkOps


def resolve_url(url: str | None, settings) -> str:
    """The Redis URL: explicit, else the settings' redis_url, else the embedded server's recorded URL."""
    if url:
        return url
    if settings.redis_url:
        return settings.redis_url
    f = settings.embedded_dir / "redis.url"
    if f.is_file():
        return f.read_text().strip()
    raise StoreUnavailable(
        "no Redis: start the embedded stack with `marlaas up` or set MARLAAS_REDIS_URL"
    )


@lru_cache(maxsize=8)
def _client(url: str) -> redis.Redis:
    # redis-py 8 reads with a 5 s timeout by default: too short for a large adapter or Tinker state
    # (100+ MB at rank 32) written while Redis appends to its file on a busy host.
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=60, health_check_interval=30)


@lru_cache(maxsize=8)
def _artifacts(url: str, cache_dir: str, cache_bytes: int) -> Artifacts:
    return open_artifacts(url, cache_dir, cache_bytes)


class Store(ServingOps, JobOps, WorkOps, LaneOps, TenantOps, ObserveOps, HygieneOps, VerifierRegistryOps, TickOps,
            BlobOps):
    """Typed access to the Redis store, one mixin per concern. Every method is one or a few round trips.

    `url`: the Redis URL; `lease_s`: how long a work item that moves to its next stage (generated ->
    verify, continued -> verify) is leased; `artifacts`: the artifact store (marlaas.store.artifacts).
    The process edges pass them; a value not passed comes from the settings, read here and nowhere
    else in the store (`Store()` is the ordinary construction in scripts, tests and the CLI)."""

    def __init__(self, url: str | None = None, *, lease_s: float | None = None,
                 artifacts: Artifacts | None = None):
        if url is None or lease_s is None or artifacts is None:
            s = get_settings()
            lease_s = s.lease_s if lease_s is None else lease_s
            url = resolve_url(url, s)
            if artifacts is None:
                artifacts = _artifacts(s.artifacts_url, str(s.home / "cache" / "artifacts"),
                                       s.artifact_cache_mb * 2**20)
        self.url = url
        self.lease_s = lease_s
        self.artifacts = artifacts
        self.r = _client(self.url)
        self._publish = self.r.register_script(scripts.PUBLISH)
        self._accept = self.r.register_script(scripts.ACCEPT_REWARDS)
        self._release = self.r.register_script(scripts.RELEASE)
        self._claim = self.r.register_script(scripts.CLAIM)
        self._replace = self.r.register_script(scripts.REPLACE_ATTEMPT)
        self._drop_cont = self.r.register_script(scripts.DROP_CONT)
        self._list_after = self.r.register_script(scripts.LIST_AFTER)
        self._init_tick_scripts()

    # ---------------------------------------------------------------- connectivity
    def ping(self) -> bool:
        try:
            return bool(self.r.ping())
        except redis.ConnectionError:
            return False

    def check(self) -> None:
        if not self.ping():
            raise StoreUnavailable(f"Redis at {redact_url(self.url)} does not answer: is the stack up (`marlaas up`)?")

