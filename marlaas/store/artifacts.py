"""The artifact store: every large byte string marlaas keeps lives here, never in Redis.

Adapter versions, optimizer states, Tinker weights and large Tinker payloads, base model files and
uploaded datasets are objects; Redis keeps a reference to each (`Ref`, a short string). One setting
chooses the backend (`MARLAAS_ARTIFACTS`, read at the process edges):

- `file:///DIR` (or a plain path): a local directory; the embedded default is `$MARLAAS_HOME/artifacts`
  (no extra process). Several worker processes of one host share it; several hosts need a shared
  filesystem or S3.
- `s3://BUCKET/PREFIX`: any S3-compatible endpoint (AWS S3, MinIO, SeaweedFS, Ceph) through boto3,
  which reads the endpoint and credentials the way every AWS tool does (`AWS_ENDPOINT_URL`,
  `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, or a profile). Path-style addressing
  when an endpoint is set (MinIO, SeaweedFS), the SDK's choice otherwise. Reads go through a bounded
  on-disk cache per host (`DiskCache`, LRU by bytes), so a hot adapter crosses the network once.

Object keys are `{owner}/{sha256 of the bytes}`: content-addressed within an owner (`t/{tenant}/jobs/{job}`,
`t/{tenant}/tinker/{model}`, `t/{tenant}/files`, `t/{tenant}/tmp`, `base/{hash}`), so one tenant's or
one job's bytes are one prefix to count or delete.

Invariants:
- `put` returns only once the object is completely written (local: temporary file, fsync, rename;
  S3: one PUT, or a completed multipart upload): no key ever names partial bytes. A caller publishes
  the reference only after `put` returned (`marlaas.store.lanes` does it in the version's CAS).
- `get` checks the bytes' sha256 against the key and raises ArtifactError rather than return other
  bytes; a missing object is an ArtifactError too (never an empty value).
- An owner is `/`-separated segments of [A-Za-z0-9_.@:-] (no `..`): a tenant-chosen name cannot reach
  another prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from marlaas.errors import ArtifactError

_SEG = re.compile(r"[A-Za-z0-9_.@:-]{1,200}")
_SHA = re.compile(r"[0-9a-f]{64}")
CHUNK = 8 * 1024 * 1024


def check_owner(owner: str) -> str:
    """The owner prefix if every segment is safe (ValueError otherwise)."""
    segs = owner.split("/")
    if not owner or any(not _SEG.fullmatch(s) or s in (".", "..") for s in segs):
        raise ValueError(f"invalid artifact owner {owner!r}")
    return owner


@dataclass(frozen=True)
class Ref:
    """A reference to one object: its key (`owner/sha256`) and size in bytes. `str(ref)` is what Redis
    holds (`key#size`)."""

    key: str
    size: int

    @property
    def sha256(self) -> str:
        return self.key.rsplit("/", 1)[1]

    @property
    def owner(self) -> str:
        return self.key.rsplit("/", 1)[0]

    def __str__(self) -> str:
        return f"{self.key}#{self.size}"

    @classmethod
    def parse(cls, s: str | bytes) -> Ref:
        if isinstance(s, bytes):
            s = s.decode(errors="replace")
        key, _, size = s.rpartition("#")
        owner, _, sha = key.rpartition("/")
        try:
            if not _SHA.fullmatch(sha) or not (size.isascii() and size.isdigit()):
                raise ValueError
            check_owner(owner)
        except ValueError:
            raise ArtifactError(f"not an artifact reference: {s[:120]!r}") from None
        return cls(key, int(size))


@dataclass(frozen=True)
class Put:
    """What `put` did: the reference, and whether the object is new (False: the same bytes were there)."""

    ref: Ref
    new: bool


@dataclass(frozen=True)
class Listed:
    key: str
    size: int
    mtime: float


def _verify(key: str, data: bytes) -> bytes:
    sha = key.rsplit("/", 1)[1]
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise ArtifactError(f"artifact {key} is corrupt: its bytes hash to {got[:12]}")
    return data


class Artifacts:
    """The interface every backend implements (bytes in, references out)."""

    url: str

    def put(self, owner: str, data: bytes) -> Put:
        key = f"{check_owner(owner)}/{hashlib.sha256(data).hexdigest()}"
        if self.size(key) is not None:
            return Put(Ref(key, len(data)), False)
        self._write(key, data)
        return Put(Ref(key, len(data)), True)

    def put_file(self, owner: str, path: Path | str, sha256: str | None = None) -> Put:
        """Store a file's bytes, streamed (`sha256` when the caller already knows it)."""
        if sha256 is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(CHUNK), b""):
                    h.update(block)
            sha256 = h.hexdigest()
        key = f"{check_owner(owner)}/{sha256}"
        size = os.path.getsize(path)
        if self.size(key) is not None:
            return Put(Ref(key, size), False)
        self._write_file(key, Path(path))
        return Put(Ref(key, size), True)

    def get(self, ref: Ref) -> bytes:
        return _verify(ref.key, self._read(ref.key))

    def fetch_to(self, ref: Ref, dest: Path | str) -> None:
        """Write the object to `dest` (created whole by one rename), checking its sha256."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            h = hashlib.sha256()
            with open(tmp, "wb") as f:
                for block in self._read_stream(ref.key):
                    h.update(block)
                    f.write(block)
            if h.hexdigest() != ref.sha256:
                raise ArtifactError(f"artifact {ref.key} is corrupt: its bytes hash to {h.hexdigest()[:12]}")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def stream(self, ref: Ref) -> Iterator[bytes]:
        """The object's bytes in chunks, unchecked: the caller hashes them (`fetch_to` does)."""
        return self._read_stream(ref.key)

    def exists(self, ref: Ref) -> bool:
        return self.size(ref.key) is not None

    # backends implement these, and _write(key, data), _write_file(key, path), _read(key) -> bytes,
    # _read_stream(key) -> Iterator[bytes]
    def size(self, key: str) -> int | None:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def list(self, prefix: str) -> Iterator[Listed]:
        """Objects under `prefix`, taken as whole segments (`t/a` lists `t/a/...`, not `t/ab/...`)."""
        raise NotImplementedError


class LocalArtifacts(Artifacts):
    """Objects as files under one directory: `root/{key}`; written to `root/.tmp` then renamed."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.url = f"file://{self.root}"
        (self.root / ".tmp").mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return None

    def _commit(self, key: str, fill) -> None:
        final, tmp = self.path(key), None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root / ".tmp")
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            raise ArtifactError(f"artifact store {self.url}: cannot write {key}: {e}") from None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def _write(self, key: str, data: bytes) -> None:
        self._commit(key, lambda f: f.write(data))

    def _write_file(self, key: str, path: Path) -> None:
        def fill(f):
            with open(path, "rb") as src:
                for block in iter(lambda: src.read(CHUNK), b""):
                    f.write(block)
        self._commit(key, fill)

    def _read(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise ArtifactError(f"artifact {key} is missing from {self.url}") from None

    def _read_stream(self, key: str) -> Iterator[bytes]:
        try:
            f = open(self.path(key), "rb")
        except FileNotFoundError:
            raise ArtifactError(f"artifact {key} is missing from {self.url}") from None
        with f:
            yield from iter(lambda: f.read(CHUNK), b"")

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.path(k).unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[Listed]:
        base = self.path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != ".tmp"]
            for name in filenames:
                if not _SHA.fullmatch(name):
                    continue
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                yield Listed(p.relative_to(self.root).as_posix(), st.st_size, st.st_mtime)


_MISSING = ("404", "NoSuchKey", "NotFound")
_DENIED = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")


class S3Artifacts(Artifacts):
    """Objects in one S3 bucket under a prefix, through boto3 (endpoint and credentials from the
    environment, as boto3 reads them). Every failure boto3 raises reaches the caller as one
    ArtifactError naming the store URL, the operation and the reason (never a botocore traceback)."""

    def __init__(self, url: str, cache: DiskCache | None = None):
        import boto3
        from botocore.config import Config

        m = re.match(r"^s3://([^/]+)/?(.*)$", url)
        if not m:
            raise ValueError(f"not an S3 URL: {url!r} (s3://BUCKET/PREFIX)")
        self.url, self.bucket, self.prefix = url, m.group(1), m.group(2).strip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        style = "path" if endpoint else "auto"
        # a session of its own: boto3's default one caches the credentials it first resolved
        self.s3 = boto3.session.Session().client("s3", config=Config(
            s3={"addressing_style": style}, retries={"max_attempts": 5}, connect_timeout=10, read_timeout=120))
        self.cache = cache

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, what: str, key: str | None, e: Exception) -> ArtifactError:
        """One line: the store, what was attempted and why (the S3 error code and message)."""
        inner = e.__cause__ or e.__context__  # boto3's upload failure wraps the S3 error
        err = getattr(e, "response", None) or getattr(inner, "response", None) or {}
        err = err.get("Error", {})
        if err.get("Code") in _MISSING and key is not None:
            return ArtifactError(f"artifact {key} is missing from {self.url}")
        why = self._why(err) if err.get("Code") else " ".join(str(e).split()) or type(e).__name__
        return ArtifactError(f"artifact store {self.url}: {what}{f' {key}' if key else ''} failed: {why}")

    def _why(self, err: dict) -> str:
        code = err.get("Code")
        if code == "NoSuchBucket":
            return f"bucket {self.bucket!r} does not exist"
        why = " ".join(f"{code} {err.get('Message') or ''}".split())
        return why + " (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)" if code in _DENIED else why

    def _call(self, what: str, key: str | None, fn, *args, missing=ArtifactError, **kw):
        """fn(*args, **kw); `missing` is returned when S3 says the object does not exist (raised as
        the ArtifactError otherwise)."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kw)
        except (BotoCoreError, ClientError, Boto3Error) as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code in _MISSING and missing is not ArtifactError:
                return missing
            raise self._error(what, key, e) from None

    def size(self, key: str) -> int | None:
        head = self._call("head", key, self.s3.head_object, Bucket=self.bucket, Key=self._k(key), missing=None)
        return None if head is None else int(head["ContentLength"])

    def _write(self, key: str, data: bytes) -> None:
        self._call("put", key, self.s3.put_object, Bucket=self.bucket, Key=self._k(key), Body=data)

    def _write_file(self, key: str, path: Path) -> None:
        # multipart past boto3's threshold: the object is visible only once the upload completes
        self._call("upload", key, self.s3.upload_file, str(path), self.bucket, self._k(key))

    def get(self, ref: Ref) -> bytes:
        if self.cache is None:
            return super().get(ref)
        return self.cache.get(ref, lambda: super(S3Artifacts, self).get(ref))

    def _read(self, key: str) -> bytes:
        def fetch() -> bytes:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()

        return self._call("get", key, fetch)

    def _read_stream(self, key: str) -> Iterator[bytes]:
        body = self._call("get", key, self.s3.get_object, Bucket=self.bucket, Key=self._k(key))["Body"]
        chunks = body.iter_chunks(CHUNK)
        while True:
            block = self._call("get", key, next, chunks, None)  # a dropped connection mid-body too
            if block is None:
                return
            yield block

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[i:i + 1000]]
            if batch:
                out = self._call("delete", None, self.s3.delete_objects, Bucket=self.bucket,
                                 Delete={"Objects": batch, "Quiet": True})
                if out.get("Errors"):
                    err = out["Errors"][0]
                    raise ArtifactError(f"artifact store {self.url}: delete of {len(out['Errors'])} object(s) "
                                        f"failed, e.g. {err.get('Key')}: {self._why(err)}")

    def list(self, prefix: str) -> Iterator[Listed]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        want = self._k(prefix.rstrip("/") + "/") if prefix else (f"{self.prefix}/" if self.prefix else "")
        pages = iter(self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=want))
        while (page := self._call(f"list {want or '/'}", None, next, pages, None)) is not None:
            for o in page.get("Contents", []):
                key = o["Key"][strip:]
                if _SHA.fullmatch(key.rsplit("/", 1)[-1]):
                    yield Listed(key, int(o["Size"]), o["LastModified"].timestamp())


class DiskCache:
    """A host's bounded read cache of remote objects: files named by sha256 under `root`, least recently
    used evicted past `max_bytes`. Safe for several processes: files appear by rename (whole or not at
    all), a hit touches the file's mtime, and eviction tolerates files another process removed."""

    def __init__(self, root: Path | str, max_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.hits = self.misses = 0

    def get(self, ref: Ref, fetch) -> bytes:
        """The object's bytes: the cached file when whole and its sha256 matches, else `fetch()`
        (which verifies), kept for the next reader."""
        p = self.root / ref.sha256
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            data = None
        if data is not None and len(data) == ref.size and hashlib.sha256(data).hexdigest() == ref.sha256:
            with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                os.utime(p)
            self.hits += 1
            return data
        self.misses += 1
        data = fetch()
        if len(data) <= self.max_bytes:
            self._keep(p, data)
            self.evict()
        return data

    def _keep(self, p: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except OSError:
            # a full cache disk costs a refetch next time, never the read itself
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def evict(self) -> None:
        files = []
        for p in self.root.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if p.name.startswith(".part") and st.st_mtime > time.time() - 3600:
                continue  # another process is writing it
            files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= s


def open_artifacts(url: str, cache_dir: Path | str | None = None, cache_bytes: int = 0) -> Artifacts:
    """The backend a URL names: `s3://...` (with a disk cache when `cache_dir` and `cache_bytes` are
    given), `file://...` or a plain directory path."""
    if url.startswith("s3://"):
        cache = DiskCache(cache_dir, cache_bytes) if cache_dir is not None and cache_bytes > 0 else None
        return S3Artifacts(url, cache)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        raise ValueError(f"MARLAAS_ARTIFACTS must be file:///DIR or s3://BUCKET/PREFIX, got {url!r}")
    return LocalArtifacts(url)
