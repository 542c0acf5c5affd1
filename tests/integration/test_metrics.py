"""Prometheus metrics: the exposition format (pure), values read back from a real store, the HTTP server."""

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from marlaas.errors import MarlaasError
from marlaas.ops import metrics
from marlaas.spec import JobSpec
from marlaas.store import Store
from marlaas.types import AdapterBlob

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
VALUE = r"(?:[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|NaN|[+-]Inf)"
SAMPLE = re.compile(rf"^({NAME})(?:\{{((?:{LABEL})(?:,{LABEL})*)?\}})? ({VALUE})$")
HELP = re.compile(rf"^# HELP ({NAME}) (.*)$")
TYPE = re.compile(rf"^# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)$")
LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse(text: str) -> tuple[dict, dict, list]:
    """Strictly parse an exposition: (help by name, type by name, [(name, labels, value)])."""
    helps, types, samples = {}, {}, []
    assert text.endswith("\n")
    for line in text.splitlines():
        if m := HELP.match(line):
            helps[m.group(1)] = m.group(2)
        elif m := TYPE.match(line):
            assert m.group(1) not in types, f"TYPE twice for {m.group(1)}"
            types[m.group(1)] = m.group(2)
        elif line.startswith("#"):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"not a valid sample line: {line!r}"
            name, raw, value = m.groups()
            assert name in types, f"sample {name} before its # TYPE"
            labels = {k: _unescape(v) for k, v in LABEL_PAIR.findall(raw or "")}
            samples.append((name, labels, float(value)))
    return helps, types, samples


def value(samples, name, **labels):
    hits = [v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items())]
    assert len(hits) == 1, f"{name} {labels}: {len(hits)} samples"
    return hits[0]


SNAPSHOT = {
    "up": True,
    "jobs": [{
        "job": "j1", "tenant": 'we"ird\\ten\nant', "task": "sort", "status": "running", "step": 2,
        "steps_total": 5, "reward_mean": 0.375, "staleness": 1, "max_staleness": 2, "regenerated": 3,
        "verify_errors": 0, "evals": {0: 0.25, 2: 0.5},
    }],
    "queues": {"generate": 4, "verify": 0, "train": 1, "control": 0},
    "window_s": 60.0,
    "busy": {"generate": 0.5, "verify": 0.125, "train": 0.0},
    "trainer": {"job": "j1"},
    "workers": {"control": 1, "generate": 2, "verify": 1, "train": 0},
}


@pytest.mark.unit
def test_render_is_valid_exposition_with_help_type_and_escaping():
    text = metrics.render(SNAPSHOT)
    helps, types, samples = parse(text)
    assert set(helps) == set(types) == set(metrics.FAMILIES)
    odd = 'we"ird\\ten\nant'
    assert 'tenant="we\\"ird\\\\ten\\nant"' in text  # quote, backslash and newline escaped
    assert value(samples, "marlaas_job_step", job="j1", tenant=odd, task="sort") == 2
    assert value(samples, "marlaas_job_steps_total", job="j1") == 5
    assert value(samples, "marlaas_job_reward_mean", job="j1") == 0.375
    assert value(samples, "marlaas_job_eval_accuracy", job="j1", version=2) == 0.5
    assert value(samples, "marlaas_job_status", job="j1", status="running") == 1
    assert value(samples, "marlaas_queue_depth", queue="generate") == 4
    assert value(samples, "marlaas_station_busy_fraction", station="verify") == 0.125
    assert value(samples, "marlaas_trainer_busy") == 1
    assert value(samples, "marlaas_trainer_lease", job="j1") == 1
    assert value(samples, "marlaas_workers", station="generate") == 2


@pytest.mark.unit
def test_render_parses_with_the_reference_parser():
    parser = pytest.importorskip("prometheus_client.parser")  # installed with Flower
    fams = {f.name: f for f in parser.text_string_to_metric_families(metrics.render(SNAPSHOT))}
    step = fams["marlaas_job_step"].samples[0]
    assert step.labels == {"job": "j1", "tenant": 'we"ird\\ten\nant', "task": "sort"} and step.value == 2
    assert fams["marlaas_job_regenerated"].type == "counter"  # the parser strips the _total suffix
    assert sum(len(f.samples) for f in fams.values()) == len(parse(metrics.render(SNAPSHOT))[2])


@pytest.mark.unit
def test_render_when_store_is_down_and_special_values():
    text = metrics.render({"up": False, "error": "connection refused\nsecond line"})
    helps, types, samples = parse(text)
    assert set(types) == set(metrics.FAMILIES)
    assert samples == [("marlaas_store_up", {}, 0.0)]
    assert [metrics.fmt_value(x) for x in (float("nan"), float("inf"), -float("inf"), 3, 0.1, True)] == \
        ["NaN", "+Inf", "-Inf", "3", "0.1", "1"]
    assert "marlaas_trainer_lease{" not in metrics.render({**SNAPSHOT, "trainer": {"job": None}})


# ------------------------------------------------------------------ against a real store
def build_state(st: Store, now: float) -> dict[str, str]:
    """Two tenants' jobs in the state the stations leave them in; returns tenant -> job id."""
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(6)]
    ids = {}
    for tenant, steps in (("alice", 3), ("bob", 2)):
        spec = JobSpec(tenant=tenant, task="sort", steps=steps, prompts_per_step=2, group_size=4,
                       max_staleness=2, eval_size=2)
        jid = st.create_job(spec, rows, rows[:2])
        st.put_eval_result(jid, 0, {"exact": 0.25, "mean_reward": 0.25, "acc": 0.25, "n": 4, "at": now - 50})
        for t in range(steps):
            m = {"loss": 0.1 * t, "step": t + 1, "reward_mean": 0.2 + 0.1 * t + (0.05 if tenant == "bob" else 0),
                 "staleness": [min(t, 2), 0], "train_s": 0.5, "at": now - 40 + t}
            assert st.publish(jid, t, AdapterBlob(config={"r": 1}, weights=b"w"), b"o", m, "tok", [], steps)
        st.put_eval_result(jid, steps, {"exact": 0.75, "mean_reward": 0.75, "acc": 0.75, "n": 4, "at": now - 30})
        ids[tenant] = jid
    st.set_status(ids["alice"], "done")
    st.incr_field(ids["bob"], "regenerated", 2)
    for station, s, e in (("generate", 0, 30), ("verify", 10, 25), ("train", 20, 35), ("generate", 40, 45)):
        st.record_event(station, now - 60 + s, now - 60 + e, list(ids.values()), "w1")
    st.heartbeat("generate@h:1", "generate")
    st.heartbeat("generate@h:2", "generate")
    st.heartbeat("verify@h:3", "verify")
    st.take_trainer(ids["bob"], 2, 30)
    st.r.rpush("generate", "m1", "m2", "m3")  # Celery's Redis transport: one list per queue
    st.r.rpush("verify\x06\x163", "m4")  # and one per non-zero priority step
    return ids


@pytest.mark.integration
def test_collect_and_render_report_what_the_store_holds(st):
    now = time.time()
    ids = build_state(st, now)
    helps, types, samples = parse(metrics.render(metrics.collect(st, now=now)))
    a, b = ids["alice"], ids["bob"]
    assert value(samples, "marlaas_store_up") == 1
    assert value(samples, "marlaas_job_step", job=a, tenant="alice", task="sort") == 3
    assert value(samples, "marlaas_job_steps_total", job=b, tenant="bob") == 2
    assert value(samples, "marlaas_job_reward_mean", job=a) == pytest.approx(0.4)
    assert value(samples, "marlaas_job_reward_mean", job=b) == pytest.approx(0.35)
    assert value(samples, "marlaas_job_staleness", job=a) == 2
    assert value(samples, "marlaas_job_staleness", job=b) == 1
    assert value(samples, "marlaas_job_eval_accuracy", job=a, version=0) == 0.25
    assert value(samples, "marlaas_job_eval_accuracy", job=a, version=3) == 0.75
    assert value(samples, "marlaas_job_status", job=a, status="done") == 1
    assert value(samples, "marlaas_job_status", job=b, status="running") == 1
    assert value(samples, "marlaas_job_regenerated_total", job=b) == 2
    assert value(samples, "marlaas_queue_depth", queue="generate") == 3
    assert value(samples, "marlaas_queue_depth", queue="verify") == 1
    assert value(samples, "marlaas_queue_depth", queue="train") == 0
    # generate busy [0,30] and [40,45] of the last 60 s; verify [10,25]; train [20,35]
    assert value(samples, "marlaas_station_busy_fraction", station="generate") == pytest.approx(35 / 60, abs=1e-3)
    assert value(samples, "marlaas_station_busy_fraction", station="verify") == pytest.approx(15 / 60, abs=1e-3)
    assert value(samples, "marlaas_station_busy_fraction", station="train") == pytest.approx(15 / 60, abs=1e-3)
    assert value(samples, "marlaas_trainer_busy") == 1
    assert value(samples, "marlaas_trainer_lease", job=b) == 1
    assert value(samples, "marlaas_workers", station="generate") == 2
    assert value(samples, "marlaas_workers", station="train") == 0
    # a finished job drops out of the export an hour after its last update
    later = metrics.collect(st, now=now + 2 * metrics.FINISHED_WITHIN_S)
    assert [j["job"] for j in later["jobs"]] == [b]


@pytest.mark.integration
def test_events_since_reads_only_the_tail(st):
    now = time.time()
    for i in range(25):
        st.record_event("verify", now - 100 + i, now - 100 + i + 0.5, ["j1"], "w")
    got = st.events_since(now - 80, chunk=4)
    assert [round(e["start"] - now) for e in got] == list(range(-80, -75))
    assert len(st.events_since(0, chunk=4)) == 25


@pytest.mark.integration
def test_a_job_reads_its_own_task_events_a_page_at_a_time(st):
    from marlaas.store.keys import job_tasks_key

    now = time.time()
    for i in range(40):  # j1 in every task, j2 in every fourth, j3 never
        st.record_event("generate", now - 100 + i, now - 100 + i + 0.5, ["j1"] + ["j2"] * (i % 4 == 0), "w")
    assert st.r.llen(job_tasks_key("j1")) == 40 and st.r.llen(job_tasks_key("j2")) == 10
    got = st.job_tasks("j1", now - 80, 3)  # ends -99.5, -98.5, ...: the first three after -80
    assert [round(e["end"] - now, 1) for e in got] == [-79.5, -78.5, -77.5]
    assert set(got[0]) == {"station", "start", "end"}  # batch-mates are not named
    assert [round(e["end"] - now, 1) for e in st.job_tasks("j2", now - 90, 100)] == [-87.5, -83.5, -79.5, -75.5,
                                                                                    -71.5, -67.5, -63.5]
    assert st.job_tasks("j1", now, 5) == [] and st.job_tasks("j3", 0, 5) == []
    assert len(st.job_tasks("j1", 0, 1000)) == 40
    # the same page read on any list of JSON in order of a field; an element without it counts as early
    key = "m:test:list"
    st.r.rpush(key, json.dumps({"x": 1}), *[json.dumps({"at": t}) for t in (1.0, 2.5, 2.5, 4.0)])
    assert st.list_after(key, "at", 2.5, 10) == [{"at": 4.0}]
    assert st.list_after(key, "at", 0.5, 2) == [{"at": 1.0}, {"at": 2.5}]
    assert st.list_after(key, "at", 4.0, 10) == []


@pytest.mark.integration
def test_http_server_answers_metrics_and_healthz(st):
    build_state(st, time.time())
    server = metrics.make_server("127.0.0.1", 0, url=st.url)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            _, types, samples = parse(r.read().decode())
        assert value(samples, "marlaas_job_step", tenant="alice") == 3
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200 and b"redis up" in r.read()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/nope", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_metrics_server_answers_store_down_without_failing():
    server = metrics.make_server("127.0.0.1", 0, url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=20) as r:
            _, _, samples = parse(r.read().decode())
        assert samples == [("marlaas_store_up", {}, 0.0)]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration
def test_procfile_metrics_line_serves(st, redis_stack):
    from marlaas.ops.embedded import free_port

    build_state(st, time.time())
    port = free_port()
    redis_stack.start("metrics", env={"MARLAAS_REDIS_URL": st.url, "MARLAAS_METRICS_PORT": str(port)})
    try:
        deadline, text = time.time() + 30, None
        while text is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except (urllib.error.URLError, ConnectionError):
                assert time.time() < deadline, "the Procfile's metrics line never answered"
                time.sleep(0.2)
        _, _, samples = parse(text)
        assert value(samples, "marlaas_job_step", tenant="bob") == 2
    finally:
        redis_stack.kill("metrics")


@pytest.mark.integration
def test_busy_port_keeps_the_process_up_without_serving(tmp_path):
    """Under honcho one exiting process stops the whole stack: a taken port must not exit."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "metrics.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "marlaas.cli", "metrics-server", "--port", str(port)],
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "MARLAAS_REDIS_URL": "redis://127.0.0.1:1/0"})
        try:
            deadline = time.time() + 30
            while b"in use" not in log.read_bytes():
                assert p.poll() is None, log.read_text()
                assert time.time() < deadline, "no error line"
                time.sleep(0.1)
            time.sleep(0.3)
            assert p.poll() is None
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)


@pytest.mark.integration
def test_metrics_are_operator_only(st):
    """Loopback by default; a token makes /metrics need it; a public bind without a token is refused."""
    with pytest.raises(MarlaasError, match="without a token"):
        metrics.make_server("0.0.0.0", 0, url=st.url)
    server = metrics.make_server("127.0.0.1", 0, url=st.url, token="s3cret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base, timeout=10)
        assert e.value.code == 401
        req = urllib.request.Request(base, headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and b"marlaas_store_up 1" in r.read()
    finally:
        server.shutdown()
        server.server_close()
