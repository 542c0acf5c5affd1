"""The store's side of the scheduler tick: Lua scripts, the `TickOps` methods of `Store`, decoders.

Part of the store layer (key names come from marlaas/store/keys.py; nothing outside the store layer
calls these scripts). Work items are named `kind|job|idx` (store_keys.item_name).

The scheduling table `m:sched:jobs` (hash job -> "status\\tversion\\tdispatched\\tpass\\tcreated") mirrors
those five fields of every job in `m:jobs:active`, so that a tick reads all jobs with one HGETALL
or, better, only the rows changed since its last read: the change log `m:sched:changes` (zset job
-> sequence number of its row's last change) and the epoch `m:sched:epoch` let a process keep a copy
of the table (marlaas/control/memory.py). Invariant: every write of those fields (create_job, set_status,
advance_dispatched, advance_pass, publish, the tick's own writes) re-derives the job's row from its
hash in the same atomic step (`sync_row` below: row present iff the job is active; a row that comes
out different gets the next sequence number). TICK_STATE rebuilds the table, with a new epoch, when
its size differs from the active set's (a deployment written before the table existed, or a job
removed from the set by hand), and starts a new epoch when the epoch key is missing (flushed DB).
A write that bypasses the store (a raw HSET of those fields) is not seen by the tick until the job's
next write through the store.

Why scripts: redis-py's packing and parsing of each command or reply element costs tens of
microseconds in Python, so the per-job reads happen inside Redis and replies are single strings
(rows joined by newlines, fields by tabs). A tick is five round trips: lock, TICK_STATE, TICK_DETAILS
(only when the trainer lane is free or the generate station has room), TICK_WRITE, unlock.
  TICK_STATE   clears the kick flag; the table's rows changed since the caller's sequence number (all
               of them when the caller's epoch is not the current one); the expired leases; the generate
               batches in flight
               (expired ones dropped); the trainer lease; the live workers (registry members whose
               heartbeat key still exists; dead names are pruned).
  TICK_DETAILS the trainer's pick: the first candidate (the caller orders them by pass, then id) whose
               next step's groups are all verified; then, per job in order, which of the evaluations
               asked about are done / leased / needed, stopping once the needed ones' rows exceed a
               budget (the generate capacity left: nothing past it could be dispatched this tick).
  TICK_WRITE   leases (re-leases of expired items need no index entry: their family was indexed when
               first leased), new leases with their per-job index, the generate batches, dispatch
               counters, the trainer lease and the picked job's pass; re-syncs the changed rows.
"""

from __future__ import annotations

import json
import time

from marlaas.store.keys import (
    ACTIVE,
    EVAL_KINDS,
    GEN_INFLIGHT,
    GROUP_KINDS,
    KICK,
    LEASES,
    SCHED_CHANGES,
    SCHED_EPOCH,
    SCHED_JOBS,
    TRAINER,
    VT,
    WORKERS,
    evals_key,
    job_key,
    lease_index_key,
    verified_key,
    worker_key,
)
from marlaas.store.scripts import DROP_JOB_LEASES, SYNC_ROWS, TICK_DETAILS, TICK_STATE, TICK_WRITE, WORKERS_SCRIPT


def split_key(key_fn) -> tuple[str, str]:
    """The prefix and suffix a key function puts around a job id: `f"m:job:{j}:verified"` ->
    ("m:job:", ":verified"), so that scripts can build per-job keys without spelling them."""
    pre, _, post = key_fn("\0").partition("\0")
    return pre, post


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def decode_pairs(flat: list) -> dict[str, dict]:
    """[name, json, name, json, ...] -> {name: decoded json}."""
    return {_s(flat[i]): json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}


class TickOps:
    """The scheduler tick's store methods (mixed into marlaas.store.Store)."""

    def _init_tick_scripts(self) -> None:
        self._sync_rows = self.r.register_script(SYNC_ROWS)
        self._tick_state = self.r.register_script(TICK_STATE)
        self._tick_details = self.r.register_script(TICK_DETAILS)
        self._tick_write = self.r.register_script(TICK_WRITE)
        self._workers = self.r.register_script(WORKERS_SCRIPT)
        self._drop_leases = self.r.register_script(DROP_JOB_LEASES)

    def sync_rows(self, jids: list[str], pipe=None) -> None:
        """Re-derive these jobs' rows of the scheduling table from their hashes (with `pipe`, only
        queue it there, to run atomically with the writes before it)."""
        if jids:
            self._sync_rows(keys=[SCHED_JOBS, ACTIVE, SCHED_CHANGES], args=[job_key(""), *jids], client=pipe or self.r)

    def drop_job_leases(self, jid: str, pipe=None) -> None:
        """Drop every lease of the job through its lease index, not a walk over every lease."""
        self._drop_leases(keys=[LEASES, lease_index_key(jid)], args=[" ".join(GROUP_KINDS), " ".join(EVAL_KINDS)],
                          client=pipe or self.r)

    # ---------------------------------------------------------------- workers
    def heartbeat(self, name: str, station: str, ttl: float = 30.0, **info) -> None:
        """A worker is alive while its heartbeat key lives (Redis TTL, the server's clock); the
        registry set lets readers find the workers without scanning the keyspace."""
        p = self.r.pipeline(transaction=False)
        p.set(worker_key(name), json.dumps({"station": station, "at": time.time(), **info}), px=int(ttl * 1000))
        p.sadd(WORKERS, name)
        p.execute()

    def workers(self) -> dict[str, dict]:
        """Live workers {name: info}: registry members whose heartbeat has not expired."""
        return decode_pairs(self._workers(keys=[WORKERS], args=[worker_key("")]))

    # ---------------------------------------------------------------- the tick's reads and writes
    def tick_state(self, now: float, epoch: str = "", seq: str = "0") -> dict:
        """One round trip (also clears the kick flag): 'epoch' and 'seq' to pass next time; 'full'
        (every row is here: the epoch passed is not the current one); 'rows', "job\\trow" strings
        (row = "status\\tversion\\tdispatched\\tpass\\tcreated", '' once the job left the active set)
        changed after `seq`, or all; 'expired' item names; 'gen_inflight'; 'trainer' lease (dict or
        None); live 'workers' {name: info}."""
        ep, sq, rows, expired, inflight, trainer, workers = self._tick_state(
            keys=[SCHED_JOBS, ACTIVE, SCHED_CHANGES, SCHED_EPOCH, LEASES, GEN_INFLIGHT, TRAINER, WORKERS, KICK],
            args=[repr(now), job_key(""), worker_key(""), epoch, seq])
        ep, rows, expired, workers = _s(ep), _s(rows), _s(expired), _s(workers)
        return {
            "epoch": ep,
            "seq": _s(sq),
            "full": ep != epoch,
            "rows": rows.split("\n") if rows else [],
            "expired": expired.split("\n") if expired else [],
            "gen_inflight": int(inflight),
            "trainer": json.loads(trainer) if trainer else None,
            "workers": {n: json.loads(w) for n, _, w in (x.partition("\t") for x in workers.split("\n"))}
            if workers else {},
        }

    def tick_details(self, trainer_lines: list[str], budget: int,
                     eval_lines: list[str]) -> tuple[str | None, list[str]]:
        """One round trip: the first trainer candidate ("job g0 n", in the caller's order) whose groups
        are all verified (None if none), and per eval line ("job rows v1 v2 ..") its flags ('d' done,
        '0' leased, '1' needed per version), for a prefix of the lines: answering stops once the
        needed evaluations' rows exceed `budget`."""
        if not trainer_lines and not eval_lines:
            return None, []
        vpre, vpost = split_key(verified_key)
        pick, words = self._tick_details(keys=[LEASES], args=[vpre, vpost, split_key(evals_key)[1],
                                                              "\n".join(trainer_lines), budget, "\n".join(eval_lines)])
        pick, words = _s(pick), _s(words)
        return (pick or None), (words.split(" ") if words else [])

    def tick_write(self, relet: list[str], new: list[str], seconds: float, gen_batches: list[str],
                   dispatched: dict[str, int], train: tuple | None = None) -> str | None:
        """One atomic script call for a tick's writes: leases until now + seconds (`new` ones also
        indexed per job), the generate batches in flight, the jobs' dispatch counters and, with
        `train` = (job, version, weight, lease seconds[, tinker]), the trainer lane (SET NX) and, iff
        taken, the job's pass += 1 / weight (the virtual time becomes its old pass if that is later;
        it never moves back). A Tinker model (`tinker` true) is first lifted to the virtual time: it
        earns no credit while it has nothing queued. Returns the trainer lease's token, or None."""
        if not (relet or new or gen_batches or dispatched or train):
            return None
        ipre, ipost = split_key(lease_index_key)
        token, tj, val, ttl, inc, lift = None, "", "", 0, 0.0, ""
        if train is not None:
            import uuid

            tj, version, weight, lease_s, *tinker = train
            lift = "1" if tinker and tinker[0] else ""
            token = uuid.uuid4().hex
            val = json.dumps({"token": token, "job": tj, "version": version, "since": time.time()})
            ttl, inc = int(lease_s * 1000), 1.0 / weight
        took = self._tick_write(
            keys=[LEASES, GEN_INFLIGHT, SCHED_JOBS, ACTIVE, TRAINER, VT, SCHED_CHANGES],
            args=[repr(time.time() + seconds), ipre, ipost, "\n".join(relet), "\n".join(new), "\n".join(gen_batches),
                  "\n".join(f"{j} {n}" for j, n in dispatched.items()), tj, val, ttl, repr(inc), lift],
        )
        return token if took else None

    def record_dispatch(self, leases: list[str], seconds: float, gen_batches: list[str],
                        dispatched: dict[str, int]) -> None:
        """`tick_write` without the trainer, every lease indexed."""
        self.tick_write([], leases, seconds, gen_batches, dispatched)

    def advance_pass(self, jid: str, weight: float) -> None:
        """Charge the job one trainer step; the virtual time becomes the pass it was picked at, if later."""
        p = self.r.pipeline(transaction=True)
        p.hget(job_key(jid), "pass")
        p.get(VT)
        p.hincrbyfloat(job_key(jid), "pass", 1.0 / weight)
        self.sync_rows([jid], pipe=p)
        old, vt = p.execute()[:2]
        if float(old or 0.0) > float(vt or 0.0):
            self.r.set(VT, old)

    def charge_lane(self, lane_id: str, amount: float) -> None:
        """Add `amount` to a Tinker model's trainer-lane pass (what its grant owed beyond one step:
        `scheduler.grant_extra_charge`)."""
        if amount > 0:
            self.r.hincrbyfloat(job_key(lane_id), "pass", amount)

    def lane_passes(self, ids: list[str]) -> dict[str, float]:
        """The trainer-lane pass of each Tinker model id (the pass the tick charges it, kept under its id
        like a job's), never earlier than the virtual time: a model that had nothing queued comes back
        at the virtual time (one never charged starts there)."""
        p = self.r.pipeline(transaction=False)
        p.get(VT)
        for i in ids:
            p.hget(job_key(i), "pass")
        vt, *passes = p.execute()
        start = float(vt or 0.0)
        return {i: max(float(x), start) if x is not None else start for i, x in zip(ids, passes)}

    def virtual_time(self) -> float:
        """The trainer lane's virtual time: the pass of the job it was last given to."""
        return float(self.r.get(VT) or 0.0)
