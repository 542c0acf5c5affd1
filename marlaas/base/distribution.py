"""The base model through the store: no host needs a shared disk or a copy made by hand.

`marlaas base push DIR` uploads a base model directory once; a generate or train worker whose
MARLAAS_BASE is unset or missing fetches it into its own cache, `$MARLAAS_HOME/cache/base/<hash>`,
and loads it from there. Two ways to carry the bytes:

- through the artifact store (the default; marlaas.store.artifacts: a local directory, or S3 for
  several hosts): each file is an object `base/<H>/<sha256 of the file>`; Redis holds only the
  manifest, so a base of any size never passes through Redis;
- by URL (`--url`, an fsspec URL such as `file:///srv/bases/qwen`, or `s3://...` with that
  filesystem's package installed): the files are copied there (unless DIR already is that place) and
  only the manifest goes into Redis; workers read each file from the URL.

Content hash (the identity of a base): H = sha256 of the concatenated lines
`f"{path}\\0{sha256(file bytes)}\\n"` over every regular file of the directory, sorted by `path` (the
POSIX path relative to the directory). A fetched file whose sha256 differs from the manifest's is
refused, and H is recomputed from the files before the cache directory is published.

Invariants: the manifest is stored after every file (a worker that sees it finds the files); a
cache directory named H appears by one atomic rename only after every file was verified, so it is
complete or absent; a deployment has one base: pushing a different one is refused unless `replace`
is asked and no job is active; a worker with a local base refuses to start if a different base was
pushed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from marlaas.errors import BaseModelError

CHUNK_BYTES = 8 * 1024 * 1024


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_hash(file_hashes: dict[str, str]) -> str:
    """H over {relative path: sha256 hex} (see the module docstring)."""
    h = hashlib.sha256()
    for path in sorted(file_hashes):
        h.update(f"{path}\0{file_hashes[path]}\n".encode())
    return h.hexdigest()


def manifest_of(src: Path | str) -> dict:
    """The manifest of a local model directory: {hash, name, files: {path: {sha256, size}}, bytes}."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise BaseModelError(f"{src} is not a model directory (no config.json)")
    files = {}
    for p in sorted(src.rglob("*")):
        if p.is_file():
            files[p.relative_to(src).as_posix()] = {"sha256": _sha256_file(p), "size": p.stat().st_size}
    return {
        "hash": content_hash({k: v["sha256"] for k, v in files.items()}),
        "name": src.resolve().name,
        "files": files,
        "bytes": sum(v["size"] for v in files.values()),
    }


def push(store, src: Path | str, url: str | None = None, replace: bool = False) -> dict:
    """Make `src` the deployment's base: files into the artifact store (or to `url`), then the manifest.

    Pushing the same content again is a no-op. Returns the stored manifest (with `pushed`, `url`)."""
    src = Path(src)
    m = manifest_of(src)
    old = store.base_manifest()
    if old is not None and old["hash"] == m["hash"] and old.get("url") == url:
        return old
    if old is not None and old["hash"] != m["hash"]:
        if not replace:
            raise BaseModelError(
                f"this deployment already has base {old['name']!r} ({old['hash'][:12]}); the base of a "
                f"deployment never changes (push with --replace when no job is active)")
        active = store.active_job_ids()
        if active:
            raise BaseModelError(f"cannot replace the base while {len(active)} job(s) are active: {', '.join(active)}")
    if url is None:
        for path, info in m["files"].items():
            info["ref"] = str(store.put_blob_file(f"base/{m['hash']}", src / path, info["sha256"]))
    else:
        _copy_to_url(src, m, url)
    m.update(url=url, pushed=time.time())
    store.set_base_manifest(m)
    if old is not None and old.get("url") is None and (old["hash"] != m["hash"] or url is not None):
        store.drop_prefix(f"base/{old['hash']}/")  # objects no worker will read again
    return m


def _copy_to_url(src: Path, m: dict, url: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols and Path(root).resolve() == src.resolve():
        return  # the directory already is the place the workers read
    for path in m["files"]:
        target = f"{root.rstrip('/')}/{path}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(src / path), target)


def _read_chunks(store, m: dict, path: str):
    if m.get("url") is None:
        from marlaas.store.artifacts import Ref

        yield from store.artifacts.stream(Ref.parse(m["files"][path]["ref"]))  # checked whole below
        return
    import fsspec

    with fsspec.open(f"{m['url'].rstrip('/')}/{path}", "rb") as f:
        yield from iter(lambda: f.read(CHUNK_BYTES), b"")


def fetch(store, cache_root: Path | str) -> Path:
    """The pushed base as a local directory `cache_root/<hash>`, downloaded and verified once."""
    m = store.base_manifest()
    if m is None:
        raise BaseModelError(
            "no base model: set MARLAAS_BASE to a local model directory on this host, or push one "
            "into the store with `marlaas base push DIR`")
    _check_manifest(m)
    cache_root = Path(cache_root)
    target = cache_root / m["hash"]
    if target.is_dir():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".{m['hash']}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        got = {}
        for path, info in m["files"].items():
            out = tmp / path
            out.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with open(out, "wb") as f:
                for chunk in _read_chunks(store, m, path):
                    h.update(chunk)
                    f.write(chunk)
            got[path] = h.hexdigest()
            if got[path] != info["sha256"]:
                raise BaseModelError(
                    f"base file {path} arrived with sha256 {got[path][:12]}, the manifest says "
                    f"{info['sha256'][:12]}: push the base again")
        if content_hash(got) != m["hash"]:
            raise BaseModelError(f"the pushed base's manifest does not match its hash {m['hash'][:12]}: push it again")
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # another process of this host won the race: keep its copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _check_manifest(m: dict) -> None:
    """Refuse a manifest that could write outside its directory: the hash names the directory (64 hex
    digits), and every file path must be relative, with no '..', no empty or hidden-dot segments, and
    a sha256 to check. Files are written into a temporary directory and checked before it is renamed
    into place, so nothing unverified is ever at the target."""
    if not isinstance(m.get("hash"), str) or not _HEX64.match(m["hash"]):
        raise BaseModelError("the pushed base's manifest has no valid hash: push the base again")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise BaseModelError("the pushed base's manifest lists no files: push the base again")
    for path, info in files.items():
        parts = path.split("/") if isinstance(path, str) else []
        if (not parts or path.startswith("/") or "\\" in path or "\0" in path
                or any(s in ("", ".", "..") for s in parts)):
            raise BaseModelError(f"the pushed base's manifest names an unsafe path {str(path)[:80]!r}: refused")
        if not isinstance(info, dict) or not _HEX64.match(str(info.get("sha256", ""))):
            raise BaseModelError(f"the pushed base's manifest has no sha256 for {path!r}: refused")


def local_base(settings, store) -> tuple[Path, str]:
    """(directory, name) of the base this worker loads.

    MARLAAS_BASE (or `$MARLAAS_HOME/base`) when it holds a model, checked against a pushed base if
    there is one; otherwise the pushed base, fetched into `$MARLAAS_HOME/cache/base`."""
    path = settings.base_path
    m = store.base_manifest()
    if (path / "config.json").is_file():
        if m is not None:
            mine = manifest_of(path)["hash"]
            if mine != m["hash"]:
                raise BaseModelError(
                    f"the local base {path} ({mine[:12]}) is not the deployment's pushed base {m['name']!r} "
                    f"({m['hash'][:12]}): unset MARLAAS_BASE to fetch the pushed one")
            return path, m["name"]
        return path, path.name
    if m is None:
        where = f"MARLAAS_BASE={settings.base}" if settings.base is not None else f"{path}"
        raise BaseModelError(
            f"no base model: {where} holds none and none was pushed (`marlaas base push DIR`)")
    return fetch(store, settings.home / "cache" / "base"), m["name"]
