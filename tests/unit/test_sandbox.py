"""The code sandbox contains hostile programs: each is scored not-ok, and the caller keeps working.

One batch holds all the hostile programs (one runner process, as in production), with short limits
to keep the run fast; each test then checks its own program's result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlaas.verify import sandbox
from marlaas.verify.sandbox import Limits, RunResult, SandboxError, probe, run_batch

pytestmark = pytest.mark.unit

FAST = Limits(cpu_s=1, wall_s=1.5)
SECRET = "marlaas-fake-secret-7f3a"

HOSTILE = {
    "loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n",
    "huge_output": "print('x' * 10 ** 7)\n",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n",
    "dns": "import socket\nsocket.getaddrinfo('example.com', 80)\n",
    "kill_all": "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
    "exit_zero": "import os\nos._exit(0)\n",
    "sys_exit": "import sys\nsys.exit(0)\n",
    "big_file": "open('big.bin', 'wb').write(b'x' * (2 << 20))\n",
    "env_secret": f"import os\nassert not any({SECRET!r} in v for v in os.environ.values()), 'secret visible'\n",
    "proc_environ": (
        "import os\nfound = []\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        f"            found += [pid] if {SECRET.encode()!r} in f.read() else []\n"
        "    except OSError:\n"
        "        pass\n"
        "print('FOUND' if found else 'CLEAN')\n"
    ),
    "passwd": "print(open('/etc/passwd').read()[:4])\n",
    "unix_socket": "import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nprint('opened')\n",
    "last": "print('still fine')\n",
}


@pytest.fixture(scope="module")
def isolation() -> dict:
    return probe(FAST)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, isolation) -> dict[str, RunResult]:
    outside = tmp_path_factory.mktemp("outside")
    from marlaas.settings import get_settings

    home = get_settings().home
    home.mkdir(parents=True, exist_ok=True)
    (home / "service-secret.txt").write_text("redis://:password@127.0.0.1:1/0")
    readme = Path(__file__).resolve().parents[2] / "README.md"
    programs = dict(HOSTILE, write_outside=f"open({str(outside / 'pwned')!r}, 'w').write('x')\n",
                    service_home=f"import os\nprint(sorted(os.listdir({str(home)!r})))\n",
                    project_file=f"print(open({str(readme)!r}).read()[:9])\n")
    # A process with the secret in its *initial* environment, as a worker started with credentials.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "MARLAAS_TEST_SECRET": SECRET}
    )
    old = os.environ.get("MARLAAS_TEST_SECRET")
    os.environ["MARLAAS_TEST_SECRET"] = SECRET
    try:
        results = run_batch(list(programs.values()), FAST)
    finally:
        holder.kill()
        holder.wait()
        if old is None:
            del os.environ["MARLAAS_TEST_SECRET"]
        else:
            os.environ["MARLAAS_TEST_SECRET"] = old
    by_name = dict(zip(programs, results))
    by_name["_outside"] = outside  # type: ignore[assignment]
    return by_name


def test_plain_programs_run_and_report():
    ok, failing, crashing = run_batch(["print(6 * 7)", "assert 1 == 2", "import ctypes\nctypes.string_at(0)"], FAST)
    assert ok == RunResult(ok=True, status="ok", stdout="42\n", error="")
    assert failing.status == "error" and failing.error.startswith("AssertionError")
    assert crashing.status == "killed" and "SIGSEGV" in crashing.error
    assert run_batch([]) == []


def test_infinite_loop_is_stopped(hostile):
    assert hostile["loop"].status == "timeout" and not hostile["loop"].ok


def test_sleeping_program_hits_the_wall_clock(hostile):
    assert hostile["sleep"].status == "timeout" and "wall-clock" in hostile["sleep"].error


def test_fork_bomb_is_contained(hostile):
    assert not hostile["fork_bomb"].ok
    assert hostile["fork_bomb"].status in ("error", "timeout")


def test_memory_bomb_is_contained(hostile):
    assert not hostile["memory_bomb"].ok
    assert "MemoryError" in hostile["memory_bomb"].error or hostile["memory_bomb"].status == "killed"


def test_huge_output_is_capped(hostile):
    assert hostile["huge_output"].ok  # printing is allowed; what comes back is capped
    assert len(hostile["huge_output"].stdout) <= FAST.output_bytes


def test_network_is_unreachable(hostile):
    for name in ("network", "dns"):
        assert not hostile[name].ok
        assert hostile[name].status == "error"


def test_kill_all_reaches_nothing_outside(hostile):
    # the caller (this process) is alive, and the rest of the batch still ran. (kill(-1) itself may
    # "succeed" with programs in parallel lanes: the kernel counts the lanes it may not signal.)
    assert hostile["last"] == RunResult(ok=True, status="ok", stdout="still fine\n", error="")


def test_exiting_early_never_counts_as_a_pass(hostile):
    assert hostile["exit_zero"].status == "error" and not hostile["exit_zero"].ok
    assert hostile["sys_exit"].status == "error" and "SystemExit" in hostile["sys_exit"].error


def test_file_size_is_capped(hostile):
    assert not hostile["big_file"].ok and "File too large" in hostile["big_file"].error


def test_environment_secrets_are_not_visible(hostile, isolation):
    assert hostile["env_secret"].ok, hostile["env_secret"].error
    if not (isolation["private_proc"] or isolation["uid"].startswith("dropped")):
        pytest.skip("no pid namespace and same uid: /proc/<pid>/environ of the worker is readable here")
    assert hostile["proc_environ"].stdout == "CLEAN\n"


def test_writes_outside_the_sandbox_are_refused(hostile, isolation):
    if isolation["readonly_fs"] != "yes" and not isolation["uid"].startswith("dropped"):
        pytest.skip("no mount namespace and same uid: the worker's files are writable here")
    assert not hostile["write_outside"].ok
    assert not (hostile["_outside"] / "pwned").exists()


def test_unix_sockets_are_refused_too(hostile):
    assert not hostile["unix_socket"].ok and "opened" not in hostile["unix_socket"].stdout


def test_the_services_own_files_are_hidden(hostile, isolation):
    if "mount" not in isolation["namespaces"]:
        pytest.skip("no mount namespace here: the service directories cannot be covered")
    assert hostile["service_home"].ok and hostile["service_home"].stdout == "[]\n"  # credentials out of sight
    assert not hostile["project_file"].ok  # the source checkout too


def test_reading_world_readable_files_is_not_prevented(hostile):
    # Documented limit: no chroot, so world-readable system files stay readable.
    assert hostile["passwd"].ok and hostile["passwd"].stdout == "root\n"


def test_fallback_without_namespaces_still_contains(tmp_path):
    lim = Limits(cpu_s=1, wall_s=1.5, namespaces=False)
    iso = probe(lim)
    assert iso["namespaces"] == []
    bomb, net, kill_all, last = run_batch(
        [HOSTILE["fork_bomb"], HOSTILE["network"], HOSTILE["kill_all"], HOSTILE["last"]], lim
    )
    assert not bomb.ok and not net.ok and not kill_all.ok
    assert last.ok and last.stdout == "still fine\n"


def test_a_hung_runner_is_killed_by_the_caller(tmp_path, monkeypatch):
    hung = tmp_path / "hung_runner.py"
    hung.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(sandbox, "RUNNER", hung)
    start = time.monotonic()
    with pytest.raises(SandboxError, match="exceeded"):
        run_batch(["pass"], Limits(wall_s=0.2, batch_overhead_s=0.3))
    assert time.monotonic() - start < 5


def test_caller_keeps_working_after_the_hostile_batch(hostile):
    assert run_batch(["print('again')"], FAST)[0].stdout == "again\n"
