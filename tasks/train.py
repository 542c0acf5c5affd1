"""Train station: the single trainer lane; one policy-gradient step, then publish version t+1.

After its step the train task runs the scheduler tick itself (the same `dispatch.tick`, under the
same lock, so the same round-robin pick) instead of kicking one on the control worker: the next train
message is on the queue the moment this one is acknowledged, one broker round trip and a worker
wake-up sooner (the trainer's idle gap between steps; bench/throughput.py reports it). When another
tick holds the lock, a tick is kicked as every other station does. One Celery task is one step, so
Flower lists every step and a lost worker loses at most the step it was running.

The trainer lane is held by ONE context manager, `trainer_lane(token)`, for both job steps (`train`)
and Tinker steps (`tasks.tinker.tinker_train`): it names this worker on the lease and releases it on
every exit. Releases are token-checked, so releasing a lease that the publish script already freed,
or that the tick has since given to another task (another token), changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from marlaas.control import dispatch
from marlaas.settings import get_settings
from marlaas.train import station
from tasks.app import app
from tasks.common import base_dir, kick, send, station_event, store, tick_config, worker_name

log = logging.getLogger("marlaas.train")
_engine = None
_step_s: float | None = None  # the running mean of this trainer's job steps (seconds)


def step_seconds() -> float | None:
    """What a job step takes on this trainer lately (an exponential mean over its steps; None before
    the first): the unit Tinker grants are charged in (`tasks.tinker.tinker_train`)."""
    return _step_s


def _record_step(seconds: float) -> None:
    global _step_s
    _step_s = seconds if _step_s is None else 0.8 * _step_s + 0.2 * seconds


def engine():
    global _engine
    if _engine is None:
        from marlaas.train.engine import TrainingEngine

        s = get_settings()
        _engine = TrainingEngine(base_dir(), threads=s.threads, device=s.device, dtype=s.dtype,
                                 checkpointing=s.train_checkpointing,
                                 micro_bytes="auto" if s.train_activation_mb is None else s.train_activation_mb * 2**20)
    return _engine


def tick_here() -> None:
    """Run the scheduler tick in this process; kick one instead if another tick holds the lock."""
    try:
        ran = dispatch.tick(store(), send, tick_config()) is not None
    except Exception as e:  # a failed tick here must not fail the step: the control worker ticks anyway
        log.warning("tick after the train step failed (%s: %s); kicking the control worker", type(e).__name__, e)
        ran = False
    if not ran:
        kick()


@contextmanager
def trainer_lane(token: str) -> Iterator[None]:
    """Hold the trainer lane `token` for the block (this worker named on the lease); released on every
    exit, once (token-checked: see the module docstring)."""
    store().claim_trainer(token, f"train@{worker_name()}")
    try:
        yield
    finally:
        store().release_trainer(token)


@app.task(name="marlaas.train", ignore_result=True)
def train(job_id: str, version: int, token: str) -> dict:
    try:
        try:
            with trainer_lane(token), station_event("train", [job_id], version=version):
                t0 = time.monotonic()
                out = station.run_train(store(), engine(), job_id, version, token)
                if not out.get("skipped"):
                    _record_step(time.monotonic() - t0)
        except Exception as e:
            # The lane is already free (other tenants go on); a job that keeps failing is stopped.
            store().count_failure(job_id, "train", e)
            raise
    finally:
        tick_here()
    return {k: v for k, v in out.items() if k in ("step", "reward_mean", "skipped", "loss")}
