"""Train station: the single trainer lane; one policy-gradient step, then publish version t+1."""

from __future__ import annotations

from marlaas import stations
from marlaas.settings import get_settings
from tasks.app import app
from tasks.common import base_dir, kick, station_event, store, worker_name

_engine = None


def engine():
    global _engine
    if _engine is None:
        from marlaas.engines.training import TrainingEngine

        s = get_settings()
        _engine = TrainingEngine(base_dir(), threads=s.threads)
    return _engine


@app.task(name="marlaas.train", ignore_result=True)
def train(job_id: str, version: int, token: str) -> dict:
    store().claim_trainer(token, f"train@{worker_name()}")
    try:
        with station_event("train", [job_id], version=version):
            out = stations.run_train(store(), engine(), job_id, version, token)
    except Exception as e:
        # Free the lane at once (other tenants go on); a job that keeps failing is stopped.
        store().release_trainer(token)
        stations.count_failure(store(), job_id, "train", e)
        raise
    finally:
        kick()
    return {k: v for k, v in out.items() if k in ("step", "reward_mean", "skipped", "loss")}
