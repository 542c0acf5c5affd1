"""Train pool: ONE worker (solo pool) holds the base model and every job's adapter and optimizer.

    celery -A workers.train worker -Q train -P solo
"""

from marlaas.settings import get_settings
from workers.common import announce, limit_threads

limit_threads(get_settings().threads)

from tasks import train as _train  # noqa: E402
from tasks.app import app  # noqa: E402,F401

announce("train", on_ready=_train.engine)
