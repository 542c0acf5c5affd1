"""Verify station: verifiers and the code sandbox score completions (CPU pool)."""

from marlaas import stations
from tasks.app import app
from tasks.common import kick, station_event, store


@app.task(name="marlaas.verify", ignore_result=True)
def verify(job_id: str, kind: str, idxs: list[int]) -> dict:
    with station_event("verify", [job_id], kind=kind, items=len(idxs)):
        n = stations.run_verify(store(), job_id, kind, idxs)
    kick()
    return {"accepted": n}
