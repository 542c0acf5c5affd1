"""Station timelines from the event log: busy fractions and idle gaps (pure functions).

Every task records its busy interval (station, start, end). A station's busy time is the length of
the union of its intervals (a pool with several processes counts as busy while any is); its busy
fraction is that over the window's length.
"""

from __future__ import annotations

STATIONS = ("generate", "verify", "train")


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of intervals clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def busy_fractions(events: list[dict], lo: float, hi: float) -> dict[str, float]:
    """Busy fraction of each station over [lo, hi]."""
    span = max(hi - lo, 1e-9)
    return {
        st: round(union_length([(e["start"], e["end"]) for e in events if e["station"] == st], lo, hi) / span, 4)
        for st in STATIONS
    }


def overlap_fraction(events: list[dict], a: str, b: str, lo: float, hi: float) -> float:
    """Fraction of station a's busy time during which station b is busy too (stations overlap)."""
    ia = [(e["start"], e["end"]) for e in events if e["station"] == a]
    ib = [(e["start"], e["end"]) for e in events if e["station"] == b]
    busy_a = union_length(ia, lo, hi)
    if busy_a == 0:
        return 0.0
    both = sum(union_length(ib, max(s, lo), min(e, hi)) for s, e in _merge(ia))
    return round(both / busy_a, 4)


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def idle_gaps(events: list[dict], station: str, lo: float, hi: float) -> list[float]:
    """Lengths of the intervals in [lo, hi] where `station` is idle, between its first start and last
    end (the wait before its first task and after its last are not gaps)."""
    merged = [(max(s, lo), min(e, hi)) for s, e in _merge([(e["start"], e["end"]) for e in events
                                                             if e["station"] == station])]
    merged = [(s, e) for s, e in merged if e > s]
    return [round(b[0] - a[1], 4) for a, b in zip(merged, merged[1:]) if b[0] > a[1]]


def steady_window(events: list[dict], station: str = "train") -> tuple[float, float] | None:
    """The steady state of a multi-job run, for `station`: from its first task's start to the end of
    the first job's last task there (after that fewer jobs are left to feed it); None if the
    station ran nothing. The ramp-up before the first task (nothing to train before the first
    groups are generated and verified) and the tail where jobs finish one by one are left out."""
    ev = [e for e in events if e["station"] == station]
    if not ev:
        return None
    last_per_job: dict[str, float] = {}
    for e in ev:
        for j in e.get("jobs", []):
            last_per_job[j] = max(last_per_job.get(j, e["end"]), e["end"])
    lo = min(e["start"] for e in ev)
    hi = min(last_per_job.values()) if last_per_job else max(e["end"] for e in ev)
    return lo, hi


def steady_busy(events: list[dict], station: str = "train") -> float | None:
    """`station`'s busy fraction over its steady_window (None when the window is empty)."""
    w = steady_window(events, station)
    if w is None or w[1] <= w[0]:
        return None
    return round(union_length([(e["start"], e["end"]) for e in events if e["station"] == station], *w)
                 / (w[1] - w[0]), 4)
