"""Tinker protocol tasks: thin glue over marlaas.train.tinker_ops and marlaas.generate.tinker_sample.

`marlaas.tinker_train(model)` runs on the train queue (the single trainer process, so Tinker ops and job
steps never run at once); sample requests ride in the generate tasks' engine calls, or, when no generate
batch goes out, in a `marlaas.tinker_sample(request ids)` task (both in tasks/generate.py, with the
generate worker's engine). `dispatch()` is called by every scheduler tick: it moves the store's pending
samples into a Celery message (each pending item is taken once, atomically).
"""

from __future__ import annotations

import time
from functools import lru_cache

from marlaas.store.tinker import TinkerStore
from tasks.app import app
from tasks.common import send, station_event, store


@lru_cache(maxsize=1)
def tinker_store() -> TinkerStore:
    return TinkerStore(store())


def dispatch() -> int:
    """Send one generate task for the pending samples, unless a generate batch is in flight (the tick
    records the batches it sends before this runs): the generate tasks take the pending samples into
    their engine calls when they start (`tasks.generate.generate`), and once none is in flight (each
    ends with a kick) the next tick sends what is left here. Each sample is taken from the store
    atomically, so exactly one task serves it; a sample waits at most one generate batch (or, when a
    generate worker dies mid-batch, that batch's lease). Training ops wait for the trainer lane: the
    scheduler tick gives it to a model in the same weighted round-robin as job steps."""
    if store().gen_inflight(time.time()) > 0:
        return 0
    samples = tinker_store().take_samples()
    if samples:
        send([("marlaas.tinker_sample", [samples])])
    return len(samples)


@app.task(name="marlaas.tinker_train", ignore_result=True)
def tinker_train(model_id: str, token: str, weight: float = 1.0) -> dict:
    """One grant of the trainer lane to a Tinker model (its queued ops up to and including the next
    optim_step, or GRANT_TOKENS tokens of forward passes), under the lease the tick took for it; the
    grant's time beyond one job step is then charged to the model's pass (`weight`: its lane weight),
    the lane is free and the model goes back to the candidates if ops remain."""
    from marlaas.control.scheduler import grant_extra_charge
    from marlaas.train.tinker_ops import GRANT_TOKENS, TinkerTrainer
    from tasks.train import engine, step_seconds, tick_here, trainer_lane

    ts = tinker_store()
    try:
        with trainer_lane(token), station_event("train", [model_id], tinker=True):
            t0 = time.monotonic()
            try:
                n = TinkerTrainer(ts, engine()).run_queue(model_id, until_step=True, max_tokens=GRANT_TOKENS)
            finally:
                store().charge_lane(model_id, grant_extra_charge(time.monotonic() - t0, step_seconds(), weight))
    finally:
        if ts.queue_length(model_id):
            ts.mark_pending(model_id)
        tick_here()
    return {"ops": n}
