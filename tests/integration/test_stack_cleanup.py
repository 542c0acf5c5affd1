"""A process that started a Stack and dies without cleaning up (SIGKILL) takes its stack with it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from marlaas.ops.embedded import _PDEATHSIG, ROOT

pytestmark = pytest.mark.integration

CHILD = """
import sys, time
from pathlib import Path
from marlaas.ops.embedded import Stack
s = Stack(log_dir=Path(sys.argv[1]))
s.start("redis")
print(s.procs["redis"].pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.skipif(not _PDEATHSIG, reason="needs Linux and util-linux's setpriv")
def test_a_killed_owner_leaves_no_stack_behind(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             env={**os.environ, "MARLAAS_HOME": str(tmp_path)}, text=True)
    try:
        redis_pid = int(owner.stdout.readline())
        assert _alive(redis_pid)
        owner.send_signal(signal.SIGKILL)  # no finally, no atexit: only the kernel can tell the child
        owner.wait(timeout=30)
        deadline = time.time() + 30
        while _alive(redis_pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(redis_pid), "the stack's redis-server outlived the process that started it"
    finally:
        if owner.poll() is None:
            owner.kill()
