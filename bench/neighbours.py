"""Noisy-neighbour benchmark: how much a tenant working WITHIN its plan slows another tenant down.

    .venv/bin/python bench/neighbours.py --out results/neighbours.json [--window-s S] [--attack NAME ...]

Starts the private stack of bench/abuse.py (Redis, the API, control, generate, verify, train, beat on
127.0.0.1, the tiny test base, tenant tokens), registers two tenants with equal (default) plans,
victim and attacker, and starts the victim's long `sort` job plus a small Tinker loop of the victim
(the unmodified `tinker` SDK: forward_backward + optim_step every few seconds). Then, one attack at a
time: a quiet window of --window-s seconds ("before"), then the attack for --window-s seconds
("during"); the attacker's jobs, futures and streams are cancelled or closed after each window.
Attacks (`--attack`, default all, in this order):

- dryrun_flood: `POST /v1/graders/run` from 8 threads, a python grader that sleeps 1.8 s of its 2 s.
- slow_grader_job: two jobs (one per verify process) whose python grader sleeps 9.5 s of its 10 s per call.
- similarity_long: text_similarity dry runs (rouge_l, rouge_5, bleu, gleu, fuzzy_match) on 20,000-char
  texts from 4 threads.
- parquet_bomb: `POST /v1/files` of small parquet files whose rows are far larger (a dictionary-encoded
  column that decodes to ~120 GB of rows, and a zstd file whose footer says ~72 MB), from 2 threads.
- tinker_fwdbwd_huge: forward_backward ops of the plan's most datums per op (each datum the whole
  context), kept at the plan's queued-op bound, never an optim_step.
- tinker_sample_flood: asample requests of 128 samples x (context - prompt) tokens each, kept at the
  plan's pending-sample bound.
- rg_expensive: a reasoning_gym:count_primes submit with max_n 10^10 (the guard's refusal), then
  submits of the largest max_n it accepts from 2 threads (the first job kept running, the others
  cancelled at once, so the active-job bound never stops the submits).
- events_flood: 48 server-sent event streams of the attacker's (paused) job held open, and 4 threads
  of job reads (`GET /v1/jobs/{id}`, `GET /v1/jobs`).

Figures per attack (JSON `attacks[]`):
- victim.jobs: the victim's jobs in order (a job of the plan's 10,000 steps ends within ~8 minutes here:
  before an attack whose windows it could end in, it is cancelled and a new one started).
- victim.steps_per_min {before, during, baseline} and `ratio` (during / before), `ratio_to_baseline`
  (during / the first quiet window): the victim job's published trainer steps (store metrics) per
  minute. A "before" well under the baseline means the previous attack was still being felt.
- victim.longest_gap_s: the longest time between two published versions of the victim's job during the
  attack (from its last version before the window to the window's end, so a gap still open counts).
- victim.health_latency_s / job_read_latency_s: `GET /v1/health` and `GET /v1/jobs/{id}` with the
  victim's token every ~0.5 s: n, p50, p99, max, non-200 answers (and the same for the quiet window).
- victim.tinker: the victim's Tinker steps (forward_backward + optim_step, submit to result) started
  in the window: n, failures, p50 / max seconds.
- attacker.answers: status-code counts of every attacker request (by route), examples of each refusal;
  `refused_up_front` where the API refused the attack as built before any work.
- peak_rss_mib: per stack process (api, control, generate, verify, train, beat, redis), the peak RSS
  sampled every ~0.5 s during the attack, of the process and with its children (verify's prefork
  pool, sandboxes, dry-run and upload-check children), and the process's VmHWM (lifetime peak).
- bench_client_cpu_s: CPU seconds this bench process itself used in the window (the attacker's
  client runs on the same cores as the stack: on a small machine part of any slowdown is the client).
`targets`: per attack, pass when both ratios >= 0.45, longest gap < the lease (MARLAAS_LEASE_S of the
stack), health and job-read p99 < 1 s. `machine`: cores and load average at start and end.
Every loop is bounded in time; the stack is stopped on any exit (Ctrl-C included). Loopback only.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from abuse import LEASE_S, SORT, make_stack, start_stack, two_tenants

TARGET_RATIO, TARGET_P99_S = 0.45, 1.0
SAMPLE_EVERY_S = 0.5
TINKER_EVERY_S = 3.0
VICTIM_STEPS = 10_000  # the plan's max_steps
MAX_VICTIM_STEPS_PER_S = 40  # above what the victim's job does alone here: a new job is started before it could end
PROCS = ("api", "control", "generate", "verify", "train", "beat", "redis")
ROWS = [{"prompt": f"max:{i}{i + 3}{i + 1}=", "answer": str(i + 3)} for i in range(1, 7)]


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    p99 = statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) >= 2 else xs[0]
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "p99": round(p99, 4), "max": round(xs[-1], 4)}


def one_line(resp) -> str:
    try:
        body = resp.json()
        err = body.get("error") if isinstance(body, dict) else None
        text = (f"{err.get('type')}: {err.get('message')}" if isinstance(err, dict)
                else body.get("detail", body) if isinstance(body, dict) else body)
    except Exception:  # noqa: BLE001 - not JSON, or a stream not read
        try:
            text = resp.text
        except Exception:  # noqa: BLE001
            text = ""
    return (text if isinstance(text, str) else json.dumps(text))[:200]


class Answers:
    """Status codes of the attacker's requests, by label, with one example answer per refusal."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: Counter = Counter()
        self.examples: dict[str, str] = {}
        self.reasons: Counter = Counter()  # refusals by their answer (numbers as N)
        self.latency: dict[str, list[float]] = {}

    def add(self, label: str, resp, took: float | None = None) -> None:
        key = f"{label} {resp.status_code}"
        with self.lock:
            self.codes[key] += 1
            if resp.status_code >= 400:
                why = re.sub(r"\d+", "N", one_line(resp))[:90]
                self.reasons[f"{resp.status_code} {why}"] += 1
                self.examples.setdefault(key, one_line(resp))
            if took is not None:
                self.latency.setdefault(label, []).append(took)

    def error(self, label: str, e: Exception) -> None:
        key = f"{label} {type(e).__name__}"
        with self.lock:
            self.codes[key] += 1
            self.examples.setdefault(key, str(e)[:200])

    def out(self) -> dict:
        with self.lock:
            return {"answers": dict(sorted(self.codes.items())), "refusals": dict(self.reasons.most_common(8)),
                    "examples": self.examples,
                    "latency_s": {k: quantiles(v) for k, v in self.latency.items()}}


def flood(n: int, deadline: float, label: str, call, ans: Answers, on_429_s: float = 0.0) -> None:
    """`call()` (one request, its own timeout) in n threads until the deadline; every answer recorded."""
    import httpx

    def loop() -> None:
        while time.time() < deadline:
            t0 = time.time()
            try:
                r = call()
            except httpx.HTTPError as e:
                ans.error(label, e)
                time.sleep(0.2)
                continue
            ans.add(label, r, time.time() - t0)
            if r.status_code == 429 and on_429_s:
                time.sleep(on_429_s)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.time()) + 150)


def left(deadline: float, extra: float = 20.0) -> float:
    return max(deadline - time.time(), 1.0) + extra


class Monitor:
    """Background samplers: the victim's health and job-read latency, the stack's RSS, the victim's Tinker
    loop. Each keeps timestamped samples; `window(t0, t1)` summarises those of one window."""

    def __init__(self, api: str, victim_tok: str, vjob: str, stack) -> None:
        import httpx

        self.stop = threading.Event()
        self.vjob, self.stack = vjob, stack
        self.http = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {victim_tok}"}, timeout=10)
        self.lat: list[tuple[float, str, float | None, int]] = []  # (at, what, seconds, status; 0: no answer)
        self.rss: list[tuple[float, str, int, int]] = []  # (at, process, own rss, with children)
        self.tinker: list[tuple[float, float, bool, str]] = []  # (start, seconds, ok, error)
        self.tinker_note: str | None = None
        self.threads = [threading.Thread(target=self._latency, daemon=True),
                        threading.Thread(target=self._memory, daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _latency(self) -> None:
        import httpx

        while not self.stop.is_set():
            t_next = time.time() + SAMPLE_EVERY_S
            for what, path in (("health", "/v1/health"), ("job_read", f"/v1/jobs/{self.vjob}")):
                t0 = time.time()
                try:
                    code = self.http.get(path).status_code
                    self.lat.append((t0, what, time.time() - t0, code))
                except httpx.HTTPError:
                    self.lat.append((t0, what, time.time() - t0, 0))
            self.stop.wait(max(0.0, t_next - time.time()))

    def _memory(self) -> None:
        import psutil

        while not self.stop.is_set():
            now = time.time()
            for name in PROCS:
                p = self.stack.procs.get(name)
                if p is None:
                    continue
                try:
                    proc = psutil.Process(p.pid)
                    own = proc.memory_info().rss
                    kids = 0
                    for c in proc.children(recursive=True):
                        try:
                            kids += c.memory_info().rss
                        except psutil.Error:
                            pass
                    self.rss.append((now, name, own, own + kids))
                except psutil.Error:
                    pass
            self.stop.wait(SAMPLE_EVERY_S)

    def start_tinker(self, api: str, victim_tok: str, tokenizer) -> None:
        """The victim's small Tinker loop (SDK): forward_backward + optim_step every TINKER_EVERY_S."""
        try:
            import tinker
            from tinker import types

            sc = tinker.ServiceClient(base_url=api, api_key="tml-" + victim_tok)
            base = sc.get_server_capabilities().supported_models[0].model_name
            tc = sc.create_lora_training_client(base_model=base, rank=8, seed=0).result(timeout=120)
        except Exception as e:  # recorded, the job-level figures still stand
            self.tinker_note = f"the victim's Tinker loop could not start: {type(e).__name__}: {str(e)[:160]}"
            return
        ids = tokenizer("sort:3142=1234;")["input_ids"]
        n = len(ids) - 1
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n])})

        def loop() -> None:
            while not self.stop.is_set():
                t0 = time.time()
                try:
                    fb = tc.forward_backward([datum] * 4, "cross_entropy")
                    opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
                    fb.result(timeout=300)
                    opt.result(timeout=300)
                    self.tinker.append((t0, time.time() - t0, True, ""))
                except Exception as e:  # a failed step is a figure, not the end of the loop
                    self.tinker.append((t0, time.time() - t0, False, f"{type(e).__name__}: {str(e)[:120]}"))
                self.stop.wait(max(0.0, t0 + TINKER_EVERY_S - time.time()))

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append(t)

    def window(self, t0: float, t1: float) -> dict:
        out = {}
        for what in ("health", "job_read"):
            xs = [x for x in self.lat if x[1] == what and t0 <= x[0] < t1]
            out[f"{what}_latency_s"] = {**quantiles([x[2] for x in xs if x[3] == 200]),
                                        "not_200": dict(Counter(str(x[3]) for x in xs if x[3] != 200))}
        steps = [x for x in self.tinker if t0 <= x[0] < t1]
        out["tinker"] = ({"note": self.tinker_note} if self.tinker_note else
                         {"steps_started": len(steps), "failed": sum(not x[2] for x in steps),
                          "errors": sorted({x[3] for x in steps if not x[2]})[:3],
                          "step_s": quantiles([x[1] for x in steps if x[2]])})
        return out

    def peak_rss(self, t0: float, t1: float) -> dict:
        out = {}
        for name in PROCS:
            xs = [x for x in self.rss if x[1] == name and t0 <= x[0] < t1]
            if not xs:
                continue
            rec = {"process": round(max(x[2] for x in xs) / 2**20, 1),
                   "with_children": round(max(x[3] for x in xs) / 2**20, 1)}
            p = self.stack.procs.get(name)
            try:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        rec["vmhwm"] = round(int(line.split()[1]) / 1024, 1)
            except (OSError, AttributeError):
                pass
            out[name] = rec
        return out


class Ctx:
    """What the attacks share: the attacker's HTTP client and token, the API, the base, Tinker clients."""

    def __init__(self, api: str, attacker, attacker_tok: str, base: Path, store) -> None:
        self.api, self.http, self.tok, self.base, self.store = api, attacker, attacker_tok, base, store
        from marlaas.base.tiny import load_tokenizer

        self.tokenizer = load_tokenizer(base)
        self._service = None
        self._model_id = None
        self.seq = 1_000_000

    def service(self):
        if self._service is None:
            import tinker

            self._service = tinker.ServiceClient(base_url=self.api, api_key="tml-" + self.tok)
        return self._service

    def base_name(self) -> str:
        return self.service().get_server_capabilities().supported_models[0].model_name

    def model_id(self) -> str:
        if self._model_id is None:
            tc = self.service().create_lora_training_client(base_model=self.base_name(), rank=8, seed=1)
            self._model_id = tc.result(timeout=120).get_info().model_id
        return self._model_id

    def context(self) -> int:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(self.base).max_position_embeddings)

    def submit(self, spec: dict, ans: Answers, label: str = "POST /v1/jobs"):
        t0 = time.time()
        r = self.http.post("/v1/jobs", json=spec)
        ans.add(label, r, time.time() - t0)
        return r

    def cancel_jobs(self, ids: list[str]) -> None:
        for jid in ids:
            for _ in range(20):  # the attacker's token may be at its rate limit: retry, bounded
                try:
                    if self.http.post(f"/v1/jobs/{jid}/cancel").status_code != 429:
                        break
                except Exception:  # noqa: BLE001 - best effort, the stack is private
                    pass
                time.sleep(0.5)

    def cancel_futures(self, rids: list[str]) -> int:
        n, t_end = 0, time.time() + 30
        for rid in rids:
            while time.time() < t_end:
                try:
                    code = self.http.post("/api/v1/cancel_future", json={"request_id": rid}).status_code
                except Exception:  # noqa: BLE001
                    code = 0
                if code != 429:
                    n += code == 200
                    break
                time.sleep(0.3)
        return n


# ------------------------------------------------------------------------------------------ attacks
SLEEPER = "import time\n\ndef grade(sample, item):\n    time.sleep({s})\n    return 1.0\n"


def attack_dryrun_flood(ctx: Ctx, deadline: float) -> dict:
    ans = Answers()
    grader = {"type": "python", "name": "sleeper", "source": SLEEPER.format(s=1.8), "timeout_s": 2.0}
    body = {"grader": grader, "sample": {"output_text": "3"}, "item": {"answer": "3"}}
    flood(8, deadline, "POST /v1/graders/run",
          lambda: ctx.http.post("/v1/graders/run", json=body, timeout=left(deadline, 35)), ans)
    return {"attacker": {"threads": 8, "grader": "python, sleeps 1.8 s of timeout_s 2", **ans.out()}}


def attack_slow_grader_job(ctx: Ctx, deadline: float) -> dict:
    ans = Answers()
    grader = {"type": "python", "name": "slow", "source": SLEEPER.format(s=9.5), "timeout_s": 10.0}
    made = []
    try:
        for i in range(2):
            r = ctx.submit({"dataset": ROWS, "grader": grader, "steps": 100, "eval_size": 1, "eval_k": 0,
                            "prompts_per_step": 4, "group_size": 8, "seed": 10 + i}, ans)
            if r.status_code == 201:
                made.append(r.json()["id"])
        if not made:
            return {"refused_up_front": ans.out()["examples"], "attacker": ans.out()}
        time.sleep(max(0.0, deadline - time.time()))
        seen = {}
        for jid in made:
            try:
                j = ctx.http.get(f"/v1/jobs/{jid}").json()
                seen[jid] = {k: j.get(k) for k in ("status", "version", "verify_errors")}
            except Exception as e:  # noqa: BLE001
                seen[jid] = str(e)[:100]
        return {"attacker": {"jobs": seen, "grader": "python, sleeps 9.5 s of timeout_s 10; 4 prompts x 8 samples",
                             **ans.out()}}
    finally:
        ctx.cancel_jobs(made)


def attack_similarity_long(ctx: Ctx, deadline: float) -> dict:
    import random

    rnd = random.Random(0)
    words = [f"w{rnd.randrange(5000)}" for _ in range(4000)]
    a_text = " ".join(words)[:20_000]
    b_text = " ".join(reversed(words))[:20_000]
    metrics = ["rouge_l", "rouge_5", "bleu", "gleu", "fuzzy_match"]
    ans, i, lock = Answers(), [0], threading.Lock()

    def call():
        with lock:
            metric = metrics[i[0] % len(metrics)]
            i[0] += 1
        grader = {"type": "text_similarity", "name": metric, "input": "{{sample.output_text}}",
                  "reference": "{{item.ref}}", "evaluation_metric": metric}
        return ctx.http.post("/v1/graders/run", json={"grader": grader, "sample": {"output_text": a_text},
                                                     "item": {"ref": b_text}}, timeout=left(deadline, 35))

    flood(4, deadline, "POST /v1/graders/run", call, ans)
    return {"attacker": {"threads": 4, "text_chars": len(a_text), "metrics": metrics, **ans.out()}}


def parquet_bombs() -> dict[str, dict]:
    """Two small parquet files with huge rows: {name: {bytes, rows, row_json_bytes_total}}."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = "max:" + "7" * 60_000 + "="  # one row stays under max_row_bytes (64 KiB)
    row_bytes = len(json.dumps({"prompt": prompt, "answer": "7"}))
    out = {}
    n = 2_000_000  # dictionary-encoded: one value, run-length indices; the footer sees almost nothing
    idx = pa.array(np.zeros(n, dtype=np.int32))
    table = pa.table({"prompt": pa.DictionaryArray.from_arrays(idx, pa.array([prompt])),
                      "answer": pa.DictionaryArray.from_arrays(idx, pa.array(["7"]))})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    out["dictionary"] = {"data": buf.getvalue(), "rows": n, "rows_json_bytes": n * row_bytes}
    n = 1_200  # plain strings, zstd: the footer's uncompressed size is the rows' size
    table = pa.table({"prompt": pa.array([prompt] * n), "answer": pa.array(["7"] * n)})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", use_dictionary=False)
    out["plain_zstd"] = {"data": buf.getvalue(), "rows": n, "rows_json_bytes": n * row_bytes}
    return out


def attack_parquet_bomb(ctx: Ctx, deadline: float, bombs: dict | None = None) -> dict:
    bombs = bombs or parquet_bombs()
    ans, i, lock = Answers(), [0], threading.Lock()
    names = sorted(bombs)

    def call():
        with lock:
            name = names[i[0] % len(names)]
            i[0] += 1
        return ctx.http.post("/v1/files", params={"filename": f"bomb-{name}.parquet"}, content=bombs[name]["data"],
                             headers={"Content-Type": "application/octet-stream"}, timeout=left(deadline, 130))

    flood(2, deadline, "POST /v1/files", call, ans)
    return {"attacker": {"threads": 2, "files": {k: {"bytes": len(v["data"]), "rows": v["rows"],
                                                     "rows_json_bytes": v["rows_json_bytes"]}
                                                 for k, v in bombs.items()}, **ans.out()}}


def flood_futures(ctx: Ctx, deadline: float, path: str, body, ans: Answers) -> tuple[list[str], int]:
    """POST `body()` to a Tinker route from 2 threads until the deadline (a 429 waits 0.5 s), keeping the
    futures it queued; then cancel them. (the futures' ids, how many cancels answered 200)."""
    rids, lock = [], threading.Lock()

    def call():
        r = ctx.http.post(path, json=body(), timeout=left(deadline))
        if r.status_code == 200:
            with lock:
                rids.append(r.json()["request_id"])
        return r

    try:
        flood(2, deadline, f"POST {path}", call, ans, on_429_s=0.5)
    finally:
        cancelled = ctx.cancel_futures(list(rids))
    return rids, cancelled


def attack_tinker_fwdbwd_huge(ctx: Ctx, deadline: float) -> dict:
    from marlaas.api.tenancy import Quotas

    plan, ctx_len = Quotas(), ctx.context()
    mid = ctx.model_id()
    ids = ctx.tokenizer("sort:3142=1234;")["input_ids"]
    toks = (ids * (ctx_len // len(ids) + 2))[:ctx_len + 1]
    per_op = min(plan.tinker_max_data_per_op, plan.tinker_max_tokens_per_op // ctx_len)

    def datum():
        return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": toks[:-1]}]},
                "loss_fn_inputs": {"target_tokens": {"data": toks[1:], "dtype": "int64", "shape": [ctx_len]},
                                   "weights": {"data": [1.0] * ctx_len, "dtype": "float32", "shape": [ctx_len]}}}

    data = [datum() for _ in range(per_op)]
    ans, lock = Answers(), threading.Lock()
    probe = ctx.http.post("/api/v1/forward_backward", json={
        "model_id": mid, "seq_id": 1, "forward_backward_input": {"data": data + [datum()], "loss_fn": "cross_entropy"}})
    ans.add("forward_backward over the plan (probe)", probe)

    def body() -> dict:
        with lock:
            ctx.seq += 1
            seq = ctx.seq
        return {"model_id": mid, "seq_id": seq, "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}

    rids, cancelled = flood_futures(ctx, deadline, "/api/v1/forward_backward", body, ans)
    return {"attacker": {"model": mid, "datums_per_op": per_op, "tokens_per_op": per_op * ctx_len,
                         "context": ctx_len, "ops_queued": len(rids), "cancel_answered_200": cancelled,
                         "bounds": {"tinker_max_data_per_op": plan.tinker_max_data_per_op,
                                    "tinker_max_tokens_per_op": plan.tinker_max_tokens_per_op,
                                    "tinker_max_queued_ops": plan.tinker_max_queued_ops}, **ans.out()}}


def attack_tinker_sample_flood(ctx: Ctx, deadline: float) -> dict:
    from marlaas.api.tenancy import Quotas

    plan, ctx_len, base = Quotas(), ctx.context(), ctx.base_name()
    ids = ctx.tokenizer("sort:31=")["input_ids"]
    body = {"num_samples": 128, "prompt": {"chunks": [{"type": "encoded_text", "tokens": ids}]},
            "sampling_params": {"max_tokens": ctx_len - len(ids), "temperature": 1.0}, "base_model": base}
    ans = Answers()
    rids, cancelled = flood_futures(ctx, deadline, "/api/v1/asample", lambda: body, ans)
    return {"attacker": {"samples_per_request": 128, "max_tokens": ctx_len - len(ids), "requests_queued": len(rids),
                         "cancel_answered_200": cancelled, "bound": {"tinker_max_pending_samples":
                                                                 plan.tinker_max_pending_samples}, **ans.out()}}


def attack_rg_expensive(ctx: Ctx, deadline: float) -> dict:
    from marlaas.verify.rg_guard import COSTLY

    largest = COSTLY["count_primes"]["max_n"][0]
    spec = {"task": "reasoning_gym:count_primes", "steps": 100, "eval_size": 1, "eval_k": 0, "prompts_per_step": 2,
            "group_size": 4}
    ans = Answers()
    t0 = time.time()
    big = ctx.submit({**spec, "task_config": {"max_n": 10**10}}, ans, "POST /v1/jobs max_n=1e10")
    refused = {"status": big.status_code, "answer": one_line(big), "seconds": round(time.time() - t0, 2)}
    made, lock = [], threading.Lock()

    def call():
        r = ctx.http.post("/v1/jobs", json={**spec, "task_config": {"max_n": largest}}, timeout=left(deadline, 40))
        if r.status_code == 201:
            with lock:
                made.append(r.json()["id"])
                extra = made[-1] if len(made) > 1 else None
            if extra:
                ctx.cancel_jobs([extra])  # keeps the active-job bound out of the way of the next submit
        return r

    try:
        flood(2, deadline, f"POST /v1/jobs max_n={largest}", call, ans)
    finally:
        ctx.cancel_jobs(made[:1])
    out = {"attacker": {"largest_max_n_the_guard_passes": largest, "jobs_admitted": len(made), **ans.out()}}
    if not made:  # e.g. a base whose context is shorter than the task's prompts: refused after the rows were made
        out["attacker"]["note"] = (f"no submit of max_n={largest} was admitted; each still cost the API host the "
                                   "time in `latency_s` (its rows are made in a child before the refusal)")
    if big.status_code >= 400:
        out["refused_up_front"] = refused["answer"]
        out["attacker"]["max_n_1e10"] = refused
    return out


def attack_events_flood(ctx: Ctx, deadline: float) -> dict:
    import httpx

    ans = Answers()
    r = ctx.submit({**SORT, "steps": 100, "seed": 7}, ans)
    if r.status_code != 201:
        return {"refused_up_front": one_line(r), "attacker": ans.out()}
    jid = r.json()["id"]
    ans.add("POST /v1/jobs/{id}/pause", ctx.http.post(f"/v1/jobs/{jid}/pause"))
    opened = Counter()

    def stream() -> None:
        while time.time() < deadline:
            try:
                with ctx.http.stream("GET", f"/v1/jobs/{jid}/events", headers={"Accept": "text/event-stream"},
                                     timeout=httpx.Timeout(10, read=left(deadline, 2))) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        ans.add("GET /v1/jobs/{id}/events (SSE)", resp)
                        time.sleep(0.5)
                        continue
                    ans.add("GET /v1/jobs/{id}/events (SSE)", resp)
                    opened["held"] += 1
                    for _ in resp.iter_lines():
                        if time.time() >= deadline:
                            break
                    return
            except httpx.HTTPError as e:
                if time.time() < deadline:
                    ans.error("GET /v1/jobs/{id}/events (SSE)", e)
                    time.sleep(0.5)

    streams = [threading.Thread(target=stream, daemon=True) for _ in range(48)]
    try:
        for t in streams:
            t.start()
        paths = [f"/v1/jobs/{jid}", "/v1/jobs"]
        flood(4, deadline, "GET /v1/jobs[/{id}]",
              lambda: ctx.http.get(paths[int(time.time() * 10) % 2], timeout=left(deadline)), ans)
        for t in streams:
            t.join(timeout=max(0.0, deadline - time.time()) + 15)
    finally:
        ctx.cancel_jobs([jid])
    return {"attacker": {"sse_streams": 48, "sse_held_open": opened["held"], "read_threads": 4, **ans.out()}}


ATTACKS = {
    "dryrun_flood": attack_dryrun_flood,
    "slow_grader_job": attack_slow_grader_job,
    "similarity_long": attack_similarity_long,
    "parquet_bomb": attack_parquet_bomb,
    "tinker_fwdbwd_huge": attack_tinker_fwdbwd_huge,
    "tinker_sample_flood": attack_tinker_sample_flood,
    "rg_expensive": attack_rg_expensive,
    "events_flood": attack_events_flood,
}


def longest_gap(ats: list[float], t0: float, t1: float) -> float | None:
    before = [x for x in ats if x < t0]
    points = ([before[-1]] if before else [t0]) + [x for x in ats if t0 <= x < t1] + [t1]
    return round(max(b - a for a, b in zip(points, points[1:])), 2) if len(points) > 1 else None


def steps_per_min(ats: list[float], t0: float, t1: float) -> float:
    return round(sum(1 for x in ats if t0 <= x < t1) / max(t1 - t0, 1e-9) * 60, 1)


def verdict(rec: dict, lease_s: float) -> dict:
    v = rec["victim"]
    ratios = [r for r in (v["ratio"], v["ratio_to_baseline"]) if r is not None]
    ok = {"steps_ratio": bool(ratios) and min(ratios) >= TARGET_RATIO,
          "longest_gap": v["longest_gap_s"] is not None and v["longest_gap_s"] < lease_s,
          "health_p99": v["health_latency_s"].get("p99", 1e9) < TARGET_P99_S and not v["health_latency_s"]["not_200"],
          "job_read_p99": v["job_read_latency_s"].get("p99", 1e9) < TARGET_P99_S
          and not v["job_read_latency_s"]["not_200"]}
    return {**ok, "pass": all(ok.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=60.0, help="seconds of each quiet window and each attack")
    ap.add_argument("--attack", action="append", choices=list(ATTACKS), help="run only these (repeatable)")
    ap.add_argument("--no-tinker", action="store_true", help="no victim Tinker loop (its job only)")
    ap.add_argument("--out", type=Path, default=Path("results/neighbours.json"))
    a = ap.parse_args()
    names = a.attack or list(ATTACKS)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    lease_s = LEASE_S
    out = {"command": shlex.join(["bench/neighbours.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
           "machine": {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
           "window_s": a.window_s, "lease_s": lease_s, "plans": "equal (the default Quotas) for victim and attacker",
           "attacks": []}
    t_begin = time.time()
    home, api, _, stack = make_stack("marlaas-bench-neighbours-", lease_s, flower=False)
    monitor = None

    def write() -> None:
        out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        out["elapsed_s"] = round(time.time() - t_begin, 1)
        recs = out["attacks"]
        out["targets"] = {"victim_steps_ratio_min": TARGET_RATIO, "longest_gap_s_below": lease_s,
                          "health_p99_s_below": TARGET_P99_S, "job_read_p99_s_below": TARGET_P99_S,
                          "per_attack": {r["attack"]: r["pass"] for r in recs},
                          "all_pass": bool(recs) and all(r["pass"]["pass"] for r in recs)}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")

    try:
        store = start_stack(stack, api, flower=False)
        tenants = two_tenants(store, api)
        (vtok, victim), (atok, attacker) = tenants["victim"], tenants["attacker"]

        def victim_job(seed: int) -> str:
            spec = {**SORT, "steps": VICTIM_STEPS, "seed": seed}
            jid = victim.post("/v1/jobs", json=spec).raise_for_status().json()["id"]
            t_wait = time.time() + 240
            while len(store.metrics(jid)) < 3 and time.time() < t_wait:  # past its first steps and evaluation
                time.sleep(1)
            return jid

        vjob = victim_job(1)
        out["victim"] = {"job": vjob, "jobs": [vjob], "spec": {**SORT, "steps": VICTIM_STEPS}}
        ctx = Ctx(api, attacker, atok, home / "base-test", store)
        monitor = Monitor(api, vtok, vjob, stack)
        monitor.start()
        if not a.no_tinker:
            monitor.start_tinker(api, vtok, ctx.tokenizer)
        out["victim"]["tinker_loop"] = (monitor.tinker_note or f"forward_backward (4 datums) + optim_step every "
                                        f"{TINKER_EVERY_S:g} s, the tinker SDK, the victim's token"
                                        if not a.no_tinker else "off (--no-tinker)")
        bombs = parquet_bombs() if "parquet_bomb" in names else None
        print(f"stack up, victim job {vjob}; {len(names)} attacks of {a.window_s:g} s after {a.window_s:g} s "
              "quiet each", flush=True)
        baseline = None
        for name in names:
            left = VICTIM_STEPS - len(store.metrics(vjob))
            if left < 2 * a.window_s * MAX_VICTIM_STEPS_PER_S:  # it could end inside this attack's windows
                victim.post(f"/v1/jobs/{vjob}/cancel")
                vjob = monitor.vjob = victim_job(len(out["victim"]["jobs"]) + 1)
                out["victim"]["jobs"].append(vjob)
            t0 = time.time()
            time.sleep(a.window_s)
            t1 = time.time()
            cpu0 = sum(os.times()[:2])
            try:
                res = (attack_parquet_bomb(ctx, t1 + a.window_s, bombs) if name == "parquet_bomb"
                       else ATTACKS[name](ctx, t1 + a.window_s))
            except Exception as e:  # an attack that cannot be built is recorded as such
                res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            t2 = max(time.time(), t1 + 1e-3)
            cpu = round(sum(os.times()[:2]) - cpu0, 1)
            time.sleep(1.0)  # the victim's step at the window's end gets recorded
            ats = sorted(m["at"] for m in store.metrics(vjob) if "at" in m)
            before, during = steps_per_min(ats, t0, t1), steps_per_min(ats, t1, t2)
            baseline = baseline or before  # the first quiet window: a slow "before" shows a lingering attack
            quiet = monitor.window(t0, t1)
            rec = {"attack": name, "window_s": {"before": round(t1 - t0, 1), "during": round(t2 - t1, 1)},
                   "victim": {"steps_per_min": {"before": before, "during": during, "baseline": baseline},
                              "ratio": round(during / before, 3) if before else None,
                              "ratio_to_baseline": round(during / baseline, 3) if baseline else None,
                              "longest_gap_s": longest_gap(ats, t1, t2), **monitor.window(t1, t2),
                              "before_window": {k: quiet[k] for k in ("health_latency_s", "job_read_latency_s")}},
                   **res, "peak_rss_mib": monitor.peak_rss(t1, t2), "bench_client_cpu_s": cpu}
            rec["pass"] = verdict(rec, lease_s)
            out["attacks"].append(rec)
            write()
            v = rec["victim"]
            print(f"{'ok  ' if rec['pass']['pass'] else 'FAIL'} {name}: steps/min {before} -> {during} "
                  f"(ratio {v['ratio']}), gap {v['longest_gap_s']} s, health p99 {v['health_latency_s'].get('p99')} s, "
                  f"job read p99 {v['job_read_latency_s'].get('p99')} s, attacker "
                  f"{res.get('attacker', {}).get('answers', res.get('error'))}", flush=True)
        write()
        print(f"wrote {a.out}", flush=True)
    finally:
        if monitor is not None:
            monitor.stop.set()
        stack.stop()


if __name__ == "__main__":
    main()
