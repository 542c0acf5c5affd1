"""Quality parity with TRL over several seeds of the same race (bench/real.py outputs).

    .venv/bin/python bench/parity.py results/real_fair5.json results/real_fair7_seed1.json \\
        results/real.json results/real_fair10_seed3.json results/real_fair11_seed4.json \\
        --out results/real_parity.json

One race's final accuracies move by more than 5 points from seed to seed, TRL's included, so one seed
cannot say whether marlaas learns as well as TRL. This reads several `bench/real.py` results that differ
only in `--seed` (it refuses files whose sizes differ, or that repeat a seed) and writes, per task:

- each mode's final held-out greedy accuracy on every seed and its mean over the seeds;
- the gap, mode minus TRL, per seed (the seeds pair the runs: the same rows and the same held-out
  prompts), its mean, its standard error over the seeds and a 95% t interval;
- the noise floor: the widest spread of each mode's own finals across seeds (TRL against TRL), and the
  standard error that the evaluation alone puts on one seed's gap (a binomial on `eval_size` prompts);
- the verdicts: the mean gap within 5 points on every task, and the one-sided reading (the mean gap
  no lower than -5 points on every task).

`--repeat A.json B.json`: two runs of one seed (the same rows and held-out prompts) whose TRL drew
with different seeds (`bench/real.py --trl-seed-offset`) or skipped steps without signal
(`--trl-skip-no-signal`): per task and per mode that both ran, the first's final minus the second's
(and `<mode>_minus_second_trl`: the first's marlaas modes against the second's TRL), and whether
every task's gap is within the limit. TRL against itself is the noise floor of one race's "within 5
points of TRL on every task".

    .venv/bin/python bench/parity.py --repeat results/real_fair15_seed6_quarter.json \\
        results/real_trl_repeat_seed6.json --out results/real_trl_repeat_seed6_gaps.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

MODES = ("sync", "async")
# two-sided 95% quantiles of Student's t, by degrees of freedom (n seeds - 1)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


class ParityError(ValueError):
    pass


def seed_of(result: dict) -> int:
    parts = result.get("command", "").split()
    if "--seed" in parts and parts.index("--seed") + 1 < len(parts):
        return int(parts[parts.index("--seed") + 1])
    raise ParityError("a result has no --seed in its command; give bench/real.py outputs")


def size_diff(a: dict, b: dict) -> str:
    """The names of the sizes two runs set differently, sorted."""
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def eval_se_points(p: float, q: float, n: int) -> float:
    """Standard error (points) of the difference of two accuracies, each measured on n prompts."""
    return 100 * math.sqrt((p * (1 - p) + q * (1 - q)) / n)


def parity(results: list[dict], limit: float = 5.0) -> dict:
    if not results:
        raise ParityError("give at least one bench/real.py result")
    sizes = results[0]["sizes"]
    seeds = [seed_of(r) for r in results]
    if len(set(seeds)) != len(seeds):
        raise ParityError(f"seeds repeat: {seeds}; each result must be a different seed")
    for r, s in zip(results, seeds):
        if r["sizes"] != sizes:
            raise ParityError(f"seed {s} ran with other sizes ({size_diff(sizes, r['sizes'])}); compare like with like")
    tasks = [t for t in results[0]["tasks"] if all(t in r["tasks"] for r in results)]
    n_eval = int(sizes["eval_size"])
    out: dict = {"seeds": seeds, "sizes": sizes, "limit_points": limit, "tasks": {}}
    for t in tasks:
        per = [r["tasks"][t] for r in results]
        if not all("trl" in p and p["trl"].get("final_acc") is not None for p in per):
            raise ParityError(f"task {t}: a seed has no TRL final; run bench/real.py with --modes ...,trl")
        rec: dict = {"final": {}, "mean_final": {}, "spread_points": {}}
        for mode in (*MODES, "trl"):
            finals = [p[mode]["final_acc"] for p in per if mode in p and p[mode].get("final_acc") is not None]
            if len(finals) != len(per):
                continue
            rec["final"][mode] = finals
            rec["mean_final"][mode] = round(sum(finals) / len(finals), 4)
            rec["spread_points"][mode] = round(100 * (max(finals) - min(finals)), 1)
        for mode in MODES:
            if mode not in rec["final"]:
                continue
            gaps = [100 * (a - b) for a, b in zip(rec["final"][mode], rec["final"]["trl"])]
            m, se = mean_se(gaps)
            g: dict = {"per_seed": [round(x, 1) for x in gaps], "mean": round(m, 2),
                       "se": None if se is None else round(se, 2)}
            if se is not None and len(gaps) - 1 in T95:
                h = T95[len(gaps) - 1] * se
                g["ci95"] = [round(m - h, 1), round(m + h, 1)]
            g["eval_se_per_seed"] = [round(eval_se_points(a, b, n_eval), 1)
                                     for a, b in zip(rec["final"][mode], rec["final"]["trl"])]
            rec[f"{mode}_minus_trl_points"] = g
        out["tasks"][t] = rec
    for mode in MODES:
        key = f"{mode}_minus_trl_points"
        means = {t: rec[key]["mean"] for t, rec in out["tasks"].items() if key in rec}
        if means:
            out[f"{mode}_goal"] = {
                "mean_within_limit_every_task": all(abs(x) <= limit for x in means.values()),
                "mean_no_lower_than_minus_limit_every_task": all(x >= -limit for x in means.values()),
                "mean_gap_over_tasks": round(sum(means.values()) / len(means), 2),
            }
    return out


def repeat(a: dict, b: dict, limit: float = 5.0) -> dict:
    """Per task and per mode both runs have, a's final minus b's (points), and a's marlaas modes
    minus b's TRL: two runs of one seed and sizes whose TRL differs (seed offset or step policy)."""
    sa, sb = seed_of(a), seed_of(b)
    if sa != sb:
        raise ParityError(f"--repeat compares two runs of one seed (the same rows), got seeds {sa} and {sb}")
    if a["sizes"] != b["sizes"]:
        raise ParityError(f"the two runs differ in sizes ({size_diff(a['sizes'], b['sizes'])}); compare like with like")
    oa, ob = a.get("trl_seed_offset", 0), b.get("trl_seed_offset", 0)
    ka, kb = bool(a.get("trl_skip_no_signal")), bool(b.get("trl_skip_no_signal"))
    if (oa, ka) == (ob, kb):
        raise ParityError(f"both runs drew TRL with seed offset {oa} and skip_no_signal {ka}: the same run, "
                          f"not a repeat")
    out: dict = {"seed": sa, "trl_seed_offsets": [oa, ob], "trl_skip_no_signal": [ka, kb], "limit_points": limit,
                 "tasks": {}, "modes": {}}
    pairs = [(m, m, m) for m in (*MODES, "trl")] + [(f"{m}_minus_second_trl", m, "trl") for m in MODES]
    for t in a["tasks"]:
        if t not in b["tasks"]:
            continue
        rec = {}
        for name, mode_a, mode_b in pairs:  # the name, a's mode, b's mode
            fa = a["tasks"][t].get(mode_a, {}).get("final_acc")
            fb = b["tasks"][t].get(mode_b, {}).get("final_acc")
            if fa is not None and fb is not None:
                rec[name] = {"finals": [fa, fb], "gap_points": round(100 * (fa - fb), 1)}
        out["tasks"][t] = rec
    for mode, _, _ in pairs:
        gaps = {t: r[mode]["gap_points"] for t, r in out["tasks"].items() if mode in r}
        if gaps:
            out["modes"][mode] = {"gaps_points": gaps, "max_abs_gap_points": max(abs(g) for g in gaps.values()),
                                  "every_task_within_limit": all(abs(g) <= limit for g in gaps.values())}
    if not out["modes"]:
        raise ParityError("the two runs share no task and mode with a final accuracy")
    return out


def _load(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ParityError(f"{p}: cannot read it as JSON ({e})") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench/real.py outputs, one per seed")
    ap.add_argument("--limit", type=float, default=5.0, help="parity bound in points (default 5)")
    ap.add_argument("--repeat", action="store_true",
                    help="two runs of one seed whose TRL differs (--trl-seed-offset, --trl-skip-no-signal): "
                         "each task's gap, run 1 - run 2")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.repeat and len(a.results) != 2:
        ap.error(f"--repeat compares two runs, got {len(a.results)}")
    try:
        loaded = [_load(p) for p in a.results]
        out = repeat(*loaded, a.limit) if a.repeat else parity(loaded, a.limit)
    except (ParityError, KeyError) as e:
        sys.exit(f"bench/parity.py: {e}")
    out = {"command": " ".join([".venv/bin/python bench/parity.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "inputs": [str(p) for p in a.results], **out}
    if a.repeat:
        for mode, m in out["modes"].items():
            print(f"{mode}: run 1 - run 2 per task {m['gaps_points']}, every task within {a.limit}: "
                  f"{m['every_task_within_limit']}")
    else:
        print_parity(out)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", a.out)


def print_parity(out: dict) -> None:
    for t, rec in out["tasks"].items():
        line = "  ".join(f"{m} {rec['mean_final'][m]:.3f}" for m in rec["mean_final"])
        gap = rec.get("async_minus_trl_points", {})
        print(f"{t:18s} {line}  async-trl {gap.get('mean')} (ci95 {gap.get('ci95')}, per seed {gap.get('per_seed')})")
    for mode in MODES:
        if f"{mode}_goal" in out:
            print(mode, out[f"{mode}_goal"])


if __name__ == "__main__":
    main()
