"""The synthetic sections of bench/store_bytes.py: --scale (32 tenants x an 8B LoRA through the real
`Store.publish` while a real tick runs) and --latency (publish to first sample, local directory vs S3).

Run them through bench/store_bytes.py (its docstring says what each figure means). Invariants: Redis,
`Store.publish`, `dispatch.tick` and the S3 server are the real ones; only `SizesOnly` (--scale) stands
in for the object bytes, and it says so in the JSON.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.store_bytes import (
    LLAMA_8B,
    MIB,
    SMOLLM2_135M,
    TARGET_SCALE_REDIS,
    TARGET_TICK_P95_MS,
    family,
    lora_params,
    lora_safetensors,
    ms,
    pct,
    redis_stack,
    scan_memory,
    stamped,
    used_memory,
)


# ------------------------------------------------------------------------------------------ --scale
def sizes_only_class():
    """`SizesOnly`: an Artifacts backend that hashes nothing and stores nothing. Keys come from a counter
    (64 hex digits, so `Ref.parse` accepts them); it keeps each live object's size, so `drop`, the
    tenant totals and the live/written byte counts are exact, while no byte is written or read."""
    from marlaas.errors import ArtifactError
    from marlaas.store.artifacts import Artifacts, Listed, Put, Ref, check_owner

    class SizesOnly(Artifacts):
        url = "sizes-only://"

        def __init__(self) -> None:
            self.n = 0
            self.objects: dict[str, int] = {}
            self.written = 0

        def put(self, owner: str, data: bytes) -> Put:
            self.n += 1
            key = f"{check_owner(owner)}/{self.n:064x}"
            self.objects[key] = len(data)
            self.written += len(data)
            return Put(Ref(key, len(data)), True)

        def put_file(self, owner: str, path, sha256: str | None = None) -> Put:
            raise ArtifactError("SizesOnly keeps no files")

        def _read(self, key: str) -> bytes:
            raise ArtifactError(f"SizesOnly keeps sizes, not bytes ({key})")

        def size(self, key: str) -> int | None:
            return self.objects.get(key)

        def delete(self, keys: list[str]) -> None:
            for k in keys:
                self.objects.pop(k, None)

        def list(self, prefix: str):
            now = time.time()
            for k, v in list(self.objects.items()):
                if not prefix or k.startswith(prefix.rstrip("/") + "/"):
                    yield Listed(k, v, now)

    return SizesOnly


def tick_loop(url: str, every_s: float, stop, q) -> None:
    """A control worker's tick, in its own process: `dispatch.tick` back to back (pause `every_s`),
    its messages counted, not sent; (wall time, seconds, messages) of every tick go back on `q`."""
    from marlaas.control import dispatch
    from marlaas.store import Store

    st = Store(url, lease_s=60.0, artifacts=sizes_only_class()())
    out = []
    while not stop.is_set():
        sent: list = []
        t = time.perf_counter()
        dispatch.tick(st, sent.extend)
        out.append((time.time(), time.perf_counter() - t, len(sent)))
        time.sleep(every_s)
    q.put(out)


def tick_stats(samples: list[tuple[float, float, int]], t0: float, t1: float) -> dict:
    d = [s for w, s, _ in samples if t0 <= w <= t1]
    return {"ticks": len(d), "p50_ms": ms(pct(d, 0.5)), "p95_ms": ms(pct(d, 0.95)), "max_ms": ms(max(d, default=None)),
            "messages": sum(m for w, _, m in samples if t0 <= w <= t1)}


def scale_jobs(st, tenants: list[str], steps: int, rank: int) -> list[str]:
    from marlaas.spec import JobSpec, LoraSpec

    rows = [{"prompt": f"sort:{i} {i + 3} {i + 1}=", "answer": f"{i} {i + 1} {i + 3}"} for i in range(16)]
    return [st.create_job(JobSpec(tenant=t, task="sort", steps=steps, prompts_per_step=4, group_size=8,
                                  max_staleness=2, eval_size=16, seed=i, lora=LoraSpec(rank=rank, alpha=2.0 * rank)),
                          rows, rows) for i, t in enumerate(tenants)]


def run_scale(a) -> dict:
    import multiprocessing as mp

    from marlaas.store import Store
    from marlaas.store.artifacts import LocalArtifacts
    from marlaas.store.keys import adapter_key, optim_key
    from marlaas.types import AdapterBlob, AdapterRef

    params = lora_params(LLAMA_8B, a.lora_rank)
    t_build = time.perf_counter()
    weights = lora_safetensors(LLAMA_8B["shapes"], LLAMA_8B["layers"], a.lora_rank)
    optim = lora_safetensors(LLAMA_8B["shapes"], LLAMA_8B["layers"], a.lora_rank, copies=2)
    build_s = time.perf_counter() - t_build
    cfg = {"r": a.lora_rank, "lora_alpha": 2 * a.lora_rank, "target_modules": "all-linear",
           "peft_type": "LORA", "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B"}
    stack, url, home = redis_stack("scale")
    ctx = mp.get_context("fork")
    out: dict = {}
    try:
        arts = sizes_only_class()()
        st = Store(url, lease_s=60.0, artifacts=arts)
        mem_empty = used_memory(st.r)
        tenants = [f"t{i}" for i in range(a.tenants)]
        jids = scale_jobs(st, tenants, a.scale_versions, a.lora_rank)
        for i, station in enumerate(("generate", "generate", "generate", "generate", "verify", "train", "control")):
            st.heartbeat(f"{station}@bench:{i}", station, ttl=3600)
        mem_setup = used_memory(st.r)
        stop, q = ctx.Event(), ctx.Queue()
        ticker = ctx.Process(target=tick_loop, args=(url, a.tick_every_ms / 1000, stop, q), daemon=True)
        ticker.start()
        t_idle = time.time()
        time.sleep(5.0)
        t_pub0 = time.time()
        pub_s, live_peak = [], 0
        for v in range(a.scale_versions):
            for jid in jids:
                t = time.perf_counter()
                ok = st.publish(jid, v, AdapterBlob(cfg, weights), optim, {"step": v + 1, "loss": 0.5}, "-", [],
                                a.scale_versions)
                pub_s.append(time.perf_counter() - t)
                assert ok, f"publish {jid} v{v} lost its compare-and-set"
                live_peak = max(live_peak, sum(arts.objects.values()))
                time.sleep(a.pace_ms / 1000)
        t_pub1 = time.time()
        mem_pub = used_memory(st.r)
        scan = scan_memory(st.r)
        n_pub = a.tenants * a.scale_versions
        live = sum(arts.objects.values())
        kept = sum(len(st.existing_adapters(j, list(range(1, a.scale_versions + 1)))) for j in jids)
        # one honest real-bytes point: the same shapes to the local directory backend, every byte written
        root = home / "artifacts-real"
        timed: list[tuple[int, float]] = []

        class TimedLocal(LocalArtifacts):
            def put(self, owner, data):
                t = time.perf_counter()
                try:
                    return super().put(owner, data)
                finally:
                    timed.append((len(data), time.perf_counter() - t))

        rst = Store(url, lease_s=60.0, artifacts=TimedLocal(root))
        t_real0 = time.time()
        rj = scale_jobs(rst, [f"real{i}" for i in range(a.real_tenants)], a.real_versions, a.lora_rank)
        rpub, k = [], 0
        for v in range(a.real_versions):
            for jid in rj:
                k += 1
                w, o = stamped(weights, k), stamped(optim, k)
                t = time.perf_counter()
                assert rst.publish(jid, v, AdapterBlob(cfg, w), o, {"step": v + 1}, "-", [], a.real_versions)
                rpub.append(time.perf_counter() - t)
                del w, o
        t = time.perf_counter()
        blob = rst.adapter(AdapterRef(rj[0], a.real_versions))
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        ostate = rst.optimizer_state(rj[0])
        oread_s = time.perf_counter() - t
        assert len(blob.weights) == len(weights) and ostate is not None and len(ostate[1]) == len(optim)
        del blob, ostate
        t_real1 = time.time()
        disk = sum(x.size for x in rst.artifacts.list(""))
        ref_mem = {"adapter_hash": st.r.memory_usage(adapter_key(rj[0], a.real_versions), samples=0),
                   "optimizer_hash": st.r.memory_usage(optim_key(rj[0]), samples=0)}
        # the old design, for comparison: the same adapter and optimizer state as Redis values (SET, GET,
        # DEL on a scratch key, 3 times) while the tick runs
        t_old0, old_s = time.time(), []
        for _ in range(3):
            t = time.perf_counter()
            st.r.set("bench:old-design:adapter", weights)
            st.r.set("bench:old-design:optim", optim)
            got = st.r.get("bench:old-design:adapter")
            st.r.delete("bench:old-design:adapter", "bench:old-design:optim")
            old_s.append(time.perf_counter() - t)
            assert got is not None and len(got) == len(weights)
            del got
        t_old1 = time.time()
        time.sleep(1.0)
        stop.set()
        samples = q.get(timeout=120)
        ticker.join(timeout=30)
        mem_end = used_memory(st.r)
        idle, busy = tick_stats(samples, t_idle, t_pub0), tick_stats(samples, t_pub0, t_pub1)
        out = {
            "setup": {"tenants": a.tenants, "versions_each": a.scale_versions, "max_staleness": 2,
                      "model": "Llama-3-8B shapes (32 layers, hidden 4096, MLP 14336, 8 KV heads x 128)",
                      "lora": {"rank": a.lora_rank, "targets": "q,k,v,o,gate,up,down (all-linear)",
                               "parameters": params},
                      "adapter_bytes": len(weights), "optimizer_state_bytes": len(optim),
                      "tensors": "safetensors of float32 zeros, the real names and shapes; optimizer: 2 moments",
                      "tensor_build_s": round(build_s, 1), "publish_pace_ms": a.pace_ms,
                      "tick_pause_ms": a.tick_every_ms,
                      "backend": "SizesOnly: Redis and the tick are real; the object bytes are accounted, not "
                                 "written (keys from a counter, nothing hashed or stored, each live object's "
                                 "size kept so drops and tenant totals are exact)",
                      "tick": "dispatch.tick in its own process over the same jobs, messages counted not sent; "
                              "4 generate, 1 verify, 1 train, 1 control worker heartbeating"},
            "redis_used_memory_empty": mem_empty,
            "redis_used_memory_jobs_created": mem_setup,
            "redis_used_memory_after": mem_pub,
            "redis_used_memory_after_real_bytes_point": mem_end,
            "redis_used_memory_target": TARGET_SCALE_REDIS,
            "meets_redis_target": max(mem_pub, mem_end) < TARGET_SCALE_REDIS,
            "versions_published": n_pub,
            "redis_bytes_per_published_version": round((mem_pub - mem_setup) / n_pub),
            "largest_redis_value_bytes": scan["largest_bytes"],
            "largest_redis_value_key": family(scan["largest_key"]),
            "redis_scan_after": scan,
            "adapter_versions_kept": kept,
            "artifact_bytes_accounted_live": live,
            "artifact_bytes_accounted_live_peak": live_peak,
            "artifact_bytes_accounted_written": arts.written,
            "artifact_objects_live": len(arts.objects),
            "tenant_stored_bytes_t0": st.stored_bytes("t0"),
            "before_change_redis_values_bytes": live,
            "publish_ms": {"p50": ms(pct(pub_s, 0.5)), "p95": ms(pct(pub_s, 0.95)), "max": ms(max(pub_s))},
            "tick": {"idle": idle, "publishing": busy, "real_bytes_point": tick_stats(samples, t_real0, t_real1)},
            "tick_p95_target_ms": TARGET_TICK_P95_MS,
            "meets_tick_target": busy["p95_ms"] is not None and busy["p95_ms"] <= TARGET_TICK_P95_MS,
            "old_design_probe": {
                "what": "the 8B adapter (168 MB) and optimizer state (336 MB) SET as Redis values, the adapter "
                        "read back, both deleted: 3 times while the tick ran (how the store kept them before)",
                "seconds_each": [round(x, 2) for x in old_s],
                "tick": tick_stats(samples, t_old0, t_old1)},
            "real_bytes_point": {
                "tenants": a.real_tenants, "versions_each": a.real_versions,
                "backend": "local directory (LocalArtifacts): sha256, write, fsync, rename; read back with verify",
                "publish_s": [round(x, 2) for x in rpub],
                "publish_s_p50": round(pct(rpub, 0.5), 2),
                "put_s_adapter_p50": round(pct([s for n, s in timed if n == len(weights)], 0.5), 2),
                "put_s_optimizer_p50": round(pct([s for n, s in timed if n == len(optim)], 0.5), 2),
                "read_adapter_s": round(read_s, 2), "read_optimizer_s": round(oread_s, 2),
                "disk_bytes_live": disk,
                "redis_memory_usage_of_references": ref_mem,
                "tenant_stored_bytes_real0": st.stored_bytes("real0"),
            },
        }
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    return out


SCALE_MEANING = {
    "redis_used_memory_*": "INFO used_memory: empty, after the jobs were created, after every publish, after "
                           "the real-bytes point",
    "redis_bytes_per_published_version": "(used_memory after publishing - after creating the jobs) / versions "
                                         "published; includes what the running tick wrote meanwhile",
    "largest_redis_value_bytes": "the largest MEMORY USAGE (samples=0) over every key after publishing",
    "artifact_bytes_accounted_live": "the bytes the artifact store would hold at the end (adapters kept + one "
                                     "optimizer state per job), accounted by SizesOnly, not written",
    "before_change_redis_values_bytes": "the same bytes: what Redis would have held as values before this change",
    "tick.*": "dispatch.tick wall time in its own process: idle = 5 s before any publish, publishing = while "
              "the 32 x 20 publishes ran (paced), real_bytes_point = while real 8B objects were written",
    "old_design_probe": "the tick while the same bytes went through Redis as values (before this change)",
    "real_bytes_point": "the same 8B shapes through Store.publish to the local directory: publish_s is one "
                        "whole publish (adapter 168 MB + optimizer 336 MB hashed, written, fsynced, then the CAS)",
}



# ------------------------------------------------------------------------------------------ --latency
def open_backend(desc: tuple):
    """An artifact backend from a picklable description: ("local", root) or ("s3", url, cache_dir)."""
    from marlaas.store.artifacts import DiskCache, LocalArtifacts, S3Artifacts

    if desc[0] == "local":
        return LocalArtifacts(desc[1])
    cache = DiskCache(desc[2], 2 * 1024 * MIB) if len(desc) > 2 and desc[2] else None
    return S3Artifacts(desc[1], cache)


def reader_loop(url: str, desc: tuple, jid: str, last_v: int, poll_s: float, q) -> None:
    """A generate worker's side: poll the job's version; on a new one fetch the adapter (cold: the
    first read of that version on this host), then read it again (warm: the host's cache)."""
    from marlaas.store import Store, job_key
    from marlaas.types import AdapterRef

    arts = open_backend(desc)
    st = Store(url, lease_s=60.0, artifacts=arts)
    q.put(("ready",))
    seen = 0
    while seen < last_v:
        v = int(st.r.hget(job_key(jid), "version") or 0)
        if v <= seen:
            time.sleep(poll_s)
            continue
        t_notice = time.time()
        blob = st.adapter(AdapterRef(jid, v))
        t_have = time.time()
        t = time.perf_counter()
        again = st.adapter(AdapterRef(jid, v))
        warm = time.perf_counter() - t
        assert again.sha256 == blob.sha256
        hits = getattr(getattr(arts, "cache", None), "hits", None)
        q.put((v, t_notice, t_have, warm, len(blob.weights), hits))
        seen = v


def latency_backend(name: str, url: str, writer_desc: tuple, reader_desc: tuple, versions: int,
                    poll_s: float, rank: int) -> dict:
    import multiprocessing as mp

    from marlaas.store import Store
    from marlaas.types import AdapterBlob

    weights = lora_safetensors(SMOLLM2_135M["shapes"], SMOLLM2_135M["layers"], rank)
    optim = lora_safetensors(SMOLLM2_135M["shapes"], SMOLLM2_135M["layers"], rank, copies=2)
    cfg = {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear", "peft_type": "LORA"}
    st = Store(url, lease_s=60.0, artifacts=open_backend(writer_desc))
    (jid,) = scale_jobs(st, [f"lat-{name}"], versions, rank)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    reader = ctx.Process(target=reader_loop, args=(url, reader_desc, jid, versions, poll_s, q), daemon=True)
    reader.start()
    assert q.get(timeout=120) == ("ready",)
    rows = []
    try:
        for v in range(versions):
            w, o = stamped(weights, v + 1), stamped(optim, v + 1)
            t0 = time.time()
            assert st.publish(jid, v, AdapterBlob(cfg, w), o, {"step": v + 1}, "-", [], versions)
            t1 = time.time()
            got, t_notice, t_have, warm, n, hits = q.get(timeout=120)
            assert got == v + 1 and n == len(weights), (got, v + 1, n)
            rows.append({"t0": t0, "t1": t1, "notice": t_notice, "have": t_have, "warm": warm, "hits": hits})
    finally:
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()

    def stat(xs: list[float]) -> dict:
        return {"p50_ms": ms(pct(xs, 0.5)), "p99_ms": ms(pct(xs, 0.99)), "max_ms": ms(max(xs))}

    return {
        "versions": len(rows), "adapter_bytes": len(weights), "optimizer_state_bytes": len(optim),
        "publish_start_to_adapter": stat([r["have"] - r["t0"] for r in rows]),
        "publish_call": stat([r["t1"] - r["t0"] for r in rows]),
        "notice_after_publish_start": stat([r["notice"] - r["t0"] for r in rows]),
        "fetch_cold": stat([r["have"] - r["notice"] for r in rows]),
        "fetch_warm": stat([r["warm"] for r in rows]),
        "reader_cache_hits": rows[-1]["hits"] if rows else None,
    }


def run_latency(a) -> dict:
    from tests.s3server import seaweed

    stack, url, home = redis_stack("latency")
    out: dict = {"setup": {
        "adapter": f"SmolLM2-135M rank-{a.lora_rank} all-linear LoRA ({lora_params(SMOLLM2_135M, a.lora_rank):,} "
                   "float32 parameters, safetensors of zeros with one distinct stamp per version)",
        "optimizer": "two moments of the same shapes, written by every publish",
        "reader": f"a separate process polling the job's version every {a.poll_ms} ms, then store.adapter(...)",
        "writer": "Store.publish of version v+1 once the reader had version v (one version in flight)"}}
    try:
        print("  local directory", flush=True)
        root = str(home / "artifacts")
        out["local"] = latency_backend("local", url, ("local", root), ("local", root), a.versions,
                                       a.poll_ms / 1000, a.lora_rank)
        out["local"]["backend"] = "local directory; cold = the first read (the file was just written: page cache)"
        print("  SeaweedFS S3", flush=True)
        s3dir = Path(tempfile.mkdtemp(prefix="marlaas-bytes-s3-"))
        try:
            with seaweed(s3dir / "weed", volume_mb=512) as s3:
                os.environ.update(s3.env)
                out["s3"] = latency_backend("s3", url, ("s3", s3.url), ("s3", s3.url, str(s3dir / "cache")),
                                            a.versions, a.poll_ms / 1000, a.lora_rank)
                out["s3"]["backend"] = ("SeaweedFS S3 (tests/s3server.py, one `weed server` on loopback) through "
                                        "boto3; the reader has the worker's disk cache (DiskCache): cold = S3 GET "
                                        "+ sha256 + cache write, warm = cache hit + sha256")
                out["s3"]["objects_left"] = len(s3.keys())
        finally:
            for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
                os.environ.pop(k, None)
            shutil.rmtree(s3dir, ignore_errors=True)
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    return out


LATENCY_MEANING = {
    "publish_start_to_adapter": "the headline: from the writer calling Store.publish (objects written, then the "
                                "CAS) to the reader holding the verified adapter bytes, i.e. able to sample",
    "publish_call": "Store.publish's own time: adapter + optimizer objects written, the CAS, the replaced "
                    "objects dropped",
    "notice_after_publish_start": "when the reader saw the new version (its poll)",
    "fetch_cold": "store.adapter(...) of a version the reader's host has not read yet",
    "fetch_warm": "store.adapter(...) again on the same host (S3: the disk cache; local: the page cache)",
}
