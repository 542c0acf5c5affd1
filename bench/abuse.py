"""Abuse benchmark: every attack of the front-door and cost audits, tried by a hostile tenant through
the HTTP API with its own token, while another tenant's job runs.

    .venv/bin/python bench/abuse.py --out results/abuse.json

Starts a private stack on 127.0.0.1 (Redis with its generated password, the API, control, generate,
verify, train, beat, Flower behind its login) on a tiny test base, registers two tenants with equal
plans (victim, attacker), starts the victim's long job, and measures its trainer steps per minute
before, during and after the attacks. Each attack is recorded as refused (the answer the API gave)
or contained (what bounded it), with evidence; `nothing_of_victim_read_or_changed` checks the
victim's job afterwards; `victim_longest_gap_s` is the longest time between two of its published
steps while the attacks ran (the target: at most one lease period, MARLAAS_LEASE_S). All traffic
goes to loopback; every loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

SORT = {"task": "sort", "prompts_per_step": 2, "group_size": 4, "eval_size": 4, "eval_k": 0, "max_staleness": 1}
LEASE_S = 60


def make_stack(prefix: str = "marlaas-bench-abuse-", lease_s: int = LEASE_S, flower: bool = True):
    """This bench's private stack, not started yet: (home, API URL, Flower port or None, Stack). Points
    this process at a fresh MARLAAS_HOME (one thread, this interpreter's tools on PATH) and builds the
    tiny test base there; every port is free and on 127.0.0.1, the API needs a tenant token."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["MARLAAS_HOME"] = str(home)
    os.environ.pop("MARLAAS_REDIS_URL", None)
    os.environ["MARLAAS_THREADS"] = "1"
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    from marlaas.base.pretrain import ensure_base
    from marlaas.ops.embedded import Stack, free_port

    base = ensure_base(home / "base-test", preset="test", seed=0, progress=False, threads=1)
    api_port, flower_port = free_port(), (free_port() if flower else None)
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_LEASE_S": str(lease_s),
           "MARLAAS_API_PORT": str(api_port), "MARLAAS_API_OPEN": "0", "MARLAAS_API_RATE": "20",
           "MARLAAS_API_BURST": "40"}
    if flower:
        env["MARLAAS_FLOWER_PORT"] = str(flower_port)
    return home, f"http://127.0.0.1:{api_port}", flower_port, Stack(log_dir=home / "logs", env=env)


def start_stack(stack, api: str, flower: bool = True):
    """Start the stack's processes (Redis, the API, control, generate, verify, train, beat, and Flower
    when asked), wait for its workers and its API; returns its Store. The caller stops the stack."""
    from marlaas.ops.embedded import wait_for_api, wait_for_workers
    from marlaas.store import Store

    stack.start("redis", "api", "control", "generate", "verify", "train", "beat", *(["flower"] if flower else []))
    store = Store(stack.url)
    wait_for_workers(store, timeout=240)
    wait_for_api(api)
    return store


def two_tenants(store, api: str) -> dict:
    """Registers the tenants victim and attacker with equal (default) plans: {name: (token, httpx.Client)}."""
    import httpx

    from marlaas.api.tenancy import Quotas, add_tenant

    out = {}
    for name in ("victim", "attacker"):
        tok = add_tenant(store, name, Quotas())
        out[name] = (tok, httpx.Client(base_url=api, headers={"Authorization": f"Bearer {tok}"}, timeout=60))
    return out


def steps_per_min(metrics: list[dict], t0: float, t1: float) -> float:
    n = sum(1 for m in metrics if t0 <= m.get("at", 0) < t1)
    return round(n / max(t1 - t0, 1e-9) * 60, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=30.0, help="seconds measured before and after the attacks")
    ap.add_argument("--out", type=Path, default=Path("results/abuse.json"))
    a = ap.parse_args()

    lease_s = LEASE_S
    home, api, flower_port, stack = make_stack("marlaas-bench-abuse-", lease_s)

    import httpx
    import redis

    attacks: list[dict] = []

    def record(name: str, outcome: str, evidence, ok: bool) -> None:
        attacks.append({"attack": name, "outcome": outcome, "evidence": evidence, "ok": ok})
        print(f"{'ok ' if ok else 'BAD'} {name}: {outcome} ({evidence})", flush=True)

    try:
        store = start_stack(stack, api)
        tenants = two_tenants(store, api)
        victim, attacker = tenants["victim"][1], tenants["attacker"][1]
        vjob = victim.post("/v1/jobs", json={**SORT, "steps": 10_000, "seed": 1}).raise_for_status().json()["id"]
        t_start = time.time()
        time.sleep(a.window_s)
        t_attack = time.time()

        def expect(name: str, resp: httpx.Response, codes: tuple[int, ...]) -> None:
            body = resp.text[:160]
            record(name, f"refused with {resp.status_code}" if resp.status_code in codes
                   else f"ANSWERED {resp.status_code}", body, resp.status_code in codes)

        # -- the front door: another tenant's resources, roles, the private store -------------------
        for path in ("", "/events?after=0", "/metrics", "/evals", "/checkpoints", "/checkpoints/1/adapter"):
            expect(f"read the victim's job{path or ''}", attacker.get(f"/v1/jobs/{vjob}{path}",
                                                                    headers={"Accept": "application/json"}), (404,))
        for verb in ("cancel", "pause", "resume"):
            expect(f"{verb} the victim's job", attacker.post(f"/v1/jobs/{vjob}/{verb}"), (404,))
        listed = attacker.get("/v1/jobs", params={"tenant": "victim"})
        expect("list the victim's jobs", listed, (403, 404))
        own = attacker.get("/v1/jobs").json()
        record("list every job", "only its own listed", {"jobs": [j["id"] for j in own.get("jobs", [])]},
               vjob not in json.dumps(own))
        expect("register a tenant (operator action) with a tenant token",
               attacker.post("/v1/tenants", json={"name": "mallory"}), (403,))
        expect("no token", httpx.get(f"{api}/v1/jobs", timeout=10), (401,))
        expect("forged token", httpx.get(f"{api}/v1/jobs", headers={"Authorization": "Bearer mt_forged"}, timeout=10),
               (401,))
        u = urlparse(stack.url)
        try:
            redis.Redis(host=u.hostname, port=u.port, socket_connect_timeout=2).ping()
            record("Redis without the password (impersonation, quota edits, FLUSHALL, CONFIG SET dir)",
                   "ANSWERED", "ping ok", False)
        except redis.exceptions.AuthenticationError as e:
            record("Redis without the password (impersonation, quota edits, FLUSHALL, CONFIG SET dir)",
                   "refused", str(e)[:80], True)
        try:
            store.r.execute_command("CONFIG", "SET", "dir", "/tmp")
            record("CONFIG SET dir even with the service password", "ANSWERED", "ok", False)
        except redis.exceptions.ResponseError as e:
            record("CONFIG SET dir even with the service password", "refused", str(e)[:80], True)
        expect("Flower without its login (tasks, and its API that can revoke tasks)",
               httpx.get(f"http://127.0.0.1:{flower_port}/api/tasks", timeout=10), (401,))
        from celery import Celery

        celery_app = Celery("probe")
        celery_app.config_from_object("celeryconfig")
        celery_app.conf.broker_url = stack.url
        replies = celery_app.control.ping(timeout=1.0)
        celery_app.close()
        record("Celery remote control (shutdown, cancel_consumer)", "no worker answers a broadcast"
               if not replies else "ANSWERED", {"replies": replies}, not replies)
        # -- code execution through rewards ----------------------------------------------------------
        rows = [{"prompt": "max:123=", "answer": "3"}] * 4
        for path in ("sympy:sympify", "marlaas.verify.sandbox:shutil.rmtree", "marlaas.verify.sandbox:subprocess.run",
                     "requests:get"):
            expect(f"verifier import path {path}",
                   attacker.post("/v1/jobs", json={"dataset": rows, "verifier": path, "steps": 2, "eval_size": 1}),
                   (403, 422))
        # -- reasoning-gym tasks: a file read through a config, a scorer that evals the model's answer --
        expect("reasoning-gym config reading a service file (data_file = the operator token)",
               attacker.post("/v1/jobs", json={"task": "reasoning_gym:spell_backward", "steps": 2, "eval_size": 1,
                                               "task_config": {"data_file": str(home / "operator_token")}}), (422,))
        expect("reasoning-gym task whose scorer evals the model's answer (string_insertion)",
               attacker.post("/v1/jobs", json={"task": "reasoning_gym:string_insertion", "steps": 2,
                                               "eval_size": 1}), (422,))
        t0 = time.time()
        resp = attacker.post("/v1/jobs", json={"task": "reasoning_gym:count_primes", "steps": 2, "eval_size": 1,
                                               "task_config": {"max_n": 10**10}})
        expect(f"reasoning-gym config building a 10^10-entry sieve (answered in {time.time() - t0:.1f} s)", resp,
               (422,))
        # -- costs outside the quotas ---------------------------------------------------------------
        expect("eval_size=100000, eval_k=256", attacker.post("/v1/jobs", json={**SORT, "steps": 2,
                                                                               "eval_size": 100000, "eval_k": 256}),
               (422,))
        expect("tokens per step", attacker.post("/v1/jobs", json={**SORT, "steps": 2, "prompts_per_step": 256,
                                                                  "group_size": 64, "max_new_tokens": 64}), (422,))
        huge = [{"prompt": "max:" + "1" * 100_000 + "=", "answer": "1"}] * 2
        expect("a 100 kB row", attacker.post("/v1/jobs", json={"dataset": huge, "steps": 2, "eval_size": 1}),
               (413, 422))
        spin = "def grade(sample, item):\n    while True:\n        pass\n"
        grader = {"type": "python", "name": "spin", "source": spin, "timeout_s": 0.5}
        r = attacker.post("/v1/jobs", json={"dataset": rows, "grader": grader, "steps": 2, "eval_size": 1,
                                            "prompts_per_step": 1, "group_size": 2})
        if r.status_code == 201:
            gid, st = r.json()["id"], {}
            for _ in range(240):  # bounded: the sandbox's limits end every call
                st = attacker.get(f"/v1/jobs/{gid}").json()
                if st.get("status") in ("done", "failed", "cancelled"):
                    break
                time.sleep(0.5)
            ended = st.get("status") in ("done", "failed") and (st.get("verify_errors") or 0) > 0
            record("python grader `while True: pass`", f"contained: the job ended {st.get('status')} with "
                   f"{st.get('verify_errors')} grader errors counted", {"error": st.get("error")}, ended)
        else:
            expect("python grader `while True: pass`", r, (422,))
        resp = attacker.post("/v1/jobs", json={**SORT, "steps": 100, "weight": 100.0})
        if resp.status_code == 201:
            w = store.spec(resp.json()["id"]).weight
            record("weight=100 in the spec", f"contained: the plan's weight {w} applies", {"stored_weight": w},
                   w == 1.0)
        else:
            expect("weight=100 in the spec", resp, (422,))
        made = [resp.json()["id"]] if resp.status_code == 201 else []
        refused = None
        for _ in range(10):  # 8 jobs to grab the trainer: the quota and the per-tenant share bound it
            r = attacker.post("/v1/jobs", json={**SORT, "steps": 100})
            if r.status_code != 201:
                refused = r.status_code
                break
            made.append(r.json()["id"])
        record("many jobs to grab the trainer", f"contained: {len(made)} jobs admitted (max_active_jobs), then "
               f"{refused}; the trainer share is per tenant", {"admitted": len(made)}, refused == 422)
        codes = []
        for _ in range(120):  # a request flood: bounded loop, loopback only
            codes.append(attacker.get("/v1/jobs").status_code)
            if codes[-1] == 429:
                break
        record("request flood", "rate limited" if 429 in codes else "NOT limited",
               {"requests_until_429": len(codes)}, 429 in codes)
        for jid in made:
            store.set_status(jid, "cancelled")
        t_end_attack = time.time()
        time.sleep(a.window_s)
        t_after = time.time()
        metrics = store.metrics(vjob)
        ats = sorted(m["at"] for m in metrics if t_attack - lease_s <= m.get("at", 0) <= t_end_attack + lease_s)
        gap = max((b - x for x, b in zip(ats, ats[1:])), default=None)
        rec = store.job(vjob)
        n_after = len(store.metrics(vjob))  # the victim keeps training between the two reads
        untouched = rec.status == "running" and rec.tenant == "victim" and len(metrics) <= rec.version <= n_after
        out = {
            "command": "bench/abuse.py" + (f" --window-s {a.window_s:g}" if a.window_s != 30 else ""),
            "date": time.strftime("%Y-%m-%d"),
            "attacks": attacks,
            "all_refused_or_contained": all(x["ok"] for x in attacks),
            "victim": {"job": vjob,
                       "steps_per_min": {"before": steps_per_min(metrics, t_start, t_attack),
                                         "during": steps_per_min(metrics, t_attack, t_end_attack),
                                         "after": steps_per_min(metrics, t_end_attack, t_after)},
                       "attack_window_s": round(t_end_attack - t_attack, 1),
                       "longest_gap_s": gap and round(gap, 2), "lease_s": lease_s,
                       "nothing_of_victim_read_or_changed": untouched},
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out["victim"]), f"\nwrote {a.out}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
