"""API latency benchmark: GET /v1/jobs/{id} and POST /v1/jobs over HTTP vs the direct Redis client.

    .venv/bin/python bench/api.py --out results/api.json [--requests 256] [--concurrency 1 16 64]

Starts a private embedded Redis and the API server (uvicorn, one process, rate limit off) on
127.0.0.1, registers one tenant, then at each concurrency c runs c closed-loop client threads that
together send --requests requests of each operation, through (a) the HTTP client path (one httpx
client per thread) and (b) the old direct path, `marlaas.api.client.Client` over Redis (`submit`, and
`Job.status` for the read). Reports p50 / p99 latency and throughput per (path, op, c). No workers:
the submitted jobs are tiny and never run. The client threads share one Python process (and its
GIL) with each other, not with the server.

Then (--first-generate N, default 5; 0 skips it) the stations start on a tiny test base, and N jobs
are submitted one at a time through each path, alternating: the time from the submit call to the
start of the first generate task of that job (its station event), API versus direct.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SPEC = {"task": "sort", "steps": 1, "prompts_per_step": 1, "group_size": 2, "eval_size": 1, "eval_k": 0}


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return {"n": len(xs), "p50_ms": round(q[49] * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}


def run_level(make_call, concurrency: int, total: int) -> dict:
    """`concurrency` threads, each making its own caller (make_call()) and timing total/concurrency calls."""
    per = max(1, total // concurrency)
    lat: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(concurrency)

    def worker() -> None:
        call = make_call()
        mine = []
        start.wait()
        for i in range(per):
            t0 = time.perf_counter()
            call(i)
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for f in [ex.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return {**percentiles(lat), "concurrency": concurrency, "throughput_rps": round(len(lat) / wall, 1)}


def wait_http(url: str, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/v1/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not up yet
        time.sleep(0.1)
    raise RuntimeError(f"the API server at {url} did not answer within {timeout:.0f} s")


def first_generate(stack, store, url: str, headers: dict, direct, home: Path, n: int) -> dict:
    """Submit n jobs through each path (alternating) with the stations running; seconds from the submit
    call to the start of the job's first generate task."""
    import httpx

    from marlaas.base.pretrain import ensure_base
    from marlaas.ops.embedded import wait_for_workers

    base = ensure_base(home / "base-test", preset="test", seed=0, progress=False, threads=1)
    stack.env.update({"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1"})
    stack.start("control", "generate", "verify", "train", "beat")
    wait_for_workers(store, timeout=240)
    h = httpx.Client(base_url=url, headers=headers, timeout=60)
    spec = dict(SPEC, steps=2)
    times: dict[str, list[float]] = {"http": [], "direct": []}
    for i in range(2 * n):
        path = ("http", "direct")[i % 2]
        t0 = time.time()
        jid = h.post("/v1/jobs", json=spec).json()["id"] if path == "http" else direct.submit(dict(spec)).id
        while True:
            starts = [e["start"] for e in store.events(since=t0) if e["station"] == "generate" and jid in e["jobs"]]
            if starts:
                times[path].append(min(starts) - t0)
                break
            if time.time() - t0 > 120:
                raise RuntimeError(f"job {jid} saw no generate task in 120 s (see the logs under {home})")
            time.sleep(0.005)
        store.set_status(jid, "cancelled")
    return {p: {"n": len(v), "median_ms": round(statistics.median(v) * 1e3, 1),
                "max_ms": round(max(v) * 1e3, 1)} for p, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256, help="requests per (path, operation, concurrency)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--first-generate", type=int, default=5, help="jobs per path for submit -> first generate")
    ap.add_argument("--out", type=Path, default=Path("results/api.json"))
    a = ap.parse_args()
    if a.requests < 1 or a.requests > 10_000 or max(a.concurrency) > 256:
        raise SystemExit("keep --requests within 1..10000 and --concurrency at most 256")

    home = Path(tempfile.mkdtemp(prefix="marlaas-bench-api-"))
    os.environ["MARLAAS_HOME"] = str(home)
    os.environ.pop("MARLAAS_REDIS_URL", None)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    from marlaas.ops.embedded import Stack, free_port

    stack = Stack(log_dir=home / "logs")
    stack.start("redis")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MARLAAS_REDIS_URL": stack.url, "MARLAAS_API_RATE": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "marlaas.api.app:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        env=env, stdout=open(home / "logs" / "api.log", "ab"), stderr=subprocess.STDOUT)
    try:
        wait_http(url)
        import httpx

        from marlaas.api.client import Client as DirectClient
        from marlaas.api.client import Job as DirectJob
        from marlaas.api.tenancy import Quotas, add_tenant
        from marlaas.store import Store

        store = Store(stack.url)
        token = add_tenant(store, "bench", Quotas(max_active_jobs=10_000))
        headers = {"Authorization": f"Bearer {token}"}
        direct = DirectClient(stack.url, token=token)
        seed_job = direct.submit(dict(SPEC)).id
        results = []
        for c in a.concurrency:
            def http_get():
                h = httpx.Client(base_url=url, headers=headers, timeout=60)
                return lambda i: h.get(f"/v1/jobs/{seed_job}").raise_for_status()

            def http_post():
                h = httpx.Client(base_url=url, headers=headers, timeout=60)
                return lambda i: h.post("/v1/jobs", json=SPEC).raise_for_status()

            def direct_get():
                return lambda i: DirectJob(direct, seed_job).status()

            def direct_post():
                return lambda i: direct.submit(dict(SPEC))

            for path, op, make in (("http", "GET /v1/jobs/{id}", http_get), ("http", "POST /v1/jobs", http_post),
                                   ("direct", "Job.status", direct_get), ("direct", "Client.submit", direct_post)):
                r = {"path": path, "op": op, **run_level(make, c, a.requests)}
                results.append(r)
                print(json.dumps(r), flush=True)
        first = first_generate(stack, store, url, headers, direct, home, a.first_generate) if a.first_generate else None
        out = {
            "command": f"bench/api.py --requests {a.requests} --concurrency {' '.join(map(str, a.concurrency))} "
                       f"--first-generate {a.first_generate}",
            "submit_to_first_generate": first,
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "server": "uvicorn, 1 process, FastAPI sync routes (thread pool), rate limit off; embedded Redis",
            "spec": SPEC,
            "results": results,
            "jobs_submitted": len(store.job_ids("bench")),
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {a.out}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        stack.stop()


if __name__ == "__main__":
    main()
