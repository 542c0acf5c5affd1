"""Grader dry runs leave the API's request threads: one tenant's flood of slow dry runs is refused past
its cap (429) while another tenant's health checks and job reads stay fast; a multi grader is graded
once; a dry run that costs too much is its own error line, not the server's."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.test_api import err, serve, two  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

SLOW = {"type": "python", "timeout_s": 6.0, "source": "import time\ndef grade(sample, item):\n"
        "    time.sleep(2)\n    return 1.0\n"}
SLOW_MULTI = {"type": "multi", "calculate_output": "(a + b + c) / 3", "graders": {"a": SLOW, "b": SLOW, "c": SLOW}}


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def test_a_flood_of_slow_dry_runs_leaves_other_tenants_fast(two):  # noqa: F811
    url, c, _ = two
    alice, bob = c["alice"], c["bob"]
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    r = bob.post("/v1/jobs", json={"dataset": rows, "steps": 1, "prompts_per_step": 1, "group_size": 2,
                                   "eval_size": 1})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    codes: list[int] = []
    health, reads = [], []
    done = threading.Event()

    def flood_one(_):
        with httpx.Client(base_url=url, headers=dict(alice.headers), timeout=120) as cl:
            r = cl.post("/v1/graders/run", json={"grader": SLOW_MULTI, "sample": {"output_text": "x"}})
            codes.append(r.status_code)
            return r

    def victim():
        with httpx.Client(base_url=url, headers=dict(bob.headers), timeout=60) as cl:
            while not done.is_set():
                t = time.monotonic()
                assert cl.get("/v1/health").status_code == 200
                health.append(time.monotonic() - t)
                t = time.monotonic()
                assert cl.get(f"/v1/jobs/{job}").status_code == 200
                reads.append(time.monotonic() - t)
                time.sleep(0.05)

    watcher = threading.Thread(target=victim)
    watcher.start()
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(flood_one, range(40)))
    done.set()
    watcher.join()
    ok = [r for r in results if r.status_code == 200]
    limited = [r for r in results if r.status_code == 429]
    assert len(ok) + len(limited) == 40, codes
    assert len(limited) >= 30, codes  # the cap is 2 at once; the flood is over within a few dry runs' time
    assert "max_concurrent_dry_runs" in err(limited[0], 429, "RateLimited")
    assert all(r.json() == {"reward": 1.0, "error": None, "sub_rewards": {"a": 1.0, "b": 1.0, "c": 1.0}} for r in ok)
    assert len(health) >= 5 and len(reads) >= 5
    assert _p99(health) < 2.0 and _p99(reads) < 2.0, (_p99(health), _p99(reads))
    # another tenant's dry run still runs while alice's flood is refused
    r = bob.post("/v1/graders/run", json={"grader": {"type": "string_check", "input": "{{sample.output_text}}",
                                                     "reference": "a", "operation": "eq"},
                                          "sample": {"output_text": "a"}})
    assert r.status_code == 200 and r.json()["reward"] == 1.0


def test_long_rouge_l_is_fast_and_an_unloadable_grader_is_422(two):  # noqa: F811
    _, c, _ = two
    alice = c["alice"]
    text = " ".join("abcdefghij"[i % 10] for i in range(10_000))  # 20,000 characters, 10,000 tokens
    g = {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "evaluation_metric": "rouge_l"}
    t = time.monotonic()
    r = alice.post("/v1/graders/run", json={"grader": g, "sample": {"output_text": text[:19_999]},
                                            "item": {"answer": text[::-1]}}, timeout=60)
    assert r.status_code == 200 and r.json()["error"] is None, r.text
    assert 0.0 < r.json()["reward"] < 1.0 and time.monotonic() - t < 10
    assert "not registered" in err(alice.post("/v1/graders/run", json={
        "grader": {"type": "builtin", "verifier": "nosuch"}, "sample": {"output_text": "x"}}), 422, "SpecError")
