"""The artifact store's contract on a local directory (marlaas/store/artifacts.py): references, safe
owners, content addressing and dedup, verified reads, whole-or-nothing writes, and the per-host
DiskCache (LRU by bytes, several processes)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from marlaas.errors import ArtifactError
from marlaas.store.artifacts import DiskCache, LocalArtifacts, Ref, check_owner, open_artifacts

pytestmark = pytest.mark.unit

SHA = hashlib.sha256(b"x").hexdigest()


def test_ref_round_trips_through_its_string_and_bytes():
    ref = Ref(f"t/alice/jobs/j1/{SHA}", 1)
    assert str(ref) == f"t/alice/jobs/j1/{SHA}#1"
    assert Ref.parse(str(ref)) == ref
    assert Ref.parse(str(ref).encode()) == ref
    assert (ref.owner, ref.sha256, ref.size) == ("t/alice/jobs/j1", SHA, 1)


@pytest.mark.parametrize("bad", [
    "", "#1", SHA, f"t/a/{SHA}", f"t/a/{SHA}#", f"t/a/{SHA}#-1", f"t/a/{SHA}#1x", f"t/a/{SHA[:-1]}#1",
    f"t/a/{SHA}#\u00b2",
    f"t/a/{SHA.upper()}#1", f"/{SHA}#1", f"t/../{SHA}#1", f"t//a/{SHA}#1", f"t/a b/{SHA}#1", f"{SHA}#1",
])
def test_ref_parse_refuses_what_is_not_a_reference(bad):
    with pytest.raises(ArtifactError, match="not an artifact reference"):
        Ref.parse(bad)


def test_check_owner_accepts_safe_segments_only():
    assert check_owner("t/alice/jobs/j-1_2.v@x:y") == "t/alice/jobs/j-1_2.v@x:y"
    for bad in ("", "..", "t/..", "t/../b", "t/./b", "/t", "t/", "t//a", "t/a b", "t/a\n", "t/ä", "t/a*b",
                "t/" + "x" * 201):
        with pytest.raises(ValueError):
            check_owner(bad)


def test_local_put_is_content_addressed_and_deduplicated(tmp_path):
    a = LocalArtifacts(tmp_path)
    first = a.put("t/alice/jobs/j1", b"weights")
    assert first.new and first.ref.sha256 == hashlib.sha256(b"weights").hexdigest() and first.ref.size == 7
    again = a.put("t/alice/jobs/j1", b"weights")
    assert again.ref == first.ref and not again.new
    other = a.put("t/bob/jobs/j1", b"weights")  # same bytes, another owner: another object
    assert other.new and other.ref.key != first.ref.key
    assert a.get(first.ref) == b"weights" and a.exists(first.ref)
    assert a.size(first.ref.key) == 7


def test_local_put_file_streams_and_dedups(tmp_path):
    a = LocalArtifacts(tmp_path / "store")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 * 2**20))
    put = a.put_file("base/abc", src)
    assert put.new and put.ref.size == 3 * 2**20
    assert put.ref.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert not a.put_file("base/abc", src).new
    assert a.get(put.ref) == src.read_bytes()


def test_local_get_verifies_bytes_and_refuses_missing(tmp_path):
    a = LocalArtifacts(tmp_path)
    ref = a.put("t/alice/files", b"good bytes").ref
    a.path(ref.key).write_bytes(b"evil bytes")  # same size, other bytes
    with pytest.raises(ArtifactError, match="corrupt"):
        a.get(ref)
    with pytest.raises(ArtifactError, match="corrupt"):
        a.fetch_to(ref, tmp_path / "out" / "f")
    assert not (tmp_path / "out" / "f").exists() and list((tmp_path / "out").iterdir()) == []
    a.delete([ref.key])
    with pytest.raises(ArtifactError, match="missing"):
        a.get(ref)
    with pytest.raises(ArtifactError, match="missing"):
        a.fetch_to(ref, tmp_path / "out" / "f")
    with pytest.raises(ArtifactError, match="missing"):
        b"".join(a.stream(ref))


def test_local_fetch_to_stream_list_delete(tmp_path):
    a = LocalArtifacts(tmp_path / "store")
    r1 = a.put("t/alice/jobs/j1", b"one").ref
    r2 = a.put("t/alice/jobs/j1", b"two").ref
    r3 = a.put("t/alice/jobs/j10", b"three").ref
    r4 = a.put("t/bob/jobs/j1", b"four").ref
    a.fetch_to(r1, tmp_path / "dl" / "adapter.safetensors")
    assert (tmp_path / "dl" / "adapter.safetensors").read_bytes() == b"one"
    assert os.listdir(tmp_path / "dl") == ["adapter.safetensors"]  # no leftover part file
    assert b"".join(a.stream(r2)) == b"two"
    listed = {o.key: o.size for o in a.list("t/alice/jobs/j1/")}
    assert listed == {r1.key: 3, r2.key: 3}
    assert {o.key for o in a.list("t/alice/jobs/j1")} == {r1.key, r2.key}  # whole segments: not j10
    assert {o.key for o in a.list("t/alice/")} == {r1.key, r2.key, r3.key}
    assert {o.key for o in a.list("")} == {r1.key, r2.key, r3.key, r4.key}
    assert list(a.list("t/carol/")) == []
    assert all(o.mtime <= time.time() + 1 for o in a.list(""))
    a.delete([r1.key, r3.key, r3.key, "t/alice/jobs/j1/" + SHA])  # absent keys are fine
    assert {o.key for o in a.list("")} == {r2.key, r4.key}


def test_a_write_that_fails_midway_leaves_no_object(tmp_path, monkeypatch):
    a = LocalArtifacts(tmp_path)

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(ArtifactError, match=r"cannot write .*No space left"):
        a.put("t/alice/jobs/j1", b"half-written weights")
    key = "t/alice/jobs/j1/" + hashlib.sha256(b"half-written weights").hexdigest()
    assert a.size(key) is None
    assert list(a.list("")) == []
    assert list((tmp_path / ".tmp").iterdir()) == []
    src = tmp_path / "f.bin"
    src.write_bytes(b"abc")
    with pytest.raises(ArtifactError):
        a.put_file("base/h", src)
    assert list(a.list("")) == [] and list((tmp_path / ".tmp").iterdir()) == []
    monkeypatch.undo()
    assert a.put("t/alice/jobs/j1", b"half-written weights").new  # and a retry then works


def test_open_artifacts_chooses_the_backend(tmp_path):
    assert isinstance(open_artifacts(f"file://{tmp_path}/a"), LocalArtifacts)
    assert open_artifacts(str(tmp_path / "b")).root == tmp_path / "b"
    with pytest.raises(ValueError, match="MARLAAS_ARTIFACTS"):
        open_artifacts("gs://bucket/x")


def _ref(data: bytes) -> Ref:
    return Ref(f"t/a/jobs/j/{hashlib.sha256(data).hexdigest()}", len(data))


def test_disk_cache_hits_and_evicts_the_least_recently_used_by_bytes(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=100)
    blobs = [bytes([i]) * 40 for i in range(4)]
    fetched: list[int] = []

    def get(i: int) -> bytes:
        return cache.get(_ref(blobs[i]), lambda: fetched.append(i) or blobs[i])

    assert get(0) == blobs[0] and get(1) == blobs[1]
    time.sleep(0.02)
    assert get(0) == blobs[0]  # a hit: no fetch, and 0 is now the most recently used
    assert fetched == [0, 1] and (cache.hits, cache.misses) == (1, 2)
    time.sleep(0.02)
    get(2)  # 120 bytes > 100: the least recently used (1) goes
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {_ref(blobs[0]).sha256, _ref(blobs[2]).sha256}
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 100
    get(1)
    assert fetched == [0, 1, 2, 1]
    big = b"z" * 101  # larger than the whole cache: served, never kept
    assert cache.get(_ref(big), lambda: big) == big
    assert _ref(big).sha256 not in {p.name for p in tmp_path.iterdir()}


def test_disk_cache_refetches_a_damaged_file(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=1000)
    data = b"adapter bytes"
    assert cache.get(_ref(data), lambda: data) == data
    (tmp_path / _ref(data).sha256).write_bytes(b"adapter bytez")  # same size, other bytes
    assert cache.get(_ref(data), lambda: data) == data
    assert (cache.hits, cache.misses) == (0, 2)
    assert (tmp_path / _ref(data).sha256).read_bytes() == data


def test_disk_cache_tolerates_files_removed_by_another_process(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path, max_bytes=100)
    other = DiskCache(tmp_path, max_bytes=100)  # a second worker process on the same host
    a, b = b"a" * 60, b"b" * 60
    cache.get(_ref(a), lambda: a)
    (tmp_path / _ref(a).sha256).unlink()  # the other process evicted it
    assert cache.get(_ref(a), lambda: a) == a and cache.misses == 2
    # a file that vanishes between the listing and its stat or unlink does not break eviction
    real_stat = os.stat
    gone = tmp_path / _ref(a).sha256

    def racing_stat(path, *args, **kw):
        if str(path) == str(gone):
            gone.unlink(missing_ok=True)
        return real_stat(path, *args, **kw)

    monkeypatch.setattr(os, "stat", racing_stat)
    assert other.get(_ref(b), lambda: b) == b
    monkeypatch.undo()
    assert {p.name for p in tmp_path.iterdir()} == {_ref(b).sha256}
    # a hit whose file another process removes right after the read is still a hit
    real_utime = os.utime

    def racing_utime(path, *args, **kw):
        os.unlink(path)
        return real_utime(path, *args, **kw)

    monkeypatch.setattr(os, "utime", racing_utime)
    assert other.get(_ref(b), lambda: pytest.fail("a hit must not fetch")) == b
    assert other.hits == 1


def test_disk_cache_keeps_other_processes_parts_while_fresh(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=50)
    part = tmp_path / ".partXYZ"
    part.write_bytes(b"p" * 40)  # another process is writing this one right now
    stale = tmp_path / ".partOLD"
    stale.write_bytes(b"s" * 40)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))  # a writer killed two hours ago
    data = b"d" * 30
    cache.get(_ref(data), lambda: data)
    assert part.exists() and not stale.exists()
