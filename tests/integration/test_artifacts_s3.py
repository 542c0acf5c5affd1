"""The artifact store over a real S3 server (SeaweedFS from tests/s3server.py, credentials required):
S3Artifacts' whole contract, its errors as one ArtifactError line, the per-host DiskCache in front
of it (one GET per object and host, several processes), and a real Store whose adapter versions and
optimizer states live in the bucket while Redis holds only references."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from marlaas.errors import ArtifactError
from marlaas.store.artifacts import DiskCache, S3Artifacts, open_artifacts

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def s3env(s3_server, monkeypatch):
    """The standard AWS variables of the test server in this process's environment (boto3 reads them)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture()
def url(s3env) -> str:
    """A fresh prefix of the bucket for one test."""
    return f"s3://{s3env.bucket}/t-{uuid.uuid4().hex[:10]}"


def gets(a: S3Artifacts) -> list[str]:
    """Counts the GET requests this client sends (a list that grows by one per GetObject)."""
    seen: list[str] = []
    a.s3.meta.events.register("before-call.s3.GetObject", lambda params, **kw: seen.append(params["url_path"]))
    return seen


def test_s3_put_get_list_delete_fetch_stream(url, s3env, tmp_path):
    a = open_artifacts(url)
    assert isinstance(a, S3Artifacts) and a.cache is None
    put = a.put("t/alice/jobs/j1", b"weights v1")
    assert put.new and put.ref.size == 10 and put.ref.sha256 == hashlib.sha256(b"weights v1").hexdigest()
    assert not a.put("t/alice/jobs/j1", b"weights v1").new  # dedup: the same bytes are already there
    r2 = a.put("t/alice/jobs/j1", b"optimizer").ref
    r3 = a.put("t/alice/jobs/j10", b"other job").ref
    assert a.get(put.ref) == b"weights v1" and a.exists(put.ref) and a.size(r2.key) == 9
    # the object really is in the bucket, under the URL's prefix
    prefix = url.split("/", 3)[3]
    assert s3env.keys(prefix + "/")[f"{prefix}/{put.ref.key}"] == 10
    assert {o.key: o.size for o in a.list("t/alice/jobs/j1/")} == {put.ref.key: 10, r2.key: 9}
    assert {o.key for o in a.list("t/alice/jobs/j1")} == {put.ref.key, r2.key}  # whole segments
    assert {o.key for o in a.list("")} == {put.ref.key, r2.key, r3.key}
    assert all(abs(o.mtime - time.time()) < 300 for o in a.list(""))
    a.fetch_to(r2, tmp_path / "dl" / "optim.pt")
    assert (tmp_path / "dl" / "optim.pt").read_bytes() == b"optimizer"
    assert os.listdir(tmp_path / "dl") == ["optim.pt"]
    assert b"".join(a.stream(r3)) == b"other job"
    big = tmp_path / "base.safetensors"
    big.write_bytes(os.urandom(20 * 2**20))  # past boto3's multipart threshold
    fput = a.put_file("base/abc", big)
    assert fput.new and a.size(fput.ref.key) == 20 * 2**20 and not a.put_file("base/abc", big).new
    a.fetch_to(fput.ref, tmp_path / "dl" / "base.safetensors")
    assert (tmp_path / "dl" / "base.safetensors").read_bytes() == big.read_bytes()
    a.delete([put.ref.key, r3.key, r3.key])
    assert {o.key for o in a.list("t/")} == {r2.key}
    with pytest.raises(ArtifactError, match=f"artifact {put.ref.key} is missing from {url}$"):
        a.get(put.ref)
    with pytest.raises(ArtifactError, match="is missing from"):
        a.fetch_to(put.ref, tmp_path / "dl" / "gone")
    with pytest.raises(ArtifactError, match="is missing from"):
        b"".join(a.stream(put.ref))
    assert not (tmp_path / "dl" / "gone").exists() and a.size(put.ref.key) is None
    a.delete([o.key for o in a.list("")])
    assert list(a.list("")) == []


def test_s3_reads_detect_other_bytes_under_a_key(url, s3env, tmp_path):
    a = open_artifacts(url)
    ref = a.put("t/alice/files", b"the real dataset").ref
    s3env.client().put_object(Bucket=s3env.bucket, Key=f"{url.split('/', 3)[3]}/{ref.key}", Body=b"a forged dataset")
    with pytest.raises(ArtifactError, match=f"artifact {ref.key} is corrupt"):
        a.get(ref)
    with pytest.raises(ArtifactError, match="is corrupt"):
        a.fetch_to(ref, tmp_path / "x")
    assert not (tmp_path / "x").exists() and os.listdir(tmp_path) == []
    cached = open_artifacts(url, tmp_path / "cache", 2**20)
    with pytest.raises(ArtifactError, match="is corrupt"):
        cached.get(ref)
    assert os.listdir(tmp_path / "cache") == []  # nothing forged was kept


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg and e.value.__cause__ is None, msg
    assert e.value.__context__ is None or e.value.__suppress_context__, "a botocore error must not be chained"
    return msg


def refused(op) -> str:
    with pytest.raises(ArtifactError) as e:
        op()
    msg = one_line(e)
    assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in msg, msg
    return msg


def test_wrong_credentials_are_one_clear_artifact_error_for_every_operation(url, s3env, monkeypatch, tmp_path):
    good = open_artifacts(url)
    ref = good.put("t/alice/jobs/j1", b"bytes").ref
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    bad = open_artifacts(url)
    f = tmp_path / "f.bin"
    f.write_bytes(b"file bytes")
    for op in (lambda: bad.put("t/alice/jobs/j1", b"new bytes"), lambda: bad.put_file("base/h", f),
               lambda: bad.get(ref), lambda: bad.size(ref.key), lambda: bad.fetch_to(ref, tmp_path / "out"),
               lambda: list(bad.list("t/")), lambda: bad.delete([ref.key]), lambda: b"".join(bad.stream(ref))):
        assert refused(op).startswith(f"artifact store {url}: ")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    assert "403 Forbidden" in refused(lambda: open_artifacts(url).put("t/alice/jobs/j1", b"x"))  # a HEAD: no body
    assert "InvalidAccessKeyId" in refused(lambda: open_artifacts(url).get(ref))
    assert good.get(ref) == b"bytes"  # nothing was changed by the refused calls
    assert not (tmp_path / "out").exists()


def test_refused_writes_are_one_clear_artifact_error(url, s3env, monkeypatch, tmp_path):
    """An identity that may read but not write: the writes themselves (PUT, multipart upload,
    delete) are refused after the existence check passed."""
    good = open_artifacts(url)
    ref = good.put("t/alice/jobs/j1", b"bytes").ref
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3env.readonly[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3env.readonly[1])
    ro = open_artifacts(url)
    assert ro.get(ref) == b"bytes" and ro.size(ref.key) == 5  # reading is allowed
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(b"file bytes")
    big.write_bytes(os.urandom(12 * 2**20))  # multipart
    for op, what in ((lambda: ro.put("t/alice/jobs/j1", b"new bytes"), "put"),
                     (lambda: ro.put_file("base/h", small), "upload"), (lambda: ro.put_file("base/h", big), "upload"),
                     (lambda: ro.delete([ref.key]), "delete")):
        assert refused(op).startswith(f"artifact store {url}: {what}")
    assert {o.key for o in good.list("")} == {ref.key}  # nothing partial became visible


def test_anonymous_requests_are_refused(s3env):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    anon = boto3.client("s3", endpoint_url=s3env.endpoint, region_name="us-east-1",
                        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}))
    with pytest.raises(ClientError, match="AccessDenied"):
        anon.put_object(Bucket=s3env.bucket, Key="anon", Body=b"x")
    with pytest.raises(ClientError, match="AccessDenied"):
        anon.list_objects_v2(Bucket=s3env.bucket)


def test_unreachable_endpoint_and_missing_bucket_are_one_line(s3env, monkeypatch):
    from tests.s3server import free_ports

    ref = open_artifacts(f"s3://{s3env.bucket}/x").put("t/a/files", b"x").ref
    with pytest.raises(ArtifactError) as e:
        open_artifacts("s3://no-such-bucket-here/x").get(ref)
    assert one_line(e).endswith("failed: bucket 'no-such-bucket-here' does not exist")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    a = open_artifacts(f"s3://{s3env.bucket}/x")
    with pytest.raises(ArtifactError) as e:
        a.put("t/a/files", b"x")
    assert "Could not connect to the endpoint URL" in one_line(e)


def test_disk_cache_in_front_serves_a_hot_object_without_a_get(url, s3env, tmp_path):
    a = open_artifacts(url, tmp_path / "cache", 4 * 2**20)
    assert isinstance(a.cache, DiskCache)
    sent = gets(a)
    data = os.urandom(2**20)
    ref = a.put("t/alice/jobs/j1", data).ref
    assert a.get(ref) == data and len(sent) == 1
    for _ in range(3):
        assert a.get(ref) == data
    assert len(sent) == 1 and (a.cache.hits, a.cache.misses) == (3, 1)
    # a second process of the host (another client over the same directory) reads it from disk too
    b = open_artifacts(url, tmp_path / "cache", 4 * 2**20)
    sent_b = gets(b)
    assert b.get(ref) == data and sent_b == [] and b.cache.hits == 1
    # LRU by bytes: 5 objects of 1 MiB through a 4 MiB cache keep the 4 newest
    refs = [a.put("t/alice/jobs/j1", os.urandom(2**20)).ref for _ in range(4)]
    for r in refs:
        a.get(r)
    names = {p.name for p in (tmp_path / "cache").iterdir()}
    assert names == {r.sha256 for r in refs}
    a.get(ref)
    assert len(sent) == 6  # evicted, so fetched again


READER = """
import hashlib, json, os, sys
from marlaas.store.artifacts import Ref, open_artifacts
url, cache, refs = sys.argv[1], sys.argv[2], [Ref.parse(r) for r in sys.argv[3:]]
a = open_artifacts(url, cache, 3 * 2**20)  # smaller than the objects together: eviction races reads
n = 0
for i in range(60):  # one hot object, the others in turn
    r = refs[0] if i % 2 == 0 else refs[1 + (i // 2) % (len(refs) - 1)]
    assert hashlib.sha256(a.get(r)).hexdigest() == r.sha256
    n += 1
print(json.dumps({"reads": n, "hits": a.cache.hits, "misses": a.cache.misses}))
"""


def test_two_processes_read_through_one_cache_directory(url, s3env, tmp_path):
    a = open_artifacts(url)
    refs = [a.put("t/alice/jobs/j1", os.urandom(2**20 + i)).ref for i in range(5)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", READER, url, str(tmp_path / "cache"), *map(str, refs)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out)["reads"] == 60
    totals = [json.loads(out) for out, _ in outs]
    assert sum(t["hits"] for t in totals) > 0 and sum(t["misses"] for t in totals) >= len(refs)
    left = list((tmp_path / "cache").iterdir())
    assert sum(p.stat().st_size for p in left if not p.name.startswith(".part")) <= 3 * 2**20
    for p in left:  # every file the cache holds is whole: named by the sha256 of its bytes
        if not p.name.startswith(".part"):
            assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name


def test_a_store_over_s3_keeps_only_references_in_redis(url, s3env, scratch_url, tmp_path):
    from marlaas.spec import JobSpec
    from marlaas.store import Store
    from marlaas.store.artifacts import Ref
    from marlaas.store.keys import adapter_key, optim_key
    from marlaas.types import AdapterBlob, AdapterRef

    st = Store(scratch_url, artifacts=open_artifacts(url, tmp_path / "cache", 64 * 2**20))
    spec = JobSpec(task="sort", steps=3, prompts_per_step=2, group_size=4, max_staleness=1, eval_size=2)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(10)]
    jid = st.create_job(spec, rows, rows[:2])
    w1, w2 = os.urandom(3 * 2**20), os.urandom(3 * 2**20)  # each larger than any Redis value may be
    o1, o2 = os.urandom(2 * 2**20), os.urandom(2 * 2**20)
    assert st.publish(jid, 0, AdapterBlob({"r": 4}, w1), o1, {"step": 1}, "x", [0], spec.steps)
    assert st.publish(jid, 1, AdapterBlob({"r": 4}, w2), o2, {"step": 2}, "x", [1], spec.steps)
    assert st.job(jid).version == 2
    assert st.adapter(AdapterRef(jid, 1)).weights == w1
    assert st.adapter(AdapterRef(jid, 2)).weights == w2
    assert st.optimizer_state(jid) == (2, o2)
    # the bucket holds both versions and the live optimizer state (the replaced one was dropped)
    prefix = url.split("/", 3)[3]
    tenant = st.job(jid).spec.tenant
    owner = f"t/{tenant or '_'}/jobs/{jid}"
    assert Ref.parse(st.r.hget(adapter_key(jid, 1), "ref")).owner == owner
    want = {hashlib.sha256(x).hexdigest(): len(x) for x in (w1, w2, o2)}
    objs = s3env.keys(f"{prefix}/{owner}/")
    assert {k.rsplit("/", 1)[1]: n for k, n in objs.items()} == want
    assert st.stored_bytes(tenant) == sum(want.values())
    # Redis holds references: the adapter hash names its object, and no value reaches 1 MiB
    raw = st.r.hget(adapter_key(jid, 2), "ref")
    assert Ref.parse(raw).sha256 == hashlib.sha256(w2).hexdigest() and len(raw) < 200
    assert Ref.parse(st.r.hget(optim_key(jid), "ref")).size == len(o2)
    sizes = {k: st.r.memory_usage(k, samples=0) or 0 for k in st.r.scan_iter(count=1000)}
    assert sizes and max(sizes.values()) < 2**20, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    # the sweep over S3: an orphan older than the grace period goes, every referenced object stays
    orphan = st.put_blob(owner, b"written by a trainer killed before its publish")
    out = st.sweep(now=time.time() + 7200, grace_s=3600)
    assert out["orphans"] == 1 and st.artifacts.size(orphan.key) is None
    assert {k.rsplit("/", 1)[1] for k in s3env.keys(f"{prefix}/{owner}/")} == set(want)
    assert st.stored_bytes(tenant) == sum(want.values())
