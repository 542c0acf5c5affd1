"""Control worker: runs the scheduler tick (fast, lock-protected) and Celery beat's target.

    celery -A workers.control worker -Q control -P solo

Besides beat's tick every second and the ticks that finished tasks kick, a thread waits on the
store's wake-up list (a new job pushes one: Store.create_job) and kicks a tick at once, so a job's
first work is dispatched within milliseconds of its submission instead of at the next beat.
"""

import threading
import time

from tasks.app import app  # noqa: F401
from workers.common import announce


def _watch_wakes() -> None:
    from tasks.common import kick, store

    while True:
        try:
            if store().wait_wake(5.0):
                kick()
        except Exception:  # the broker may be restarting: try again shortly
            time.sleep(1.0)


def _start_watcher() -> None:
    threading.Thread(target=_watch_wakes, daemon=True, name="marlaas-wake").start()


announce("control", on_ready=_start_watcher)
