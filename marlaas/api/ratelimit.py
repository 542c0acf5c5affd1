"""The API's per-caller rate limit: one in-process token bucket per token (per peer address without one).

Invariants: thread-safe; the least recently used keys beyond `max_keys` are forgotten, which only ever
gives a caller a full bucket back; rate 0 disables the limit. With several server processes, each has
its own buckets.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class RateLimiter:
    """Token buckets keyed by caller: `rate` tokens per second, `burst` at most."""

    def __init__(self, rate: float, burst: int, max_keys: int = 65_536):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: str, now: float | None = None) -> float:
        """0 when the caller may go on (one token taken), else the seconds until a token is back."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens - 1.0 if wait == 0.0 else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait
