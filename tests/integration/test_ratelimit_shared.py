"""The rate limit holds across API processes: two uvicorn server processes on one Redis give a token one
budget, not one each (the documented way to scale the API is more processes behind a proxy); the plan's
concurrency caps (event streams open, dry runs running) are one count across them too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from marlaas.api.ratelimit import SharedCap
from marlaas.api.tenancy import Quotas, add_tenant
from marlaas.ops.embedded import free_port
from marlaas.spec import JobSpec

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


def test_two_api_processes_share_each_tenants_event_stream_cap(two_processes, st):
    """max_event_streams counts the tenant's streams over every API process: one open on each of two
    processes is the plan's 2, a third is refused on either; closing one frees its place."""
    a_url, b_url = two_processes
    token = add_tenant(st, "alice", Quotas(max_event_streams=2))
    spec = JobSpec(tenant="alice", task="sort", steps=2, prompts_per_step=2, group_size=4, eval_size=2)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(8)]
    jid = st.create_job(spec, rows, rows[:2])  # no worker runs this DB: the job stays queued, its stream open
    auth, sse = {"Authorization": f"Bearer {token}"}, {"Accept": "text/event-stream"}
    url = f"/v1/jobs/{jid}/events"
    with httpx.Client(base_url=a_url, headers=auth) as a, httpx.Client(base_url=b_url, headers=auth) as b:
        with a.stream("GET", url, headers=sse) as s1, b.stream("GET", url, headers=sse) as s2:
            assert s1.status_code == s2.status_code == 200
            for c in (a, b):
                r = c.get(url, headers=sse)
                assert r.status_code == 429 and "max_event_streams" in r.json()["error"]["message"], r.text
        deadline = time.time() + 15
        while time.time() < deadline:  # each server notices its closed stream at its next poll
            with b.stream("GET", url, headers=sse) as again, a.stream("GET", url, headers=sse) as again2:
                if again.status_code == again2.status_code == 200:
                    break
            time.sleep(0.3)
        assert again.status_code == again2.status_code == 200


def test_a_hold_ends_by_itself_when_its_holder_is_gone_and_renewing_keeps_it(st):
    caps = SharedCap(st.r, "test", ttl_s=1)
    first = caps.take("alice", 1)
    assert first and caps.take("alice", 1) is None and caps.held("alice") == 1
    assert caps.take("bob", 1)  # another tenant's count is its own
    time.sleep(1.3)  # alice's holder died without releasing: its hold runs out
    kept = caps.take("alice", 1)
    assert kept and caps.held("alice") == 1
    for _ in range(3):  # renewed more often than its time limit, the hold stays
        time.sleep(0.5)
        assert caps.renew("alice", kept)
    assert caps.take("alice", 1) is None
    caps.release("alice", kept)
    assert caps.held("alice") == 0 and caps.take("alice", 1)
    assert not caps.renew("alice", first)  # a hold that ran out is not brought back
