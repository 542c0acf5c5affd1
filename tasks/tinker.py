"""Tinker protocol tasks: thin glue over marlaas.train.tinker_ops and marlaas.generate.tinker_sample.

`marlaas.tinker_train(model)` runs on the train queue (the single trainer process, so Tinker ops and job
steps never run at once); `marlaas.tinker_sample(request ids)` runs on the generate queue with the
generate worker's engine. `dispatch()` is called by every scheduler tick: it moves the store's pending
Tinker work into Celery messages (each pending item is taken once, atomically).
"""

from __future__ import annotations

from functools import lru_cache

from marlaas.store.tinker import TinkerStore
from tasks.app import app
from tasks.common import kick, send, station_event, store


@lru_cache(maxsize=1)
def tinker_store() -> TinkerStore:
    return TinkerStore(store())


def dispatch() -> int:
    """Send one generate task for the pending samples. Training ops wait for the trainer lane: the
    scheduler tick gives it to a model in the same weighted round-robin as job steps."""
    samples = tinker_store().take_samples()
    if samples:
        send([("marlaas.tinker_sample", [samples])])
    return len(samples)


@app.task(name="marlaas.tinker_train", ignore_result=True)
def tinker_train(model_id: str, token: str) -> dict:
    """One step of a Tinker model on the trainer lane (its queued ops up to and including the next
    optim_step), under the lease the tick took for it; then the lane is free and the model goes back
    to the candidates if ops remain."""
    from marlaas.train.tinker_ops import TinkerTrainer
    from tasks.train import engine, tick_here, trainer_lane

    ts = tinker_store()
    try:
        with trainer_lane(token), station_event("train", [model_id], tinker=True):
            n = TinkerTrainer(ts, engine()).run_queue(model_id, until_step=True)
    finally:
        if ts.queue_length(model_id):
            ts.mark_pending(model_id)
        tick_here()
    return {"ops": n}


@app.task(name="marlaas.tinker_sample", ignore_result=True)
def tinker_sample(request_ids: list[str]) -> dict:
    from marlaas.generate.tinker_sample import run_samples
    from tasks.generate import engine

    with station_event("generate", [], tinker=len(request_ids)):
        n = run_samples(tinker_store(), engine(), request_ids)
    kick()
    return {"samples": n}
