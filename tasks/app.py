"""The Celery application shared by every marlaas process."""

from celery import Celery

app = Celery("marlaas", include=["tasks.scheduler", "tasks.generate", "tasks.verify", "tasks.train", "tasks.tinker"])
app.config_from_object("celeryconfig")
