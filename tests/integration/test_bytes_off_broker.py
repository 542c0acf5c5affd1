"""Bytes off the broker (marlaas/store/blobs.py over a real Redis and a real local artifact store):
references published in the version's compare-and-set, objects deleted with the last reference that
names them, orphans swept, stored bytes per tenant, job and tenant deletion, Tinker payloads too
large for a Redis value. The S3 backend is tested in test_artifacts_s3.py."""

from __future__ import annotations

import json

import pytest

from marlaas.errors import ArtifactError, Conflict, NotFound
from marlaas.spec import JobSpec
from marlaas.store import Store, adapter_key, optim_key
from marlaas.store.artifacts import LocalArtifacts
from marlaas.store.blobs import INLINE_MAX, job_owner
from marlaas.store.keys import kept_key
from marlaas.store.tinker import TinkerStore
from marlaas.types import AdapterBlob, AdapterRef
from tests.redis_scan import big_values

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture()
def ast(scratch_url, tmp_path):
    """A Store on the scratch DB with an artifact store of its own (a sweep sees only this test's objects)."""
    return Store(scratch_url, artifacts=LocalArtifacts(tmp_path / "artifacts"))


def job(st, tenant="acme", steps=6, eval_every=0):
    spec = JobSpec(tenant=tenant, task="sort", steps=steps, prompts_per_step=2, group_size=4, eval_size=2,
                   eval_every=eval_every)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(8)]
    return st.create_job(spec, rows, rows[:2])


def keys_of(st, prefix=""):
    return {o.key: o.size for o in st.artifacts.list(prefix)}


def test_a_publish_stores_references_and_the_replaced_objects_go(ast):
    jid = job(ast)
    w = [bytes([t]) * (2 * MiB) for t in range(5)]  # 2 MiB: a Redis value this large is refused by the e2e scan
    for t in range(5):
        assert ast.publish(jid, t, AdapterBlob({"r": 4}, w[t]), b"opt%d" % t, {"step": t + 1}, "x", [], 6)
    # Redis holds references only
    assert big_values(ast.r) == []
    assert ast.r.hget(adapter_key(jid, 5), "weights") is None and len(ast.r.hget(adapter_key(jid, 5), "ref")) < 200
    got = ast.adapter(AdapterRef(jid, 5))
    assert got.weights == w[4] and got.sha256 == ast.adapter_ref(AdapterRef(jid, 5)).sha256
    assert ast.optimizer_state(jid) == (5, b"opt4")
    # versions 1 and 2 were dropped (KEEP_VERSIONS_EXTRA = 2 besides the newest), with their objects,
    # and so was every optimizer state but the last
    owner = job_owner("acme", jid)
    assert set(keys_of(ast, owner)) == ast.job_live_keys(jid)
    assert len(ast.job_live_keys(jid)) == 4  # adapters 3, 4, 5 and the optimizer state
    assert ast.stored_bytes("acme") == 3 * 2 * MiB + len(b"opt4")


def test_identical_bytes_in_two_versions_survive_the_older_ones_deletion(ast):
    jid = job(ast)
    same = AdapterBlob({"r": 4}, b"unchanged")  # a step skipped on a non-finite norm leaves the weights as they were
    for t in range(4):
        ast.publish(jid, t, same, b"o", {}, "x", [], 6)
    assert ast.adapter(AdapterRef(jid, 4)).weights == b"unchanged"  # version 1's deletion kept the shared object
    assert ast.stored_bytes("acme") == len(b"unchanged") + 1


def test_a_publish_reads_only_the_versions_still_kept_and_an_older_job_gets_its_set(ast):
    """A publish looks up the references it must not delete among the kept versions only (it read
    every version ever published: a job at step 6,800 made 6,800 lookups per step and its rate fell
    from 1,600 to 630 steps/min); a job published before the kept set existed gets it built once."""
    jid = job(ast, steps=30, eval_every=10)
    for t in range(25):
        assert ast.publish(jid, t, AdapterBlob({"r": 4}, b"w%d" % t), b"o%d" % t, {"step": t + 1}, "x", [], 30, 10)
    kept = [int(v) for v in ast.r.zrange(kept_key(jid), 0, -1)]
    assert kept == [10, 20, 23, 24, 25]  # evaluated versions and the newest KEEP_VERSIONS_EXTRA + 1
    assert kept == ast.existing_adapters(jid, list(range(1, 26)))
    owner = job_owner("acme", jid)
    assert ast.job_live_keys(jid) == set(keys_of(ast, owner))
    # what is read is the kept set, not every version: a stray record outside it is never looked at
    stray = ast.r.hget(adapter_key(jid, 25), "ref").decode().replace(ast.adapter_ref(AdapterRef(jid, 25)).key, "stray")
    ast.r.hset(adapter_key(jid, 5), "ref", stray)
    assert ast.job_live_keys(jid) == set(keys_of(ast, owner))
    ast.r.delete(adapter_key(jid, 5))
    # an older marlaas's job: no kept set; the next publish builds it from the records that exist
    ast.r.delete(kept_key(jid))
    assert ast.publish(jid, 25, AdapterBlob({"r": 4}, b"w25"), b"o25", {"step": 26}, "x", [], 30, 10)
    assert [int(v) for v in ast.r.zrange(kept_key(jid), 0, -1)] == [10, 20, 24, 25, 26]
    assert ast.job_live_keys(jid) == set(keys_of(ast, owner))


def test_a_lost_publish_and_a_killed_writer_leave_orphans_the_sweep_collects(ast):
    jid = job(ast)
    assert ast.publish(jid, 0, AdapterBlob({"r": 4}, b"v1"), b"o1", {}, "x", [], 6)
    # a duplicate train task loses the compare-and-set: its objects are written, never referenced
    assert not ast.publish(jid, 0, AdapterBlob({"r": 4}, b"dup"), b"o-dup", {}, "x", [], 6)
    # a trainer killed between its write and its publish
    orphan = ast.put_blob(job_owner("acme", jid), b"killed before the publish")
    before = keys_of(ast)
    assert orphan.key in before and len(before) == 5
    young = ast.sweep(grace_s=3600)  # a write younger than the grace period may still be published
    assert young["orphans"] == 0 and keys_of(ast) == before
    out = ast.sweep(now=9e12, grace_s=3600)
    assert out["orphans"] == 3
    assert out["bytes_freed"] == len(b"dup") + len(b"o-dup") + len(b"killed before the publish")
    assert set(keys_of(ast)) == ast.job_live_keys(jid)
    assert ast.adapter(AdapterRef(jid, 1)).weights == b"v1"  # nothing referenced was touched
    assert ast.stored_bytes("acme") == len(b"v1") + len(b"o1") == out["tenants"]["acme"]  # recounted


def test_a_corrupt_or_missing_object_is_an_error_never_other_bytes(ast):
    jid = job(ast)
    ast.publish(jid, 0, AdapterBlob({"r": 4}, b"good weights"), b"o", {}, "x", [], 6)
    ref = ast.adapter_ref(AdapterRef(jid, 1))
    path = ast.artifacts.path(ref.key)
    path.write_bytes(b"evil weights")
    with pytest.raises(ArtifactError, match="corrupt"):
        ast.adapter(AdapterRef(jid, 1))
    path.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        ast.adapter(AdapterRef(jid, 1))


def test_deleting_an_ended_job_frees_its_bytes(ast):
    jid, other = job(ast), job(ast)
    for j in (jid, other):
        for t in range(2):
            ast.publish(j, t, AdapterBlob({"r": 4}, f"{j}-{t}".encode() * 1000), b"o" * 500, {}, "x", [], 6)
    held = ast.stored_bytes("acme")
    with pytest.raises(Conflict, match="has not ended"):
        ast.delete_job(jid)
    ast.set_status(jid, "done")
    freed = ast.delete_job(jid)
    assert freed == len(f"{jid}-0".encode() * 1000) + len(f"{jid}-1".encode() * 1000) + 500
    assert ast.stored_bytes("acme") == held - freed
    assert keys_of(ast, job_owner("acme", jid) + "/") == {}
    assert list(ast.r.scan_iter(match=f"m:job:{jid}:*")) == [] and jid not in ast.job_ids("acme")
    with pytest.raises(NotFound):
        ast.job(jid)
    assert ast.adapter(AdapterRef(other, 2)).weights == f"{other}-1".encode() * 1000  # the other job is whole


def test_tinker_payloads_too_large_for_redis_become_objects(ast):
    ts = TinkerStore(ast)
    body = {"data": "x" * (INLINE_MAX + 10)}
    rid = ts.new_future("acme", "forward_backward", "", 0, body)
    assert ts.request(rid)["body"] == body
    h = {k.decode(): v for k, v in ast.r.hgetall(f"m:tk:fut:{rid}").items()}
    assert "body" not in h and len(h["body_ref"]) < 200
    (only,) = keys_of(ast, "t/acme/tmp").values()
    assert only == len(json.dumps(body))
    result = {"loss": [0.5] * 100_000}
    ts.finish(rid, result)
    assert ts.future("acme", rid)["result"] == result
    assert big_values(ast.r, limit=INLINE_MAX * 2) == []
    assert len(keys_of(ast, "t/acme/tmp")) == 1  # the body's object went with the end; the result's stays
    small = ts.new_future("acme", "optim_step", "", 0, {"adam": {}})
    assert ts.request(small)["body"] == {"adam": {}} and len(keys_of(ast, "t/acme/tmp")) == 1
    # two requests with the same large body: ending one leaves the other's bytes
    twins = [ts.new_future("acme", "forward_backward", "", 0, body) for _ in range(2)]
    ts.fail(twins[0], "cancelled")
    assert ts.request(twins[1])["body"] == body


def test_deleting_a_tenant_deletes_everything_it_stored(ast):
    from marlaas.api.tenancy import Quotas, add_tenant

    add_tenant(ast, "gone", Quotas())
    add_tenant(ast, "stays", Quotas())
    a, b = job(ast, tenant="gone"), job(ast, tenant="stays")
    for j in (a, b):
        ast.publish(j, 0, AdapterBlob({"r": 4}, j.encode() * 100), b"o", {}, "x", [], 6)
    with pytest.raises(Conflict, match="active jobs"):
        ast.delete_tenant("gone")
    ast.set_status(a, "cancelled")
    out = ast.delete_tenant("gone")
    assert out == {"jobs": 1, "bytes_freed": len(a.encode() * 100) + 1}
    assert ast.tenant("gone") is None and ast.stored_bytes("gone") == 0
    assert keys_of(ast, "t/gone/") == {} and keys_of(ast, "t/stays/") != {}
    assert ast.adapter(AdapterRef(b, 1)).weights == b.encode() * 100
    assert not ast.r.exists(optim_key(a))


def test_bytes_an_earlier_version_left_in_redis_are_read_then_moved(ast):
    jid = job(ast)
    ast.r.hset(adapter_key(jid, 1), mapping={"config": json.dumps({"r": 4}), "weights": b"old weights"})
    ast.r.hset(optim_key(jid), mapping={"version": 1, "data": b"old optim"})
    ast.r.hset(f"m:job:{jid}", "version", 1)
    assert ast.adapter(AdapterRef(jid, 1)).weights == b"old weights"  # readable as it is
    assert ast.optimizer_state(jid) == (1, b"old optim")
    assert ast.sweep_once(grace_s=3600, lock_s=60)["migrated"] == 2
    assert ast.r.hget(adapter_key(jid, 1), "weights") is None and ast.r.hget(optim_key(jid), "data") is None
    assert ast.adapter(AdapterRef(jid, 1)).weights == b"old weights"  # now from the artifact store
    assert ast.optimizer_state(jid) == (1, b"old optim")
    assert ast.stored_bytes("acme") == len(b"old weights") + len(b"old optim")
