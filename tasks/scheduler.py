"""The scheduler tick: beat sends it every second; every finished task kicks one. The artifact store's
sweep (orphaned objects, per-tenant stored bytes recounted): beat sends it every SWEEP_EVERY_S."""

from marlaas.control import dispatch
from marlaas.settings import get_settings
from tasks import tinker
from tasks.app import app
from tasks.common import send, store, tick_config

SWEEP_EVERY_S = 600.0


@app.task(name="marlaas.tick", ignore_result=True, acks_late=False)
def tick() -> dict:
    plan = dispatch.tick(store(), send, tick_config())
    tinker.dispatch()  # pending samples -> the generate batches in flight take them, else a task of their own
    if plan is None:
        return {"skipped": "another tick holds the lock"}
    return {
        "gen_batches": len(plan.gen_batches),
        "verify": len(plan.verify),
        "train": plan.train,
        "tinker": plan.tinker,
    }


@app.task(name="marlaas.sweep", ignore_result=True, acks_late=False)
def sweep() -> dict:
    return store().sweep_once(grace_s=get_settings().artifact_grace_s, lock_s=SWEEP_EVERY_S)
