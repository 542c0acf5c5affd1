"""Generate station: one engine per worker process serves every tenant's adapter, and the Tinker samples,
in mixed batches."""

from __future__ import annotations

from functools import lru_cache

from marlaas.generate.station import run_generate_isolated, verify_messages
from marlaas.generate.tinker_sample import run_samples, take
from marlaas.settings import get_settings
from marlaas.store.tinker import TinkerStore
from marlaas.types import WorkItem
from tasks.app import app
from tasks.common import base_dir, kick, register_lora_rank, send, station_event, store

_engine = None


def engine():
    """The process's engine, created once (workers call this at start-up)."""
    global _engine
    if _engine is None:
        from marlaas.generate.factory import make_engine

        s = get_settings()
        base = base_dir()
        extra = {**s.vllm_args, "max_lora_rank": s.max_lora_rank} if s.engine == "vllm" else \
            {"device": s.device, "dtype": s.dtype, "max_lora_rank": s.max_lora_rank}
        _engine = make_engine(s.engine, base, store().adapter, threads=s.threads,
                              cache_dir=s.home / "cache" / "adapters", **extra)
        register_lora_rank(_engine.max_lora_rank)  # the rank the engine serves: what tenants may ask for
    return _engine


@lru_cache(maxsize=1)
def tinker_store() -> TinkerStore:
    return TinkerStore(store())


@app.task(name="marlaas.generate", ignore_result=True)
def generate(batch_id: str, items: list[list]) -> dict:
    """A batch of [kind, job, idx] items: run the station, send its verify messages, kick a tick. The
    Tinker sample requests pending now ride in the same engine call (taken atomically: each by exactly
    one task; the tick sends the rest in a `marlaas.tinker_sample` of their own once no generate batch
    is in flight, `tasks.tinker.dispatch`)."""
    work = [WorkItem.of(it) for it in items]
    to_verify: list[WorkItem] = []
    try:
        samples = take(tinker_store(), engine(), tinker_store().take_samples())
        with station_event("generate", [it.job for it in work], items=len(work), batch=batch_id,
                           tinker=len(samples.requests), kinds=sorted({str(it.kind) for it in work})) as ev:
            to_verify = run_generate_isolated(store(), engine(), work, get_settings().tool_url, samples,
                                              get_settings().serve_share)
            ev["adapters"] = len(engine().loaded())  # adapter versions the engine holds after the task
        send(verify_messages(store(), to_verify))
    finally:
        store().end_gen_batch(batch_id)
        kick()
    return {"verify": len(to_verify)}


@app.task(name="marlaas.tinker_sample", ignore_result=True)
def tinker_sample(request_ids: list[str]) -> dict:
    """Tinker sample requests the tick took while no generate batch was going out: one engine call."""
    with station_event("generate", [], tinker=len(request_ids)):
        n = run_samples(tinker_store(), engine(), request_ids)
    kick()
    return {"samples": n}
