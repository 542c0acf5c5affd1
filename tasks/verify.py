"""Verify station: verifiers and the code sandbox score completions (CPU pool).

Messages carry [job, kind, idxs] with the kinds the leases name: 'ver' (groups) or 'evalver'
(evaluations; idxs are versions).

Fair per tenant: before it runs, a `marlaas.verify` task takes one of the pool's processes for its
job's tenant (`marlaas.store.slots.PoolSlots`, decided by `scheduler.may_take_slot`). While another
tenant has verify work waiting, a tenant past its plan-weighted share of the pool's processes is
refused: its task goes back to the queue after a short pause (a Celery retry: no process is held
while it waits, and no failure is charged), so a slow grader holds at most its tenant's share and
delays only that tenant. `verify_many` (tool groups of one generate batch, several jobs) is not
gated: its time is the tool server's latency, bounded per call.
"""

from __future__ import annotations

import random
from functools import lru_cache, partial

from marlaas.control.scheduler import may_take_slot
from marlaas.settings import get_settings
from marlaas.store.slots import PoolSlots, PoolState
from marlaas.verify import station
from tasks.app import app
from tasks.common import kick, station_event, store, worker_name

DEFER_S = (0.5, 1.5)  # a refused task waits this long (uniform) before it asks again


@lru_cache(maxsize=1)
def pool() -> PoolSlots:
    return PoolSlots(store(), "verify")


def _decide(tenant: str, state: PoolState) -> bool:
    names = {*state.running, *state.waiting, tenant}
    weights = {t: store().tenant_weight(t or None) for t in names}
    return may_take_slot(tenant, state.capacity, weights, state.running, state.waiting)


@app.task(name="marlaas.verify", ignore_result=True, bind=True, max_retries=None)
def verify(self, job_id: str, kind: str, idxs: list[int]) -> dict:
    tenant = store().job_fields(job_id, "tenant")[0] or ""
    process = worker_name()
    if not pool().take(tenant, process, partial(_decide, tenant)):
        raise self.retry(countdown=random.uniform(*DEFER_S), max_retries=None)
    try:
        with station_event("verify", [job_id], kind=kind, items=len(idxs)):
            n = station.run_verify(store(), job_id, kind, idxs, get_settings().tool_url)
    except Exception as e:  # a verifier that cannot load, or a task past its time limit: charged, visible
        store().count_failure(job_id, "verify", e)
        raise
    finally:
        pool().release(process)
    kick()
    return {"accepted": n}


@app.task(name="marlaas.verify_many", ignore_result=True)
def verify_many(items: list[list]) -> dict:
    """Several jobs' [job, kind, idxs] at once: a generate batch's tool-task groups, whose tool calls
    then go out in one concurrent round (the task waits one tool latency, not one per job)."""
    try:
        with station_event("verify", [it[0] for it in items], kind="many", items=sum(len(it[2]) for it in items)):
            n = station.run_verify_many(store(), [tuple(it) for it in items], get_settings().tool_url)
    except Exception as e:
        for jid in sorted({it[0] for it in items}):
            store().count_failure(jid, "verify", e)
        raise
    kick()
    return {"accepted": n}
