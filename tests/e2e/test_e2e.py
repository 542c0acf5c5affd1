"""End to end: several tenants at once through real generate -> verify -> train worker processes.

Tenants submit and follow their jobs over the HTTP API. Once with each generation engine
(transformers+PEFT, then vLLM). Every job must reach its step
count with contiguous versions 0..steps, train only on rollouts within its staleness bound, and the
stations must overlap in time.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from marlaas import (
    Client,  # tenants reach the service through the HTTP API
    JobSpec,
)
from marlaas.ops.embedded import wait_for_workers
from marlaas.store import Store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASKS = ("sort", "reverse", "code")


def specs(seed0: int):
    return [
        JobSpec(tenant=f"tenant{i}", task=task, steps=4, prompts_per_step=2, group_size=4,
                max_staleness=1 + (i % 2), eval_size=8, seed=seed0 + i)
        for i, task in enumerate(TASKS)
    ]


def run_and_check(url: str, seed0: int) -> dict:
    client = Client()  # the worker stack's API (MARLAAS_API_URL)
    t0 = time.time()
    # The tenants submit at once; the scheduler's lock is held meanwhile so that the first tick sees all
    # three jobs (each HTTP submit wakes a tick at once, which would otherwise dispatch job by job).
    deadline, lock = time.time() + 10, None
    while lock is None and time.time() < deadline:  # a running tick holds it for milliseconds
        lock = Store(url).acquire_lock(seconds=30)
    assert lock is not None
    try:
        with ThreadPoolExecutor(3) as pool:
            jobs = list(pool.map(client.submit, specs(seed0)))
    finally:
        Store(url).release_lock(lock)
    finals = [j.wait(timeout=900) for j in jobs]
    for j, st, spec in zip(jobs, finals, specs(seed0)):
        assert st["status"] == "done", st
        m = j.metrics()
        # versions 1..steps published exactly once each, in order (0 is the base)
        assert [s["step"] for s in m["steps"]] == list(range(1, spec.steps + 1))
        assert st["version"] == spec.steps
        # every trained group respected the staleness bound
        assert all(0 <= x <= spec.max_staleness for s in m["steps"] for x in s["staleness"])
        assert set(m["evals"]) == {0, spec.steps}
        assert 0.0 <= m["evals"][spec.steps]["acc"] <= 1.0
    events = Store(url).events(since=t0)  # the operator's view of the stations
    gen = [e for e in events if e["station"] == "generate"]
    train = [e for e in events if e["station"] == "train"]
    # mixed-tenant batches reached the engine
    assert any(len(e["jobs"]) > 1 for e in gen), gen
    # trainer served every tenant
    assert {j for e in train for j in e["jobs"]} == {j.id for j in jobs}
    # the stations overlapped: some generation ran while the trainer was busy
    assert any(g["start"] < t["end"] and t["start"] < g["end"] for g in gen for t in train)
    return {"wall_s": time.time() - t0}


def test_three_tenants_hf_engine(worker_stack):
    run_and_check(worker_stack.url, seed0=0)


def test_three_tenants_vllm_engine(worker_stack):
    store = Store(worker_stack.url)
    old = set(store.workers())
    worker_stack.restart("generate", env={"MARLAAS_ENGINE": "vllm"})
    deadline = time.time() + 300
    while time.time() < deadline:
        new = {n for n, w in store.workers().items() if w["station"] == "generate"} - old
        if new:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the vLLM generate worker did not start (see logs/generate.log)")
    try:
        assert any(w.get("engine") == "vllm" for n, w in store.workers().items() if n in new)
        wait_for_workers(store)
        run_and_check(worker_stack.url, seed0=10)
    finally:  # the session's later tests expect the hf engine (e.g. prompt logprobs)
        worker_stack.restart("generate", env={"MARLAAS_ENGINE": "hf"})
        wait_for_workers(store)


def test_a_raising_verifier_stops_only_its_own_job(worker_stack):
    client = Client()
    rows = [{"prompt": f"max:{i}{i + 1}{i + 2}=", "answer": str(i + 2)} for i in range(7)]
    broken = client.submit(JobSpec(tenant="broken", dataset=rows, verifier="tests.helpers_verifiers:always_raises",
                                   steps=2, prompts_per_step=2, group_size=4, eval_size=2))
    healthy = client.submit(JobSpec(tenant="healthy", task="max", steps=2, prompts_per_step=2, group_size=4,
                                    eval_size=4))
    b, h = broken.wait(timeout=600), healthy.wait(timeout=600)
    assert h["status"] == "done" and h["verify_errors"] == 0
    # the broken verifier scores 0 and is counted; its job still runs to the end
    assert b["status"] == "done" and b["verify_errors"] > 0
    assert all(r == 0.0 for m in broken.metrics()["steps"] for r in [m["reward_mean"]])
