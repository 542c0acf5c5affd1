"""The store's work in flight: leases, generate batches, rollouts and their attempts, evaluations."""

from __future__ import annotations

import json
import time
import uuid

from marlaas.store.keys import (
    GEN_INFLIGHT,
    LEASES,
    adapter_key,
    eval_key,
    eval_times_key,
    evals_key,
    job_key,
    lease_index_key,
    parse_item,
    roll_key,
    verified_key,
)
from marlaas.types import AdapterRef, ItemKind, Rollout, WorkItem


class WorkOps:
    """Leases, rollouts, continuations and evaluations (mixed into marlaas.store.Store)."""

    # ---------------------------------------------------------------- leases and dispatch
    def lease(self, items: list[str], seconds: float, now: float | None = None, pipe=None) -> None:
        """Lease work items until now + seconds (recorded in each job's lease index too); with
        `pipe`, only queue the writes on that pipeline."""
        if items:
            until = (now or time.time()) + seconds
            p = pipe if pipe is not None else self.r.pipeline(transaction=False)
            p.zadd(LEASES, {i: until for i in items})
            by_job: dict[str, list[str]] = {}
            for i in items:
                by_job.setdefault(parse_item(i)[1], []).append(i)
            for j, names in by_job.items():
                p.sadd(lease_index_key(j), *names)
            if pipe is None:
                p.execute()

    def expired_leases(self, now: float) -> list[str]:
        return [x.decode() for x in self.r.zrangebyscore(LEASES, "-inf", now)]

    def leased(self, items: list[str]) -> list[bool]:
        if not items:
            return []
        return [s is not None for s in self.r.zmscore(LEASES, items)]

    def drop_lease(self, *items: str) -> None:
        if items:
            self.r.zrem(LEASES, *items)

    def gen_inflight(self, now: float) -> int:
        self.r.zremrangebyscore(GEN_INFLIGHT, "-inf", now)
        return int(self.r.zcard(GEN_INFLIGHT))

    def add_gen_batch(self, batch_id: str, seconds: float) -> None:
        self.r.zadd(GEN_INFLIGHT, {batch_id: time.time() + seconds})

    def end_gen_batch(self, batch_id: str) -> None:
        self.r.zrem(GEN_INFLIGHT, batch_id)

    def advance_dispatched(self, jid: str, new_total: int) -> None:
        p = self.r.pipeline(transaction=True)
        p.hset(job_key(jid), "dispatched", new_total)
        self.sync_rows([jid], pipe=p)
        p.execute()

    # ---------------------------------------------------------------- rollouts
    def _put_attempt(self, key: str, version: int, data: dict, done: WorkItem, next_item: WorkItem, *extra) -> str:
        """Store a (re)generated result under a fresh attempt id: its lease moves from generation
        (`done`) to verification (`next_lease`); `extra` are more pipeline calls to run atomically."""
        attempt = uuid.uuid4().hex
        p = self.r.pipeline(transaction=True)
        p.delete(key)
        p.hset(key, mapping={"attempt": attempt, "version": version, "data": _group_json(data)})
        for method, *args in extra:
            getattr(p, method)(*args)
        p.zrem(LEASES, done.name)
        p.zadd(LEASES, {next_item.name: time.time() + self.lease_s})
        p.sadd(lease_index_key(next_item.job), next_item.name)
        p.execute()
        return attempt

    def put_rollout(self, jid: str, g: int, version: int, data: dict) -> str:
        """Store a (re)generated group; invalidates rewards of any earlier attempt. Returns the attempt id."""
        return self._put_attempt(roll_key(jid, g), version, data, WorkItem(ItemKind.GEN, jid, g),
                                 WorkItem(ItemKind.VER, jid, g), ("srem", verified_key(jid), g))

    def rollout(self, jid: str, g: int) -> Rollout | None:
        h = self.r.hgetall(roll_key(jid, g))
        if not h:
            return None
        d = {k.decode(): v for k, v in h.items()}
        out = json.loads(d["data"])
        out["attempt"] = d["attempt"].decode()
        out["version"] = int(d["version"])
        if b"rewards" in h and d.get("r_attempt") == d["attempt"]:
            out["rewards"] = json.loads(d["rewards"])
        out["awaiting_cont"] = d.get("cont") == b"1"
        if "row" not in out and "row_idx" in out:  # stored by reference: the job's row, read once here
            out["row"] = self.row(jid, "train", out["row_idx"])
        return out

    # Tool episodes (marlaas.tools.agentic): verify hands a group back to generate for its next model turn
    # ("cont" item, dispatched by the scheduler as an expired lease: deadline 0), generate stores the
    # continued group and hands it to verify again. Both are compare-and-set on the attempt read.
    def request_continuation(self, jid: str, g: int, attempt: str, data: dict) -> bool:
        """Verify side: store the group with its tool results pending; lease ver -> cont (due now)."""
        return bool(self._replace(
            keys=[roll_key(jid, g), LEASES],
            args=[attempt, uuid.uuid4().hex, _group_json(data), "", "1", WorkItem(ItemKind.VER, jid, g).name,
                  WorkItem(ItemKind.CONT, jid, g).name, 0],
        ))

    def put_continuation(self, jid: str, g: int, attempt: str, data: dict) -> bool:
        """Generate side: store the continued group iff it still awaits this continuation; lease
        cont -> ver. False: a duplicate or stale continuation (nothing written)."""
        return bool(self._replace(
            keys=[roll_key(jid, g), LEASES],
            args=[attempt, uuid.uuid4().hex, _group_json(data), "1", "", WorkItem(ItemKind.CONT, jid, g).name,
                  WorkItem(ItemKind.VER, jid, g).name, time.time() + self.lease_s],
        ))

    def drop_cont_lease(self, jid: str, g: int) -> bool:
        """Drop a continuation's lease iff the group awaits none (a late duplicate or a regenerated
        group); atomic, so a continuation requested meanwhile is never lost."""
        return bool(self._drop_cont(keys=[roll_key(jid, g), LEASES], args=[WorkItem(ItemKind.CONT, jid, g).name]))

    def has_adapter(self, ref: AdapterRef) -> bool:
        return ref.version == 0 or bool(self.r.exists(adapter_key(ref.job_id, ref.version)))

    def accept_rewards(self, jid: str, g: int, attempt: str, rewards: dict) -> bool:
        ok = self._accept(
            keys=[roll_key(jid, g), verified_key(jid), LEASES],
            args=[attempt, json.dumps(rewards), g, WorkItem(ItemKind.VER, jid, g).name],
        )
        return bool(ok)

    def verified(self, jid: str, groups: list[int]) -> list[bool]:
        if not groups:
            return []
        return [bool(x) for x in self.r.smismember(verified_key(jid), groups)]

    def invalidate_group(self, jid: str, g: int) -> None:
        """Throw a group away so that it is generated again (counted as regenerated)."""
        p = self.r.pipeline(transaction=True)
        p.delete(roll_key(jid, g))
        p.srem(verified_key(jid), g)
        p.zrem(LEASES, WorkItem(ItemKind.CONT, jid, g).name)
        p.zadd(LEASES, {WorkItem(ItemKind.GEN, jid, g).name: 0})
        p.sadd(lease_index_key(jid), WorkItem(ItemKind.GEN, jid, g).name)
        p.hincrby(job_key(jid), "regenerated", 1)
        p.execute()

    # ---------------------------------------------------------------- evaluation
    def put_eval_rollout(self, jid: str, v: int, data: dict) -> str:
        return self._put_attempt(eval_key(jid, v), v, data, WorkItem(ItemKind.EVAL, jid, v),
                                 WorkItem(ItemKind.EVALVER, jid, v))

    def eval_rollout(self, jid: str, v: int) -> dict | None:
        h = self.r.hgetall(eval_key(jid, v))
        if not h:
            return None
        out = json.loads(h[b"data"])
        out["attempt"] = h[b"attempt"].decode()
        return out

    # put_eval_result: marlaas.store.serving (it moves the job's @best in the same script)

    def evals(self, jid: str) -> dict[int, dict]:
        return {int(k): json.loads(v) for k, v in self.r.hgetall(evals_key(jid)).items()}

    def evals_of(self, jid: str, versions: list[int]) -> dict[int, dict]:
        """The stored evaluations of these versions only (absent ones left out): one HMGET."""
        got = self.r.hmget(evals_key(jid), [str(v) for v in versions]) if versions else []
        return {v: json.loads(x) for v, x in zip(versions, got) if x is not None}

    def evals_after(self, jid: str, since: float, count: int) -> list[tuple[int, dict]]:
        """The job's first `count` evaluations stored after time `since`, oldest first, as (version,
        result): its evaluation times are read a page at a time (a zset by `at`) and only those
        evaluations' results, so the cost does not grow with the job's number of evaluations. A job
        evaluated before the times were kept gets them from its results, once."""
        times, after = eval_times_key(jid), f"({since!r}"
        p = self.r.pipeline(transaction=False)  # the page and the back-fill check in one round trip
        p.zcard(times)
        p.hlen(evals_key(jid))
        p.zrangebyscore(times, after, "+inf", start=0, num=count)
        timed, stored, page = p.execute()
        if timed < stored:
            # an evaluation without a time counts as stored at 0, as the timeline always read it; NX: a
            # time written meanwhile by put_eval_result (a newer result) is not set back
            self.r.zadd(times, {str(k): float(ev.get("at") or 0) for k, ev in self.evals(jid).items()}, nx=True)
            page = self.r.zrangebyscore(times, after, "+inf", start=0, num=count)
        if not page:
            return []
        got = self.r.hmget(evals_key(jid), page)
        return [(int(v), json.loads(x)) for v, x in zip(page, got) if x is not None]

    def has_evals(self, jid: str, versions: list[int]) -> list[bool]:
        return [bool(x) for x in self.r.hmget(evals_key(jid), [str(v) for v in versions])]

    # ---------------------------------------------------------------- preflights
    def groups_verified_counts(self, jids: list[str]) -> list[int]:
        """How many groups of each job are verified (one pipelined round trip): a preflight of N
        groups is complete when its count reaches N (its groups are 0..N-1, nothing else)."""
        if not jids:
            return []
        p = self.r.pipeline(transaction=False)
        for j in jids:
            p.scard(verified_key(j))
        return [int(x) for x in p.execute()]

    def group_rewards(self, jid: str, n: int) -> tuple[list[list[float]], int]:
        """(rewards of groups 0..n-1 that have rewards for their current attempt, grader errors
        among them): one pipelined read, without the completions."""
        p = self.r.pipeline(transaction=False)
        for g in range(n):
            p.hmget(roll_key(jid, g), "attempt", "r_attempt", "rewards")
        groups, errors = [], 0
        for attempt, r_attempt, raw in p.execute():
            if raw is None or attempt != r_attempt:
                continue
            d = json.loads(raw)
            groups.append([float(x) for x in d["rewards"]])
            errors += int(d.get("errors") or 0)
        return groups, errors

    def end_preflight(self, jid: str, result: dict) -> bool:
        """Store a preflight's summary (job field `preflight`) and end the job as done, iff it is
        still running (a cancelled or failed one stays so); True if it was ended here."""
        if self.job_fields(jid, "status")[0] != "running":
            return False
        self.r.hset(job_key(jid), "preflight", json.dumps(result))
        self.set_status(jid, "done")
        return True


def _group_json(data: dict) -> str:
    """A group's data as stored: its row by reference (`row_idx` into the job's rows), not copied into
    every rollout and every attempt of it; `Store.rollout` puts the row back."""
    if "row_idx" in data and "row" in data:
        data = {k: v for k, v in data.items() if k != "row"}
    return json.dumps(data)
