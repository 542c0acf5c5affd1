"""Several hosts, no shared disk, a host lost mid-run (bench/multihost.py over network namespaces).

Hosts redis, gen1, gen2, verify1, train1, ctl and client are network namespaces on a private bridge,
each with its own hostname and MARLAAS_HOME and no MARLAAS_BASE, and no shared disk: the artifact store
is a SeaweedFS S3 server on the redis host (credentials required), so the base's files, every adapter
version and every optimizer state travel as S3 objects and Redis holds only references (no value over
1 MiB). gen1's link is cut once it has done some work; the run must still complete, with
every generate batch after the cut on gen2. Skipped (with the reason) where network namespaces
cannot be created (not root, or a sandbox that forbids them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location(
    "bench_multihost", Path(__file__).resolve().parents[2] / "bench" / "multihost.py")
multihost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multihost)


@pytest.fixture(scope="module")
def netns_ok():
    why = multihost.unavailable()
    if why:
        pytest.skip(f"multi-host test over network namespaces: {why}")


@pytest.mark.timeout(600)
def test_four_tenants_across_hosts_survive_a_lost_generate_host(netns_ok, tiny_base, tmp_path):
    from marlaas.base import distribution

    lines: list[str] = []
    out = multihost.run(tiny_base, tenants=4, steps=4, lease_s=8.0, timeout=420, workdir=tmp_path,
                        log=lines.append)
    report = "\n".join(lines)
    jobs = out["jobs"]
    assert len(jobs) == 4, report
    for j in jobs:
        assert j["status"] == "done", report
        assert j["steps"] == [1, 2, 3, 4], report  # every version published exactly once, in order
        assert all(0 <= s <= 1 for s in j["staleness"]), report
    # gen1 worked, was cut mid-run, and everything generated afterwards ran on gen2
    assert out["cut_after_s"] is not None, report
    assert out["per_host"]["generate@gen1"]["before"] >= 1, report
    assert out["per_host"]["generate@gen1"]["after"] == 0, report
    assert out["generate_hosts_after_cut"] == ["gen2"], report
    assert out["per_host"]["train@train1"]["after"] >= 1, report
    # the base came through the store: each model-loading host has its own verified copy, the
    # others none
    h = distribution.manifest_of(tiny_base)["hash"]
    assert out["base"]["hash"] == h
    assert out["base_caches"] == {"gen1": [h], "gen2": [h], "train1": [h]}, report
    for host in ("gen2", "train1"):
        assert distribution.manifest_of(tmp_path / "hosts" / host / "cache" / "base" / h)["hash"] == h
    # the bytes went through S3: the base's files and every job's objects are in the bucket, no host
    # wrote a local artifacts directory, and Redis kept only references
    bucket = out["bucket"]
    assert bucket["url"].startswith("s3://") and 1 <= bucket["base_files"] <= out["base"]["files"], report
    assert bucket["base_bytes"] >= out["base"]["bytes"] * 0.9, report  # files with equal bytes are one object
    assert sorted(bucket["jobs"]) == sorted(j["job"] for j in jobs), report
    assert all(x["objects"] >= 2 for x in bucket["jobs"].values()), report  # an adapter and its optimizer
    assert out["local_artifacts"] == [], report
    assert out["redis"]["keys"] > 0 and out["redis"]["largest_bytes"] < 2**20, report
