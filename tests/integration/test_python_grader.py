"""Python graders in the real sandbox, the failure policy on a real store, registered verifiers and the
grader routes over a real HTTP server.

Hostile graders: `while True: pass` ends by its time limit with its errors counted; a socket
connection fails; the environment shows no MARLAAS_* or REDIS variables; a 300 kB source is refused.
"""

from __future__ import annotations

import os
import time

import pytest

from marlaas.errors import SpecError
from marlaas.spec import JobSpec
from marlaas.verify.graders import grade_group, grade_groups, parse_grader
from marlaas.verify.job_scoring import score_job
from tests.integration.test_api import err, serve, two  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

EXACT = "def grade(sample, item):\n    return 1.0 if sample['output_text'].strip() == item['answer'] else 0.0\n"


def py(source: str, **kw) -> dict:
    return {"type": "python", "source": source, **kw}


def test_python_grader_scores_in_the_sandbox():
    g = parse_grader(py("import math\n" + EXACT.replace("1.0 if", "math.sqrt(1.0) if")))
    score = grade_group(g, {"answer": "123"}, ["123", " 123 ", "321"])
    assert score.rewards == [1.0, 1.0, 0.0] and score.errors == 0


def test_prints_are_discarded_and_bad_results_are_errors():
    noisy = "def grade(sample, item):\n    print('x' * 100000)\n    return 0.25\n"
    assert grade_group(parse_grader(py(noisy)), {}, ["a"]).rewards == [0.25]
    for body, message in (("return 1.5", "outside [0, 1]"), ("return float('nan')", "nan"),
                          ("return 'yes'", "not a number"), ("raise KeyError('k')", "KeyError")):
        score = grade_group(parse_grader(py(f"def grade(sample, item):\n    {body}\n")), {}, ["a", "b"])
        assert score.rewards == [0.0, 0.0] and score.errors == 2 and message in score.error, score


def test_an_infinite_loop_ends_by_its_time_limit_with_errors_counted():
    g = parse_grader(py("def grade(sample, item):\n    while True:\n        pass\n", timeout_s=0.5))
    t = time.monotonic()
    score = grade_group(g, {}, ["a", "b"])
    assert time.monotonic() - t < 15
    assert score.rewards == [0.0, 0.0] and score.errors == 2 and "limit" in score.error


def test_no_network_and_no_environment():
    os.environ["MARLAAS_GRADER_TEST_SECRET"] = "s3cret"
    os.environ.setdefault("REDIS_URL", "redis://secret@localhost")
    try:
        net = py("import socket\ndef grade(sample, item):\n"
                 "    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return 1.0\n", timeout_s=3)
        score = grade_group(parse_grader(net), {}, ["a"])
        assert score.errors == 1 and score.rewards == [0.0]
        env = py("import os\ndef grade(sample, item):\n"
                 "    leaked = [k for k in os.environ if k.startswith(('MARLAAS', 'REDIS'))]\n"
                 "    assert not leaked, leaked\n    return 1.0\n")
        assert grade_group(parse_grader(env), {}, ["a"]).rewards == [1.0]
    finally:
        os.environ.pop("MARLAAS_GRADER_TEST_SECRET", None)


def test_a_300_kb_source_is_refused():
    with pytest.raises(SpecError, match="bytes"):
        parse_grader(py(EXACT + "#" * (300 * 1024)))


def test_one_batch_for_several_groups_and_multi():
    g = parse_grader({"type": "multi", "calculate_output": "0.5 * py + 0.5 * fmt", "graders": {
        "py": py(EXACT), "fmt": {"type": "string_check", "input": "{{sample.output_text}}", "reference": "1",
                                 "operation": "like"}}})
    scores = grade_groups(g, [({"answer": "12"}, ["12", "21"]), ({"answer": "33"}, ["33", "3"])])
    assert [s.rewards for s in scores] == [[1.0, 0.5], [0.5, 0.0]]


# ---------------------------------------------------------------- the failure policy on a real store
ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)]


FAIL_AFTER_GROUPS = 3


def _job(st, grader: dict) -> tuple[str, JobSpec]:
    spec = JobSpec(dataset=ROWS, grader=grader, steps=2, prompts_per_step=1, group_size=2, eval_size=1,
                   max_grader_error_groups=FAIL_AFTER_GROUPS)
    return st.create_job(spec, ROWS, ROWS[:1]), spec


def test_a_grader_failing_every_completion_fails_the_job(st):
    jid, spec = _job(st, py("def grade(sample, item):\n    raise ValueError('broken grader')\n"))
    items = [({"answer": "1"}, ["a", "b"])]
    for _ in range(FAIL_AFTER_GROUPS - 1):
        assert score_job(st, jid, spec, items) is not None
    assert st.job(jid).status != "failed"
    assert score_job(st, jid, spec, items) is None
    rec = st.job(jid)
    assert rec.status == "failed" and "broken grader" in rec.extra["error"]
    assert "3 groups in a row (max_grader_error_groups 3)" in rec.extra["error"]
    assert int(rec.extra["verify_errors"]) == 2
    # the tenant was warned first (at half the limit: 1 group), and the reason is one line
    warnings = [n for n in st.notices(jid) if n["type"] == "warning"]
    assert len(warnings) == 1 and "fails at 3" in warnings[0]["data"]["message"]
    assert "\n" not in rec.extra["error"]


def test_one_scored_completion_resets_the_streak(st):
    jid, spec = _job(st, py("def grade(sample, item):\n    return 1.0 if sample['output_text'] == 'ok' else 1 / 0\n"))
    for i in range(3 * FAIL_AFTER_GROUPS):
        comps = ["ok", "x"] if i % 2 else ["x", "y"]
        assert score_job(st, jid, spec, [({}, comps)]) is not None
    assert st.job(jid).status != "failed"


def test_an_unregistered_name_fails_the_job_at_once(st):
    jid, spec = _job(st, {"type": "builtin", "verifier": "gone"})
    assert score_job(st, jid, spec, [({"answer": "1"}, ["1", "2"])]) is None
    assert st.job(jid).status == "failed" and "not registered" in st.job(jid).extra["error"]


# ---------------------------------------------------------------- the HTTP routes
def test_grader_routes(two):  # noqa: F811
    _, c, _ = two
    alice, op = c["alice"], c["op"]
    g = {"type": "multi", "calculate_output": "0.5 * a + 0.5 * b", "graders": {
        "a": py(EXACT), "b": {"type": "text_similarity", "input": "{{sample.output_text}}",
                              "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}}}
    r = alice.post("/v1/graders/validate", json={"grader": g})
    assert r.status_code == 200 and r.json()["grader"]["graders"]["a"]["timeout_s"] == 2.0
    r = alice.post("/v1/graders/run", json={"grader": g, "sample": {"output_text": "abce"}, "item": {"answer": "abcd"}})
    assert r.status_code == 200 and r.json() == {"reward": 0.375, "error": None, "sub_rewards": {"a": 0.0, "b": 0.75}}
    bad = dict(g, calculate_output="a.__class__")
    assert "attribute" in err(alice.post("/v1/graders/validate", json={"grader": bad}), 422, "SpecError")
    assert "not registered" in err(alice.post("/v1/graders/validate", json={
        "grader": {"type": "builtin", "verifier": "mine"}}), 422, "SpecError")
    assert c["anon"].post("/v1/graders/validate", json={"grader": g}).status_code == 401
    # registered verifiers: the operator's, refused for the audit's paths, then usable by tenants
    err(alice.put("/v1/verifiers/mine", json={"path": "tests.helpers_verifiers:always_raises"}), 403, "Forbidden")
    for path in ("requests:get", "sympy:sympify", "marlaas.verify.sandbox:subprocess.run"):
        err(op.put("/v1/verifiers/mine", json={"path": path}), 422, "SpecError")
    assert op.put("/v1/verifiers/mine", json={"path": "tests.helpers_verifiers:always_raises"}).status_code == 200
    assert alice.get("/v1/verifiers").json() == {"verifiers": [{"name": "mine"}]}
    r = alice.post("/v1/graders/run", json={"grader": {"type": "builtin", "verifier": "mine"},
                                           "sample": {"output_text": "x"}})
    assert r.json()["reward"] == 0.0 and "always fails" in r.json()["error"]
    # a tenant's job names the registered name, never an import path
    rows = [{"prompt": f"sort:{i}1=", "answer": f"1{i}"} for i in range(2, 6)]
    spec = {"dataset": rows, "steps": 1, "prompts_per_step": 1, "group_size": 2, "eval_size": 1}
    by_path = dict(spec, verifier="tests.helpers_verifiers:always_raises")
    assert "import paths" in err(alice.post("/v1/jobs", json=by_path), 422, "SpecError")
    assert "not registered" in err(alice.post("/v1/jobs", json=dict(spec, verifier="other")), 422, "SpecError")
    assert alice.post("/v1/jobs", json=dict(spec, verifier="mine")).status_code == 201
    assert alice.post("/v1/jobs", json=dict(spec, grader=g)).status_code == 201
    assert op.delete("/v1/verifiers/mine").status_code == 200
    assert op.delete("/v1/verifiers/mine").status_code == 404
