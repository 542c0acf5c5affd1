"""A store that takes long to load (a large append-only file replayed at start) is waited for, with
progress, instead of being reported as a Redis that "did not come up"; errors never show the password."""

import signal
import subprocess
import time

import pytest
import redis

from marlaas.errors import MarlaasError
from marlaas.ops.embedded import embedded_url, redis_argv, wait_for_redis

pytestmark = pytest.mark.integration


def _start(url, data, *extra):
    return subprocess.Popen([*redis_argv(url, data), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(p):
    p.send_signal(signal.SIGTERM)  # Redis writes its append-only file out on SIGTERM
    p.wait(30)


def test_a_loading_store_is_waited_for_with_progress(tmp_path):
    url = embedded_url()
    password = url.split(":")[2].split("@")[0]
    p = _start(url, tmp_path / "data")
    try:
        wait_for_redis(url)
        r = redis.Redis.from_url(url)
        with r.pipeline(transaction=False) as pipe:  # Redis answers clients once per 1,000 keys it loads
            for i in range(5000):
                pipe.set(f"k{i}", "v")
            pipe.execute()
    finally:
        _stop(p)
    # 5,000 keys at 1 ms each: ~5 s of loading, far longer than the 1 s allowed to come up
    p = _start(url, tmp_path / "data", "--key-load-delay", "1000")
    try:
        said: list[str] = []
        t0 = time.time()
        wait_for_redis(url, timeout=1.0, progress=said.append)
        assert time.time() - t0 > 2.0 and redis.Redis.from_url(url).dbsize() == 5000
        assert said and all("is loading its data" in m and "%" in m for m in said)
        assert not any(password in m for m in said)
    finally:
        _stop(p)
    p = _start(url, tmp_path / "data", "--key-load-delay", "1000")
    try:
        with pytest.raises(MarlaasError, match="did not finish loading its data within") as e:
            wait_for_redis(url, timeout=0.5, load_timeout=1.5, progress=lambda m: None)
        assert password not in str(e.value) and ":***@" in str(e.value)
    finally:
        _stop(p)
