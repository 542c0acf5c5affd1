"""The preflight's wait over HTTP: `POST /v1/jobs` with `"preflight": true` answers with the result.

A preflight (`JobSpec.preflight`) is a job record the stations run like any other (the scheduler
dispatches its groups at version 0, the verify station scores them, the tick ends it with its summary:
`marlaas.verify.preflight`); the API process only waits. The wait is asynchronous (no request thread
is held: each look at the job is one short store read on the thread pool, between `asyncio.sleep`s)
and bounded: past `MAX_WAIT_S` the route answers 202 with the job, whose id the caller polls
(`GET /v1/jobs/{id}`: `preflight` holds the result once the status is done).
"""

from __future__ import annotations

import asyncio
import time

from starlette.concurrency import run_in_threadpool

from marlaas.api.access import Principal
from marlaas.types import TERMINAL_STATUSES

MAX_WAIT_S = 60.0
"""The longest a submit waits for its preflight's result before answering 202."""
POLL_S = 0.2


def wanted(spec: object) -> bool:
    """Whether a submitted spec (the request's JSON body) asks for a preflight."""
    return isinstance(spec, dict) and spec.get("preflight") is True


async def wait(svc, principal: Principal, job_id: str, timeout_s: float = MAX_WAIT_S,
               poll_s: float = POLL_S) -> dict:
    """The job's summary once it has ended, or as it is after `timeout_s` (capped at MAX_WAIT_S)."""
    deadline = time.monotonic() + max(0.0, min(timeout_s, MAX_WAIT_S))
    while True:
        st = await run_in_threadpool(svc.get, principal, job_id)
        left = deadline - time.monotonic()
        if st["status"] in TERMINAL_STATUSES or left <= 0:
            return st
        await asyncio.sleep(min(poll_s, left))
