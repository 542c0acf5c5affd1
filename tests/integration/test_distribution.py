"""The base model through the store (marlaas/base/distribution.py): push, fetch into a host's cache, verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marlaas.base import distribution
from marlaas.errors import BaseModelError
from marlaas.settings import Settings
from marlaas.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]


def fake_model(d: Path, weights: bytes = b"w" * 1000, extra: str = "") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen2"}' + extra)
    (d / "model.safetensors").write_bytes(weights)
    (d / "sub").mkdir(exist_ok=True)
    (d / "sub" / "tokenizer.json").write_text("hello")
    return d


# ---------------------------------------------------------------- unit
@pytest.mark.unit
def test_content_hash_formula():
    # sha256 of the line "a\0x\n"
    assert distribution.content_hash({"a": "x"}) == "aa46ba1bd01741be2f1503f4a4232558132bb3a45535866bd08a0062dbedec13"
    # lines sorted by path, whatever the dict order
    h = "968bc84f7a24c7bac505db2caf8cdf848018989814b995a1020afc09e1530f86"
    assert distribution.content_hash({"c": "2" * 64, "a/b": "1" * 64}) == h
    assert distribution.content_hash({"a/b": "1" * 64, "c": "2" * 64}) == h


@pytest.mark.unit
def test_manifest_of(tmp_path):
    m = distribution.manifest_of(fake_model(tmp_path / "tiny"))
    assert m["name"] == "tiny"
    assert sorted(m["files"]) == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    # sha256("hello"), the well-known value
    assert m["files"]["sub/tokenizer.json"] == {
        "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", "size": 5}
    assert m["bytes"] == 23 + 1000 + 5
    assert m["hash"] == distribution.content_hash({k: v["sha256"] for k, v in m["files"].items()})
    with pytest.raises(BaseModelError, match="not a model directory"):
        distribution.manifest_of(tmp_path / "sub-nothing")


# ---------------------------------------------------------------- integration (real Redis)
@pytest.mark.integration
def test_push_then_fetch_through_the_artifact_store(st, tmp_path):
    src = fake_model(tmp_path / "base", weights=os.urandom(1000))
    m = distribution.push(st, src)
    stored = {o.key: o.size for o in st.artifacts.list(f"base/{m['hash']}/")}
    assert stored == {f"base/{m['hash']}/{v['sha256']}": v["size"] for v in m["files"].values()}
    assert [k for k in st.r.scan_iter(match="m:base:*")] == [b"m:base:manifest"]  # no bytes in Redis
    got = distribution.fetch(st, tmp_path / "hostA" / "cache")
    assert got == tmp_path / "hostA" / "cache" / m["hash"]
    for rel in m["files"]:
        assert (got / rel).read_bytes() == (src / rel).read_bytes()
    # the cache is reused: with the objects gone, a second fetch still answers
    st.drop_prefix(f"base/{m['hash']}/")
    assert distribution.fetch(st, tmp_path / "hostA" / "cache") == got
    # nothing left behind but the one directory
    assert [p.name for p in (tmp_path / "hostA" / "cache").iterdir()] == [m["hash"]]


@pytest.mark.integration
def test_corrupt_blob_is_refused_and_leaves_no_cache(st, tmp_path):
    src = fake_model(tmp_path / "base")
    m = distribution.push(st, src)
    ref = m["files"]["model.safetensors"]["ref"]
    (st.artifacts.root / ref.split("#")[0]).write_bytes(b"x" * 1000)
    cache = tmp_path / "cache"
    with pytest.raises(BaseModelError, match="model.safetensors arrived with sha256"):
        distribution.fetch(st, cache)
    assert list(cache.iterdir()) == []


@pytest.mark.integration
@pytest.mark.parametrize("evil", ["../../../../escaped_by_manifest.pth", "/tmp/abs.pth", "a/../../b", "./x", ""])
def test_a_manifest_path_outside_the_cache_is_refused(st, tmp_path, evil):
    src = fake_model(tmp_path / "base")
    m = distribution.push(st, src)
    info = next(iter(m["files"].values()))
    st.set_base_manifest({**m, "files": {**m["files"], evil: info}})
    cache = tmp_path / "deep" / "er" / "cache"
    with pytest.raises(BaseModelError, match="unsafe path"):
        distribution.fetch(st, cache)
    assert not (tmp_path / "escaped_by_manifest.pth").exists() and not any(tmp_path.rglob("*.pth"))


@pytest.mark.integration
def test_a_manifest_hash_that_is_a_path_is_refused(st, tmp_path):
    m = distribution.push(st, fake_model(tmp_path / "base"))
    st.set_base_manifest({**m, "hash": "../../escaped"})
    with pytest.raises(BaseModelError, match="no valid hash"):
        distribution.fetch(st, tmp_path / "cache")


@pytest.mark.integration
def test_one_base_per_deployment(st, tmp_path):
    a = distribution.push(st, fake_model(tmp_path / "a"))
    assert distribution.push(st, fake_model(tmp_path / "a")) == a  # same content: a no-op
    b_dir = fake_model(tmp_path / "b", extra=" ")
    with pytest.raises(BaseModelError, match="already has base 'a'"):
        distribution.push(st, b_dir)
    assert st.base_manifest()["hash"] == a["hash"]
    jid = st.create_job(JobSpec(tenant="t", task="sort", steps=1), [{"prompt": "p", "answer": "a"}],
                        [{"prompt": "q", "answer": "b"}])
    with pytest.raises(BaseModelError, match=f"1 job\\(s\\) are active: {jid}"):
        distribution.push(st, b_dir, replace=True)
    st.r.srem("m:jobs:active", jid)
    b = distribution.push(st, b_dir, replace=True)
    assert st.base_manifest()["hash"] == b["hash"] != a["hash"]
    assert list(st.artifacts.list(f"base/{a['hash']}/")) == []  # the replaced base's objects are gone
    assert len(list(st.artifacts.list(f"base/{b['hash']}/"))) == 3


@pytest.mark.integration
def test_push_by_file_url(st, tmp_path):
    src = fake_model(tmp_path / "base")
    shared = tmp_path / "bucket" / "bases" / "tiny"
    m = distribution.push(st, src, url=shared.as_uri())
    assert m["url"] == shared.as_uri()
    assert (shared / "sub" / "tokenizer.json").read_text() == "hello"
    assert list(st.r.scan_iter(match="m:base:*:file:*")) == []  # only the manifest went into Redis
    got = distribution.fetch(st, tmp_path / "cache")
    assert (got / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


@pytest.mark.integration
def test_local_base_choice(st, tmp_path):
    home = tmp_path / "home"
    missing = Settings(home=home, base=tmp_path / "nowhere")
    with pytest.raises(BaseModelError, match="holds none and none was pushed"):
        distribution.local_base(missing, st)
    local = fake_model(tmp_path / "local")
    assert distribution.local_base(Settings(home=home, base=local), st) == (local, "local")
    m = distribution.push(st, fake_model(tmp_path / "pushed", extra=" "))
    # a missing MARLAAS_BASE (or none) fetches the pushed one into $MARLAAS_HOME/cache/base
    assert distribution.local_base(missing, st) == (home / "cache" / "base" / m["hash"], "pushed")
    assert distribution.local_base(Settings(home=home, base=None), st)[0] == home / "cache" / "base" / m["hash"]
    # a local base that is not the pushed one is refused
    with pytest.raises(BaseModelError, match="is not the deployment's pushed base 'pushed'"):
        distribution.local_base(Settings(home=home, base=local), st)


def _cli(args, url, home):
    # every "host" has its own home; they share one artifact store (S3 on real hosts)
    env = {**os.environ, "MARLAAS_REDIS_URL": url, "MARLAAS_HOME": str(home),
           "MARLAAS_ARTIFACTS": f"file://{home.parent / 'artifacts-shared'}"}
    env.pop("MARLAAS_BASE", None)
    return subprocess.run([sys.executable, "-m", "marlaas.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_cli_push_and_fetch_real_base(scratch_url, st, tiny_base, tmp_path):
    r = _cli(["base", "push", str(tiny_base), "--json"], scratch_url, tmp_path / "client")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["name"] == tiny_base.name and out["url"] is None
    assert out["hash"] == distribution.manifest_of(tiny_base)["hash"]
    r = _cli(["base", "fetch", "--json"], scratch_url, tmp_path / "gen1")
    assert r.returncode == 0, r.stderr
    path = Path(json.loads(r.stdout)["path"])
    assert path == tmp_path / "gen1" / "cache" / "base" / out["hash"]
    from transformers import AutoModelForCausalLM

    from marlaas.base.tiny import load_tokenizer

    tok = load_tokenizer(path)
    assert tok("12")["input_ids"] == load_tokenizer(tiny_base)("12")["input_ids"]
    assert AutoModelForCausalLM.from_pretrained(path).num_parameters() > 0
    # a bad push: one line on stderr, exit 2, nothing stored
    st.r.delete("m:base:manifest")
    r = _cli(["base", "push", str(tmp_path)], scratch_url, tmp_path / "client")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no config.json" in r.stderr
    assert st.base_manifest() is None
