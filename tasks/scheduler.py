"""The scheduler tick: beat sends it every second; every finished task kicks one."""

from marlaas.control import dispatch
from tasks import tinker
from tasks.app import app
from tasks.common import send, store, tick_config


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
