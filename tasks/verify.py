"""Verify station: verifiers and the code sandbox score completions (CPU pool).

Messages carry [job, kind, idxs] with the kinds the leases name: 'ver' (groups) or 'evalver'
(evaluations; idxs are versions)."""

from marlaas.settings import get_settings
from marlaas.verify import station
from tasks.app import app
from tasks.common import kick, station_event, store


@app.task(name="marlaas.verify", ignore_result=True)
def verify(job_id: str, kind: str, idxs: list[int]) -> dict:
    try:
        with station_event("verify", [job_id], kind=kind, items=len(idxs)):
            n = station.run_verify(store(), job_id, kind, idxs, get_settings().tool_url)
    except Exception as e:  # a verifier that cannot load, or a task past its time limit: charged, visible
        store().count_failure(job_id, "verify", e)
        raise
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
