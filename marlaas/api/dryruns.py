"""Grader dry runs (`POST /v1/graders/run`) off the API's request threads, in limited child processes.

A dry run grades one tenant-supplied sample with a tenant-supplied grader: in-process graders
(string_check, text_similarity, builtin) cost CPU and memory in the process that runs them, python
graders wait on the sandbox. So the API never grades on its own threads:

- each dry run is one child process (`python -m marlaas.api._dry_child`, about 0.3 s to start) limited
  to `memory_mb` of address space (RLIMIT_AS) and `wall_s` seconds of CPU (RLIMIT_CPU) and of wall
  clock (killed past it); a python grader's calls run in the sandbox from there, as in a job;
- the child is started and awaited from a small thread pool of its own (`slots` threads), never the
  API's request thread pool, and the request awaits it asynchronously: authentication, `GET
  /v1/health` and every other route keep their threads whatever tenants' dry runs do;
- at most `slots` dry runs run at once in the process, and at most the plan's
  `max_concurrent_dry_runs` per tenant (the operator and the open single user count as one
  tenant, `None`) across every API process (`caps`, a `SharedCap` in the deployment's Redis; in
  this process only without one); past either bound the request is refused at once with 429
  (RateLimited), never queued.

Invariants: a reservation is always released (the child ended, was killed, or never started); a
child that dies or runs past its limits is the dry run's error line (reward 0.0), not a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marlaas.errors import RateLimited, SpecError, one_line

SLOTS = 8
"""Dry runs at once per API process (every tenant together)."""
WALL_S = 30.0
"""Wall-clock and CPU seconds of one dry run (the sandbox's python calls included)."""
MEMORY_MB = 1024
"""Address space of one dry run's child (the interpreter and the similarity libraries take ~200 MB)."""


class DryRuns:
    """The process's dry-run slots and children (one per API app)."""

    def __init__(self, home: str | None = None, slots: int = SLOTS, wall_s: float = WALL_S,
                 memory_mb: int = MEMORY_MB, caps=None):
        self.home, self.slots, self.wall_s, self.memory_mb = home, slots, wall_s, memory_mb
        self.caps = caps  # a marlaas.api.ratelimit.SharedCap: the per-tenant cap across API processes
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="marlaas-dry-run")
        self._lock = threading.Lock()  # guards the counters only, held for a few instructions
        self._running: dict[str | None, int] = {}
        self._total = 0

    def running(self, tenant: str | None = None) -> int:
        """The tenant's dry runs running now (None: the operator's and the open single user's)."""
        with self._lock:
            return self._running.get(tenant, 0)

    def _reserve(self, tenant: str | None, cap: int) -> str | None:
        """Take a place of the process and one of the tenant's (RateLimited when either is full);
        returns the tenant's shared hold (None without `caps`)."""
        def refused(mine: int) -> RateLimited:
            return RateLimited(f"too many dry runs at once: {mine} of this tenant's are running (plan: "
                               f"max_concurrent_dry_runs {cap}); retry when one has ended", 1.0)

        with self._lock:
            mine = self._running.get(tenant, 0)
            if self.caps is None and mine >= cap:
                raise refused(mine)
            if self._total >= self.slots:
                raise RateLimited(f"the server is running its {self.slots} dry runs at once; retry in a moment", 1.0)
            self._running[tenant] = mine + 1
            self._total += 1
        if self.caps is None:
            return None
        try:
            hold = self.caps.take(tenant, cap)
        except BaseException:
            self._release(tenant, None)
            raise
        if hold is None:
            self._release(tenant, None)
            raise refused(cap)
        return hold

    def _release(self, tenant: str | None, hold: str | None) -> None:
        with self._lock:
            self._total -= 1
            left = self._running.get(tenant, 1) - 1
            if left > 0:
                self._running[tenant] = left
            else:
                self._running.pop(tenant, None)
        if hold is not None:
            self.caps.release(tenant, hold)

    async def run(self, tenant: str | None, cap: int, grader: dict, item: Mapping, output_text: str,
                  registered: Mapping[str, str]) -> dict:
        """{"reward", "error", "sub_rewards"} of one dry run; RateLimited past the caps; SpecError when
        the grader cannot load."""
        hold = self._reserve(tenant, cap)
        try:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(self._pool, self._call, grader, dict(item), output_text,
                                             dict(registered))
        finally:
            self._release(tenant, hold)
        if "fail" in out:
            raise SpecError(out["fail"])
        return out

    def _call(self, grader: dict, item: dict, output_text: str, registered: dict) -> dict:
        """Run the child, wait for its answer at most wall_s, kill it past that (on a pool thread)."""
        request = json.dumps({"grader": grader, "item": item, "output_text": output_text, "registered": registered,
                              "home": self.home, "memory_mb": self.memory_mb, "cpu_s": int(self.wall_s)})
        try:
            proc = subprocess.run([sys.executable, "-m", "marlaas.api._dry_child"], input=request,
                                  capture_output=True, text=True, timeout=self.wall_s,
                                  cwd=str(Path.cwd()))  # registered verifiers import as in this process
        except subprocess.TimeoutExpired:
            return self._failed(f"the dry run took more than {self.wall_s:.0f} s")
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return self._failed(f"the grader needed more than {self.wall_s:.0f} s of CPU or {self.memory_mb} MB "
                                f"(exit {proc.returncode}: {one_line(tail, 120)})")
        return json.loads(proc.stdout)

    @staticmethod
    def _failed(why: str) -> dict:
        return {"reward": 0.0, "error": why, "sub_rewards": {}}

    def close(self) -> None:
        """Stop taking dry runs (the threads end with their current child)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
