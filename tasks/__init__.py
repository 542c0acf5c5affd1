"""Celery tasks: thin glue that takes IDs, calls `marlaas`, persists, and kicks the scheduler."""
