"""Generate pool (GPU hosts; the CPU default too): solo pool, one engine per process.

    celery -A workers.generate worker -Q generate -P solo
"""

from marlaas.settings import get_settings
from workers.common import announce, limit_threads

limit_threads(get_settings().threads)

from tasks import generate as _generate  # noqa: E402
from tasks.app import app  # noqa: E402,F401

announce("generate", on_ready=_generate.engine, engine=get_settings().engine)
