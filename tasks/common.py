"""Helpers every task uses: the store, kicking the scheduler, recording station events.

A process edge: the settings are read here and in the task modules, and passed down to the library
(the Store's URL and lease, the tick's `TickConfig`)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from functools import lru_cache

from marlaas.control.dispatch import TickConfig
from marlaas.settings import get_settings
from marlaas.store import Store, resolve_url
from marlaas.types import ItemKind
from tasks.app import app


@lru_cache(maxsize=1)
def store() -> Store:
    s = get_settings()
    return Store(resolve_url(None, s), lease_s=s.lease_s)


def tick_config() -> TickConfig:
    """The scheduler tick's settings (marlaas.control.dispatch.tick's `config`)."""
    return TickConfig.from_settings(get_settings())


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def send(messages: list[tuple[str, list]]) -> None:
    """Enqueue several tasks, [(task name, args), ...], in one pipelined round trip to the broker
    (kombu's producer batch: one Redis pipeline instead of a round trip or more per message; a
    scheduler tick sends up to a dozen at once)."""
    if not messages:
        return
    with app.producer_or_acquire() as producer, producer.batch():
        for name, args in messages:
            app.send_task(name, args=args, argsrepr=describe(name, args), producer=producer)


@lru_cache(maxsize=65536)
def _tenant(jid: str) -> str:
    return store().job_fields(jid, "tenant")[0] or "?"


def describe(name: str, args: list) -> str:
    """What Flower shows as the task's arguments: station, job, tenant, version (IDs stay the payload)."""
    station = name.rsplit(".", 1)[-1]
    if station == "generate":
        per_job: dict[str, list[str]] = {}
        for kind, jid, idx in args[1]:
            label = {ItemKind.GEN: "group", ItemKind.CONT: "tool turn of group"}.get(kind, "eval v")
            per_job.setdefault(jid, []).append(f"{label}{idx}")
        jobs = "; ".join(f"job={j} tenant={_tenant(j)} [{', '.join(v)}]" for j, v in per_job.items())
        return f"station=generate batch={args[0]} {jobs}"
    if station == "verify":
        return f"station=verify job={args[0]} tenant={_tenant(args[0])} kind={args[1]} items={args[2]}"
    if station == "verify_many":
        return "station=verify " + "; ".join(f"job={j} tenant={_tenant(j)} kind={k} items={i}" for j, k, i in args[0])
    if station == "train":
        return f"station=train job={args[0]} tenant={_tenant(args[0])} version={args[1]}"
    return f"station={station} {args}"


def kick() -> None:
    """Ask for a scheduler tick now; at most one is pending at a time."""
    if store().want_kick():
        app.send_task("marlaas.tick", expires=30)


@contextlib.contextmanager
def station_event(station: str, jobs: list[str], **info):
    """Record the task's busy interval for the station timeline and busy fractions, with the worker
    process's peak resident set so far (`peak_rss_mb`: the first task after which it rose is the one
    that raised it)."""
    start = time.time()
    try:
        yield info
    finally:
        store().record_event(station, start, time.time(), jobs, worker_name(),
                             **{**info, "peak_rss_mb": peak_rss_mb()})


def peak_rss_mb() -> float | None:
    """This process's peak resident set (Linux VmHWM) in MB; None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def register_base(path, name: str | None = None) -> None:
    """Record which base this deployment serves (jobs naming another base are refused at submit)."""
    store().set_deployment(base=str(path), base_name=name or os.path.basename(str(path).rstrip("/")))


def register_lora_rank(max_lora_rank: int) -> None:
    """Record the largest LoRA rank the generate engine serves (`GenerationEngine.max_lora_rank`,
    written by a generate worker once its engine is up; a train worker does not know the generate
    engine): the one value `marlaas.api.access.max_lora_rank` reads for jobs and Tinker models."""
    store().set_deployment(max_lora_rank=int(max_lora_rank))


def base_dir():
    """The base directory this worker loads (MARLAAS_BASE, else the pushed base fetched into the
    host's cache: marlaas.base.distribution), recorded in the store."""
    from marlaas.base.distribution import local_base

    path, name = local_base(get_settings(), store())
    register_base(path, name)
    return path
