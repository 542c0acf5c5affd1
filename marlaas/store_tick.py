"""The store's side of the scheduler tick: Lua scripts, the `TickOps` methods of `Store`, decoders.

Part of the store layer (key names come from marlaas/store_keys.py; nothing outside the store layer
calls these scripts). Work items are named `kind|job|idx` (store_keys.item_name).

The scheduling table `m:sched:jobs` (hash job -> "status\\tversion\\tdispatched\\tpass\\tcreated") mirrors
those five fields of every job in `m:jobs:active`, so that a tick reads all jobs with one HGETALL
or, better, only the rows changed since its last read: the change log `m:sched:changes` (zset job
-> sequence number of its row's last change) and the epoch `m:sched:epoch` let a process keep a copy
of the table (marlaas/dispatch.py). Invariant: every write of those fields (create_job, set_status,
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

from marlaas.store_keys import (
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

# Re-derive job j's row of the scheduling table from its hash (prepended to every script that
# writes status, version, dispatched or pass). tbl, active, chg: the table, the active set and the
# change log (zset job -> sequence number of its row's last change; the next number is the highest
# score + 1). A row that comes out the same is no change.
SYNC_FN = """
local function sync_row(tbl, active, chg, jkey, j)
  local row = false
  if redis.call('SISMEMBER', active, j) == 1 then
    local v = redis.call('HMGET', jkey, 'status', 'version', 'dispatched', 'pass', 'created')
    row = (v[1] or '') .. '\\t' .. (v[2] or '') .. '\\t' .. (v[3] or '') .. '\\t' .. (v[4] or '') .. '\\t'
          .. (v[5] or '')
  end
  if redis.call('HGET', tbl, j) == row then return end
  if row then redis.call('HSET', tbl, j, row) else redis.call('HDEL', tbl, j) end
  local top = redis.call('ZREVRANGE', chg, 0, 0, 'WITHSCORES')
  redis.call('ZADD', chg, (tonumber(top[2]) or 0) + 1, j)
end
"""

SYNC_ROWS = SYNC_FN + """
-- KEYS: table, active set, change log ; ARGV: job key prefix, job ids...
for i = 2, #ARGV do sync_row(KEYS[1], KEYS[2], KEYS[3], ARGV[1] .. ARGV[i], ARGV[i]) end
return 1
"""

TICK_STATE = SYNC_FN + """
-- KEYS: table, active set, change log, epoch, leases zset, gen in-flight zset, trainer lease,
--       workers set, kick flag
-- ARGV: now, job key prefix, worker key prefix, the caller's epoch, the caller's sequence number
-- Rows come back as "job\\trow" lines (row '' = no longer active): all of them when the caller's
-- epoch is not the current one, else those changed after the caller's sequence number. A new epoch
-- starts when the epoch key is missing (a new or flushed database) or the table is rebuilt (its size
-- differs from the active set's).
redis.call('DEL', KEYS[9])
local epoch = redis.call('GET', KEYS[4])
if redis.call('SCARD', KEYS[2]) ~= redis.call('HLEN', KEYS[1]) then
  redis.call('DEL', KEYS[1], KEYS[3])
  for _, j in ipairs(redis.call('SMEMBERS', KEYS[2])) do sync_row(KEYS[1], KEYS[2], KEYS[3], ARGV[2] .. j, j) end
  epoch = false
end
if not epoch then
  local t = redis.call('TIME')
  epoch = t[1] .. '.' .. t[2]
  redis.call('SET', KEYS[4], epoch)
end
local top = redis.call('ZREVRANGE', KEYS[3], 0, 0, 'WITHSCORES')
local seq = top[2] or '0'
local rows = {}
if epoch ~= ARGV[4] then
  local t = redis.call('HGETALL', KEYS[1])
  for i = 1, #t, 2 do rows[#rows + 1] = t[i] .. '\\t' .. t[i + 1] end
else
  local js = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. ARGV[5], '+inf')
  for i = 1, #js, 1000 do
    local part = {unpack(js, i, math.min(i + 999, #js))}
    local v = redis.call('HMGET', KEYS[1], unpack(part))
    for k = 1, #part do rows[#rows + 1] = part[k] .. '\\t' .. (v[k] or '') end
  end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', ARGV[1])
local inflight = redis.call('ZCARD', KEYS[6])
local trainer = redis.call('GET', KEYS[7]) or ''
local workers = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[8])) do
  local w = redis.call('GET', ARGV[3] .. name)
  if w then
    workers[#workers + 1] = name .. '\\t' .. w
  else
    redis.call('SREM', KEYS[8], name)
  end
end
return {epoch, seq, table.concat(rows, '\\n'), table.concat(expired, '\\n'), inflight, trainer,
        table.concat(workers, '\\n')}
"""

TICK_DETAILS = """
-- KEYS: leases zset ; ARGV: job key prefix, verified suffix, evals suffix,
--   trainer candidates in pick order, one "job first_group n_groups" a line,
--   row budget, eval asks in job order, one "job rows_per_eval v1 v2 ..." a line.
-- Returns {picked job or '', words}: one word per eval line answered, a character per version:
-- 'd' done (result stored), '0' leased (eval or evalver), '1' needed; stops after the line whose
-- needed rows bring the total past the budget.
local pick = ''
for j, g0, n in string.gmatch(ARGV[4], '(%S+) (%d+) (%d+)') do
  local gs = {}
  for g = tonumber(g0), tonumber(g0) + tonumber(n) - 1 do gs[#gs + 1] = g end
  local got = redis.call('SMISMEMBER', ARGV[1] .. j .. ARGV[2], unpack(gs))
  local all = true
  for _, x in ipairs(got) do if x == 0 then all = false break end end
  if all then pick = j break end
end
local budget, used, out = tonumber(ARGV[5]), 0, {}
for line in string.gmatch(ARGV[6], '[^\\n]+') do
  if used > budget then break end
  local f = {}
  for w in string.gmatch(line, '%S+') do f[#f + 1] = w end
  local j, rows, vs, names = f[1], tonumber(f[2]), {}, {}
  for k = 3, #f do
    vs[#vs + 1] = f[k]
    names[#names + 1] = 'eval|' .. j .. '|' .. f[k]
    names[#names + 1] = 'evalver|' .. j .. '|' .. f[k]
  end
  local done = redis.call('HMGET', ARGV[1] .. j .. ARGV[3], unpack(vs))
  local leased = redis.call('ZMSCORE', KEYS[1], unpack(names))
  local word = {}
  for k = 1, #vs do
    if done[k] then
      word[k] = 'd'
    elseif leased[2 * k - 1] or leased[2 * k] then
      word[k] = '0'
    else
      word[k] = '1'
      used = used + rows
    end
  end
  out[#out + 1] = table.concat(word)
end
return {pick, table.concat(out, ' ')}
"""

TICK_WRITE = SYNC_FN + """
-- KEYS: leases, gen in-flight, table, active set, trainer lease, virtual time, change log
-- ARGV: deadline, job key prefix, index suffix, re-leased items (a line each), new items (a line
--   each: indexed per job too), batch ids (a line each), "job total" lines (dispatch counters),
--   train job ('' = none), trainer lease value, its ttl ms, pass increment (1 / weight)
-- Returns 1 iff the trainer lease was taken.
local sync, zargs, n, deadline = {}, {}, 0, ARGV[1]
for _, a in ipairs({ARGV[4], ARGV[5]}) do
  for item in string.gmatch(a, '[^\\n]+') do
    zargs[n + 1] = deadline
    zargs[n + 2] = item
    n = n + 2
  end
end
for b in string.gmatch(ARGV[6], '[^\\n]+') do redis.call('ZADD', KEYS[2], deadline, b) end
for i = 1, n, 4000 do redis.call('ZADD', KEYS[1], unpack(zargs, i, math.min(i + 3999, n))) end
local byjob = {}
for item in string.gmatch(ARGV[5], '[^\\n]+') do
  local j = string.match(item, '^[^|]+|([^|]+)|')
  byjob[j] = byjob[j] or {}
  table.insert(byjob[j], item)
end
for j, names in pairs(byjob) do redis.call('SADD', ARGV[2] .. j .. ARGV[3], unpack(names)) end
for j, n in string.gmatch(ARGV[7], '(%S+) (%S+)') do
  redis.call('HSET', ARGV[2] .. j, 'dispatched', n)
  sync[j] = true
end
local took = 0
if ARGV[8] ~= '' then
  if redis.call('SET', KEYS[5], ARGV[9], 'NX', 'PX', ARGV[10]) then
    took = 1
    local jkey = ARGV[2] .. ARGV[8]
    local old = redis.call('HGET', jkey, 'pass') or '0'
    redis.call('HINCRBYFLOAT', jkey, 'pass', ARGV[11])
    redis.call('SET', KEYS[6], old)  -- the virtual time: the pass the job was picked at
    sync[ARGV[8]] = true
  end
end
for j, _ in pairs(sync) do sync_row(KEYS[3], KEYS[4], KEYS[7], ARGV[2] .. j, j) end
return took
"""

WORKERS_SCRIPT = """
-- KEYS: workers set ; ARGV: worker key prefix. Live workers as [name, json, ...]; prunes dead names.
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local w = redis.call('GET', ARGV[1] .. name)
  if w then
    out[#out + 1] = name
    out[#out + 1] = w
  else
    redis.call('SREM', KEYS[1], name)
  end
end
return out
"""

DROP_JOB_LEASES = """
-- KEYS: leases zset, the job's lease index set ; ARGV: group kinds, eval kinds (space-separated).
-- Drops every lease of the job: each indexed item `kind|job|idx` with every kind of its family, so a
-- stage leased by a writer that does not index (e.g. a continuation) goes too. Absent members are
-- no-ops, so the index may be a superset of the live leases.
local fam = {}
for _, a in ipairs({ARGV[1], ARGV[2]}) do
  local kinds = {}
  for k in string.gmatch(a, '%S+') do kinds[#kinds + 1] = k end
  for _, k in ipairs(kinds) do fam[k] = kinds end
end
local names, n = {}, 0
for _, item in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local kind, rest = string.match(item, '^([^|]+)(|.*)$')
  for _, k in ipairs(fam[kind] or {kind}) do names[#names + 1] = k .. rest end
end
for i = 1, #names, 1000 do
  n = n + redis.call('ZREM', KEYS[1], unpack(names, i, math.min(i + 999, #names)))
end
redis.call('DEL', KEYS[2])
return n
"""


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
                   dispatched: dict[str, int], train: tuple[str, int, float, float] | None = None) -> str | None:
        """One atomic script call for a tick's writes: leases until now + seconds (`new` ones also
        indexed per job), the generate batches in flight, the jobs' dispatch counters and, with
        `train` = (job, version, weight, lease seconds), the trainer lane (SET NX) and, iff taken, the
        job's pass += 1 / weight (the virtual time becomes its old pass). Returns the trainer lease's
        token, or None."""
        if not (relet or new or gen_batches or dispatched or train):
            return None
        ipre, ipost = split_key(lease_index_key)
        token, tj, val, ttl, inc = None, "", "", 0, 0.0
        if train is not None:
            import uuid

            tj, version, weight, lease_s = train
            token = uuid.uuid4().hex
            val = json.dumps({"token": token, "job": tj, "version": version, "since": time.time()})
            ttl, inc = int(lease_s * 1000), 1.0 / weight
        took = self._tick_write(
            keys=[LEASES, GEN_INFLIGHT, SCHED_JOBS, ACTIVE, TRAINER, VT, SCHED_CHANGES],
            args=[repr(time.time() + seconds), ipre, ipost, "\n".join(relet), "\n".join(new), "\n".join(gen_batches),
                  "\n".join(f"{j} {n}" for j, n in dispatched.items()), tj, val, ttl, repr(inc)],
        )
        return token if took else None

    def record_dispatch(self, leases: list[str], seconds: float, gen_batches: list[str],
                        dispatched: dict[str, int]) -> None:
        """`tick_write` without the trainer, every lease indexed."""
        self.tick_write([], leases, seconds, gen_batches, dispatched)

    def advance_pass(self, jid: str, weight: float) -> None:
        """Charge the job one trainer step; the virtual time is the pass it was picked at."""
        p = self.r.pipeline(transaction=True)
        p.hget(job_key(jid), "pass")
        p.hincrbyfloat(job_key(jid), "pass", 1.0 / weight)
        self.sync_rows([jid], pipe=p)
        old = p.execute()[0]
        self.r.set(VT, old or b"0")
