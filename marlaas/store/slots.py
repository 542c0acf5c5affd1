"""A station pool's processes per tenant (the verify pool): who holds one now, who wants one.

The verify task asks `PoolSlots.take` before it runs and `release`s after; the decision itself is
the scheduler's pure `may_take_slot`, passed in as `decide`, run on a consistent read (WATCH/MULTI:
two processes asking at once never both take the last process of a share). Keys, all under the
station's name:

- `m:pool:<station>:run`  hash process -> "tenant\\tuntil": the process runs a task of the tenant
  until `until` at the latest (a process killed mid-task leaves an entry that ends by itself; a
  process runs one task at a time, so its next take replaces it);
- `m:pool:<station>:want` zset tenant -> when it last asked (taken or refused): the tenants with work
  waiting are those that asked within `want_s` (a reservation: a tenant whose tasks come one at a
  time keeps its share between them), until the tenant's last running job ends (`forget`: a
  tenant with nothing left to verify reserves nothing, so the next tenant, alone, gets the pool);
- `m:pool:<station>:procs` zset process -> when it last asked: the pool's size is the processes
  seen within `seen_s` (a pool under contention is busy, so all of its processes are seen).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from marlaas.store.keys import P


def _key(station: str, what: str) -> str:
    return f"{P}pool:{station}:{what}"


@dataclass(frozen=True)
class PoolState:
    """One read of a pool: processes held per tenant, tenants waiting, the pool's size."""

    running: dict[str, int] = field(default_factory=dict)
    waiting: frozenset[str] = frozenset()
    capacity: int = 1


def forget(r, tenant: str, stations: tuple[str, ...] = ("verify",)) -> None:
    """The tenant has no job left: its want marks go (it waits for no process any more)."""
    for station in stations:
        r.zrem(_key(station, "want"), tenant)


class PoolSlots:
    """Per-tenant slots of one station pool over a `marlaas.store.Store`'s connection."""

    def __init__(self, store, station: str = "verify", hold_s: float = 600.0, want_s: float = 10.0,
                 seen_s: float = 600.0):
        self.r = store.r
        self.run_key, self.want_key, self.procs_key = (_key(station, w) for w in ("run", "want", "procs"))
        self.hold_s, self.want_s, self.seen_s = hold_s, want_s, seen_s

    def _read(self, pipe, now: float) -> PoolState:
        running: dict[str, int] = {}
        for raw in pipe.hvals(self.run_key):
            tenant, _, until = raw.decode().rpartition("\t")
            if float(until or 0) > now:
                running[tenant] = running.get(tenant, 0) + 1
        waiting = frozenset(t.decode() for t in pipe.zrangebyscore(self.want_key, now - self.want_s, "+inf"))
        seen = int(pipe.zcount(self.procs_key, now - self.seen_s, "+inf"))
        return PoolState(running, waiting, max(1, seen))

    def state(self, now: float | None = None) -> PoolState:
        return self._read(self.r, time.time() if now is None else now)

    def take(self, tenant: str, process: str, decide: Callable[[PoolState], bool], now: float | None = None) -> bool:
        """Mark the tenant waiting and this process seen; then, if `decide(state)` (state read with
        this process already counted in the pool and not holding anything), hold a process for the
        tenant. True when held."""
        now = time.time() if now is None else now
        p = self.r.pipeline(transaction=False)
        p.zadd(self.procs_key, {process: now})
        p.hdel(self.run_key, process)  # whatever this process held before ended with its last task
        p.zremrangebyscore(self.procs_key, "-inf", now - self.seen_s)
        p.zremrangebyscore(self.want_key, "-inf", now - self.want_s)
        p.execute()
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.run_key)
                    ok = decide(self._read(pipe, now))
                    pipe.multi()
                    pipe.zadd(self.want_key, {tenant: now})
                    if ok:
                        pipe.hset(self.run_key, process, f"{tenant}\t{now + self.hold_s}")
                    pipe.execute()
                    return ok
                except redis.WatchError:
                    continue

    def release(self, process: str) -> None:
        """The process's task ended: its hold ends (the tenant's want mark stays for `want_s`)."""
        self.r.hdel(self.run_key, process)
