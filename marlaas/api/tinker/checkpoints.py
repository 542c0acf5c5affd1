"""A Tinker model's checkpoints as the REST client lists them, and a checkpoint's adapter.

Invariants: every read goes through `TinkerStore` with the caller's tenant, so another tenant's model
or checkpoint is NotFound exactly like a missing one. The archive of an adapter is the API's one
(`marlaas.api.access.archive`), as for a job's adapter downloads.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from marlaas.errors import NotFound
from marlaas.store.tinker import TinkerStore
from marlaas.types import AdapterBlob, AdapterRef


def iso(t: float) -> str:
    """A Unix time as the ISO 8601 UTC string the SDK parses."""
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


def entry(mid: str, c: dict) -> dict:
    """One checkpoint as the SDK's `Checkpoint` (expires_at from its TTL, None: never)."""
    return {"checkpoint_id": c["checkpoint_id"], "checkpoint_type": c["type"], "time": iso(c["time"]),
            "tinker_path": f"tinker://{mid}/{c['checkpoint_id']}", "size_bytes": c.get("size"),
            "expires_at": iso(c["expires"]) if c.get("expires") is not None else None}


def listing(ts: TinkerStore, tenant: str, mid: str) -> dict:
    """The body of GET /training_runs/{mid}/checkpoints."""
    return {"checkpoints": [entry(mid, c) for c in ts.checkpoints(tenant, mid)]}


def training_run(ts: TinkerStore, tenant: str, mid: str) -> dict:
    """A model as the SDK's `TrainingRun`, with its latest training and sampler checkpoints."""
    m = ts.model(tenant, mid)
    cks = ts.checkpoints(tenant, mid)
    last = {kind: next((entry(mid, c) for c in reversed(cks) if c["type"] == kind), None)
            for kind in ("training", "sampler")}
    return {"training_run_id": mid, "base_model": m["base"], "model_owner": tenant, "is_lora": True,
            "lora_rank": int(m["rank"]), "last_request_time": iso(float(m.get("last") or m["created"])),
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": json.loads(m.get("user_metadata") or "{}") or None}


def adapter_blob(ts: TinkerStore, tenant: str, mid: str, kind: str, name: str) -> AdapterBlob:
    """The adapter of checkpoint tinker://{mid}/{kind}/{name}: a training state's LoRA weights, or a
    sampler snapshot as stored for the generate engines."""
    m = ts.model(tenant, mid)
    if kind == "weights":
        from marlaas.train.tinker_ops import blob_from_state  # torch: only when an archive is asked for

        weights, _ = ts.state(tenant, mid, name)
        return blob_from_state(m, weights)
    if kind == "sampler_weights":
        return ts.store.adapter(AdapterRef(mid, ts.sampler_version(tenant, mid, name)))
    raise NotFound(f"no checkpoint 'tinker://{mid}/{kind}/{name}'")

