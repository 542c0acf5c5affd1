"""Bytes off the broker: Redis per job and per version, the paper's scale, and a new version's latency.

    .venv/bin/python bench/store_bytes.py --real --scale --latency --out results/store_bytes.json

Sections (flags; each writes its block of the JSON and keeps the others; --scale and --latency live in
bench/store_bytes_synth.py):
  --real     SmolLM2-135M-Instruct, 4 jobs x `--steps` steps submitted at once on the embedded stack
             (the Procfile lines, hf engine, as bench/real.py runs them) under a fresh $MARLAAS_HOME
             whose artifact store is the local-directory default. Redis `used_memory` before and
             after, per job and per published version; MEMORY USAGE of every key at the end (the
             largest value and its key, and the sum per key family); the artifact store's bytes; and
             "before": the bytes now in the artifact store that used to be Redis values (adapters kept
             + optimizer states) -- what Redis held for the same run before this change.
  --scale    The paper's scale without a model: 32 tenants, rank-16 all-linear LoRA of an 8B Llama
             (safetensors of the real shapes: 41,943,040 float32 parameters = 168 MB; Adam moments 336 MB),
             max_staleness 2, 20 versions each, through the real `Store.publish` against a real Redis
             while a real scheduler tick (`dispatch.tick`, in its own process) runs over the same jobs.
             The object bytes of 32 x 20 x 504 MB do not fit this machine, so the backend is
             `SizesOnly`: it hashes nothing and stores nothing, names objects by a counter and keeps
             their sizes (Redis and the tick are real; the object bytes are accounted, not written).
             Then one real-bytes point: `--real-tenants` x `--real-versions` versions of the same 8B
             shapes to the local-directory backend (every byte hashed, written, fsynced and read back).
  --latency  Publish-to-first-sample latency of a new version: a writer publishes `--versions` versions
             of a SmolLM2-135M rank-16 all-linear adapter (synthetic safetensors, distinct bytes each), a
             reader process (as a generate worker) polls the job's version, and on a new one fetches
             it with `store.adapter(...)`; local directory vs a real SeaweedFS S3 server (tests/s3server.py)
             with the worker's disk cache: cold (the first read of a new version: S3 GET + verify) and
             warm (the next read of the same version on that host: cache hit + verify). The sampling
             itself (model-dependent) is not in the figure: it is when the reader can start sampling.

Done-when targets (issue 23): Redis memory per published version <= 16 KiB; at the 32 x 8B scale Redis
under 256 MiB and the tick's p95 <= 10 ms. Every figure is reported, met or not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marlaas.settings import get_settings  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
TARGET_PER_VERSION = 16 * KIB
TARGET_SCALE_REDIS = 256 * MIB
TARGET_TICK_P95_MS = 10.0
REAL_TASKS = ("basic_arithmetic", "chain_sum", "products", "lcm")
BASE_NAME = "smollm2-135m-instruct"


# ------------------------------------------------------------------------------------------ helpers
def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of xs, None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


def family(key: str) -> str:
    """A key with its ids replaced by `*` (job ids, numbers, hashes): the key's family."""
    key = re.sub(r"(?<=:job:)[^:]+", "*", re.sub(r"[0-9a-f]{12,}", "*", key))
    return re.sub(r"(?<=[:/])\d+(?=$|[:/])", "*", key)


def used_memory(r) -> int:
    return int(r.info("memory")["used_memory"])


def scan_memory(r) -> dict:
    """MEMORY USAGE of every key: the largest value and its key, totals per family."""
    keys = [k.decode() if isinstance(k, bytes) else k for k in r.scan_iter(count=1000)]
    sizes: dict[str, int] = {}
    for i in range(0, len(keys), 500):
        p = r.pipeline(transaction=False)
        for k in keys[i:i + 500]:
            p.memory_usage(k, samples=0)
        sizes.update({k: int(v or 0) for k, v in zip(keys[i:i + 500], p.execute())})
    fam: dict[str, list[int]] = {}
    for k, v in sizes.items():
        fam.setdefault(family(k), []).append(v)
    top = max(sizes.items(), key=lambda kv: kv[1], default=("", 0))
    return {"keys": len(sizes), "sum_bytes": sum(sizes.values()), "largest_key": top[0],
            "largest_bytes": top[1],
            "families": {f: {"keys": len(v), "bytes": sum(v), "max_bytes": max(v)}
                         for f, v in sorted(fam.items(), key=lambda kv: -sum(kv[1]))[:25]}}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "os": platform.system(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "note": "load_avg_1m: the machine's load when the section started (other work on a shared machine "
                    "shows there, and timings carry it)"}


def fresh_home(tag: str) -> Path:
    """A throw-away $MARLAAS_HOME for this section (its Redis data and artifact store)."""
    home = Path(tempfile.mkdtemp(prefix=f"marlaas-bytes-{tag}-"))
    os.environ["MARLAAS_HOME"] = str(home)
    for k in ("MARLAAS_REDIS_URL", "MARLAAS_ARTIFACTS"):
        os.environ.pop(k, None)
    get_settings.cache_clear()
    return home


def redis_stack(tag: str):
    """(stack, url, home): a private embedded Redis under a fresh home."""
    from marlaas.ops.embedded import Stack

    home = fresh_home(tag)
    stack = Stack()
    stack.start("redis")
    return stack, stack.url, home


def lora_safetensors(shapes: list[tuple[int, int]], layers: int, rank: int, copies: int = 1) -> bytes:
    """A PEFT-named safetensors file of an all-linear LoRA: A (rank x in) and B (out x rank) per linear
    per layer, float32 zeros (`copies` tensors per weight: 2 for Adam's two moments)."""
    import torch
    from safetensors.torch import save

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    tensors = {}
    for li in range(layers):
        for name, (fan_in, fan_out) in zip(names, shapes):
            mod = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            base = f"base_model.model.model.layers.{li}.{mod}.{name}"
            for c in range(copies):
                sfx = "" if copies == 1 else f".m{c}"
                tensors[f"{base}.lora_A.weight{sfx}"] = torch.zeros(rank, fan_in)
                tensors[f"{base}.lora_B.weight{sfx}"] = torch.zeros(fan_out, rank)
    return save(tensors)


def llama_shapes(hidden: int, inter: int, kv: int) -> list[tuple[int, int]]:
    """(in, out) of q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inter), (hidden, inter),
            (inter, hidden)]


LLAMA_8B = {"shapes": llama_shapes(4096, 14336, 1024), "layers": 32}  # Llama-3-8B: 8 KV heads x 128
SMOLLM2_135M = {"shapes": llama_shapes(576, 1536, 192), "layers": 30}  # 3 KV heads x 64


def lora_params(model: dict, rank: int) -> int:
    return model["layers"] * sum(rank * (i + o) for i, o in model["shapes"])


def stamped(data: bytes, n: int) -> bytes:
    """`data` with its last 8 bytes set to `n`: distinct content (hence a distinct object) per version."""
    return data[:-8] + n.to_bytes(8, "little")


# ------------------------------------------------------------------------------------------ --real
def run_real(a) -> dict:
    from bench.real import TASK_CONFIGS  # the same easy reasoning-gym configs as bench/real.py
    from marlaas.api.client import Client
    from marlaas.ops.embedded import Stack, wait_for_workers
    from marlaas.spec import JobSpec, LoraSpec
    from marlaas.store import Store
    from marlaas.store.artifacts import LocalArtifacts, Ref
    from marlaas.store.keys import adapter_key, job_key, optim_key

    base = a.base_dir or get_settings().home / "models" / BASE_NAME
    if not (base / "marlaas_import.json").is_file():
        from marlaas.base.importer import import_base

        import_base(BASE_NAME, base)
    home = fresh_home("real")
    env = {"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "600"}
    stack = Stack(env=env, log_dir=home / "logs")
    t_start = time.time()
    out: dict = {}
    try:
        stack.lines["generate2"] = stack.lines["generate"].replace("-n generate@", "-n generate2@")
        stack.start("redis", "control", "generate", "generate2", "verify", "train", "beat")
        st = Store(stack.url)
        wait_for_workers(st, timeout=300)
        client = Client(stack.url)
        time.sleep(10)  # the workers' start-up traffic settles before the baseline
        before = used_memory(st.r)
        scan_before = scan_memory(st.r)
        specs = [JobSpec(tenant=f"bytes-{task}", task=f"reasoning_gym:{task}", task_config=TASK_CONFIGS[task],
                         steps=a.steps, group_size=4, prompts_per_step=4, max_staleness=2, seed=i,
                         learning_rate=1e-3, max_new_tokens=12, eval_size=a.eval_size, eval_every=0, eval_k=0,
                         lora=LoraSpec(rank=a.lora_rank, alpha=2.0 * a.lora_rank), chat_template=True)
                 for i, task in enumerate(REAL_TASKS)]
        t0 = time.time()
        jobs = [client.submit(s) for s in specs]
        samples = []
        while any(j.status()["status"] not in ("done", "failed", "cancelled") for j in jobs):
            samples.append(used_memory(st.r))
            if time.time() - t0 > a.job_timeout:
                raise TimeoutError(f"the 4 jobs did not end within {a.job_timeout} s")
            time.sleep(5)
        wall = time.time() - t0
        after = used_memory(st.r)
        scan_after = scan_memory(st.r)
        arts = st.artifacts
        assert isinstance(arts, LocalArtifacts), arts
        listed = list(arts.list(""))
        by_key = {o.key: o.size for o in listed}
        per_job, versions_total = {}, 0
        moved_adapters = moved_optim = 0
        largest_object = 0
        for j, s in zip(jobs, specs):
            status = j.status()
            v = int(st.r.hget(job_key(j.id), "version") or 0)
            versions_total += v
            p = st.r.pipeline(transaction=False)
            for k in range(1, v + 1):
                p.hget(adapter_key(j.id, k), "ref")
            ad_refs = [x for x in p.execute() if x]
            o_ref = st.r.hget(optim_key(j.id), "ref")
            ad = sum(Ref.parse(x).size for x in ad_refs)
            noop = sum(1 for m in st.metrics(j.id) if m.get("noop"))
            op = Ref.parse(o_ref).size if o_ref else 0
            largest_object = max([largest_object, op, *(Ref.parse(x).size for x in ad_refs)])
            moved_adapters += ad
            moved_optim += op
            per_job[s.tenant] = {"status": status["status"], "versions_published": v,
                                 "adapter_versions_kept": len(ad_refs), "adapter_bytes_kept": ad,
                                 "distinct_adapter_objects_kept": len({Ref.parse(x).key for x in ad_refs}),
                                 "noop_steps": noop,
                                 "optimizer_state_bytes": op, "tenant_stored_bytes": st.stored_bytes(s.tenant)}
        delta = after - before
        moved = moved_adapters + moved_optim
        out = {
            "setup": {"model": "SmolLM2-135M-Instruct", "jobs": len(jobs), "tasks": list(REAL_TASKS),
                      "steps": a.steps, "group_size": 4, "prompts_per_step": 4, "max_new_tokens": 12,
                      "eval_size": a.eval_size, "max_staleness": 2, "lora": {"rank": a.lora_rank,
                                                                             "targets": "all-linear"},
                      "engine": "hf", "workers": "2 generate, 1 verify, 1 train, control, beat (1 thread each)",
                      "artifact_store": "local directory ($MARLAAS_HOME/artifacts, the embedded default)",
                      "steps_note": a.steps_note or None},
            "wall_s": round(wall, 1),
            "redis_used_memory_before": before,
            "redis_used_memory_after": after,
            "redis_used_memory_peak_sampled": max(samples + [after]),
            "redis_used_memory_delta": delta,
            "versions_published": versions_total,
            "redis_bytes_per_job": round(delta / len(jobs)),
            "redis_bytes_per_published_version": round(delta / max(versions_total, 1)),
            "redis_bytes_per_published_version_target": TARGET_PER_VERSION,
            "meets_per_version_target": delta / max(versions_total, 1) <= TARGET_PER_VERSION,
            "largest_redis_value_bytes": scan_after["largest_bytes"],
            "largest_redis_value_key": family(scan_after["largest_key"]),
            "redis_keys_before": scan_before["keys"],
            "redis_scan_after": scan_after,
            "artifact_store_bytes": sum(by_key.values()),
            "artifact_store_objects": len(by_key),
            "per_job": per_job,
            "before_change_redis_values_bytes": moved,
            "before_change_detail": {"adapter_versions_kept_bytes": moved_adapters,
                                     "optimizer_states_bytes": moved_optim,
                                     "largest_value_bytes": largest_object},
            "before_change_redis_used_memory_estimate": after + moved,
            "before_change_redis_bytes_per_published_version_estimate": round((delta + moved) / max(versions_total, 1)),
        }
    finally:
        stack.stop()
    out["total_wall_s"] = round(time.time() - t_start, 1)
    shutil.rmtree(home, ignore_errors=True)
    return out


REAL_MEANING = {
    "redis_used_memory_before/after": "INFO memory used_memory of the stack's Redis with every worker up and "
                                      "nothing submitted, and once all 4 jobs ended",
    "redis_bytes_per_job": "(after - before) / 4: everything a finished job leaves in Redis (records, "
                           "metrics, events, rollouts left, references)",
    "redis_bytes_per_published_version": "(after - before) / the versions the 4 jobs published",
    "largest_redis_value_bytes": "the largest MEMORY USAGE (samples=0) over every key at the end; its key "
                                 "with ids replaced by *",
    "redis_scan_after.families": "MEMORY USAGE summed per key family (ids replaced by *), the 25 largest",
    "artifact_store_bytes": "every object in the local artifact store at the end (distinct objects: versions "
                            "with identical bytes, e.g. a step that left the weights unchanged, share one "
                            "content-addressed object; before the change each version was its own Redis value)",
    "before_change_redis_values_bytes": "before = what Redis held for the same run before this change: the "
                                        "bytes now in the artifact store that used to be Redis values (the "
                                        "objects' sizes: adapters kept + optimizer states)",
    "before_change_redis_used_memory_estimate": "used_memory after + those bytes (Redis's own per-value "
                                                "overhead not added)",
}



# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct jobs on the embedded stack")
    ap.add_argument("--scale", action="store_true", help="32 tenants x 8B LoRA, synthetic, with a running tick")
    ap.add_argument("--latency", action="store_true", help="publish-to-first-sample, local directory vs S3")
    ap.add_argument("--steps", type=int, default=30, help="--real: steps per job")
    ap.add_argument("--steps-note", default="", help="--real: why fewer steps than the issue's 30, if so")
    ap.add_argument("--eval-size", type=int, default=16, help="--real: held-out prompts per evaluation")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--job-timeout", type=float, default=3600.0)
    ap.add_argument("--base-dir", type=Path, default=None,
                    help="--real: the imported SmolLM2 directory (default $MARLAAS_HOME/models/smollm2-135m-instruct)")
    ap.add_argument("--tenants", type=int, default=32, help="--scale")
    ap.add_argument("--scale-versions", type=int, default=20, help="--scale: versions per tenant")
    ap.add_argument("--pace-ms", type=float, default=30.0, help="--scale: pause between two publishes")
    ap.add_argument("--tick-every-ms", type=float, default=50.0, help="--scale: pause between two ticks")
    ap.add_argument("--real-tenants", type=int, default=2, help="--scale: real-bytes point, tenants")
    ap.add_argument("--real-versions", type=int, default=3, help="--scale: real-bytes point, versions each")
    ap.add_argument("--versions", type=int, default=40, help="--latency: versions published per backend")
    ap.add_argument("--poll-ms", type=float, default=2.0, help="--latency: the reader's poll of the version")
    ap.add_argument("--out", type=Path, default=Path("results/store_bytes.json"))
    a = ap.parse_args()
    if not (a.real or a.scale or a.latency):
        ap.error("choose at least one of --real, --scale, --latency")
    doc = json.loads(a.out.read_text()) if a.out.is_file() else {}
    doc["what"] = ("issue 23 'Bytes off the broker': Redis memory per job and per version, the largest Redis "
                   "value, the artifact store's bytes, the tick at the paper's scale, and publish-to-first-"
                   "sample latency; every figure reported, met or not")
    doc["targets"] = {"redis_bytes_per_published_version_max": TARGET_PER_VERSION,
                      "scale_redis_used_memory_max": TARGET_SCALE_REDIS,
                      "scale_tick_p95_ms_max": TARGET_TICK_P95_MS}
    argv = " ".join(sys.argv[1:])
    home0 = get_settings().home
    if a.base_dir is None:
        a.base_dir = home0 / "models" / BASE_NAME
    from bench.store_bytes_synth import LATENCY_MEANING, SCALE_MEANING, run_latency, run_scale

    sections = [("real", a.real, run_real, REAL_MEANING), ("scale", a.scale, run_scale, SCALE_MEANING),
                ("latency", a.latency, run_latency, LATENCY_MEANING)]
    for name, on, fn, meaning in sections:
        if not on:
            continue
        print(f"== {name}", flush=True)
        block = fn(a)
        block = {"command": f".venv/bin/python bench/store_bytes.py {argv}", "at": time.strftime("%Y-%m-%d %H:%M"),
                 "machine": machine(), "meaning": meaning, **block}
        doc[name] = block
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(summary(name, block), indent=1), flush=True)
    print_table(doc)


def summary(name: str, b: dict) -> dict:
    keep = {"real": ("redis_bytes_per_job", "redis_bytes_per_published_version", "meets_per_version_target",
                     "largest_redis_value_bytes", "largest_redis_value_key", "artifact_store_bytes",
                     "before_change_redis_values_bytes", "wall_s"),
            "scale": ("redis_used_memory_after", "meets_redis_target", "tick", "meets_tick_target",
                      "redis_bytes_per_published_version", "artifact_bytes_accounted_live", "real_bytes_point"),
            "latency": ("local", "s3")}[name]
    return {k: b.get(k) for k in keep}


def print_table(doc: dict) -> None:
    rows = []
    r = doc.get("real")
    if r:
        rows += [("real: Redis bytes per published version", f"{r['redis_bytes_per_published_version']:,}"),
                 ("real: Redis bytes per job", f"{r['redis_bytes_per_job']:,}"),
                 ("real: largest Redis value", f"{r['largest_redis_value_bytes']:,} ({r['largest_redis_value_key']})"),
                 ("real: artifact store bytes", f"{r['artifact_store_bytes']:,}"),
                 ("real: before (Redis values now objects)", f"{r['before_change_redis_values_bytes']:,}")]
    s = doc.get("scale")
    if s:
        rows += [("scale: Redis used_memory after", f"{s['redis_used_memory_after']:,}"),
                 ("scale: tick p50 / p95 ms (publishing)",
                  f"{s['tick']['publishing']['p50_ms']} / {s['tick']['publishing']['p95_ms']}"),
                 ("scale: artifact bytes live (accounted)", f"{s['artifact_bytes_accounted_live']:,}")]
    lt = doc.get("latency")
    if lt:
        for b in ("local", "s3"):
            if b in lt:
                x = lt[b]
                rows.append((f"latency {b}: publish start -> adapter in reader p50/p99 ms",
                             f"{x['publish_start_to_adapter']['p50_ms']} / {x['publish_start_to_adapter']['p99_ms']}"))
    w = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
