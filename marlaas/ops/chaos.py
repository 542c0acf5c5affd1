"""Fault injection: SIGKILL random station processes (and restart the broker) while tenants train.

Used by tests/integration/test_chaos.py and bench/chaos.py. The stack is private (its own Redis, started from
the Procfile lines) with short leases, so lost work is re-dispatched within seconds, and the harness
acts as the process supervisor a deployment has: processes that exit on their own are started again. Invariants
checked by the callers: every job finishes with versions 1..steps published once each, in order,
each trained only on groups within its staleness bound; no reference names a missing object of the
artifact store, before or after the jobs' orphans (objects written by a trainer killed before its
publish, or by a publish that lost its compare-and-set) are swept.
"""

from __future__ import annotations

import random
import signal
import time

from marlaas.api.client import Client
from marlaas.ops.embedded import Stack, wait_for_workers
from marlaas.spec import JobSpec
from marlaas.store import Store

VICTIMS = ("generate", "verify", "train", "control", "beat")
TASKS = ("sort", "reverse", "max", "min", "add", "code")


def run_chaos(base, log_dir, tenants=8, kills=6, steps=4, seed=0, deadline_s=900, broker_restart=True,
              interval=(1.0, 3.0)):
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_LEASE_S": "8"}
    stack = Stack(env=env, log_dir=log_dir)
    rng = random.Random(seed)
    log = []
    try:
        stack.start("redis")
        stack.start(*VICTIMS)
        wait_for_workers(Store(stack.url), timeout=240)
        client = Client(stack.url)
        specs = [JobSpec(tenant=f"t{i}", task=TASKS[i % len(TASKS)], steps=steps, prompts_per_step=2,
                         group_size=4, max_staleness=i % 3, eval_size=4, seed=i) for i in range(tenants)]
        jobs = [client.submit(s) for s in specs]
        t0 = time.time()
        restarted = not broker_restart
        while time.time() - t0 < deadline_s:
            if all(j.status()["status"] in ("done", "failed", "cancelled") for j in jobs):
                break
            time.sleep(rng.uniform(*interval))
            # Like any process supervisor: a worker that exited on its own (Celery's prefork worker can
            # die while the broker restarts) is started again, and the harness records it.
            log += [("revived", name, round(time.time() - t0, 1)) for name in stack.revive()]
            if len([e for e in log if e[0] == "kill"]) < kills:
                name = rng.choice(VICTIMS)
                stack.kill(name, signal.SIGKILL)
                log.append(("kill", name, round(time.time() - t0, 1)))
                time.sleep(rng.uniform(0.2, 1.5))
                stack.start(name)
            elif not restarted:
                stack.kill("redis", signal.SIGTERM)  # the embedded broker goes away (AOF on) ...
                log.append(("broker-restart", "redis", round(time.time() - t0, 1)))
                time.sleep(1.0)
                stack.start("redis")  # ... and comes back on the same port
                restarted = True
        results = []
        store = Store(stack.url)
        for j, s in zip(jobs, specs):
            st = j.status()
            steps_seen = [m["step"] for m in j.metrics()["steps"]]
            results.append({"job": j.id, "status": st["status"], "steps": steps_seen, "spec_steps": s.steps,
                            "staleness_ok": all(0 <= x <= s.max_staleness for m in j.metrics()["steps"]
                                                for x in m["staleness"]),
                            "regenerated": st["regenerated"]})
            missing = store.missing_objects(j.id)
            swept = store.sweep_job(j.id, grace_s=0.0)  # every job has ended: nothing is in flight
            results[-1].update(missing_objects=missing, orphans_swept=swept["orphans"],
                               missing_after_sweep=store.missing_objects(j.id))
        return {"events": log, "jobs": results, "wall_s": round(time.time() - t0, 1)}
    finally:
        stack.stop()
