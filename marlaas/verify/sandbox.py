"""Run untrusted (model-written) Python programs in a batch sandbox; the only place such code runs.

`run_batch(programs)` starts ONE fresh `python -I -S` process per batch (`sys.executable`, isolated
mode, no site-packages) with an empty environment (no PATH, no LD_PRELOAD, no thread variables, no
secrets: vLLM edits the worker's environment and the worker may hold credentials) and a private
temporary working directory that is deleted afterwards. The batch travels as JSON on stdin and the
results come back as JSON on stdout. Inside, `_sandbox_runner.py` runs each program in its own forked
child, one after another, under `Limits`. The caller also bounds the whole batch with a wall-clock
timeout (kills the runner's process group), so nothing can hang the verify worker.

What the sandbox contains (each layer is best effort; `probe()` says which applied on this machine):

- CPU (RLIMIT_CPU), address space (RLIMIT_AS), processes (RLIMIT_NPROC: fork bombs), file size
  (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps; wall-clock per program (killed by the
  parent); stdout+stderr captured and capped.
- Network: an empty network namespace (`unshare(CLONE_NEWNET)`, inside a user namespace when not
  root) and a seccomp filter that refuses every socket, AF_UNIX included (a path socket would reach
  host services whatever the namespace), plus io_uring. Fail closed: where the filter is refused, no
  program runs (each gets an error) unless MARLAAS_SANDBOX_STRICT=0, which falls back to replacing
  Python's socket functions (weak: a determined program gets around that).
- Environment secrets: the sandbox's environment is empty. With a pid namespace and a fresh /proc the
  program cannot read other processes' /proc/<pid>/environ or memory either; when the worker runs as
  root, programs also run under an unprivileged uid, which the kernel forbids from reading them.
- Signals: a pid namespace (the runner's init is pid 1; leftovers die with it); without one, a per-
  program unprivileged uid when root. Every process a program leaves behind is killed after it.
- Files: with a mount namespace every mount is read-only and the working directory is a small
  private tmpfs that vanishes with the batch, so programs cannot modify the project, the adapters or
  anything else, nor fill the disk. The service's own directories ($MARLAAS_HOME with the store's
  credentials, the source checkout, the worker's home unless the interpreter lives there) are covered
  by an empty tmpfs. Reading the rest is NOT prevented: world-readable system files (e.g. /etc/passwd)
  and, when the worker is not root, other files the worker's user can read stay readable. Running
  the verify worker as a dedicated user (or as root, so that programs drop to an unprivileged uid)
  keeps private files out of reach.

What it does NOT contain (honest list, also in the report to the lead):

- Not a security boundary against kernel exploits, nor a VM: same kernel, no chroot.
- File reads as described above; with the mount namespace refused, writes wherever the worker's user
  (or, when root, an unprivileged uid) may write, capped per file by RLIMIT_FSIZE only.
- Memory per batch: where the host allows a cgroup v2 (`marlaas.verify.cgroups`), the batch runs in
  its own group with `memory.max`, `pids.max` and `cpu.max` (Limits.batch_*). Elsewhere each program
  may fork one child at most (RLIMIT_NPROC `fallback_processes`, when root: a uid per program), so a
  batch holds at most parallel x fallback_processes x memory_mb; and at most MARLAAS_SANDBOX_BATCHES
  batches run at once per host (a file lock per slot). CPU is capped per process, time per program
  by the wall clock, the batch by ONE deadline, the sum of its programs' wall limits (its programs
  run `parallel` at once; `bounded()` narrows it to the caller's grading budget and stops a
  cancelled job's batch).
- Without a pid namespace and not root: a program may signal processes of the worker's user
  (including the worker) and processes it started with a new session can outlive it.
- A program can forge a pass only by deliberately introspecting the harness (its frames hold the
  nonce); plain tricks (`sys.exit`, `os._exit`, exceptions, killing itself) never count as a pass.
- Programs of one batch see each other's directories only when the tmpfs is unavailable, and share
  one namespace set (one program may kill a sibling of the same group).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from marlaas.errors import MarlaasError, SandboxError  # noqa: F401  (SandboxError re-exported)
from marlaas.verify import cgroups

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("_sandbox_runner.py")

Status = Literal["ok", "error", "timeout", "killed"]


def _default_parallel() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True)
class Limits:
    """Per-program limits of the sandbox (each program of a batch gets all of them)."""

    cpu_s: int = 2
    """CPU seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL one second later)."""
    wall_s: float = 3.0
    """Wall-clock seconds before the parent kills the program (sleeping programs use no CPU)."""
    memory_mb: int = 256
    """Address space per process in MiB (RLIMIT_AS): allocations beyond it raise MemoryError."""
    processes: int = 16
    """Processes of the program's user (RLIMIT_NPROC): stops fork bombs."""
    file_bytes: int = 1 << 20
    """Largest file a program may write (RLIMIT_FSIZE); a bigger write raises OSError."""
    open_files: int = 32
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 4096
    """stdout+stderr kept per program; the rest is read and dropped."""
    tmpfs_mb: int = 16
    """Size of the private working tmpfs of a batch (when a mount namespace is available)."""
    namespaces: bool = True
    """Try Linux namespaces (net, pid, mount...); False tests the fallbacks."""
    uid_base: int = 50000
    """When the worker runs as root, programs run as uid_base + random offset + index."""
    uid_span: int = 9000
    """Range of that random offset (kept under 65536 for containers that map only 64 K ids)."""
    batch_overhead_s: float = 10.0
    """Extra seconds the caller allows a batch beyond its programs' wall limits (run `parallel` at once)."""
    parallel: int = field(default_factory=lambda: _default_parallel())
    """Programs of one batch run at once (a group's calls in parallel under ONE batch deadline): up to
    4, half the host's CPUs (every verify process runs its own batch, and a program starved of CPU
    would time out at `wall_s` and score as wrong), at least 1."""
    batch_memory_mb: int = 2048
    """Memory of the whole batch (cgroup v2 `memory.max`, swap 0): every program and child together."""
    batch_pids: int = 64
    """Processes of the whole batch (cgroup v2 `pids.max`)."""
    batch_cpus: float = 2.0
    """CPUs of the whole batch (cgroup v2 `cpu.max`)."""
    fallback_processes: int = 2
    """Without a cgroup: RLIMIT_NPROC of each program (itself and one child), so a batch's memory
    stays within parallel x fallback_processes x memory_mb."""


@dataclass(frozen=True)
class RunResult:
    """The outcome of one program."""

    ok: bool
    """The program ran to its end without an uncaught exception, exit or signal."""
    status: Status
    """ok | error (exception, exit before the end) | timeout (CPU or wall clock) | killed (signal)."""
    stdout: str
    """Captured stdout+stderr, capped at Limits.output_bytes."""
    error: str
    """One line ('' when ok)."""


def _clean_env() -> dict[str, str]:
    # Deliberately empty: no PATH, LD_PRELOAD, *_NUM_THREADS, credentials... Python needs none of them.
    return {}


_service_home: str | None = None


def set_service_home(path: str | os.PathLike) -> None:
    """The service's home directory (Settings.home: the store's credentials, logs, the embedded
    stack), hidden from every sandboxed program. Set by the process edge that runs the sandbox
    (workers/verify.py) from its settings, before any program runs."""
    global _service_home
    _service_home = str(path)


def _home() -> str:
    """The configured service home; in a process whose edge did not set it, the settings' home, read
    here as the one fallback: hiding the home fails closed, never open."""
    if _service_home is None:
        from marlaas.settings import get_settings

        return str(get_settings().home)
    return _service_home


def _policy() -> dict:
    """The sandbox policy of this deployment: fail closed without the seccomp socket filter unless
    MARLAAS_SANDBOX_STRICT=0, and the service directories to hide from programs."""
    project = str(Path(__file__).resolve().parents[2])
    return {"strict": os.environ.get("MARLAAS_SANDBOX_STRICT", "1") != "0",
            "hide": [_home(), project, os.path.expanduser("~")]}


def _run(programs: list[str], limits: Limits) -> dict:
    # The batch's deadline is the sum of its programs' wall limits, as if run one by one: lanes make a
    # batch faster where CPUs are free, but on a busy host they share the CPUs, and a deadline divided
    # by the lanes killed whole batches (every call an error) that would have finished.
    budget = len(programs) * (limits.wall_s + 0.5) + limits.batch_overhead_s
    deadline, cancelled = _BOUNDS.get()
    if deadline is not None:
        budget = min(budget, deadline - time.monotonic())
        if budget <= 0:
            raise SandboxError("the grading time budget is spent (the plan's grader seconds): not run")
    with host_slot(_host_batches(), budget), cgroups.batch_group(limits) as group:
        if group is None:  # no cgroup: each program may fork one child at most
            limits = replace(limits, processes=min(limits.processes, limits.fallback_processes))
        reply = _start(programs, limits, budget, group, cancelled)
    reply.setdefault("isolation", {})["cgroup"] = cgroups.describe(group, limits)
    return reply


def _start(programs: list[str], limits: Limits, budget: float, group, cancelled) -> dict:
    payload = json.dumps({"programs": programs, "limits": {**asdict(limits), **_policy()}}).encode()
    workdir = tempfile.mkdtemp(prefix="marlaas-sandbox-")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_clean_env(),
            close_fds=True,
            start_new_session=True,  # one process group to kill on overrun
        )
        if group is not None:  # before it reads its input, so before it forks anything
            cgroups.enter(group, proc.pid)
        out, err = _communicate(proc, payload, budget, cancelled, len(programs))
    except OSError as e:
        raise SandboxError(f"cannot start the sandbox: {e}") from e
    finally:
        try:
            shutil.rmtree(workdir)
        except OSError as e:  # a program may leave an undeletable tree; the batch result still stands
            log.warning("sandbox cleanup of %s failed: %s", workdir, e)
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()
        raise SandboxError(f"sandbox runner failed (exit {proc.returncode}): {tail[-1] if tail else 'no output'}")
    try:
        return json.loads(out)
    except ValueError as e:
        raise SandboxError(f"sandbox runner returned invalid JSON: {e}") from e


def _communicate(proc, payload: bytes, budget: float, cancelled, n: int) -> tuple[bytes, bytes]:
    """The runner's output; its process group killed (SandboxError) past `budget` seconds or as soon
    as `cancelled()` says so (checked every CANCEL_CHECK_S)."""
    end = time.monotonic() + budget
    data: bytes | None = payload
    while True:
        left = end - time.monotonic()
        try:
            return proc.communicate(data, timeout=max(0.01, min(left, CANCEL_CHECK_S)))
        except subprocess.TimeoutExpired:
            data = None  # sent already: communicate() goes on where it stopped
            why = None
            if time.monotonic() >= end:
                why = f"sandbox batch of {n} programs exceeded {budget:.0f} s"
            elif cancelled is not None and cancelled():
                why = "the job was cancelled: its sandbox batch was stopped"
            if why is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise SandboxError(why) from None


CANCEL_CHECK_S = 1.0
_BOUNDS: ContextVar[tuple[float | None, Callable[[], bool] | None]] = ContextVar("sandbox_bounds",
                                                                                 default=(None, None))


@contextmanager
def bounded(deadline: float | None = None, cancelled: Callable[[], bool] | None = None) -> Iterator[None]:
    """Every sandbox batch run inside the block ends by `deadline` (a `time.monotonic()` value: the
    verify station's grading budget of a step or evaluation) and is stopped once `cancelled()` is
    true (its job was cancelled); either ends the batch with a SandboxError (all its calls erred)."""
    token = _BOUNDS.set((deadline, cancelled))
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def _host_batches() -> int:
    """Sandbox batches at once on this host (MARLAAS_SANDBOX_BATCHES; default: the CPUs, at least 2)."""
    return max(1, int(os.environ.get("MARLAAS_SANDBOX_BATCHES", "0") or 0) or max(2, os.cpu_count() or 2))


@contextmanager
def host_slot(slots: int, wait_s: float) -> Iterator[int]:
    """Hold one of the host's `slots` sandbox batch slots (an flock on a file per slot, shared by
    every process of the host) for the block; waits up to `wait_s`, then SandboxError."""
    folder = Path(tempfile.gettempdir()) / "marlaas-sandbox-slots"
    folder.mkdir(mode=0o700, exist_ok=True)
    end = time.monotonic() + wait_s
    while True:
        for i in range(slots):
            fd = os.open(folder / f"{i}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield i
            finally:
                os.close(fd)  # closing releases the lock
            return
        if time.monotonic() >= end:
            raise SandboxError(f"all {slots} sandbox slots of this host stayed busy for {wait_s:.0f} s")
        time.sleep(0.05)


def run_batch(programs: list[str], limits: Limits | None = None) -> list[RunResult]:
    """Run each program (Python source, executed as `__main__`) in the sandbox; results in order.

    One runner process per call, so score a whole group with one call. Raises SandboxError only when
    the sandbox itself fails; a failing, looping or hostile program is a result, never an exception.
    """
    if not programs:
        return []
    reply = _run(list(programs), limits or Limits())
    results = [RunResult(**r) for r in reply["results"]]
    if len(results) != len(programs):
        raise SandboxError(f"sandbox returned {len(results)} results for {len(programs)} programs")
    return results


def probe(limits: Limits | None = None) -> dict:
    """Which isolation layers apply on this machine (runs one empty program): for doctor commands and logs."""
    return _run(["pass"], limits or Limits())["isolation"]
