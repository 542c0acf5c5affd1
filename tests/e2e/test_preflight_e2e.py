"""End to end through the HTTP API on the test base: a preflight (`"preflight": true`) runs on the real
stations (the scheduler dispatches its groups at version 0, generate samples the base, verify scores
them with the job's grader, the tick ends it with its summary) and answers without training; a task
whose grader never rewards is flagged as having no signal. A real job without signal in its first
steps gets the warning as an event, and stops when its spec says so."""

import httpx
import pytest

from marlaas import families
from marlaas.api.http_client import Client
from marlaas.verify.preflight import NO_SIGNAL_ZERO
from tests.helpers_verifiers import PARTIAL

pytestmark = pytest.mark.e2e

NEVER = "def grade(sample, item):\n    return 0.0\n"


def _spec(source: str, **kw) -> dict:
    rows = families.rows("max", "train", 64, 0)
    d = dict(dataset=[{"prompt": r["prompt"], "answer": r["answer"]} for r in rows],
             grader={"type": "python", "source": source}, steps=20, prompts_per_step=4, group_size=8,
             eval_size=4, eval_k=0, max_new_tokens=8, tenant="pf")
    d.update(kw)
    return d


def _check_untrained(c: Client, jid: str) -> None:
    job = c.job(jid)
    assert job.status()["version"] == 0
    m = job.metrics()
    assert m["steps"] == [] and m["evals"] == {}, m  # never trained, never evaluated


def test_preflight_with_signal_answers_with_its_figures(worker_stack):
    c = Client()
    st = c.preflight(_spec(PARTIAL, preflight_prompts=12))
    assert st["status"] == "done", st
    pf = st["preflight"]
    assert pf["prompts"] == 12 and pf["group_size"] == 8 and pf["completions"] == 96
    assert 0.0 <= pf["exact"] <= pf["mean_reward"] + 1e-9 <= 1.0 + 1e-9
    assert pf["groups_with_signal"] > 0 and pf["ok"] is True, pf  # partial credit varies within groups
    assert pf["verdict"].split(":")[0] in ("ok", "weak", "only partial credit")
    _check_untrained(c, st["job"])


def test_preflight_without_signal_says_so(worker_stack):
    c = Client()
    st = c.preflight(_spec(NEVER, preflight_prompts=6))
    assert st["status"] == "done", st
    pf = st["preflight"]
    assert pf["exact"] == 0 and pf["mean_reward"] == 0 and pf["signal"] == 0 and pf["ok"] is False
    assert pf["verdict"] == NO_SIGNAL_ZERO
    _check_untrained(c, st["job"])


def test_preflight_past_its_wait_is_202_then_polled(worker_stack):
    url = worker_stack.env["MARLAAS_API_URL"]
    with httpx.Client(base_url=url, timeout=90) as h:
        r = h.post("/v1/jobs", json={**_spec(NEVER, preflight_prompts=4), "preflight": True}, params={"wait": 0})
        assert r.status_code == 202, r.text
        jid = r.json()["id"]
        assert r.json()["preflight"] is None
        r = h.post("/v1/jobs", json=_spec(NEVER), params={"wait": 61})
        assert r.status_code == 422  # the wait is bounded
    final = Client().job(jid).wait(timeout=300)
    assert final["status"] == "done" and final["preflight"]["prompts"] == 4, final


def test_a_job_without_signal_is_warned_and_stopped_if_asked(worker_stack):
    c = Client()
    stop = c.submit(_spec(NEVER, steps=6, no_signal_steps=2, stop_without_signal=True))
    warn = c.submit(_spec(NEVER, steps=3, no_signal_steps=2, eval_size=2))
    st = stop.wait(timeout=600)
    assert st["status"] == "failed" and st["version"] < 6, st
    assert st["error"].startswith("no signal in the first 2 steps: no group has any signal"), st["error"]
    assert "stop_without_signal" in st["error"]
    st = warn.wait(timeout=600)
    assert st["status"] == "done" and st["version"] == 3, st  # warned, not stopped
    for job in (stop, warn):
        events = job.events(limit=10_000)["events"]
        warnings = [e["data"] for e in events if e["type"] == "warning"]
        assert len(warnings) == 1 and warnings[0]["step"] == 2, events
        assert "no signal in the first 2 steps" in warnings[0]["message"]


def test_cli_submit_preflight_prints_figures_and_verdict(worker_stack, tmp_path):
    import os
    import subprocess
    import sys

    toml = tmp_path / "never.toml"
    rows = families.rows("max", "train", 8, 0)
    toml.write_text("tenant = \"pf\"\nsteps = 20\ngroup_size = 4\neval_size = 2\neval_k = 0\npreflight_prompts = 4\n"
                    "grader = {type = \"python\", source = '''" + NEVER + "'''}\n"
                    + "".join(f"[[dataset]]\nprompt = {r['prompt']!r}\nanswer = {r['answer']!r}\n".replace("'", '"')
                              for r in rows))
    env = {**os.environ, "MARLAAS_API_URL": worker_stack.env["MARLAAS_API_URL"]}
    out = subprocess.run([sys.executable, "-m", "marlaas.cli", "submit", str(toml), "--preflight"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "4 prompts x 4 samples of the base: exact 0.00, mean reward 0.00, groups with signal 0/4" in out.stdout
    assert "verdict: " + NO_SIGNAL_ZERO in out.stdout.splitlines()
