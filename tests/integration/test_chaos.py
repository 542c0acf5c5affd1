"""Crash safety: SIGKILL random workers and restart the broker while 8 tenants train (marlaas.ops.chaos)."""

import pytest

from marlaas.ops.chaos import run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_jobs_survive_killed_workers_and_a_broker_restart(tiny_base, home):
    out = run_chaos(tiny_base, home / "chaos-logs", steps=10, interval=(0.5, 2.0))
    # every fault landed while jobs were still training
    assert len([e for e in out["events"] if e[0] == "kill"]) == 6, out["events"]
    assert [e[0] for e in out["events"]].count("broker-restart") == 1, out["events"]
    for r in out["jobs"]:
        assert r["status"] == "done", (r, out["events"])
        assert r["steps"] == list(range(1, r["spec_steps"] + 1)), r  # none lost, none duplicated
        assert r["staleness_ok"], r
        assert r["missing_objects"] == [] and r["missing_after_sweep"] == [], r  # no reference to missing bytes
