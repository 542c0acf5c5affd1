"""The store is private to the service: what a holder of the old shared Redis URL could do, refused.

Each test is one attack of the front-door audit, run against the real embedded Redis (and, for
remote control, the real worker stack)."""

from __future__ import annotations

import json
import time
from urllib.parse import urlparse

import pytest
import redis

from marlaas.control import dispatch
from marlaas.store import LEASES, Store, job_key

pytestmark = pytest.mark.integration


def test_redis_refuses_a_client_without_the_password(redis_url):
    u = urlparse(redis_url)
    assert u.password, "the embedded Redis URL carries a generated password"
    anonymous = redis.Redis(host=u.hostname, port=u.port, socket_connect_timeout=2)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    wrong = redis.Redis(host=u.hostname, port=u.port, password="guess", socket_connect_timeout=2)
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()


def test_admin_commands_are_gone_even_with_the_password(redis_url):
    r = Store(redis_url).r
    for cmd in (("FLUSHALL",), ("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "SET", "dir", "/tmp"),
                ("DEBUG", "SLEEP", "0"), ("SHUTDOWN",)):
        with pytest.raises(redis.exceptions.ResponseError, match="unknown command"):
            r.execute_command(*cmd)
    assert r.ping()  # still serving


def test_the_redis_password_is_in_no_process_command_line(redis_stack):
    password = urlparse(redis_stack.url).password
    pid = redis_stack.procs["redis"].pid
    assert password not in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")


def test_a_malformed_lease_is_dropped_and_scheduling_goes_on(st):
    st.r.zadd(LEASES, {"garbage": 0, "gen|j1": 0, "nokind|j1|3": 0})
    snap = dispatch.snapshot(st, time.time())  # no exception
    assert snap.expired == ()
    assert st.r.zcard(LEASES) == 0


def test_a_forged_spec_is_refused_by_the_service(st):
    from marlaas import JobSpec

    jid = st.create_job(JobSpec(tenant="alice", task="sort", steps=2, eval_size=2), [{"prompt": "a", "answer": "a"}],
                        [{"prompt": "b", "answer": "b"}])
    spec = json.loads(st.r.hget(job_key(jid), "spec"))
    spec.update(steps=10**9, group_size=10**6, eval_size=10**9)  # written past the API
    st.r.hset(job_key(jid), "spec", json.dumps(spec))
    with pytest.raises(ValueError):
        st.spec(jid)
    created = st.job_fields(jid, "created")[0]
    assert st.job_specs([(jid, created)]) == {}  # the tick skips it, logged, not fatal


def test_celery_remote_control_is_off(worker_stack):
    from celery import Celery

    app = Celery("probe")  # its own app and connections: the service's app keeps its broker settings
    app.config_from_object("celeryconfig")
    app.conf.broker_url = worker_stack.url
    try:
        assert app.conf.worker_enable_remote_control is False
        assert app.control.ping(timeout=1.0) == []  # no worker answers a broadcast (shutdown would be one)
    finally:
        app.close()
