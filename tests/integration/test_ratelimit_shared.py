"""The rate limit holds across API processes: two uvicorn server processes on one Redis give a token one
budget, not one each (the documented way to scale the API is more processes behind a proxy)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from marlaas.api.tenancy import add_tenant
from marlaas.ops.embedded import free_port

pytestmark = pytest.mark.integration
BURST = 6


def _start(scratch_url: str, home) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "MARLAAS_REDIS_URL": scratch_url, "MARLAAS_HOME": str(home),
           "MARLAAS_API_RATE": "0.1", "MARLAAS_API_BURST": str(BURST)}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "marlaas.api.app:create_app", "--factory",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API process exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the API process did not start")


@pytest.fixture()
def two_processes(scratch_url, tmp_path):
    procs = []
    try:
        for _ in range(2):
            procs.append(_start(scratch_url, tmp_path / "home"))
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(10)


def test_two_api_processes_share_one_budget(two_processes, st):
    a_url, b_url = two_processes
    token, other = add_tenant(st, "alice"), add_tenant(st, "bob")
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=a_url, headers=auth) as a, httpx.Client(base_url=b_url, headers=auth) as b:
        codes = [(a if i % 2 else b).get("/v1/jobs").status_code for i in range(BURST)]
        assert codes == [200] * BURST  # the burst, spread over both processes
        for c in (a, b):  # each process alone would still have half its burst left: it has none
            r = c.get("/v1/jobs")
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "RateLimited" and int(r.headers["Retry-After"]) >= 1
    with httpx.Client(base_url=b_url, headers={"Authorization": f"Bearer {other}"}) as c:
        assert c.get("/v1/jobs").status_code == 200  # another token has its own budget
