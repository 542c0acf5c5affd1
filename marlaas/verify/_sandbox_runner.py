"""Sandbox runner: run a batch of untrusted Python programs, each in its own forked, limited child.

Executed by path as `python -I -S _sandbox_runner.py` by `marlaas.verify.sandbox` (never imported):
standard library only, no site-packages. Protocol: one JSON object on stdin,
`{"programs": [str, ...], "limits": {...}}`; one JSON object on stdout,
`{"isolation": {...}, "results": [{"ok", "status", "stdout", "error"}, ...]}` (results in order).

Isolation, best effort, each layer reported in "isolation" (see the `sandbox` module docstring):

1. Namespaces for the whole batch: `unshare(NEWNET|NEWPID|NEWNS|NEWIPC|NEWUTS)`, plus NEWUSER when not
   root. No network (empty net namespace). The runner forks an init (pid 1 of the new pid namespace)
   that runs the batch: programs cannot see or signal anything outside, and when init ends the kernel
   kills every process left in the namespace. In the private mount namespace every mount is remounted
   read-only, the batch directory becomes a small private tmpfs, and a fresh /proc shows only the
   sandbox's own processes (so not the verify worker's environment or memory).
2. Per program, in the forked child: own session, `PR_SET_PDEATHSIG`, rlimits (CPU, address space,
   processes, file size, open files, no core), an unprivileged uid when the runner is root (rlimits
   on processes do not bind root), no capabilities, `no_new_privs` and a seccomp filter that refuses
   every socket (AF_UNIX too), io_uring, ptrace and process_vm_*; without seccomp a program is not run
   at all unless the caller allows weak isolation (`strict` false: then a pure-Python socket block).
   The parent enforces a wall-clock limit and caps output.

A program is "ok" only when it ran to its end: the harness then writes a per-child random nonce on a
private pipe. `sys.exit`, `os._exit`, signals and exceptions all count as not ok.
"""

import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MOUNT_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 22, 38, 36
SECCOMP_MODE_FILTER = 2
_ERROR_MAX = 300
_PRELOAD = (
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "decimal",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
)
_REPORT_MAX = 65536

_libc = ctypes.CDLL(None, use_errno=True)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _ERROR_MAX else text[: _ERROR_MAX - 3] + "..."


# ---------------------------------------------------------------- namespaces and mounts


def _unshare(is_root: bool) -> int:
    """Enter the strongest set of new namespaces this machine allows; returns the flags (0: none)."""
    full = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    attempts = [full, CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNET]
    uid, gid = os.geteuid(), os.getegid()
    for flags in attempts:
        if not is_root:
            flags |= CLONE_NEWUSER
        if _libc.unshare(flags) != 0:
            continue
        if flags & CLONE_NEWUSER:
            # Map our own ids to themselves (the only mapping an unprivileged process may write), so
            # files keep their owner; capabilities in the new namespace are dropped in each child.
            for path, text in (
                ("/proc/self/setgroups", "deny"),
                ("/proc/self/uid_map", f"{uid} {uid} 1"),
                ("/proc/self/gid_map", f"{gid} {gid} 1"),
            ):
                with open(path, "w") as f:
                    f.write(text)
        return flags
    return 0


def _mount(source, target, fstype, flags, data=None) -> bool:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    return _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _mountpoints() -> list[tuple[str, int]]:
    """(mount point, flags to keep on remount) from /proc/self/mountinfo, parents first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # \040 etc. are octal escapes
            keep = 0
            for opt in fields[5].split(","):
                keep |= _MOUNT_FLAGS.get(opt, 0)
            points.append((point, keep))
    return points


def _reachable_by_others(path: str) -> bool:
    """Can an unrelated unprivileged uid traverse to path (every ancestor has the o+x bit)?"""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _expose_stdlib(base: str, iso: dict) -> dict:
    """Bind the interpreter's library dirs under the tmpfs when a dropped uid could not reach them
    (e.g. a pyenv under /root, mode 0700); returns {original path: visible path} for sys.path."""
    mapping = {}
    for n, path in enumerate(p for p in sys.path if os.path.isdir(p)):
        if _reachable_by_others(path):
            continue
        target = os.path.join(base, ".lib", str(n))
        os.makedirs(target, mode=0o755)
        os.chmod(os.path.join(base, ".lib"), 0o755)
        if _mount(path, target, None, MS_BIND | MS_REC) and _mount(
            None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        ):
            mapping[path] = target
    if mapping:
        iso["stdlib"] = "bound read-only under the batch tmpfs for the unprivileged uid"
    return mapping


def _private_filesystem(base: str, iso: dict, tmpfs_mb: int) -> None:
    """In our own mount namespace: nothing propagates out, everything read-only, tmpfs as the batch dir."""
    if not _mount(None, "/", None, MS_REC | MS_PRIVATE):
        iso["readonly_fs"] = "no (cannot make mounts private)"
        return
    failed = 0
    for point, keep in _mountpoints():
        if not _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep):
            failed += 1
    iso["readonly_fs"] = "yes" if failed == 0 else f"partial ({failed} mounts stayed writable)"
    if _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_mb}m,mode=0711"):
        os.chdir(base)  # our cwd still pointed at the directory under the new mount
        iso["private_tmp"] = True


def _hide(paths: list[str], iso: dict) -> None:
    """Cover the service's own directories (its home with the store's credentials, the source
    checkout, the worker's home) with an empty read-only tmpfs, so programs see none of their files.
    A directory holding the interpreter or its standard library stays (it cannot be covered)."""
    needed = [os.path.realpath(x) for x in (*sys.path, sys.executable, sys.prefix, sys.base_prefix) if x]
    hidden = 0
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isdir(real) or real == "/" or any(n == real or n.startswith(real + "/") for n in needed):
            continue
        hidden += _mount("tmpfs", real, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    iso["hidden_dirs"] = hidden


# ---------------------------------------------------------------- per-child hardening


# Per architecture: audit arch id and syscall numbers. "denied" = ptrace, process_vm_readv,
# process_vm_writev, pidfd_send_signal, io_uring_setup (io_uring could open sockets past the filter).
_SYSCALLS = {
    "x86_64": dict(arch=0xC000003E, socket=41, kill=62, tkill=200, tgkill=234, denied=(101, 310, 311, 424, 425)),
    "aarch64": dict(arch=0xC00000B7, socket=198, kill=129, tkill=130, tgkill=131, denied=(117, 270, 271, 424, 425)),
}


def _seccomp_filter(machine: str, own_pid: int | None):
    """BPF filter: refuse every socket, io_uring, ptrace and process_vm_*; with own_pid
    (no pid namespace) also every signal not aimed at own_pid or its own group. None if unsupported."""
    nr = _SYSCALLS.get(machine)
    if nr is None:
        return None
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
    kill_process = 0x80000000  # a foreign ABI is never legitimate here
    arg0 = 16  # offsetof(struct seccomp_data, args[0]), low 32 bits on little-endian
    ins = [(ld, 0, 0, 4), (jeq, 1, 0, nr["arch"]), (ret, 0, 0, kill_process), (ld, 0, 0, 0)]
    ins += [(jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # x32 syscalls
    denied = nr["denied"] + ((nr["tkill"],) if own_pid is not None else ())
    for n in denied:
        ins += [(jeq, 0, 1, n), (ret, 0, 0, deny)]
    if own_pid is not None:
        # kill(pid, sig): allowed for own_pid and 0 (own process group; the child leads its session).
        ins += [
            (jeq, 0, 5, nr["kill"]),
            (ld, 0, 0, arg0),
            (jeq, 2, 0, own_pid),
            (jeq, 1, 0, 0),
            (ret, 0, 0, deny),
            (ret, 0, 0, allow),
        ]
        ins += [
            (jeq, 0, 4, nr["tgkill"]),
            (ld, 0, 0, arg0),
            (jeq, 1, 0, own_pid),
            (ret, 0, 0, deny),
            (ret, 0, 0, allow),
        ]
    # Every socket, AF_UNIX included: a path socket reaches host services (a container runtime's
    # socket, a database) whatever the net namespace. socketpair() stays (it reaches nothing).
    ins += [(jeq, 0, 1, nr["socket"]), (ret, 0, 0, deny), (ret, 0, 0, allow)]
    raw = b"".join(struct.pack("HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    return Fprog(len(ins), ctypes.addressof(buf)), buf


def _drop_capabilities() -> None:
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    if _libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _block_sockets_in_python() -> None:
    """Last resort when neither a net namespace nor seccomp is available: defeats casual use only."""
    import _socket
    import socket

    def refused(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for mod in (_socket, socket):
        for name in ("socket", "create_connection", "create_server", "getaddrinfo", "fromfd", "socketpair"):
            if hasattr(mod, name):
                setattr(mod, name, refused)


def _relocate_imports(mapping: dict) -> None:
    """Point sys.path and already-imported packages (their submodule search paths) at the bound copies."""

    def moved(path):
        for old, new in mapping.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old) :]
        return path

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [moved(p) for p in search]
    sys.path_importer_cache.clear()


def _child(src, workdir, out_w, res_w, nonce, lim, uid, ctx) -> None:
    """Runs in the forked child; never returns (os._exit)."""
    exit_ = os._exit
    write = os.write
    dumps = json.dumps
    getpid = os.getpid
    os.setsid()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.dup2(res_w, 3)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.closerange(4, 65536)
    res_fd = 3

    def fail(msg):
        write(res_fd, (dumps({"nonce": nonce, "ok": False, "error": msg}) + "\n").encode())
        exit_(0)

    try:
        os.chdir(workdir)
        cpu = int(lim["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"],) * 2)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises instead of killing
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        elif ctx["userns"]:
            _drop_capabilities()
    except OSError as e:
        fail(f"sandbox setup failed: {_one_line(e)}")
    seccomp = False
    bpf = _seccomp_filter(ctx["machine"], None if ctx["pidns"] else getpid())
    if bpf is not None and _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        seccomp = _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(bpf[0]), 0, 0) == 0
    if not seccomp:
        if ctx["strict"]:
            fail("sandbox isolation unavailable (the seccomp socket filter was refused on this host): "
                 "refusing to run the program (MARLAAS_SANDBOX_STRICT=0 accepts weaker isolation)")
        _block_sockets_in_python()
    if ctx["lib_paths"]:
        _relocate_imports(ctx["lib_paths"])
    sys.stdin = open(0, closefd=False)
    sys.stdout = sys.stderr = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    ctx.clear()  # the rest of the batch stays out of reach of casual inspection
    me = getpid()
    error = None
    main = type(sys)("__main__")  # `import __main__` in the program sees the program, not this runner
    sys.modules["__main__"] = main
    namespace = main.__dict__
    namespace["__builtins__"] = __builtins__
    try:
        exec(compile(src, "<program>", "exec"), namespace)
    except SystemExit as e:
        error = f"SystemExit({e.code!r}) before the end of the program"
    except BaseException as e:  # noqa: BLE001 - the program's own failure is the result
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" (line {tb.tb_lineno} of {tb.tb_frame.f_code.co_filename})" if tb is not None else ""
        try:
            error = _one_line(f"{type(e).__name__}: {e}{where}")
        except BaseException:  # noqa: BLE001 - a hostile __str__ must not hide the failure
            error = f"{type(e).__name__}{where}"
    if getpid() != me:
        exit_(0)  # a forked descendant never reports
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - output is best effort, the verdict is not
        pass
    write(res_fd, (dumps({"nonce": nonce, "ok": error is None, "error": error, "seccomp": seccomp}) + "\n").encode())
    exit_(0)


# ---------------------------------------------------------------- the batch loop


def _read_some(fd, buf, cap) -> bool:
    """Read what is available into buf (keeping at most cap bytes); False at EOF."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]


def _cleanup_after(child_pid: int, uid, ctx) -> None:
    """Kill whatever the program left behind and reap it."""
    try:
        os.killpg(child_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if ctx["pidns"] and os.getpid() == 1 and not ctx.get("lane"):
        try:
            os.kill(-1, signal.SIGKILL)  # pid 1 of our own namespace: everything else in it, never outside
        except ProcessLookupError:
            pass  # nothing was left
    elif uid is not None:
        killer = os.fork()
        if killer == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)  # every process of this sandbox uid but the killer
            except OSError:
                pass
            os._exit(0)
        os.waitpid(killer, 0)
    while True:  # reap orphans reparented to us (pid 1) so they stop counting against RLIMIT_NPROC
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _run_one(i, programs, base, lim, uid, ctx) -> dict:
    workdir = os.path.join(base, f"p{i}")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    nonce = os.urandom(16).hex()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            src = programs[i]
            programs.clear()
            _child(src, workdir, out_w, res_w, nonce, lim, uid, ctx)
        except BaseException:  # noqa: BLE001 - harness bug: say so on the program's output, then exit
            import traceback

            traceback.print_exc()
        os._exit(70)
    os.close(out_w)
    os.close(res_w)
    for fd in (out_r, res_r):
        os.set_blocking(fd, False)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    out, res = bytearray(), bytearray()
    caps = {out_r: (out, lim["output_bytes"]), res_r: (res, _REPORT_MAX)}
    open_fds = [out_r, res_r]
    deadline = time.monotonic() + lim["wall_s"]
    timed_out, status = False, None
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        watch = open_fds + ([pidfd] if pidfd is not None else [])
        ready, _, _ = select.select(watch, [], [], remaining if pidfd is not None else min(remaining, 0.002))
        for fd in ready:
            if fd != pidfd and not _read_some(fd, *caps[fd]):
                open_fds.remove(fd)
        if pidfd is None or pidfd in ready:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
    if status is None:
        _, status = os.waitpid(pid, 0)
    for fd in open_fds:
        _read_some(fd, *caps[fd])
    for fd in (out_r, res_r) + ((pidfd,) if pidfd is not None else ()):
        os.close(fd)
    _cleanup_after(pid, uid, ctx)

    stdout = out.decode("utf-8", "replace")
    report = None
    for line in res.decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("nonce") == nonce:
            report = msg
    if report is not None and "seccomp" in report:
        ctx["seccomp_seen"].append(bool(report["seccomp"]))
    if timed_out:
        return _result("timeout", stdout, f"wall-clock limit of {lim['wall_s']} s exceeded")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return _result("timeout", stdout, f"CPU time limit of {lim['cpu_s']} s exceeded")
        return _result("killed", stdout, f"killed by {signal.Signals(sig).name}")
    code = os.WEXITSTATUS(status)
    if report is not None and code == 0:
        if report.get("ok") is True:
            return _result("ok", stdout, "")
        return _result("error", stdout, _one_line(report.get("error") or "failed"))
    return _result("error", stdout, f"exited with code {code} before the end of the program")


def _run_lanes(programs, base, lim, first_uid, ctx) -> list:
    """Run up to `parallel` programs at once, each in its own lane: a forked process that runs one
    program as `_run_one` does (its limits, wall clock and cleanup) and is the subreaper of what the
    program leaves behind, then sends its result on a pipe. The lanes' results come back in order."""
    parallel = max(1, int(lim["parallel"]))
    results: list = [None] * len(programs)
    lanes: dict[int, tuple[int, int]] = {}  # lane pid -> (program index, read end of its pipe)
    todo = list(range(len(programs)))
    bufs: dict[int, bytes] = {}
    while todo or lanes:
        while todo and len(lanes) < parallel:
            i = todo.pop(0)
            r, w = os.pipe()
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(r)
                    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the program's orphans come to this lane
                    uid = None if first_uid is None else first_uid + i
                    ctx["lane"] = True
                    res = _run_one(i, programs, base, lim, uid, ctx)
                    msg = json.dumps({"result": res, "seccomp_seen": ctx["seccomp_seen"]}).encode()
                    with os.fdopen(w, "wb") as f:
                        f.write(msg)  # init reads as it comes
                except BaseException:  # noqa: BLE001 - the lane's failure is the program's error
                    code = 70
                os._exit(code)
            os.close(w)
            lanes[pid] = (i, r)
        # Read every lane's pipe as it writes (a result may exceed the pipe's buffer), then reap it.
        by_fd = {r: pid for pid, (_, r) in lanes.items()}
        ready, _, _ = select.select(list(by_fd), [], [])
        r = ready[0]
        chunk = os.read(r, 65536)
        if chunk:
            bufs[r] = bufs.get(r, b"") + chunk
            continue
        pid = by_fd[r]
        i, _ = lanes.pop(pid)
        os.close(r)
        data = bufs.pop(r, b"")
        _, status = os.waitpid(pid, 0)
        try:
            msg = json.loads(data)
            results[i] = msg["result"]
            ctx["seccomp_seen"].extend(msg["seccomp_seen"])
        except (ValueError, KeyError, TypeError):
            results[i] = _result("error", "", f"the sandbox lane of this program failed (status {status})")
    return results


def _result(status, stdout, error) -> dict:
    return {"ok": status == "ok", "status": status, "stdout": stdout, "error": error}


def _serve(programs, lim, flags, iso) -> None:
    base = os.getcwd()
    is_root = os.geteuid() == 0
    if flags & CLONE_NEWNS:
        _private_filesystem(base, iso, lim["tmpfs_mb"])
        _hide(list(lim.get("hide", [])), iso)
        if flags & CLONE_NEWPID:
            iso["private_proc"] = _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    first_uid, lib_paths = None, {}
    if is_root:
        if iso.get("private_tmp"):
            lib_paths = _expose_stdlib(base, iso)
        elif not all(_reachable_by_others(p) for p in sys.path if os.path.isdir(p)):
            # No mount namespace to expose the library: preload what exercises commonly import.
            for name in _PRELOAD:
                __import__(name)
            iso["stdlib"] = "not readable by the unprivileged uid: only preloaded modules importable"
        # Per-program unprivileged uids (rlimits on processes never bind root): random base per batch
        # so concurrent batches on one host do not share process counts or signal each other.
        first_uid = lim["uid_base"] + int.from_bytes(os.urandom(2), "little") % lim["uid_span"]
        if not iso.get("private_tmp"):
            os.chmod(base, 0o711)
        iso["uid"] = "dropped to an unprivileged uid per program"
    else:
        userns = " (own user namespace, no capabilities)" if flags & CLONE_NEWUSER else ""
        iso["uid"] = "same uid as the worker" + userns
    ctx = {
        "netns": bool(flags & CLONE_NEWNET),
        "pidns": bool(flags & CLONE_NEWPID),
        "userns": bool(flags & CLONE_NEWUSER),
        "machine": os.uname().machine,
        "seccomp_seen": [],
        "lib_paths": lib_paths,
        "strict": bool(lim.get("strict", True)),
    }
    if int(lim.get("parallel", 1)) > 1 and len(programs) > 1:
        results = _run_lanes(programs, base, lim, first_uid, ctx)
    else:
        results = []
        for i in range(len(programs)):
            uid = None if first_uid is None else first_uid + i
            results.append(_run_one(i, programs, base, lim, uid, ctx))
    seen = ctx["seccomp_seen"]
    iso["seccomp"] = bool(seen) and all(seen)
    iso["network"] = (
        "none (empty net namespace)"
        if ctx["netns"]
        else ("blocked by seccomp" if iso["seccomp"] else "blocked in Python only (weak)")
    )
    sys.stdout.write(json.dumps({"isolation": iso, "results": results}))
    sys.stdout.flush()


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    programs, lim = list(request["programs"]), request["limits"]
    iso = {"namespaces": [], "readonly_fs": "no", "private_tmp": False, "private_proc": False}
    flags = _unshare(os.geteuid() == 0) if lim["namespaces"] else 0
    names = {
        CLONE_NEWNET: "net",
        CLONE_NEWPID: "pid",
        CLONE_NEWNS: "mount",
        CLONE_NEWUSER: "user",
        CLONE_NEWIPC: "ipc",
        CLONE_NEWUTS: "uts",
    }
    iso["namespaces"] = [n for f, n in names.items() if flags & f]
    if not flags & CLONE_NEWPID:
        _serve(programs, lim, flags, iso)
        return
    sys.stdout.flush()
    init = os.fork()  # first child after unshare(NEWPID): pid 1 of the new namespace
    if init == 0:
        code = 0
        try:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # runner killed -> namespace torn down
            _serve(programs, lim, flags, iso)
        except BaseException:  # noqa: BLE001 - reported on stderr to the caller, which raises
            import traceback

            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(init, 0)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
