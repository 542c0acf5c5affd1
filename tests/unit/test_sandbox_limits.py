"""The sandbox's per-batch bounds: a program forking children that allocate cannot grow past the
batch bound (cgroup v2 memory.max where the host allows it, else RLIMIT_NPROC of 2 per program), a
group's programs run in parallel under one deadline, and `bounded()` stops a batch."""

import time

import pytest

from marlaas.verify import cgroups
from marlaas.verify.sandbox import Limits, SandboxError, bounded, run_batch

pytestmark = pytest.mark.unit

FORKER = """import os
kids = 0
for _ in range(4):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            x = bytearray(200 << 20)  # 200 MiB each
            x[::4096] = b"y" * len(x[::4096])
        except MemoryError:
            pass
        os._exit(0)
    kids += 1
for _ in range(kids):
    os.wait()
print("kids", kids)
"""


def test_children_that_allocate_stay_within_the_batch_bound():
    lim = Limits(cpu_s=5, wall_s=10, memory_mb=256)
    [r] = run_batch([FORKER], lim)
    if cgroups.parent() is None:  # no cgroup here: one child at most, each under RLIMIT_AS
        assert r.ok, r
        assert r.stdout.strip() == "kids 1"
        assert lim.parallel * lim.fallback_processes * lim.memory_mb <= 2048
    else:
        assert lim.batch_memory_mb <= 2048


def test_programs_of_a_batch_run_in_parallel_under_one_deadline():
    t = time.monotonic()
    results = run_batch(["import time\ntime.sleep(1)\n"] * 4, Limits(cpu_s=2, wall_s=3, parallel=4))
    assert all(r.ok for r in results)
    assert time.monotonic() - t < 3.5  # serially it takes 4 s


def test_bounded_stops_a_batch_at_its_deadline_and_on_cancel():
    with bounded(deadline=time.monotonic() + 1.0), pytest.raises(SandboxError):
        run_batch(["import time\ntime.sleep(5)\n"], Limits(cpu_s=6, wall_s=6))
    with bounded(deadline=time.monotonic() - 1), pytest.raises(SandboxError, match="budget"):
        run_batch(["print(1)"])
    t = time.monotonic()
    with bounded(cancelled=lambda: time.monotonic() - t > 0.5), pytest.raises(SandboxError, match="cancelled"):
        run_batch(["import time\ntime.sleep(5)\n"], Limits(cpu_s=6, wall_s=6))
    assert time.monotonic() - t < 3
