"""Tinker futures as the SDK retrieves them: a long poll, then the result in the shape the SDK asks for.

Invariants: `wait` returns within about `long_poll_s` (the store is read in a thread, so the event loop
never blocks on Redis); a pending future answers HTTP 408 {"type": "try_again", "queue_state": "active"}
(the SDK retries at once); a failed op answers 200 {"error", "category"} (the SDK raises
RequestFailedError); ForwardBackwardOutput and SampleResponse are protobuf when the SDK accepts it.
"""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from marlaas.api.tinker import protowire
from marlaas.api.tinker.wire import PROTO
from marlaas.store.tinker import TinkerStore

LONG_POLL_S = 5.0
POLL_INTERVAL_S = 0.05


async def wait(ts: TinkerStore, tenant: str, rid: str, long_poll_s: float = LONG_POLL_S) -> dict:
    """The future `rid` of `tenant` once it has ended, or still pending after `long_poll_s` (NotFound
    for an unknown or another tenant's request)."""
    deadline = time.monotonic() + long_poll_s
    while True:
        f = await run_in_threadpool(ts.future, tenant, rid)
        if f["status"] != "pending" or time.monotonic() >= deadline:
            return f
        await asyncio.sleep(POLL_INTERVAL_S)


def response(f: dict, rid: str, proto: bool) -> Response:
    """The HTTP answer to retrieve_future for future `f` (protobuf results when `proto`)."""
    if f["status"] == "pending":
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408)
    if f["status"] == "failed":
        return JSONResponse({"error": f["error"], "category": f["category"]})
    result = f["result"]
    if f["kind"] in ("forward", "forward_backward"):
        return _fwdbwd_output(result, proto)
    if f["kind"] == "sample":
        if proto:
            return Response(protowire.write_sample_response(result["sequences"], result.get("prompt_logprobs")),
                            media_type=PROTO)
        return JSONResponse({"type": "sample", **result})
    return JSONResponse(result)


def _fwdbwd_output(result: dict, proto: bool) -> Response:
    outs = [{k: tuple(v) for k, v in o.items()} for o in result["outputs"]]
    if proto:
        return Response(protowire.write_forward_backward_output(outs, result["metrics"]), media_type=PROTO)
    return JSONResponse({"loss_fn_output_type": "ArrayRecord", "metrics": result["metrics"],
                         "loss_fn_outputs": [{k: {"data": v[1], "dtype": v[0], "shape": [len(v[1])]}
                                              for k, v in o.items()} for o in outs]})
