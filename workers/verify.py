"""Verify pool (CPU hosts): prefork; verifiers and the code sandbox.

    celery -A workers.verify worker -Q verify -P prefork -c 2
"""

from tasks.app import app  # noqa: F401
from workers.common import announce

announce("verify")
