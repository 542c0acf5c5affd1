"""Generate station: one engine per worker process serves every tenant's adapter in mixed batches."""

from __future__ import annotations

from functools import lru_cache

from marlaas import families
from marlaas.generate.station import run_generate_isolated
from marlaas.settings import get_settings
from tasks.app import app
from tasks.common import base_dir, kick, send, station_event, store

_engine = None


def engine():
    """The process's engine, created once (workers call this at start-up)."""
    global _engine
    if _engine is None:
        from marlaas.generate.factory import make_engine

        s = get_settings()
        base = base_dir()
        extra = {**s.vllm_args, "max_lora_rank": s.max_lora_rank} if s.engine == "vllm" else \
            {"device": s.device, "dtype": s.dtype}
        _engine = make_engine(s.engine, base, store().adapter, threads=s.threads,
                              cache_dir=s.home / "cache" / "adapters", **extra)
    return _engine


@lru_cache(maxsize=65536)
def _uses_tool(jid: str) -> bool:
    return families.tool_of(store().spec(jid)) is not None


@app.task(name="marlaas.generate", ignore_result=True)
def generate(batch_id: str, items: list[list]) -> dict:
    jobs = [it[1] for it in items]
    to_verify: dict = {}
    try:
        with station_event("generate", jobs, items=len(items), batch=batch_id):
            to_verify = run_generate_isolated(store(), engine(), items)
        # A tool task's groups of the whole batch go in one message (their tool calls then overlap);
        # every other job's in its own (the CPU pool's processes share those).
        messages, tool = [], []
        for (jid, kind), idxs in to_verify.items():
            if kind == "train" and _uses_tool(jid):
                tool.append([jid, kind, idxs])
            else:
                messages.append(("marlaas.verify", [jid, kind, idxs]))
        send(messages + ([("marlaas.verify_many", [tool])] if tool else []))
    finally:
        store().end_gen_batch(batch_id)
        kick()
    return {"verify": len(to_verify)}
