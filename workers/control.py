"""Control worker: runs the scheduler tick (fast, lock-protected) and Celery beat's target.

    celery -A workers.control worker -Q control -P solo
"""

from tasks.app import app  # noqa: F401
from workers.common import announce

announce("control")
