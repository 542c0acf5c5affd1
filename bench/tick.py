"""The scheduler tick at 10 / 100 / 1,000 tenants: real `dispatch.tick` against a real Redis.

    .venv/bin/python bench/tick.py --tenants 10,100,1000 --cases expired,steady --label after2 --out results/tick.json

The CLI starts a private embedded Redis (the Procfile's `redis` line, under a throw-away
MARLAAS_HOME), builds N running jobs (one per tenant) in mid-run states, and times `dispatch.tick`
with a `send` that only records (no Celery). The states cycle over five kinds, one fifth each:
  ready      at version 3, admission full, step 3's groups verified (the trainer can take it),
             later groups leased to verify (rollouts stored) or to generate, in flight;
  generating at version 2, groups 10..13 leased to generate, 14..19 still admissible;
  expired    at version 1, generate and verify leases expired 10 s ago (re-dispatch); in the
             `steady` case (--cases) they are live instead, so no work is lost: the tick dispatches
             the needed evaluations and new groups (the `expired` case re-sends ~800 verifications
             and 256 groups every tick at 1,000 tenants);
  evaluating at its last version, the final evaluation not yet run (needs an eval item);
  new        just submitted: nothing dispatched, the base evaluation needed.
Workers: 4 generate, 1 verify, 1 train, 1 control heartbeat (generate capacity 8 batches). The
trainer lane alternates between free and held by a live, claimed train worker. Before every timed
tick the state the tick changes (dispatch counters, pass values, leases, in-flight batches, the
trainer lease, the lock) is restored, so every repeat decides on the same snapshot; restoring a job's
row of the scheduling table is a change like any other, so the next tick reads and decodes the rows
the tick before it changed (dispatch counters, the trained job's pass), as a real next tick would.
`tick_ms_cold` is the first tick of a process (every row read and decoded, every spec read).

Figures per N: the full tick's median and p95 (lock, snapshot, plan, apply, unlock), the median of
each part (timed by wrapping `dispatch.snapshot`, `scheduler.plan` and `dispatch.apply`), and the
Redis round trips (connections taken from the pool: one per command or pipeline) and commands
(server `total_commands_processed`) of one tick. `--label before|after` writes that block of the
JSON and keeps the others (`before_paired`: the committed code re-measured right before `after`,
so the ratio compares runs under the same machine load); `tick_ms_1000_tenants` is the median at
1,000 tenants of the newest `after*` block's `steady` case (a running service's every-second tick),
`tick_ms_1000_tenants_all_leases_expired` its `expired` case (the recovery tick after every job lost
its in-flight work at once). `--publish` sends the tick's messages through the service's own sender
(tasks.common.send: Celery with the service's transport settings, one pipelined batch per tick)
instead of only counting them, so their cost is in the figure.
Each block records the 1-minute load average and a CPU calibration.
`measure_tick` FLUSHES the Redis database named by its URL: give it a scratch database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from marlaas.control import dispatch, scheduler
from marlaas.spec import JobSpec
from marlaas.store import GEN_INFLIGHT, LEASES, LOCK, TRAINER, VT, Store, item_name, job_key
from marlaas.types import AdapterBlob

KINDS = ("ready", "generating", "expired", "evaluating", "new")
STEPS, P, G, S = 20, 4, 8, 2  # steps, groups per step, group size, max staleness
WORKERS = [("generate@bench:1", "generate"), ("generate@bench:2", "generate"), ("generate@bench:3", "generate"),
           ("generate@bench:4", "generate"), ("verify@bench:5", "verify"), ("train@bench:6", "train"),
           ("control@bench:7", "control")]


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"sort:{i} {i + 3} {i + 1}=", "answer": f"{i} {i + 1} {i + 3}"} for i in range(n)]


def _rollout(st: Store, jid: str, g: int, v: int, verified: bool) -> None:
    data = {"row": _rows(1)[0], "completions": [f"completion {k}" for k in range(G)],
            "tokens": [[1, 2, 3, 4]] * G, "logprobs": [[-0.5, -0.25, -0.1, -0.2]] * G}
    att = st.put_rollout(jid, g, v, data)
    if verified:
        st.accept_rewards(jid, g, att, {"rewards": [float(k % 2) for k in range(G)]})


def build(st: Store, n: int, now: float, case: str = "expired") -> None:
    """N jobs in mid-run states (see the module docstring); leases relative to `now`."""
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        spec = JobSpec(tenant=f"t{i}", task="sort", steps=STEPS, prompts_per_step=P, group_size=G,
                       max_staleness=S, eval_size=16, seed=i, weight=1.0 + (i % 3))
        jid = st.create_job(spec, _rows(16), _rows(16))
        t = {"ready": 3, "generating": 2, "expired": 1, "evaluating": STEPS, "new": 0}[kind]
        for v in range(t):
            st.publish(jid, v, AdapterBlob({"r": 8}, b"w" * 64), b"o" * 64, {"step": v + 1}, "-", [], STEPS)
        if kind != "new":
            st.put_eval_result(jid, 0, {"acc": 0.25, "n": 16})
        if kind == "ready":
            for g in range(12, 16):
                _rollout(st, jid, g, 2, verified=True)
            for g in range(16, 20):
                _rollout(st, jid, g, 3, verified=False)  # leased to verify
            st.lease([item_name("gen", jid, g) for g in range(20, 24)], 300, now)
            st.advance_dispatched(jid, 24)
        elif kind == "generating":
            for g in range(8, 10):
                _rollout(st, jid, g, 2, verified=True)
            st.lease([item_name("gen", jid, g) for g in range(10, 14)], 300, now)
            st.advance_dispatched(jid, 14)
        elif kind == "expired":
            for g in range(4, 8):
                _rollout(st, jid, g, 1, verified=True)
            for g in range(12, 16):
                _rollout(st, jid, g, 1, verified=False)
            ttl = -10 if case == "expired" else 300
            st.lease([item_name("ver", jid, g) for g in range(12, 16)], ttl, now)
            st.lease([item_name("gen", jid, g) for g in range(8, 12)], ttl, now)
            st.advance_dispatched(jid, 16)
        elif kind == "evaluating":
            st.advance_dispatched(jid, STEPS * P)
            st.set_status(jid, "evaluating")


class _Saved:
    """What a tick changes, read once after `build`, written back before every timed tick."""

    def __init__(self, st: Store):
        ids = st.active_job_ids()
        p = st.r.pipeline(transaction=False)
        for jid in ids:
            p.hmget(job_key(jid), ["dispatched", "pass"])
        self.jobs = dict(zip(ids, p.execute()))
        self.leases = {k: s for k, s in st.r.zrange(LEASES, 0, -1, withscores=True)}
        self.vt = st.r.get(VT) or b"0"

    def restore(self, st: Store, trainer_busy: bool) -> None:
        p = st.r.pipeline(transaction=False)
        for jid, (d, pv) in self.jobs.items():
            p.hset(job_key(jid), mapping={"dispatched": d, "pass": pv})
        p.delete(LEASES, GEN_INFLIGHT, TRAINER, LOCK)
        st.sync_rows(list(self.jobs), pipe=p)  # the scheduling table follows the hashes
        if self.leases:
            p.zadd(LEASES, self.leases)
        p.set(VT, self.vt)
        p.execute()
        if trainer_busy:
            tok = st.take_trainer(next(iter(self.jobs)), 3, 300)
            st.claim_trainer(tok, "train@bench:6")


def _ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _count_one_tick(st: Store) -> tuple[int, int]:
    """Round trips (connections taken from the pool) and server-side commands of one tick."""
    pool = st.r.connection_pool
    orig = pool.get_connection
    n = [0]

    def counting(*a, **kw):
        n[0] += 1
        return orig(*a, **kw)

    before = int(st.r.info("stats")["total_commands_processed"])
    pool.get_connection = counting
    try:
        dispatch.tick(st, lambda msgs: None)
    finally:
        pool.get_connection = orig
    after = int(st.r.info("stats")["total_commands_processed"])
    return n[0], after - before - 1  # the first INFO is counted by the second


def _publisher(url: str):
    """The service's own sender (tasks.common.send: the control worker's tick sends through it, with
    the service's transport settings from celeryconfig), pointed at the broker at `url`."""
    os.environ["MARLAAS_REDIS_URL"] = url
    from marlaas.settings import get_settings

    get_settings.cache_clear()
    import tasks.common

    tasks.common.app.conf.broker_url = url
    tasks.common.store.cache_clear()
    return tasks.common.send


def measure_tick(n_tenants: int, url: str, repeats: int = 50, case: str = "expired", publish: bool = False) -> dict:
    """Time `repeats` real ticks over `n_tenants` mid-run jobs. FLUSHES the database of `url`.
    `publish`: the tick's messages go to the broker through Celery (else they are only counted)."""
    st = Store(url)
    _wipe(st.r)
    dispatch.MEMORY.forget(st.url)
    now = time.time()
    t0 = time.perf_counter()
    build(st, n_tenants, now, case)
    build_s = time.perf_counter() - t0
    for name, station in WORKERS:
        st.heartbeat(name, station, ttl=3600)
    saved = _Saved(st)
    parts: dict[str, list[float]] = {"snapshot": [], "plan": [], "apply": []}
    originals = {"snapshot": dispatch.snapshot, "plan": scheduler.plan, "apply": dispatch.apply}

    def timed(name):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return originals[name](*a, **kw)
            finally:
                parts[name].append(time.perf_counter() - t)
        return wrapper

    publisher = _publisher(url) if publish else None
    ticks, sent_n, trains = [], [], 0
    saved.restore(st, trainer_busy=False)
    dispatch.tick(st, lambda msgs: None)  # scripts loaded
    saved.restore(st, trainer_busy=False)
    dispatch.MEMORY.forget(st.url)
    t = time.perf_counter()
    dispatch.tick(st, lambda msgs: None)  # cold: every row decoded
    cold = time.perf_counter() - t
    dispatch.snapshot, scheduler.plan, dispatch.apply = timed("snapshot"), timed("plan"), timed("apply")
    try:
        for k in range(repeats):
            saved.restore(st, trainer_busy=bool(k % 2))
            sent: list = []
            def send(msgs, sent=sent):
                sent.extend(msgs)
                if publisher:
                    publisher(msgs)
            t = time.perf_counter()
            plan = dispatch.tick(st, send)
            ticks.append(time.perf_counter() - t)
            assert plan is not None, "the scheduler lock was held"
            sent_n.append(len(sent))
            trains += plan.train is not None
    finally:
        dispatch.snapshot, scheduler.plan, dispatch.apply = originals["snapshot"], originals["plan"], originals["apply"]
    saved.restore(st, trainer_busy=False)
    round_trips, commands = _count_one_tick(st)
    out = {
        "n_tenants": n_tenants,
        "case": case,
        "messages": "published through Celery" if publish else "counted, not published",
        "repeats": repeats,
        "tick_ms_cold": round(1000 * cold, 3),
        "tick_ms_median": round(1000 * statistics.median(ticks), 3),
        "tick_ms_p95": _ms(ticks, 0.95),
        "tick_ms_min": round(1000 * min(ticks), 3),
        "snapshot_ms_median": round(1000 * statistics.median(parts["snapshot"]), 3),
        "plan_ms_median": round(1000 * statistics.median(parts["plan"]), 3),
        "apply_ms_median": round(1000 * statistics.median(parts["apply"]), 3),
        "redis_round_trips_per_tick": round_trips,
        "redis_commands_per_tick": commands,
        "messages_per_tick_median": statistics.median(sent_n),
        "ticks_that_started_training": trains,
        "redis_keys": int(st.r.dbsize()),
        "build_s": round(build_s, 2),
    }
    _wipe(st.r)
    return out


def _calibrate() -> float:
    """Best-of-50 microseconds of sum(range(10000)): how fast this (shared) CPU was at the time."""
    import timeit

    return round(1e6 * min(timeit.repeat("sum(range(10000))", number=1, repeat=50)), 1)


def summarize(doc: dict) -> dict:
    """The headline figures of tick.json from its blocks: the newest `after*` block gives
    `tick_ms_1000_tenants`; speedups over `before` compare blocks measured alike (messages only
    counted), so they use the newest `after*` block without --publish."""
    afters = [k for k in doc if k.startswith("after") and isinstance(doc[k], dict) and "results" in doc[k]]
    newest = max(afters, default="after", key=lambda k: (len(k), k))
    counted = max((k for k in afters if "--publish" not in doc[k].get("command", "")), default=newest,
                  key=lambda k: (len(k), k))

    def rows(block: str, case: str) -> dict:
        return {r["n_tenants"]: r for r in doc.get(block, {}).get("results", []) if r.get("case", "expired") == case}

    after, steady = rows(newest, "expired"), rows(newest, "steady")
    if 1000 in steady or 1000 in after:
        # The headline is a run's every-second tick (steady: no work lost); the recovery tick after
        # every job's leases expired at once is reported beside it.
        head = steady.get(1000) or after[1000]
        doc["tick_ms_1000_tenants"] = head["tick_ms_median"]
        doc["tick_ms_1000_tenants_case"] = head.get("case", "expired")
        doc["tick_ms_1000_tenants_all_leases_expired"] = after[1000]["tick_ms_median"] if 1000 in after else None
        doc["target_ms"] = 10.0
        doc["meets_target"] = head["tick_ms_median"] <= 10.0
        doc["tick_ms_1000_tenants_from"] = newest
    after = rows(counted, "expired")
    before = {r["n_tenants"]: r for r in doc.get("before", {}).get("results", [])}
    doc["speedup_median_from"] = counted
    doc["speedup_median"] = {str(n): round(before[n]["tick_ms_median"] / after[n]["tick_ms_median"], 2)
                             for n in sorted(set(after) & set(before))}
    paired = {r["n_tenants"]: r for r in doc.get("before_paired", {}).get("results", [])}
    if paired:
        doc["speedup_median_paired"] = {str(n): round(paired[n]["tick_ms_median"] / after[n]["tick_ms_median"], 2)
                                        for n in sorted(set(after) & set(paired))}
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", default="10,100,1000")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cases", default="expired", help="expired and/or steady (see the docstring)")
    ap.add_argument("--publish", action="store_true", help="publish the tick's messages through Celery")
    ap.add_argument("--label", default="after", help="the JSON block to write (before, after, ...)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path, default=Path("results/tick.json"))
    a = ap.parse_args()
    os.environ["MARLAAS_HOME"] = tempfile.mkdtemp(prefix="marlaas-tick-")
    os.environ.pop("MARLAAS_REDIS_URL", None)
    from marlaas.ops.embedded import Stack
    from marlaas.settings import get_settings

    get_settings.cache_clear()
    stack = Stack()
    stack.start("redis")
    try:
        rows = []
        for case in a.cases.split(","):
            for n in [int(x) for x in a.tenants.split(",")]:
                rows.append(measure_tick(n, stack.url, a.repeats, case, publish=a.publish))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stack.stop()
    doc = json.loads(a.out.read_text()) if a.out.is_file() else {}
    doc[a.label] = {"command": f"bench/tick.py --tenants {a.tenants} --cases {a.cases} --repeats {a.repeats} "
                               f"--label {a.label}" + (" --publish" if a.publish else ""),
                    "note": a.note, "cpus": os.cpu_count(), "at": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "load_avg_1m": round(os.getloadavg()[0], 2), "cpu_calibration_us": _calibrate(),
                    "results": rows}
    summarize(doc)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if not isinstance(v, dict) or "results" not in v}, indent=2))


def _wipe(r) -> None:
    """Delete every key of the bench's DB (the embedded Redis refuses FLUSHDB)."""
    keys = list(r.scan_iter(count=1000))
    for i in range(0, len(keys), 1000):
        r.delete(*keys[i:i + 1000])


if __name__ == "__main__":
    main()

