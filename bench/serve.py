"""Serving latency and what serving costs training: the OpenAI-compatible door under 1, 8 and 32 clients.

    .venv/bin/python bench/serve.py --out results/serve.json          # docs/serving.md

A private worker stack (its own home and embedded Redis; the tiny test base, hf engine, one thread per
process) with the API. Eight tenants each train a small job first: their adapters are what is served
(`JOB`, round-robin over the eight tenants, each with its own token). Then, for 1, 8 and 32 concurrent
clients, each client sends streamed text completions (`--max-tokens` new tokens, temperature 1, a
seed per request) and we record the time to the first server-sent event (TTFT) and to `[DONE]`
(total), p50 and p99, and completion tokens per second:
- with the trainer idle (no job training);
- while eight jobs train (one per tenant, `--train-steps` steps each).
The jobs' steps per minute (all eight summed, versions published per minute) are measured over a window
without serving (`--window` seconds) and over the serving phases. The chunks come once the generation
is done (docs/serving.md), so TTFT is close to the total latency here.

The numbers come from a 2-core machine shared with other work: read them as relative (idle against
training, with against without serving), not as absolute capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
HOME = Path(tempfile.mkdtemp(prefix="marlaas-bench-serve-"))
os.environ["MARLAAS_HOME"] = str(HOME)  # before marlaas reads its settings: a private home
os.environ.pop("MARLAAS_REDIS_URL", None)

import httpx  # noqa: E402

from marlaas.api import tenancy  # noqa: E402
from marlaas.api.http_client import Client  # noqa: E402
from marlaas.base.pretrain import ensure_base  # noqa: E402
from marlaas.ops.embedded import Stack, free_port, wait_for_api, wait_for_workers  # noqa: E402
from marlaas.settings import get_settings  # noqa: E402
from marlaas.store import Store  # noqa: E402

LEVELS = (1, 8, 32)
TENANTS = 8


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def one(url: str, token: str, model: str, seed: int, max_tokens: int) -> tuple[float, float, int]:
    """(ttft, total, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {token}"}, timeout=600,
                      json={"model": model, "prompt": "max:0023=", "max_tokens": max_tokens, "temperature": 1.0,
                            "seed": seed, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            if line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return ttft or 0.0, time.perf_counter() - t0, tokens


def level(url: str, targets: list[tuple[str, str]], clients: int, requests: int, max_tokens: int) -> dict:
    """`requests` streamed completions from `clients` concurrent clients over the tenants' models."""
    out: list[tuple[float, float, int]] = []
    errors: list[str] = []
    lock, counter = threading.Lock(), iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            token, model = targets[i % len(targets)]
            try:
                res = one(url, token, model, i, max_tokens)
                with lock:
                    out.append(res)
            except Exception as e:  # recorded in the JSON, the run goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft, total = [x[0] for x in out], [x[1] for x in out]
    return {"clients": clients, "requests": requests, "ok": len(out), "errors": errors[:5], "wall_s": round(wall, 2),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "total_p50_s": pct(total, 0.5),
            "total_p99_s": pct(total, 0.99), "tokens_per_s": round(sum(x[2] for x in out) / wall, 2)}


def steps_done(store: Store, jids: list[str]) -> int:
    return sum(store.job(j).version for j in jids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/serve.json"))
    ap.add_argument("--requests", type=int, default=2, help="requests per client at each level (at least 16)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of training measured without serving")
    a = ap.parse_args()
    t_start = time.time()
    base = ensure_base(HOME / "base", preset="test", seed=0, progress=False, threads=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "120",
           "MARLAAS_API_PORT": str(port), "MARLAAS_API_URL": url}
    stack = Stack(env=env, log_dir=HOME / "logs")
    try:
        stack.start("redis")
        os.environ["MARLAAS_REDIS_URL"] = stack.url
        get_settings.cache_clear()
        stack.start("api", "control", "generate", "verify", "train", "beat")
        store = Store()
        wait_for_workers(store, timeout=300)
        wait_for_api(url)
        tokens = [tenancy.add_tenant(store, f"serve{i}") for i in range(TENANTS)]
        small = {"task": "max", "steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_size": 2, "eval_k": 0}
        first = [Client(url, token=t).submit({**small, "seed": i}) for i, t in enumerate(tokens)]
        for j in first:
            assert j.wait(timeout=600)["status"] == "done"
        targets = [(t, j.id) for t, j in zip(tokens, first)]
        print(f"adapters ready after {time.time() - t_start:.0f} s", flush=True)

        def levels() -> list[dict]:
            rows = []
            for c in LEVELS:
                rows.append(level(url, targets, c, max(16, a.requests * c), a.max_tokens))
                print(rows[-1], flush=True)
            return rows

        idle = levels()
        jobs = [Client(url, token=t).submit({"task": "max", "steps": a.train_steps, "prompts_per_step": 4,
                                             "group_size": 4, "eval_size": 2, "eval_k": 0, "seed": 10 + i})
                for i, t in enumerate(tokens)]
        jids = [j.id for j in jobs]
        time.sleep(15)  # the jobs' first batches
        s0, t0 = steps_done(store, jids), time.time()
        time.sleep(a.window)
        quiet = (steps_done(store, jids) - s0) / (time.time() - t0) * 60
        s1, t1 = steps_done(store, jids), time.time()
        training = levels()
        loaded = (steps_done(store, jids) - s1) / (time.time() - t1) * 60
        for j in jobs:
            j.cancel()
        p99 = {r["clients"]: (r["total_p99_s"], w["total_p99_s"]) for r, w in zip(idle, training)}
        out = {
            "command": f".venv/bin/python bench/serve.py --requests {a.requests} --max-tokens {a.max_tokens} "
                       f"--train-steps {a.train_steps} --window {a.window:g} --out {a.out}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
            "base": "tiny test preset (marlaas.base.pretrain, preset 'test')", "engine": "hf",
            "serve_share": get_settings().serve_share, "tenants": TENANTS,
            "request": {"endpoint": "/v1/completions", "stream": True, "max_tokens": a.max_tokens,
                        "temperature": 1.0, "models": "JOB of each of the 8 tenants, round-robin"},
            "training_jobs": {"count": TENANTS, "task": "max", "prompts_per_step": 4, "group_size": 4},
            "idle": idle,
            "while_training": training,
            "p99_ratio_training_over_idle": {str(c): (round(w / i, 2) if i and w else None)
                                             for c, (i, w) in p99.items()},
            "train_steps_per_min": {"without_serving": round(quiet, 2), "with_serving": round(loaded, 2),
                                    "kept": round(loaded / quiet, 3) if quiet else None},
            "note": "chunks are sent once the generation is done: TTFT ~ total latency; a shared 2-core machine",
            "total_wall_s": round(time.time() - t_start, 1),
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))
        print(json.dumps({k: out[k] for k in ("p99_ratio_training_over_idle", "train_steps_per_min")}))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
