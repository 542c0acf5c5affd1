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
takes nothing from it. `SharedCap` is the plan's concurrency caps (dry runs running, event streams
open at once per tenant), in the same Redis for the same reason.
"""

from __future__ import annotations

import math
import time
import uuid

from limits import RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.errors import StorageError
from limits.storage import MemoryStorage, RedisStorage, Storage
from limits.strategies import MovingWindowRateLimiter
from redis import ConnectionPool

from marlaas.errors import StoreUnavailable, one_line
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


_TAKE_HOLD = """
-- KEYS: the tenant's holds (zset hold -> until, in ms of the Redis clock); ARGV: cap, hold id, ttl ms.
-- Drops holds past their time, then adds this one iff fewer than cap remain. 1: taken, 0: refused.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

_RENEW_HOLD = """
-- KEYS: the tenant's holds; ARGV: hold id, ttl ms. Moves the hold's time on iff it is still held.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2])) end
return 1
"""


class SharedCap:
    """At most `cap` things of one kind held at once per tenant (dry runs running, event streams open),
    counted in Redis so that every API process takes from the same count.

    Invariants: a hold is taken in one script (two processes asking for the last place never both get
    it); every hold has a time limit (`ttl_s`, on the Redis server's clock), so a process killed while
    holding frees its places by itself: a long hold (an event stream) renews itself while it lasts; the
    tenant's key expires with its last hold. A Redis failure is `StoreUnavailable` (503)."""

    def __init__(self, r, kind: str, ttl_s: float):
        self.r, self.kind, self.ttl_ms = r, kind, max(1000, int(ttl_s * 1000))
        self._take, self._renew = r.register_script(_TAKE_HOLD), r.register_script(_RENEW_HOLD)

    def _key(self, tenant: str | None) -> str:
        return f"{RATELIMIT}:hold:{self.kind}:{'-' if tenant is None else tenant}"

    def _call(self, fn, *args):
        import redis

        try:
            return fn(*args)
        except redis.RedisError as e:
            raise StoreUnavailable(f"the concurrency caps' store does not answer ({one_line(str(e), 120)})") from None

    def take(self, tenant: str | None, cap: int) -> str | None:
        """A hold id when the tenant holds fewer than `cap` now (it holds one more), else None."""
        hold = uuid.uuid4().hex
        ok = self._call(self._take, [self._key(tenant)], [cap, hold, self.ttl_ms])
        return hold if int(ok) else None

    def renew(self, tenant: str | None, hold: str) -> bool:
        """Move the hold's time limit on (False: it had already run out)."""
        return bool(int(self._call(self._renew, [self._key(tenant)], [hold, self.ttl_ms])))

    def release(self, tenant: str | None, hold: str) -> None:
        self._call(self.r.zrem, self._key(tenant), hold)

    def held(self, tenant: str | None) -> int:
        """Holds of the tenant not yet past their time (as the Redis clock reads now)."""
        secs, micros = self._call(self.r.time)
        return int(self._call(self.r.zcount, self._key(tenant), secs * 1000 + micros // 1000, "+inf"))
