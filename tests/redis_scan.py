"""The check that bytes never ride in Redis: no single value over 1 MiB (a string, a hash field, a list
element, a set or sorted-set member) in a Redis DB. Used by the shared fixtures at the end of every
test that used the scratch DB and at the end of the run for the worker stack's DB, and by tests."""

from __future__ import annotations

MiB = 1 << 20


def big_values(r, limit: int = MiB) -> list[tuple[str, int]]:
    """[(key or key[field/index], bytes)] of every value over `limit` bytes in this DB."""
    out = []
    for key in r.scan_iter(count=1000):
        name = key.decode(errors="replace")
        kind = r.type(key).decode()
        if kind == "string":
            n = r.strlen(key)
            if n > limit:
                out.append((name, n))
        elif kind == "hash":
            for field in r.hkeys(key):
                n = r.hstrlen(key, field)
                if n > limit:
                    out.append((f"{name}[{field.decode(errors='replace')}]", n))
        elif kind == "list":
            for start in range(0, r.llen(key), 256):
                for i, v in enumerate(r.lrange(key, start, start + 255)):
                    if len(v) > limit:
                        out.append((f"{name}[{start + i}]", len(v)))
        elif kind in ("set", "zset"):
            members = r.smembers(key) if kind == "set" else r.zrange(key, 0, -1)
            out += [(name, len(m)) for m in members if len(m) > limit]
    return out
