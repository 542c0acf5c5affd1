"""Celery transport settings for every marlaas process (workers, beat, Flower, the tick sender).

Transport only: where the broker is, which queue each task goes to, and the delivery guarantees.
Messages carry IDs and versions (JSON only, never pickle); payloads live in the store.
"""

import os

broker_url = os.environ.get("MARLAAS_REDIS_URL", "redis://127.0.0.1:6379/0")
broker_connection_retry_on_startup = True
# Redelivery of an unacknowledged message after a lost worker: longer than the longest step. The
# scheduler's own leases (MARLAAS_LEASE_S) re-dispatch lost work much sooner.
broker_transport_options = {"visibility_timeout": 7200}

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
task_ignore_result = True  # no task ever waits on another's result

# Nothing is lost on a crash: ack after the work, requeue if the worker dies, take one at a time.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1

# Flower sees every task from the moment a worker receives it (workers also run with -E). The
# "sent" event per published message is off by default: it doubled the cost of every message the
# scheduler tick sends (bench/tick.py); MARLAAS_SENT_EVENTS=1 turns it on (Flower then also lists
# tasks still waiting in a queue; the queue lengths are on Flower's Broker page either way).
worker_send_task_events = True
task_send_sent_event = os.environ.get("MARLAAS_SENT_EVENTS", "0") == "1"

task_default_queue = "control"
task_routes = {
    "marlaas.generate": {"queue": "generate"},
    "marlaas.verify": {"queue": "verify"},
    "marlaas.verify_many": {"queue": "verify"},
    "marlaas.train": {"queue": "train"},
    "marlaas.tick": {"queue": "control"},
    "marlaas.sweep": {"queue": "control"},
    "marlaas.tinker_train": {"queue": "train"},
    "marlaas.tinker_sample": {"queue": "generate"},
}

# Time limits on every task (seconds; MARLAAS_TASK_LIMIT_S scales the station tasks): the soft limit
# raises inside the task (it fails visibly and its job is charged), the hard one kills the process
# running it. The prefork pool (verify) enforces both; the solo pools (generate, train, control) do
# not support them, and there the scheduler's leases re-dispatch work that runs past MARLAAS_LEASE_S.
_LIMIT_S = float(os.environ.get("MARLAAS_TASK_LIMIT_S", "600"))
task_annotations = {
    "marlaas.generate": {"soft_time_limit": _LIMIT_S, "time_limit": _LIMIT_S + 60},
    "marlaas.verify": {"soft_time_limit": _LIMIT_S / 2, "time_limit": _LIMIT_S / 2 + 30},
    "marlaas.verify_many": {"soft_time_limit": _LIMIT_S / 2, "time_limit": _LIMIT_S / 2 + 30},
    "marlaas.train": {"soft_time_limit": _LIMIT_S, "time_limit": _LIMIT_S + 60},
    "marlaas.tick": {"soft_time_limit": 60, "time_limit": 90},
}

beat_schedule = {
    "tick": {"task": "marlaas.tick", "schedule": 1.0, "options": {"expires": 5.0}},
    "sweep": {"task": "marlaas.sweep", "schedule": 600.0, "options": {"expires": 300.0}},  # tasks.scheduler
}

# Celery remote control (broadcast commands such as shutdown or cancel_consumer to every worker) is
# off: nothing in marlaas uses it, and whoever could publish to the broker could stop every worker.
worker_enable_remote_control = False

worker_hijack_root_logger = False
timezone = "UTC"
