"""Generate station: one engine per worker process serves every tenant's adapter in mixed batches."""

from __future__ import annotations

from marlaas.generate.station import run_generate_isolated, verify_messages
from marlaas.settings import get_settings
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


@app.task(name="marlaas.generate", ignore_result=True)
def generate(batch_id: str, items: list[list]) -> dict:
    """A batch of [kind, job, idx] items: run the station, send its verify messages, kick a tick."""
    work = [WorkItem.of(it) for it in items]
    to_verify: list[WorkItem] = []
    try:
        with station_event("generate", [it.job for it in work], items=len(work), batch=batch_id):
            to_verify = run_generate_isolated(store(), engine(), work, get_settings().tool_url)
        send(verify_messages(store(), to_verify))
    finally:
        store().end_gen_batch(batch_id)
        kick()
    return {"verify": len(to_verify)}
