"""Verify pool (CPU hosts): prefork; verifiers and the code sandbox.

    celery -A workers.verify worker -Q verify -P prefork -c 2
"""

from marlaas.settings import get_settings
from marlaas.verify import sandbox
from tasks.app import app  # noqa: F401
from workers.common import announce

sandbox.set_service_home(get_settings().home)  # before the pool forks: every child hides it
announce("verify")
