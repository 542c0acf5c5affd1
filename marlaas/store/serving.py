"""The store's side of serving: each job's `@best` version (promotion and rollback) and the serving
requests handed back to the sample queue (a mixin of `marlaas.store.Store`).

Key (marlaas/store/keys.py, `# ---- serving`):
  m:job:{j}:best                hash: x:{v} -> held-out `exact` of evaluated version v; auto -> the
                                evaluated version with the highest exact (ties: the later version);
                                pinned -> the version the tenant promoted by hand (absent: none)
  m:tenant:{t}:aliases          hash: alias -> the model name it stands for (resolved at each request,
                                so `prod -> j12@best` follows the promotion); at most MAX_ALIASES

Invariants:
- `@best` is `pinned` when set, else `auto`. Both move in single Lua scripts, so an evaluation written
  while a tenant promotes never interleaves: `put_eval_result` writes the evaluation, drops its lease
  and recomputes `auto` over every recorded exact in one script; `pin_best` checks that the version was
  evaluated and is still stored and pins it in one script.
- `put_eval_result` writes the evaluation, its time in the job's evaluation times (the timeline pages
  by it), drops its lease and moves the promotion, atomically.
- Version 0 (the base model) takes part like any evaluated version: if the base scores best, `@best`
  is the base itself.
"""

from __future__ import annotations

import json

from marlaas.errors import Conflict, NotFound
from marlaas.store.keys import LEASES, adapter_key, aliases_key, best_key, eval_key, eval_times_key, evals_key
from marlaas.store.tinker import PENDING_SAMPLE
from marlaas.types import ItemKind, WorkItem

MAX_ALIASES = 64

# KEYS: aliases ; ARGV: name, model, max. 1 when set, 0 when a new name would pass the max
SET_ALIAS = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# KEYS: evals, eval rollout, leases, best, eval times ; ARGV: version, result JSON, lease name, exact ('' = none),
# at (0 = none)
PUT_EVAL = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[5], ARGV[5], ARGV[1])
if ARGV[4] == '' then return 0 end
redis.call('HSET', KEYS[4], 'x:' .. ARGV[1], ARGV[4])
local flat = redis.call('HGETALL', KEYS[4])
local best_v, best_x = nil, nil
for i = 1, #flat, 2 do
  local f = flat[i]
  if string.sub(f, 1, 2) == 'x:' then
    local v, x = tonumber(string.sub(f, 3)), tonumber(flat[i + 1])
    if best_v == nil or x > best_x or (x == best_x and v > best_v) then best_v, best_x = v, x end
  end
end
redis.call('HSET', KEYS[4], 'auto', best_v)
return 1
"""

# KEYS: best, evals, the version's adapter ; ARGV: version. 1 pinned, -1 not evaluated, -2 not stored.
PIN = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return -1 end
if ARGV[1] ~= '0' and redis.call('EXISTS', KEYS[3]) == 0 then return -2 end
redis.call('HSET', KEYS[1], 'pinned', ARGV[1])
return 1
"""


class ServingOps:
    """Promotion (`@best`), pinning, and handing serving requests back (mixed into marlaas.store.Store)."""

    r: object

    def _script(self, name: str, src: str):
        cached = self.__dict__.get(name)
        if cached is None:
            cached = self.__dict__[name] = self.r.register_script(src)
        return cached

    def put_eval_result(self, jid: str, v: int, result: dict) -> None:
        """Store the held-out evaluation of version v (its lease dropped) and move the job's automatic
        `@best` to the evaluated version with the highest `exact` (ties: the later), in one script."""
        exact, at = result.get("exact"), result.get("at")
        self._script("_put_eval", PUT_EVAL)(
            keys=[evals_key(jid), eval_key(jid, v), LEASES, best_key(jid), eval_times_key(jid)],
            args=[str(v), json.dumps(result), WorkItem(ItemKind.EVALVER, jid, v).name,
                  "" if exact is None else repr(float(exact)), repr(float(at or 0))])

    def best(self, jid: str) -> dict:
        """{"version": @best or None, "auto": the evaluated best or None, "pinned": the pinned version
        or None, "exact": {version: exact} of every evaluated version}."""
        h = {k.decode(): v.decode() for k, v in self.r.hgetall(best_key(jid)).items()}
        auto = int(h["auto"]) if h.get("auto") else None
        pinned = int(h["pinned"]) if h.get("pinned") else None
        exact = {int(k[2:]): float(x) for k, x in h.items() if k.startswith("x:")}
        return {"version": pinned if pinned is not None else auto, "auto": auto, "pinned": pinned,
                "exact": dict(sorted(exact.items()))}

    def best_version(self, jid: str) -> int | None:
        """The job's `@best`: the pinned version if any, else the automatic one (None: none evaluated)."""
        pinned, auto = self.r.hmget(best_key(jid), "pinned", "auto")
        raw = pinned if pinned is not None else auto
        return int(raw) if raw is not None else None

    def pin_best(self, jid: str, v: int) -> None:
        """Pin `@best` to version v (rollback): NotFound unless v was evaluated, Conflict when its
        adapter is no longer stored."""
        got = int(self._script("_pin", PIN)(keys=[best_key(jid), evals_key(jid), adapter_key(jid, v)],
                                            args=[str(int(v))]))
        if got == -1:
            raise NotFound(f"job {jid} has no held-out evaluation of version {v}: only evaluated versions "
                           "can be promoted")
        if got == -2:
            raise Conflict(f"job {jid}'s version {v} is no longer stored: it cannot be promoted")

    def unpin_best(self, jid: str) -> None:
        """Drop the pin: `@best` follows the evaluations again."""
        self.r.hdel(best_key(jid), "pinned")

    # ------------------------------------------------------------ aliases (tenant-defined model names)
    def set_alias(self, tenant: str, name: str, model: str) -> None:
        """Point the tenant's alias `name` at `model` (a model name: validated by the caller); Conflict
        past MAX_ALIASES aliases (replacing one is always allowed)."""
        if self._script("_set_alias", SET_ALIAS)(keys=[aliases_key(tenant)],
                                                  args=[name, model, MAX_ALIASES]) == 0:
            raise Conflict(f"at most {MAX_ALIASES} aliases per tenant: delete one first")

    def alias(self, tenant: str, name: str) -> str | None:
        raw = self.r.hget(aliases_key(tenant), name)
        return raw.decode() if raw is not None else None

    def aliases(self, tenant: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in sorted(self.r.hgetall(aliases_key(tenant)).items())}

    def drop_alias(self, tenant: str, name: str) -> bool:
        return bool(self.r.hdel(aliases_key(tenant), name))

    def requeue_samples(self, rids: list[str]) -> None:
        """Put sample requests a generate batch had no room for back at the FRONT of the sample queue,
        in their order (they go first into the next engine call)."""
        if rids:
            self.r.lpush(PENDING_SAMPLE, *reversed(rids))
