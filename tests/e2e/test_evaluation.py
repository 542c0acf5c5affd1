"""Held-out evaluation: the pass@k estimator and version choice on hand-computed values, the spec
fields, the verify station and the store on a real Redis, and an end-to-end job evaluated every
K steps through real workers, read back by `Job.metrics()` and `marlaas eval`."""

import json
import os
import subprocess
import sys
import time

import pytest

from marlaas.control import dispatch
from marlaas.control.scheduler import due_evals, evals_to_check
from marlaas.errors import NotFound, SpecError
from marlaas.spec import JobSpec, parse_spec
from marlaas.types import AdapterBlob, AdapterRef, eval_versions
from marlaas.verify.evaluation import ks_for, mean_pass_at_k, pass_at_k, summarize, table_row
from marlaas.verify.station import run_verify
from tests.conftest import api_server

CLI = [sys.executable, "-m", "marlaas.cli"]


# ------------------------------------------------------------------ unit: the estimator
@pytest.mark.unit
@pytest.mark.parametrize("n,c,k,expected", [
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (8, 3, 1, 0.375),          # k = 1: c / n
    (4, 0, 2, 0.0),            # nothing correct
    (8, 1, 8, 1.0),            # k = n: any correct one
    (4, 3, 2, 1.0),            # n - c < k: every pair holds a correct one
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.unit
@pytest.mark.parametrize("n,c,k", [(4, 5, 2), (4, -1, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


@pytest.mark.unit
def test_mean_pass_at_k_and_ks():
    assert mean_pass_at_k(4, [1, 0, 4, 2], 2) == pytest.approx((0.5 + 0 + 1 + 5 / 6) / 4)
    with pytest.raises(ValueError):
        mean_pass_at_k(4, [], 1)
    assert ks_for(8) == [1, 2, 4, 8]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(1) == [1]
    assert ks_for(0) == []


@pytest.mark.unit
def test_summarize_hand_values():
    greedy = [1.0, 0.0, 1.0, 0.0]
    # correct counts c = 1, 0, 4, 2 (the 0.5 partial credit is not a pass)
    samples = [[1, 0, 0, 0], [0, 0.5, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    s = summarize(greedy, samples)
    assert s["exact"] == s["acc"] == 0.5 and s["mean_reward"] == 0.5 and s["n"] == 4 and s["k"] == 4
    assert s["pass1_sampled"] == pytest.approx((0.25 + 0 + 1 + 0.5) / 4)          # 0.4375
    assert s["pass_at"]["2"] == pytest.approx((0.5 + 0 + 1 + (1 - 1 / 6)) / 4)     # 0.58333
    assert s["pass_at_k"] == s["pass_at"]["4"] == pytest.approx(0.75)
    assert list(s["pass_at"]) == ["1", "2", "4"]


@pytest.mark.unit
def test_summarize_greedy_only_and_bad_shapes():
    s = summarize([1.0, 0.0], None)
    assert s == {"exact": 0.5, "mean_reward": 0.5, "acc": 0.5, "n": 2, "k": 0, "pass1_sampled": None,
                 "pass_at_k": None, "pass_at": {}, "grader_errors": 0}
    with pytest.raises(ValueError, match="sampled groups"):
        summarize([1.0, 0.0], [[1.0]])
    with pytest.raises(ValueError, match="same number"):
        summarize([1.0, 0.0], [[1.0], [1.0, 0.0]])
    # an evaluation stored before pass@k existed reads as greedy only; its acc was the mean reward
    assert table_row(3, {"acc": 0.25, "n": 4, "at": 1.0}) == {
        "version": 3, "exact": None, "mean_reward": 0.25, "pass1_sampled": None, "pass_at_k": None, "k": 0,
        "n": 4, "pass_at": {}, "grader_errors": 0, "train_reward": None, "acc": None, "at": 1.0}


# ------------------------------------------------------------------ unit: which versions
@pytest.mark.unit
def test_eval_versions_hand_values():
    assert eval_versions(4, 2) == [0, 2, 4]
    assert eval_versions(4, 0) == [0, 4]
    assert eval_versions(5, 2) == [0, 2, 4, 5]
    assert eval_versions(4, 4) == [0, 4]
    assert eval_versions(1, 1) == [0, 1]
    assert eval_versions(10, 3) == [0, 3, 6, 9, 10]


@pytest.mark.unit
def test_due_evals_follow_the_published_version():
    assert due_evals(0, 4, 2) == [0]
    assert due_evals(3, 4, 2) == [0, 2]
    assert due_evals(4, 4, 2) == [0, 2, 4]
    assert due_evals(3, 4, 0) == [0]
    # reads per tick stay bounded while training; all of them once training is over
    assert evals_to_check(200, 1000, 1, window=3) == [0, 198, 199, 200]
    assert evals_to_check(3, 1000, 1, window=3) == [0, 1, 2, 3]
    assert evals_to_check(10, 10, 1, window=3) == list(range(11))


# ------------------------------------------------------------------ unit: spec
@pytest.mark.unit
def test_spec_eval_fields():
    s = JobSpec(task="sort", steps=4)
    assert (s.eval_every, s.eval_k, s.eval_temperature) == (0, 8, None)
    assert parse_spec({"task": "sort", "steps": 4, "eval_every": 2, "eval_k": 0}).eval_every == 2
    bad = {
        "eval_every": ({"eval_every": 5}, "eval_every (5) is more than steps (4)"),
        "negative every": ({"eval_every": -1}, "eval_every"),
        "negative k": ({"eval_k": -1}, "eval_k"),
        "huge k": ({"eval_k": 1000}, "eval_k"),
        "zero temperature": ({"eval_temperature": 0}, "eval_temperature"),
    }
    for name, (kw, words) in bad.items():
        with pytest.raises(SpecError) as e:
            parse_spec({"task": "sort", "steps": 4, **kw})
        assert words in str(e.value) and "\n" not in str(e.value), name


# ------------------------------------------------------------------ integration: store + verify station
ROWS = [{"prompt": f"max:{i}{i + 1}{i + 2}=", "answer": str(i + 2)} for i in range(6)]


def _publish_all(st, jid, steps, every):
    for t in range(steps):
        assert st.publish(jid, t, AdapterBlob(config={"r": 1}, weights=b"w"), b"o", {"step": t + 1}, "tok", [],
                          steps, every)


@pytest.mark.integration
def test_evaluated_versions_keep_their_adapters(st):
    spec = JobSpec(dataset=ROWS, verifier="exact", steps=6, prompts_per_step=2, group_size=4, eval_size=2,
                   eval_every=2)
    jid = st.create_job(spec, ROWS, ROWS[:2])
    _publish_all(st, jid, 6, 2)
    kept = set()
    for v in range(1, 7):
        try:
            st.adapter(AdapterRef(jid, v))
            kept.add(v)
        except NotFound:
            pass
    # 1 and 3 fall out of the window of the newest three; 2 and 4 are evaluated and stay
    assert kept == {2, 4, 5, 6}


@pytest.mark.integration
def test_verify_stores_pass_at_k_and_done_waits_for_every_evaluated_version(st):
    spec = JobSpec(dataset=ROWS, verifier="exact", steps=4, prompts_per_step=2, group_size=4, eval_size=2,
                   eval_every=2, eval_k=4)
    eval_rows = ROWS[:2]
    jid = st.create_job(spec, ROWS, eval_rows)
    _publish_all(st, jid, 4, 2)
    st.set_status(jid, "evaluating")
    snap = dispatch.snapshot(st, time.time())
    (js,) = snap.jobs
    assert js.need_eval == (0, 2, 4) and js.eval_rows == 2 * (1 + 4)

    right, wrong = [r["answer"] for r in eval_rows], ["x", "y"]
    samples = {  # per version: the sampled texts of row 0 and row 1
        4: ([right[0], "x", "x", "x"], [right[1]] * 4),   # c = 1, 4
        0: (["x"] * 4, ["y"] * 4),                      # c = 0, 0
        2: ([right[0]] * 2 + ["x"] * 2, ["y"] * 4),     # c = 2, 0
    }
    greedy = {4: right, 0: wrong, 2: [right[0], wrong[1]]}
    for v in (4, 0, 2):  # the final one first: the job is done only once all three are stored
        st.put_eval_rollout(jid, v, {"rows": [
            {"row": eval_rows[i], "text": greedy[v][i], "samples": samples[v][i]} for i in range(2)]})
        assert run_verify(st, jid, "evalver", [v]) == 1
        assert st.job_fields(jid, "status")[0] == ("done" if v == 2 else "evaluating")
    ev = st.evals(jid)
    assert set(ev) == {0, 2, 4}
    assert ev[4]["acc"] == 1.0 and ev[4]["k"] == 4 and ev[4]["n"] == 2
    assert ev[4]["pass1_sampled"] == pytest.approx((1 / 4 + 1) / 2)
    assert ev[4]["pass_at"]["2"] == pytest.approx((0.5 + 1) / 2)
    assert ev[4]["pass_at_k"] == 1.0
    assert ev[0]["acc"] == 0.0 and ev[0]["pass_at_k"] == 0.0
    # c = 2 of 4: pass@2 = 1 - C(2,2)/C(4,2) = 5/6; the other row 0
    assert ev[2]["acc"] == 0.5 and ev[2]["pass_at"]["2"] == pytest.approx(5 / 12)
    assert [o["samples_correct"] for o in ev[4]["outputs"]] == [1, 4]
    assert ev[4]["outputs"][0]["text"] == right[0]  # the greedy outputs are kept

    with api_server(st.url) as env:  # `marlaas eval` is a tenant command: it goes through the API
        out = subprocess.run(CLI + ["eval", jid, "--json"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert [(r["version"], r["exact"], r["mean_reward"], r["pass_at_k"], r["k"], r["n"]) for r in rows] == [
            (0, 0.0, 0.0, 0.0, 4, 2), (2, 0.5, 0.5, 0.5, 4, 2), (4, 1.0, 1.0, 1.0, 4, 2)]
        table = subprocess.run(CLI + ["eval", jid], env={**env, "COLUMNS": "200"}, capture_output=True, text=True)
        assert table.returncode == 0 and "pass@4" in table.stdout and "exact" in table.stdout \
            and "mean reward" in table.stdout
        missing = subprocess.run(CLI + ["eval", "j999"], env=env, capture_output=True, text=True)
        assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "j999" in missing.stderr


@pytest.mark.integration
def test_metrics_exporter_and_report_show_pass_at_k(st, tmp_path):
    from marlaas.ops import metrics, report

    spec = JobSpec(dataset=ROWS, verifier="exact", steps=2, prompts_per_step=2, group_size=4, eval_size=2, eval_k=4)
    jid = st.create_job(spec, ROWS, ROWS[:2])
    _publish_all(st, jid, 2, 0)
    st.put_eval_result(jid, 0, {**summarize([0.0, 0.0], [[0, 0, 0, 0], [1, 0, 0, 0]]), "at": time.time()})
    st.put_eval_result(jid, 2, {**summarize([1.0, 0.0], [[1, 1, 0, 0], [1, 1, 1, 1]]), "at": time.time()})
    st.set_status(jid, "done")
    text = metrics.render(metrics.collect(st))
    got = {}
    for line in text.splitlines():
        if line.startswith("marlaas_job_eval_pass_at_k{"):
            labels = dict(x.split("=") for x in line[line.index("{") + 1:line.index("}")].split(","))
            got[(labels["version"].strip('"'), labels["k"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    # version 0: c = 0, 1 -> pass@1 = 1/8, pass@2 = (0 + 1/2) / 2, pass@4 = 1/2
    # version 2: c = 2, 4 -> pass@1 = 3/4, pass@2 = (5/6 + 1) / 2, pass@4 = 1
    assert got == pytest.approx({("0", "1"): 1 / 8, ("0", "2"): 0.25, ("0", "4"): 0.5,
                                 ("2", "1"): 0.75, ("2", "2"): 11 / 12, ("2", "4"): 1.0})
    _, page = report.write_report(st, [jid], tmp_path)
    assert "<th>final pass@k</th>" in page.read_text() and "<td>pass@4 1.00</td>" in page.read_text()


# ------------------------------------------------------------------ e2e: real workers
@pytest.mark.e2e
def test_job_is_evaluated_every_k_steps(worker_stack):
    from marlaas.api.client import Client

    client = Client(worker_stack.url)
    job = client.submit(JobSpec(tenant="evalk", task="max", steps=4, eval_every=2, eval_k=4, eval_size=4,
                                prompts_per_step=2, group_size=4, max_staleness=1, seed=3))
    st = job.wait(timeout=600)
    assert st["status"] == "done", st
    evals = job.metrics()["evals"]
    assert set(evals) == {0, 2, 4}
    for v, e in evals.items():
        assert e["n"] == 4 and e["k"] == 4 and len(e["outputs"]) == 4, (v, e)
        assert 0.0 <= e["acc"] <= 1.0
        by_k = [e["pass_at"][str(k)] for k in (1, 2, 4)]
        assert by_k == sorted(by_k) and e["pass_at_k"] == by_k[-1] and e["pass1_sampled"] == by_k[0]
    out = subprocess.run(CLI + ["eval", job.id, "--json"], env={**os.environ, "MARLAAS_REDIS_URL": worker_stack.url},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["version"] for r in rows] == [0, 2, 4]
    assert [r["pass_at_k"] for r in rows] == [evals[v]["pass_at_k"] for v in (0, 2, 4)]
