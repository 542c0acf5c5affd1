"""Train station: the single trainer lane; one policy-gradient step, then publish version t+1.

The trainer does not wait for a message between steps: after a step the train task runs the
scheduler tick itself (the same `dispatch.tick`, under the same lock, so the same round-robin pick)
and, when the tick gives the trainer lane out again, runs that step at once in this task instead of
sending it through the train queue; the tick's other messages are sent as usual. A kicked tick on the
control worker would have done the same work, one broker round trip and a worker wake-up later (the
trainer's idle gap between steps; bench/throughput.py reports it). After CHAIN_S seconds of chained
steps, or when the lock is busy, the next step goes through the queue again, so a warm shutdown
is never held up for long and a restarted worker picks up from the queue.
"""

from __future__ import annotations

import time

from marlaas import dispatch, stations
from marlaas.settings import get_settings
from tasks.app import app
from tasks.common import base_dir, kick, send, station_event, store, worker_name

CHAIN_S = 60.0
_engine = None


def engine():
    global _engine
    if _engine is None:
        from marlaas.engines.training import TrainingEngine

        s = get_settings()
        _engine = TrainingEngine(base_dir(), threads=s.threads)
    return _engine


def step(job_id: str, version: int, token: str) -> dict:
    """One step on the lane held with `token` (claimed for this worker, freed on failure)."""
    store().claim_trainer(token, f"train@{worker_name()}")
    try:
        with station_event("train", [job_id], version=version):
            return stations.run_train(store(), engine(), job_id, version, token)
    except Exception as e:
        # Free the lane at once (other tenants go on); a job that keeps failing is stopped.
        store().release_trainer(token)
        stations.count_failure(store(), job_id, "train", e)
        raise


def next_step() -> tuple[str, int, str] | None:
    """Run a scheduler tick here; returns the train step it gave out (held back from the queue), or
    None (no job ready, or another tick holds the lock: then a kicked tick decides instead)."""
    held: list[list] = []

    def send_rest(messages: list[tuple[str, list]]) -> None:
        held.extend(a for n, a in messages if n == "marlaas.train")
        send([(n, a) for n, a in messages if n != "marlaas.train"])

    if dispatch.tick(store(), send_rest) is None:
        kick()
        return None
    return tuple(held[0]) if held else None


@app.task(name="marlaas.train", ignore_result=True)
def train(job_id: str, version: int, token: str) -> dict:
    deadline = time.monotonic() + CHAIN_S
    steps, out, need_tick = 0, {}, True
    try:
        while True:
            out = step(job_id, version, token)
            steps += 1
            if time.monotonic() >= deadline:
                break
            nxt, need_tick = next_step(), False  # a tick ran here, or one was kicked
            if nxt is None:
                break
            job_id, version, token = nxt
            need_tick = True
    finally:
        if need_tick:  # after a failed step too: the lane is free again
            kick()
    return {"steps": steps, **{k: v for k, v in out.items() if k in ("step", "reward_mean", "skipped", "loss")}}
