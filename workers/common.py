"""Start-up shared by every pool: thread budget, heartbeat into the store."""

from __future__ import annotations

import logging
import os
import threading

from celery.signals import worker_ready, worker_shutdown

# A worker that stops beating for this long is dead: its trainer lease is broken (dispatch.py).
HEARTBEAT_TTL_S = 10.0
log = logging.getLogger("marlaas.workers")


def limit_threads(n: int) -> None:
    """Several torch processes share the cores: give each an explicit budget before torch loads."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(n))


def announce(station: str, on_ready=None, **info) -> None:
    """On worker start: run `on_ready` (load the engine) and keep a heartbeat in the store."""
    stop = threading.Event()

    @worker_ready.connect(weak=False)
    def _ready(sender=None, **_):
        from tasks.common import kick, store, worker_name

        if on_ready is not None:
            on_ready()
        name = f"{station}@{worker_name()}"

        def beat():
            while not stop.is_set():
                try:
                    store().heartbeat(name, station, ttl=HEARTBEAT_TTL_S, **info)
                except Exception as e:  # the broker may be restarting; the next beat retries
                    log.warning("heartbeat of %s failed (%s: %s); retrying", name, type(e).__name__, e)
                stop.wait(HEARTBEAT_TTL_S / 3)

        threading.Thread(target=beat, daemon=True, name="marlaas-heartbeat").start()
        kick()

    @worker_shutdown.connect(weak=False)
    def _shutdown(**_):
        stop.set()
