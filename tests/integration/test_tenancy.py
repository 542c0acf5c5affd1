"""Tenancy against a real Redis: tokens, isolation and quotas; each refusal is one clear line."""

import pytest

from marlaas import JobSpec
from marlaas.api.client import Client
from marlaas.api.tenancy import Quotas, add_tenant, hash_token
from marlaas.errors import Forbidden, NotFound, SpecError
from marlaas.store import Store
from marlaas.types import AdapterBlob, AdapterRef

pytestmark = pytest.mark.integration


@pytest.fixture()
def url(scratch_url):
    return scratch_url


def spec(**kw):
    return JobSpec(**{"task": "sort", "steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_size": 2, **kw})


def test_single_user_mode_needs_no_token(url):
    c = Client(url)
    assert c.tenant is None
    job = c.submit(spec())
    assert c.job(job.id).status()["tenant"] == "default"
    with pytest.raises(Forbidden, match="no tenants"):
        Client(url, token="mt_whatever")


def test_tokens_isolate_tenants(url):
    store = Store(url)
    ta = add_tenant(store, "alice")
    tb = add_tenant(store, "bob")
    assert store.tenant("alice")["token_sha256"] == hash_token(ta)
    assert ta not in str(store.r.hgetall("m:tenants"))  # only the hash is stored
    with pytest.raises(Forbidden, match="needs a tenant token"):
        Client(url)
    with pytest.raises(Forbidden, match="invalid token"):
        Client(url, token="mt_forged")
    alice, bob = Client(url, token=ta), Client(url, token=tb)
    ja = alice.submit(spec())
    assert ja.status()["tenant"] == "alice"  # filled in from the token
    with pytest.raises(Forbidden, match="cannot submit jobs for tenant 'alice'"):
        bob.submit(spec(tenant="alice"))
    # bob can neither see, read, cancel nor download alice's job
    with pytest.raises(NotFound):
        bob.job(ja.id)
    from marlaas.api.client import Job

    forged = Job(bob, ja.id)
    for call in (forged.status, forged.metrics, forged.cancel, lambda: forged.download_adapter("x")):
        with pytest.raises(NotFound):
            call()
    assert [j.id for j in bob.jobs()] == []
    with pytest.raises(NotFound, match="no tenant 'alice'"):  # the same answer as over HTTP
        bob.jobs(tenant="alice")
    assert [j.id for j in alice.jobs()] == [ja.id]
    assert alice.job(ja.id).status()["status"] == "running"


def test_quotas(url):
    store = Store(url)
    tok = add_tenant(store, "carol", Quotas(max_active_jobs=1, max_steps=5, max_group_size=4))
    c = Client(url, token=tok)
    with pytest.raises(SpecError, match="over quota: steps 6 > 5"):
        c.submit(spec(steps=6))
    with pytest.raises(SpecError, match="over quota: group_size 8 > 4"):
        c.submit(JobSpec(task="sort", steps=2, group_size=8))
    c.submit(spec())
    with pytest.raises(SpecError, match="already runs 1 jobs"):
        c.submit(spec())
    with pytest.raises(SpecError, match="exists already"):
        add_tenant(store, "carol")


def test_every_cost_has_a_quota_and_the_share_comes_from_the_plan(url):
    store = Store(url)
    tok = add_tenant(store, "erik", Quotas(weight=2.5, max_tokens_per_step=1000, max_eval_rows=100,
                                           max_eval_rows_total=300, max_staleness=2, max_row_bytes=200,
                                           max_dataset_bytes=2000))
    c = Client(url, token=tok)
    for bad, match in (
        (dict(prompts_per_step=8, group_size=8, max_new_tokens=16), "tokens per step .* 1024 > 1000"),
        (dict(eval_size=100000, eval_k=256), r"evaluation rows \(eval_size x \(1 \+ eval_k\)\) 25700000 > 100"),
        (dict(steps=10, eval_every=1, eval_size=10, eval_k=2), "evaluation rows over the job .* 330 > 300"),
        (dict(max_staleness=3), "max_staleness 3 > 2"),
    ):
        with pytest.raises(SpecError, match=match):
            c.submit(spec(**bad))
    big = [{"prompt": "x" * 300, "answer": "y"}] * 3
    with pytest.raises(SpecError, match="dataset row [0-9]+ has .* bytes > 200"):
        c.submit(JobSpec(dataset=big, steps=2, eval_size=1))
    many = [{"prompt": f"p{i}" * 10, "answer": "y"} for i in range(100)]
    with pytest.raises(SpecError, match="the dataset has .* bytes > 2000"):
        c.submit(JobSpec(dataset=many, steps=2, eval_size=1))
    job = c.submit(spec(weight=100.0))  # a tenant cannot raise its own share
    assert store.spec(job.id).weight == 2.5
    assert store.job_ids() == [job.id]  # every refusal stored nothing


def test_adapter_download_of_own_job(url, tmp_path):
    store = Store(url)
    tok = add_tenant(store, "dave")
    c = Client(url, token=tok)
    job = c.submit(spec())
    store.publish(job.id, 0, AdapterBlob(config={"r": 4}, weights=b"abc"), b"o", {}, "x", [], 2)
    out = job.download_adapter(tmp_path / "a")
    assert (out / "adapter_model.safetensors").read_bytes() == b"abc"


def test_cli_tenant_add_and_one_line_refusals(url):
    import json
    import subprocess
    import sys

    from tests.conftest import api_server

    cli = [sys.executable, "-m", "marlaas.cli"]
    # `tenant add` is operator tooling on the server host (it reads the store); the tenant commands
    # (`status`) go through the API, started here as the Procfile's `api` line would.
    with api_server(url) as env:
        bad = subprocess.run(cli + ["tenant", "add", "erin", "--quota", "max_steps=0"], env=env, capture_output=True,
                             text=True)
        assert bad.returncode == 2 and bad.stderr.strip() == ("error: --quota max_steps: Input should be greater "
                                                              "than or equal to 1")
        out = subprocess.run(cli + ["tenant", "add", "erin", "--json", "--quota", "serve_requests_per_minute=5"],
                             env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        token = json.loads(out.stdout)["token"]
        assert Store(url).tenant("erin")["quotas"]["serve_requests_per_minute"] == 5
        denied = subprocess.run(cli + ["status"], env=env, capture_output=True, text=True)
        assert denied.returncode == 2
        assert denied.stderr.strip().count("\n") == 0 and "needs a token" in denied.stderr
        ok = subprocess.run(cli + ["status", "--json"], env={**env, "MARLAAS_TOKEN": token}, capture_output=True,
                            text=True)
        assert ok.returncode == 0 and json.loads(ok.stdout) == []


def test_admission_refuses_new_jobs_when_the_store_is_nearly_full(url, monkeypatch):
    from marlaas.errors import StoreFull
    from marlaas.settings import get_settings

    store = Store(url)
    used, cap = store.memory_use()
    assert cap == get_settings().redis_maxmemory_mb << 20  # the embedded Redis has its cap
    monkeypatch.setattr(get_settings(), "admission_memory_fraction", used / cap / 2)
    with pytest.raises(StoreFull, match="store is full"):
        Client(url).submit(spec())
    assert store.job_ids() == []


def test_a_full_store_collects_ended_jobs_leftovers_before_refusing(url, monkeypatch):
    """Over the admission share, the bulk data of ended jobs goes first (before its retention period):
    the submit is admitted, the old job's final adapter and record stay."""
    import time

    from marlaas.settings import get_settings
    from marlaas.store import adapter_key, optim_key, rows_key

    store = Store(url)
    old = store.create_job(spec(steps=3, eval_every=0), [{"prompt": "sort:1=", "answer": "1"}] * 4,
                           [{"prompt": "sort:1=", "answer": "1"}])
    cap = store.memory_use()[1]
    # Adapters and optimizer states are objects of the artifact store, not Redis values; what fills
    # Redis is a job's rows and rollouts (here 96 rows of ~1 MiB). The server is shared with the
    # session's worker stack (DB 0) and other tests' leftovers, so its used_memory moves with their
    # traffic: the admission line is drawn 48 MiB below the use measured just before the submit (not
    # relative to a reading taken before the writes), and collecting the 96 MiB must bring the use 48
    # MiB under it.
    for t in range(3):
        store.publish(old, t, AdapterBlob({"r": 4}, b"w%d" % t), b"opt%d" % t, {"step": t + 1}, "x", [], 3, 0)
    refs = {v: store.adapter_ref(AdapterRef(old, v)) for v in (1, 2, 3)}
    row = b"x" * ((1 << 20) - 4096)
    for _ in range(12):
        store.r.rpush(rows_key(old, "train"), *[row] * 8)
    store.set_status(old, "done")
    store.r.connection_pool.disconnect()  # Redis counts a connection's last query buffer (~ one write)
    used1, _ = store.memory_use()
    held = store.r.memory_usage(rows_key(old, "train"), samples=0) or 0
    assert held > (90 << 20)  # the 96 MiB are in the store, whatever else its use did meanwhile
    line = used1 - (48 << 20)
    monkeypatch.setattr(get_settings(), "admission_memory_fraction", line / cap)
    assert get_settings().retention_s > 3600  # well inside the retention period
    t0 = time.time()
    job = Client(url).submit(spec())
    assert job.id in store.job_ids() and time.time() - t0 < 60
    assert not store.r.exists(adapter_key(old, 1), adapter_key(old, 2), optim_key(old), rows_key(old, "train"))
    assert store.r.exists(adapter_key(old, 3)) and store.job(old).extra["collected"] == "1"
    # the collected versions' objects went with their references; the final one stays downloadable
    assert not store.artifacts.exists(refs[1]) and not store.artifacts.exists(refs[2])
    assert store.adapter(AdapterRef(old, 3)).weights == b"w2"
    assert store.memory_use()[0] < line
