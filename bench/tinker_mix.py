"""Fairness under a mixed load: one Tinker SDK client sending forward_backward + optim_step as fast as it
can, next to job-level tenants, all on the one trainer lane.

    .venv/bin/python bench/tinker_mix.py --out results/tinker_mix.json

Starts a private stack on 127.0.0.1 (Redis, the API, control, generate, verify, train, beat) on a tiny
test base; registers 4 job tenants (one long job each) and one Tinker tenant (equal plans); the
Tinker client runs the unmodified SDK in a loop (forward_backward with cross_entropy on a fixed
batch, then optim_step, waiting for each step) for --seconds. Reports each tenant's share of the
trainer's steps over the window in which every tenant was active (trainer events of the store), the
target share (equal weights: 1/5 each), the job-level steps per minute, and the Tinker client's step
latency (forward_backward + optim_step, submit to result) p50/p99. Loopback only; bounded loops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

JOB = {"task": "sort", "steps": 10_000, "prompts_per_step": 2, "group_size": 4, "eval_size": 2, "eval_k": 0,
       "max_staleness": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--job-tenants", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("results/tinker_mix.json"))
    a = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    home = Path(tempfile.mkdtemp(prefix="marlaas-bench-tinker-"))
    os.environ["MARLAAS_HOME"] = str(home)
    os.environ.pop("MARLAAS_REDIS_URL", None)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    import httpx
    import tinker
    from tinker import types

    from marlaas.api.tenancy import add_tenant
    from marlaas.base.pretrain import ensure_base
    from marlaas.base.tiny import load_tokenizer
    from marlaas.ops.embedded import Stack, free_port, wait_for_api, wait_for_workers
    from marlaas.store import Store

    base = ensure_base(home / "base-test", preset="test", seed=0, progress=False, threads=1)
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    stack = Stack(log_dir=home / "logs", env={"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1",
                                              "MARLAAS_API_PORT": str(api_port), "MARLAAS_API_RATE": "0"})
    try:
        stack.start("redis", "api", "control", "generate", "verify", "train", "beat")
        store = Store(stack.url)
        wait_for_workers(store, timeout=240)
        wait_for_api(api)
        jobs = {}
        for i in range(a.job_tenants):
            tok = add_tenant(store, f"jobs{i}")
            r = httpx.post(f"{api}/v1/jobs", json={**JOB, "seed": i}, headers={"Authorization": f"Bearer {tok}"},
                           timeout=60)
            jobs[r.raise_for_status().json()["id"]] = f"jobs{i}"
        sc = tinker.ServiceClient(base_url=api, api_key="tml-" + add_tenant(store, "tinker"))
        model = sc.get_server_capabilities().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        mid = tc.get_info().model_id
        ids = load_tokenizer(base)("sort:3142=1234;")["input_ids"]
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[len(ids) - 1]),
            "weights": types.TensorData(data=[1.0] * (len(ids) - 1), dtype="float32", shape=[len(ids) - 1])})
        latencies: list[float] = []
        stop = threading.Event()

        def tinker_loop() -> None:
            while not stop.is_set() and len(latencies) < 100_000:
                t0 = time.time()
                fb = tc.forward_backward([datum] * 8, "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()
                latencies.append(time.time() - t0)

        loop = threading.Thread(target=tinker_loop, daemon=True)
        t_start = time.time()
        loop.start()
        time.sleep(a.seconds)
        stop.set()
        loop.join(timeout=120)
        t_end = time.time()
        events = [e for e in store.events(since=t_start) if e["station"] == "train" and e["start"] >= t_start]
        owner = {**jobs, mid: "tinker"}
        # the window in which every tenant had trainer work: from the first step of the last to start
        firsts = {}
        for e in events:
            for j in e["jobs"]:
                firsts.setdefault(owner.get(j), e["start"])
        w0 = max(firsts.get(t, t_end) for t in owner.values())
        counts = {t: 0 for t in owner.values()}
        for e in events:
            if e["start"] >= w0:
                for j in e["jobs"]:
                    if j in owner:
                        counts[owner[j]] += 1
        total = sum(counts.values()) or 1
        shares = {t: round(n / total, 3) for t, n in counts.items()}
        target = round(1 / len(counts), 3)
        out = {
            "command": f"bench/tinker_mix.py --seconds {a.seconds:g} --job-tenants {a.job_tenants}",
            "date": time.strftime("%Y-%m-%d"),
            "window_s": round(t_end - w0, 1),
            "trainer_steps": counts,
            "shares": shares,
            "target_share": target,
            "max_share_error": round(max(abs(s - target) for s in shares.values()) / target, 3),
            "job_steps_per_min": round(sum(n for t, n in counts.items() if t != "tinker") / max(t_end - w0, 1) * 60,
                                       1),
            "tinker_step_latency_s": {"n": len(latencies),
                                      "p50": round(statistics.median(latencies), 3) if latencies else None,
                                      "p99": round(statistics.quantiles(latencies, n=100)[98], 3)
                                      if len(latencies) >= 2 else None},
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out, indent=2), f"\nwrote {a.out}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
