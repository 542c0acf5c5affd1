"""Every Lua script of the store, each with its KEYS/ARGV contract in its first lines.

Part of the store layer: only marlaas/store/ registers and calls them. Work items are named
`kind|job|idx` (marlaas.types.item_name). Scripts that write a job's status, version, dispatched or
pass end with `sync_row` (SYNC_FN), which keeps the scheduling table in step (see tick.py).

The only ordering rule a script relies on: TICK_DETAILS takes the trainer candidates in the order
the caller passes them, which is `marlaas.control.scheduler.trainer_order` (the same key as the
policy's own choice, `choose_trainer`); it picks the first one whose next step is fully verified.
"""

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
--   train job ('' = none), trainer lease value, its ttl ms, pass increment (1 / weight), '1' when
--   the pick is a Tinker model (its pass is lifted to the virtual time first)
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
    local vt = tonumber(redis.call('GET', KEYS[6]) or '0') or 0
    local old = tonumber(redis.call('HGET', jkey, 'pass') or '0') or 0
    if ARGV[12] == '1' and old < vt then
      -- a Tinker model (it leaves the lane whenever its queue is empty) comes back at the virtual
      -- time: no credit for the time it had nothing queued
      old = vt
      redis.call('HSET', jkey, 'pass', tostring(vt))
    end
    redis.call('HINCRBYFLOAT', jkey, 'pass', ARGV[11])
    -- the virtual time: the pass the pick had, never moving back
    if old > vt then redis.call('SET', KEYS[6], tostring(old)) end
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


PUBLISH = SYNC_FN + """
-- KEYS: job, adapter(v+1), optim, trainer lease, verified, metrics, old adapter (or ''),
--       scheduling table, active set, its change log, kept versions
-- ARGV: t, config, weights ref, optim ref, metrics json, lease token, now, n_groups, g1..gn, job id
-- Returns {0} when the job is not at version t, else {1, the old adapter's ref, the previous optim ref}
-- (the references this publish replaced; '' when none).
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1')
if cur ~= tonumber(ARGV[1]) then return {0} end
local nv = cur + 1
redis.call('HSET', KEYS[1], 'version', nv, 'updated', ARGV[7])
redis.call('HSET', KEYS[2], 'config', ARGV[2], 'ref', ARGV[3])
redis.call('ZADD', KEYS[11], nv, nv)
local old_optim = redis.call('HGET', KEYS[3], 'ref') or ''
redis.call('HSET', KEYS[3], 'version', nv, 'ref', ARGV[4])
redis.call('RPUSH', KEYS[6], ARGV[5])
local n = tonumber(ARGV[8])
for i = 1, n do
  local g = ARGV[8 + i]
  redis.call('SREM', KEYS[5], g)
  redis.call('DEL', KEYS[1] .. ':roll:' .. g)
end
local old_adapter = ''
if KEYS[7] ~= '' then
  old_adapter = redis.call('HGET', KEYS[7], 'ref') or ''
  redis.call('DEL', KEYS[7])
  redis.call('ZREM', KEYS[11], string.match(KEYS[7], ':(%d+)$'))
end
local lease = redis.call('GET', KEYS[4])
if lease and string.find(lease, ARGV[6], 1, true) then redis.call('DEL', KEYS[4]) end
sync_row(KEYS[8], KEYS[9], KEYS[10], KEYS[1], ARGV[9 + n])
return {1, old_adapter, old_optim}
"""

ACCEPT_REWARDS = """
-- KEYS: roll hash, verified set, leases ; ARGV: attempt, rewards json, g, lease member
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'r_attempt', ARGV[1], 'rewards', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[4])
return 1
"""

REPLACE_ATTEMPT = """
-- Multi-turn tool episodes: replace a group's data under a new attempt iff it is still at the
-- attempt the caller read (and, if ARGV[4] is set, its cont flag equals it); move its lease.
-- KEYS: roll hash, leases ; ARGV: read attempt, new attempt, data, required cont ('' = any),
--       new cont ('1' or ''), lease to drop, lease to add, its deadline
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'cont') ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], 'attempt', ARGV[2], 'data', ARGV[3])
redis.call('HDEL', KEYS[1], 'r_attempt', 'rewards')
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'cont', '1') else redis.call('HDEL', KEYS[1], 'cont') end
redis.call('ZREM', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[8], ARGV[7])
return 1
"""

DROP_CONT = """
-- KEYS: roll hash, leases ; ARGV: cont lease. Drop it iff the group awaits no continuation.
if redis.call('HGET', KEYS[1], 'cont') == '1' then return 0 end
return redis.call('ZREM', KEYS[2], ARGV[1])
"""

CLAIM = """
-- KEYS: trainer lease ; ARGV: token, worker. Adds the worker to the lease, keeping its TTL.
local v = redis.call('GET', KEYS[1])
if not v or not string.find(v, ARGV[1], 1, true) then return 0 end
local d = cjson.decode(v)
d['worker'] = ARGV[2]
redis.call('SET', KEYS[1], cjson.encode(d), 'KEEPTTL')
return 1
"""

RELEASE = """
local v = redis.call('GET', KEYS[1])
if v and string.find(v, ARGV[1], 1, true) then return redis.call('DEL', KEYS[1]) end
return 0
"""


LIST_AFTER = """
-- KEYS[1] a list of JSON objects in ascending order of the number ARGV[2] names; returns the (at most
-- ARGV[3]) elements after the first whose ARGV[2] > ARGV[1]: a binary search of LINDEX reads, so one
-- page costs O(log n + page), not the whole list.
local n = redis.call('LLEN', KEYS[1])
local lo, hi, since = 0, n, tonumber(ARGV[1])
while lo < hi do
  local mid = math.floor((lo + hi) / 2)
  local v = cjson.decode(redis.call('LINDEX', KEYS[1], mid))[ARGV[2]]
  if type(v) == 'number' and v > since then hi = mid else lo = mid + 1 end
end
if lo >= n then return {} end
return redis.call('LRANGE', KEYS[1], lo, lo + tonumber(ARGV[3]) - 1)
"""
