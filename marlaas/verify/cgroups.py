"""A cgroup v2 per sandbox batch, where the host allows it: the batch's memory, processes and CPU.

`batch_group(limits)` makes `<root>/marlaas-sandbox/b-<random>` with `memory.max` (and
`memory.swap.max` 0), `pids.max` and `cpu.max` from the batch limits (`marlaas.verify.sandbox.Limits`);
`enter(group, pid)` moves the sandbox runner into it before it forks anything, so every program and
every child they start is counted together; on exit every process left in it is killed and the group
removed. It yields None where the host does not allow it (no cgroup2 at the root, the controllers not
delegated, not writable, or MARLAAS_SANDBOX_CGROUP=0): the sandbox then falls back to its per-process
limits and a per-host cap on batches (see the sandbox module). The root is /sys/fs/cgroup
(MARLAAS_CGROUP_ROOT names another). Whether it applies is decided once per process.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


@lru_cache(maxsize=1)
def parent() -> Path | None:
    """The delegated parent group of every batch's group, made on first use; None where the host
    does not allow it (the reason logged once)."""
    if os.environ.get("MARLAAS_SANDBOX_CGROUP", "1") == "0":
        return None
    root = Path(os.environ.get("MARLAAS_CGROUP_ROOT", "/sys/fs/cgroup"))
    try:
        have = set((root / "cgroup.controllers").read_text().split())
        missing = [c for c in CONTROLLERS if c not in have]
        if missing:
            raise OSError(f"controllers {', '.join(missing)} not available at {root}")
        enabled = set((root / "cgroup.subtree_control").read_text().split())
        if not set(CONTROLLERS) <= enabled:
            (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
        top = root / "marlaas-sandbox"
        top.mkdir(exist_ok=True)
        (top / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
    except OSError as e:
        log.info("no cgroup v2 for sandbox batches (%s): per-process limits and a per-host cap apply", e)
        return None
    return top


@contextmanager
def batch_group(limits) -> Iterator[Path | None]:
    """A fresh group for one batch with the batch's limits, removed after; None without cgroups."""
    top = parent()
    if top is None:
        yield None
        return
    group = top / f"b-{secrets.token_hex(6)}"
    try:
        group.mkdir()
        (group / "memory.max").write_text(str(int(limits.batch_memory_mb) << 20))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        (group / "pids.max").write_text(str(int(limits.batch_pids)))
        (group / "cpu.max").write_text(f"{int(limits.batch_cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
    except OSError as e:
        log.warning("cannot make the sandbox batch's cgroup (%s): per-process limits only", e)
        _remove(group)
        yield None
        return
    try:
        yield group
    finally:
        _remove(group)


def enter(group: Path, pid: int) -> None:
    """Move process `pid` (the sandbox runner, not started on its batch yet) into the group."""
    (group / "cgroup.procs").write_text(str(pid))


def memory_peak(group: Path) -> int | None:
    """The group's peak memory in bytes (memory.peak, newer kernels), or None."""
    try:
        return int((group / "memory.peak").read_text())
    except (OSError, ValueError):
        return None


def describe(group: Path | None, limits) -> str:
    if group is None:
        return (f"none: RLIMIT_NPROC {limits.fallback_processes} per program, {limits.parallel} programs at "
                f"once, batches per host capped")
    return (f"cgroup v2 per batch: memory.max {limits.batch_memory_mb} MiB, pids.max {limits.batch_pids}, "
            f"cpu.max {limits.batch_cpus:g} CPUs")


def _remove(group: Path) -> None:
    """Kill what is left in the group, then remove it (a few tries while the kernel reaps)."""
    if not group.exists():
        return
    kill = group / "cgroup.kill"
    for _ in range(50):
        try:
            if kill.exists():
                kill.write_text("1")
            else:
                for pid in (group / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    log.warning("sandbox cgroup %s could not be removed", group.name)
