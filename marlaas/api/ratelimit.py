"""The API's per-caller rate limit, kept in the deployment's Redis so that it holds across API processes.

Built on the `limits` library (the storage and moving-window strategy `slowapi` uses), not a hand-written
bucket: every API process behind a proxy takes from the same budget, so adding processes never
multiplies a tenant's rate.

Invariants: a caller may send at most `burst` requests (at least `rate` x window) in any moving window
of `window` = round(burst / rate) seconds (at least 1): `rate` per second sustained, `burst` back to back;
rate 0 disables the limit; the budget lives under the store's `RATELIMIT` prefix, keyed by the caller's
key (a hash of its token, or its peer address), so two processes on one Redis share one budget; a Redis
failure is `StoreUnavailable` (503), never a silent pass. Without a Redis connection pool (unit use)
the budget is in-process memory.

`PlanLimiter` is the same over a tenant's plan: a named budget per tenant (serving requests and tokens
per minute), where one request may cost more than one unit; a request that would pass the budget
takes nothing from it.
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.errors import StorageError
from limits.storage import MemoryStorage, RedisStorage, Storage
from limits.strategies import MovingWindowRateLimiter
from redis import ConnectionPool

from marlaas.errors import StoreUnavailable
from marlaas.store.keys import RATELIMIT


def _limiter(pool: ConnectionPool | None, prefix: str) -> MovingWindowRateLimiter:
    """A moving-window limiter over Redis through `pool` under `prefix` (in memory without a pool)."""
    storage: Storage = (MemoryStorage() if pool is None else
                        RedisStorage("redis://", connection_pool=pool, key_prefix=prefix, wrap_exceptions=True))
    return MovingWindowRateLimiter(storage)


class RateLimiter:
    """A moving window per caller key: `rate` requests per second sustained, `burst` at most at once,
    in Redis through `pool` (the store's connection pool) or in memory without one."""

    def __init__(self, rate: float, burst: int, pool: ConnectionPool | None = None):
        self.rate, self.burst = rate, burst
        self.window = max(1, round(burst / rate)) if rate > 0 else 1
        self.item = RateLimitItemPerSecond(max(burst, math.ceil(rate * self.window)), self.window)
        self.limiter = _limiter(pool, RATELIMIT)

    def take(self, key: str) -> float:
        """0 when the caller may go on (one request counted), else the seconds until it may retry."""
        if self.rate <= 0:
            return 0.0
        try:
            if self.limiter.hit(self.item, key):
                return 0.0
            reset = self.limiter.get_window_stats(self.item, key).reset_time
        except StorageError as e:
            raise StoreUnavailable(f"the rate limit's store does not answer ({e.storage_error})") from None
        return max(reset - time.time(), 0.1)


class PlanLimiter:
    """Per-tenant budgets of the plan over a moving 60 s window, in Redis through `pool` (in memory
    without one): `take(tenant, [(name, per_minute, cost), ...])`."""

    def __init__(self, pool: ConnectionPool | None = None):
        self.limiter = _limiter(pool, RATELIMIT + "plan:")

    def take(self, tenant: str, budgets: list[tuple[str, int, int]]) -> tuple[str, float] | None:
        """None when each (name, per_minute, cost) fits in the tenant's budget of that name (all are
        then taken), else (the first name that does not fit, seconds until enough may have drained)
        and nothing is taken. Two processes may both pass the check at once: the budget may be
        exceeded by what they take together, never more."""
        try:
            for name, per_minute, cost in budgets:
                item = RateLimitItemPerMinute(per_minute)
                if not self.limiter.test(item, name, tenant, cost=cost):
                    reset = self.limiter.get_window_stats(item, name, tenant).reset_time
                    return name, max(reset - time.time(), 0.1)
            for name, per_minute, cost in budgets:
                self.limiter.hit(RateLimitItemPerMinute(per_minute), name, tenant, cost=cost)
        except StorageError as e:
            raise StoreUnavailable(f"the rate limit's store does not answer ({e.storage_error})") from None
        return None
