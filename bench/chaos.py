"""Chaos benchmark: many SIGKILLs of random station processes plus a broker restart, 8 tenants.

    .venv/bin/python bench/chaos.py --kills 50 --steps 200 --out results/chaos.json

(--steps: long enough that the jobs outlive the kills, about 3 s each; with 12 the jobs end first.)

Reports kills survived, lost steps (published versions missing) and duplicated steps (a version
published twice) per job; references naming an object missing from the artifact store (before and
after the sweep) and the orphans swept: objects a trainer killed between its write and its publish
(or a publish that lost its compare-and-set) left behind. Needs a built tiny base (`marlaas base build
--preset test --out DIR`, passed as --base; by default one is built under $MARLAAS_HOME/base-test).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from marlaas.base.pretrain import ensure_base
from marlaas.ops.chaos import run_chaos
from marlaas.settings import get_settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("results/chaos.json"))
    a = ap.parse_args()
    home = get_settings().home
    base = a.base or ensure_base(home / "base-test", preset="test", seed=0, progress=True, threads=1)
    t0 = time.time()
    out = run_chaos(base, home / "chaos-logs", tenants=a.tenants, kills=a.kills, steps=a.steps, seed=a.seed,
                    deadline_s=3600)
    lost = sum(max(0, j["spec_steps"] - len(set(j["steps"]))) for j in out["jobs"])
    dup = sum(len(j["steps"]) - len(set(j["steps"])) for j in out["jobs"])
    summary = {
        "command": f"bench/chaos.py --kills {a.kills} --tenants {a.tenants} --steps {a.steps} --seed {a.seed}",
        "kills_survived": len([e for e in out["events"] if e[0] == "kill"]),
        "broker_restarts": len([e for e in out["events"] if e[0] == "broker-restart"]),
        "revived_after_exit": len([e for e in out["events"] if e[0] == "revived"]),
        "jobs_done": sum(j["status"] == "done" for j in out["jobs"]),
        "jobs": len(out["jobs"]),
        "lost_steps": lost,
        "duplicated_steps": dup,
        "staleness_violations": sum(not j["staleness_ok"] for j in out["jobs"]),
        "regenerated_groups": sum(j["regenerated"] for j in out["jobs"]),
        "references_to_missing_objects": sum(len(j["missing_objects"]) + len(j["missing_after_sweep"])
                                             for j in out["jobs"]),
        "orphans_swept": sum(j["orphans_swept"] for j in out["jobs"]),
        "wall_s": round(time.time() - t0, 1),
        **out,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("events", "jobs")}, indent=2))


if __name__ == "__main__":
    main()
