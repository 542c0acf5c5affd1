"""The store's Redis key names and work-item names (part of the store layer; the schema is documented
in marlaas/store/__init__.py, which re-exports every name here). Nothing outside marlaas/store*.py spells a key.
"""

from __future__ import annotations

from marlaas.types import EVAL_KINDS, GROUP_KINDS, item_name, parse_item  # noqa: F401  (re-exported)

P = "m:"
ACTIVE = P + "jobs:active"
ALL = P + "jobs:all"
LEASES = P + "leases"
GEN_INFLIGHT = P + "gen:inflight"
TRAINER = P + "trainer:lease"
EVENTS = P + "events"
LOCK = P + "sched:lock"
KICK = P + "sched:kick"
WAKE = P + "sched:wake"
VT = P + "sched:vt"
SCHED_JOBS = P + "sched:jobs"
SCHED_CHANGES = P + "sched:changes"
SCHED_EPOCH = P + "sched:epoch"
DEPLOYMENT = P + "deployment"
TENANTS = P + "tenants"
TOKENS = P + "tokens"
WORKERS = P + "workers"
BASE_MANIFEST = P + "base:manifest"
SWEEP_LOCK = P + "sweep:lock"  # one artifact sweep at a time (marlaas/store/blobs.py)
RATELIMIT = P + "ratelimit"  # the API's shared rate limits: the `limits` library's keys under it (api/ratelimit.py)
ENDED = P + "jobs:ended"  # zset job -> when it ended (garbage collection after the retention period)


def job_key(j: str) -> str:
    return f"{P}job:{j}"


def rows_key(j: str, split: str) -> str:
    return f"{P}job:{j}:rows:{split}"


def roll_key(j: str, g: int) -> str:
    return f"{P}job:{j}:roll:{g}"


def eval_key(j: str, v: int) -> str:
    return f"{P}job:{j}:eval:{v}"


def adapter_key(j: str, v: int) -> str:
    return f"{P}job:{j}:adapter:{v}"


def verified_key(j: str) -> str:
    return f"{P}job:{j}:verified"


def evals_key(j: str) -> str:
    return f"{P}job:{j}:evals"


def eval_times_key(j: str) -> str:
    """Sorted set: evaluated version -> when its evaluation was stored (`at`), so the job's timeline
    pages its evaluations without reading their outputs."""
    return f"{P}job:{j}:evaltimes"


def metrics_key(j: str) -> str:
    return f"{P}job:{j}:metrics"


def kept_key(j: str) -> str:
    """The versions whose adapter record (adapter_key) the job still keeps: a sorted set, so a publish
    finds the references it must not delete without reading every version ever published."""
    return f"{P}job:{j}:kept"


def optim_key(j: str) -> str:
    return f"{P}job:{j}:optim"


def tenant_active_key(t: str) -> str:
    """The tenant's jobs that have not ended (its quota of concurrent jobs counts them)."""
    return f"{P}tenant:{t}:active"


def tenant_key(t: str) -> str:
    return f"{P}tenant:{t}:jobs"


def stored_key(t: str) -> str:
    """The tenant's bytes in the artifact store (marlaas/store/blobs.py)."""
    return f"{P}tenant:{t}:stored"


def files_key(t: str) -> str:
    """The tenant's uploaded files: file id -> JSON {ref, kind, name}."""
    return f"{P}tenant:{t}:files"


def job_end_key(j: str) -> str:
    return f"{P}job:{j}:end"


def notices_key(j: str) -> str:
    return f"{P}job:{j}:notices"


def job_tasks_key(j: str) -> str:
    return f"{P}job:{j}:tasks"


def lease_index_key(j: str) -> str:
    return f"{P}job:{j}:leases"


def worker_key(name: str) -> str:
    return f"{P}worker:{name}"


# ---------------------------------------------------------------- the Tinker protocol (store/tinker*.py)
TK = P + "tk:"


def model_key(m: str) -> str:
    return f"{TK}model:{m}"


def live_key(m: str) -> str:
    return f"{TK}live:{m}"


def ckpt_key(m: str) -> str:
    return f"{TK}ckpt:{m}"


def ttl_key(m: str) -> str:
    return f"{TK}ttl:{m}"


def state_key(m: str, name: str) -> str:
    return f"{TK}state:{m}:{name}"


def session_key(s: str) -> str:
    return f"{TK}session:{s}"


def session_models_key(s: str) -> str:
    return f"{TK}session:{s}:models"


def queue_key(m: str) -> str:
    return f"{TK}q:{m}"


def future_key(r: str) -> str:
    return f"{TK}fut:{r}"


def sampler_key(s: str) -> str:
    return f"{TK}sampler:{s}"


# ---- serving
def aliases_key(t: str) -> str:
    """Hash of the tenant's model aliases (OpenAI door): alias -> the model name it stands for."""
    return f"{P}tenant:{t}:aliases"


def best_key(j: str) -> str:
    """Hash of the job's promotion: `x:{v}` -> held-out exact of evaluated version v, `auto` (the best
    of them, ties: the later version), `pinned` (a version the tenant promoted by hand)."""
    return f"{P}job:{j}:best"
