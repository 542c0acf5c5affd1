"""Per-version adapter hand-over in the default (HF) engine: before and after in-place slot reuse.

    .venv/bin/python bench/adapter_load.py --out results/adapter_load.json

Every published adapter version is a new adapter for the generate station. The engine keeps up to
`max_adapters` (64) versions; PEFT's add_adapter / set_peft_model_state_dict / delete_adapter walk
every module of the model, whose number grows with the adapters registered, and PEFT's set_adapter
(single-adapter batches) walks them too. Measured here on the default-preset model (random weights,
LoRA r=16 on all linear layers, 1 thread): for versions 1..N loaded one after another, the time of
`HFEngine.load` (load) and of one 64-row generate call on that version, with
  before: PEFT's path for every load (slot reuse disabled) and `set_adapter` for single-adapter batches;
  after:  the engine as it is (full cache: the LRU slot is overwritten in place; one adapter: stacked).
Medians over the versions loaded while the cache was full (the steady state of a long run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.generation_engines import build  # noqa: E402


def run(mode: str, workdir: Path, versions: int, max_adapters: int) -> dict:
    from marlaas.adapters import read_adapter_dir
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterBlob, AdapterRef, GenRequest

    def source(ref: AdapterRef) -> AdapterBlob:
        return read_adapter_dir(workdir / "adapters" / f"job{ref.version % 4}")

    eng = HFEngine(workdir / "base", source, threads=1, max_adapters=max_adapters,
                   mixed_path="stacked" if mode == "after" else "peft",
                   reuse_slots=mode == "after")  # before: PEFT's add/delete for every load
    load, gen = [], []
    for v in range(1, versions + 1):
        ref = AdapterRef("j", v)
        t = time.perf_counter()
        eng.load(ref)
        load.append(time.perf_counter() - t)
        t = time.perf_counter()
        eng.generate([GenRequest(key="p", prompt="sort:3 1 2=", adapter=ref, n=64, temperature=1.0,
                                 max_new_tokens=8, seed=v)])
        gen.append(time.perf_counter() - t)
    full = slice(max_adapters, None)
    return {"load_s_median_full_cache": round(statistics.median(load[full]), 4),
            "generate_s_median_full_cache": round(statistics.median(gen[full]), 4),
            "load_s_first": round(load[0], 4), "load_s_at_fill": round(load[max_adapters - 1], 4),
            "load_s": [round(x, 4) for x in load], "generate_s": [round(x, 4) for x in gen]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=96)
    ap.add_argument("--max-adapters", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("results/adapter_load.json"))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="marlaas-adapter-load-"))
    build(work, 4)
    out = {"command": f"bench/adapter_load.py --versions {a.versions} --max-adapters {a.max_adapters}",
           "date": time.strftime("%Y-%m-%d"), "max_adapters": a.max_adapters, "versions": a.versions}
    for mode in ("before", "after"):
        out[mode] = run(mode, work, a.versions, a.max_adapters)
        print(mode, {k: v for k, v in out[mode].items() if not isinstance(v, list)}, flush=True)
    out["load_speedup_full_cache"] = round(out["before"]["load_s_median_full_cache"]
                                           / out["after"]["load_s_median_full_cache"], 1)
    out["per_version_saved_s"] = round(
        out["before"]["load_s_median_full_cache"] + out["before"]["generate_s_median_full_cache"]
        - out["after"]["load_s_median_full_cache"] - out["after"]["generate_s_median_full_cache"], 4)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("before", "after")}))


if __name__ == "__main__":
    main()
