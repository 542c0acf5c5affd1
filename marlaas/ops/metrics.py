"""Prometheus metrics: a snapshot of the store, rendered in the text exposition format, over HTTP.

    collect(store) -> snapshot (plain dict)  ->  render(snapshot) -> text  ->  GET /metrics

`collect` is the only part that reads Redis (through `Store` methods); `render` is a pure function
of the snapshot, so the exposition format is tested without a server. `serve` is a small stdlib
HTTP server (`ThreadingHTTPServer`) answering `GET /metrics` and `GET /healthz`; the CLI runs it as
`marlaas metrics-server` and the Procfile's `metrics` line runs that. Every family is always
announced with `# HELP` and `# TYPE`, even without samples, and every metric name is listed in
`docs/metrics.md`.

Invariants: a scrape never changes the store; when Redis does not answer, /metrics still answers
200 with `marlaas_store_up 0` (the exporter is up, its target is not) instead of failing the scrape.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis

from marlaas.errors import MarlaasError, NotFound, StoreUnavailable
from marlaas.ops.timeline import STATIONS, busy_fractions
from marlaas.types import TERMINAL_STATUSES
from marlaas.verify.evaluation import figures

log = logging.getLogger(__name__)

WINDOW_S = 60.0
"""Busy fractions cover the last this many seconds of the event log."""
FINISHED_WITHIN_S = 3600.0
"""Finished jobs stay exported this long after their last update (bounds the series count)."""
QUEUES = ("generate", "verify", "train", "control")
WORKER_STATIONS = ("control", "generate", "verify", "train")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help). Order is the exposition order; docs/metrics.md lists the same names.
FAMILIES: dict[str, tuple[str, str]] = {
    "marlaas_store_up": ("gauge", "1 if the store (Redis) answered this scrape, else 0."),
    "marlaas_job_step": ("gauge", "Published adapter version of the job (steps done)."),
    "marlaas_job_steps_total": ("gauge", "Target number of steps of the job (its final version)."),
    "marlaas_job_reward_mean": ("gauge", "Mean reward of the rollouts trained on in the job's last step."),
    "marlaas_job_staleness": ("gauge", "Largest staleness (trained version minus sampling version) in the last step."),
    "marlaas_job_max_staleness": ("gauge", "The job's staleness bound S (max_staleness)."),
    "marlaas_job_eval_exact": ("gauge", "Share of held-out prompts whose greedy completion gets full reward, "
                               "per evaluated adapter version."),
    "marlaas_job_eval_mean_reward": ("gauge", "Mean reward of the held-out greedy completions (partial credit "
                                     "included), per evaluated adapter version."),
    "marlaas_job_eval_accuracy": ("gauge", "Deprecated alias of marlaas_job_eval_exact (the same value)."),
    "marlaas_job_eval_pass_at_k": ("gauge", "Held-out sampled pass@k (unbiased, counted on full-reward samples) "
                                   "of each evaluated version and k."),
    "marlaas_job_status": ("gauge", "1 for the job's current status (label status)."),
    "marlaas_job_regenerated_total": ("counter", "Rollout groups thrown away and generated again."),
    "marlaas_job_verify_errors_total": ("counter", "Verifier errors while scoring the job's rollouts."),
    "marlaas_job_grader_errors_total": ("counter", "Completions the grader could not score, by phase "
                                        "(train, eval)."),
    "marlaas_queue_depth": ("gauge", "Messages waiting in each Celery queue (Redis list length)."),
    "marlaas_station_busy_fraction": ("gauge", "Fraction of the last window each station was busy (union of tasks)."),
    "marlaas_station_busy_window_seconds": ("gauge", "Length of the window the busy fractions cover."),
    "marlaas_trainer_busy": ("gauge", "1 while a job holds the single trainer lane's lease, else 0."),
    "marlaas_trainer_lease": ("gauge", "1 for the job holding the trainer lease (absent when the lane is free)."),
    "marlaas_workers": ("gauge", "Live workers per station (heartbeats that have not expired)."),
}


# ------------------------------------------------------------------ collect (reads the store)
def collect(store, now: float | None = None, window_s: float = WINDOW_S,
            finished_within_s: float | None = FINISHED_WITHIN_S) -> dict:
    """A snapshot of everything `render` exports. Reads only; a Redis failure gives {"up": False}."""
    now = time.time() if now is None else now
    try:
        return _collect(store, now, window_s, finished_within_s)
    except (redis.RedisError, StoreUnavailable) as e:
        return {"up": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def _collect(store, now: float, window_s: float, finished_within_s: float | None) -> dict:
    jobs = []
    for jid in store.job_ids():
        try:
            rec = store.job(jid)
        except NotFound:  # deleted between listing and reading
            continue
        updated = float(rec.extra.get("updated") or rec.created)
        if rec.status in TERMINAL_STATUSES and finished_within_s is not None and now - updated > finished_within_s:
            continue
        last = store.last_metrics(jid) or {}
        stale = last.get("staleness")
        evs = dict(sorted(store.evals(jid).items()))
        jobs.append({
            "job": jid,
            "tenant": rec.tenant,
            "task": rec.spec.task or "dataset",
            "status": rec.status,
            "step": rec.version,
            "steps_total": rec.spec.steps,
            "reward_mean": last.get("reward_mean"),
            "staleness": max(stale) if stale else None,
            "max_staleness": rec.spec.max_staleness,
            "regenerated": int(rec.extra.get("regenerated") or 0),
            "verify_errors": int(rec.extra.get("verify_errors") or 0),
            "eval_verify_errors": int(rec.extra.get("eval_verify_errors") or 0),
            "evals": {v: figures(e)[0] for v, e in evs.items()},
            "mean_reward": {v: figures(e)[1] for v, e in evs.items()},
            "pass_at": {v: e.get("pass_at", {}) for v, e in evs.items()},
        })
    lease = store.trainer_lease()
    workers = dict.fromkeys(WORKER_STATIONS, 0)
    for info in store.workers().values():
        st = info.get("station", "?")
        workers[st] = workers.get(st, 0) + 1
    return {
        "up": True,
        "time": now,
        "jobs": jobs,
        "queues": store.queue_depths(QUEUES),
        "window_s": window_s,
        "busy": busy_fractions(store.events_since(now - window_s), now - window_s, now),
        "trainer": {"job": lease.get("job") if lease else None},
        "workers": workers,
    }


# ------------------------------------------------------------------ render (pure)
def escape_label(v) -> str:
    """A label value as the exposition format wants it: backslash, double quote and newline escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def fmt_value(x) -> str:
    """A sample value: integers without a point, floats in Python's shortest repr, NaN/+Inf/-Inf."""
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(x)


def _line(name: str, labels: dict, value) -> str:
    if labels:
        inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {fmt_value(value)}"
    return f"{name} {fmt_value(value)}"


def render(snapshot: dict) -> str:
    """The Prometheus text exposition (format 0.0.4) of a `collect` snapshot."""
    samples: dict[str, list[tuple[dict, object]]] = {name: [] for name in FAMILIES}
    up = bool(snapshot.get("up", True))
    samples["marlaas_store_up"].append(({}, 1 if up else 0))
    for j in snapshot.get("jobs", []) if up else []:
        base = {"job": j["job"], "tenant": j["tenant"], "task": j["task"]}
        samples["marlaas_job_step"].append((base, j["step"]))
        samples["marlaas_job_steps_total"].append((base, j["steps_total"]))
        if j.get("reward_mean") is not None:
            samples["marlaas_job_reward_mean"].append((base, j["reward_mean"]))
        if j.get("staleness") is not None:
            samples["marlaas_job_staleness"].append((base, j["staleness"]))
        if j.get("max_staleness") is not None:
            samples["marlaas_job_max_staleness"].append((base, j["max_staleness"]))
        for v, exact in sorted((int(v), a) for v, a in j.get("evals", {}).items()):
            if exact is not None:
                samples["marlaas_job_eval_exact"].append(({**base, "version": v}, exact))
                samples["marlaas_job_eval_accuracy"].append(({**base, "version": v}, exact))
        for v, mean in sorted((int(v), a) for v, a in j.get("mean_reward", {}).items()):
            if mean is not None:
                samples["marlaas_job_eval_mean_reward"].append(({**base, "version": v}, mean))
        for v, by_k in sorted((int(v), p) for v, p in j.get("pass_at", {}).items()):
            for k, val in sorted(by_k.items(), key=lambda kv: int(kv[0])):
                if val is not None:
                    samples["marlaas_job_eval_pass_at_k"].append(({**base, "version": v, "k": int(k)}, val))
        samples["marlaas_job_status"].append(({**base, "status": j["status"]}, 1))
        samples["marlaas_job_regenerated_total"].append((base, j.get("regenerated", 0)))
        samples["marlaas_job_verify_errors_total"].append((base, j.get("verify_errors", 0)))
        samples["marlaas_job_grader_errors_total"].append(({**base, "phase": "train"}, j.get("verify_errors", 0)))
        samples["marlaas_job_grader_errors_total"].append(({**base, "phase": "eval"}, j.get("eval_verify_errors", 0)))
    if up:
        for q, n in snapshot.get("queues", {}).items():
            samples["marlaas_queue_depth"].append(({"queue": q}, n))
        busy = snapshot.get("busy", {})
        for st in STATIONS:
            if st in busy:
                samples["marlaas_station_busy_fraction"].append(({"station": st}, busy[st]))
        if "window_s" in snapshot:
            samples["marlaas_station_busy_window_seconds"].append(({}, snapshot["window_s"]))
        holder = (snapshot.get("trainer") or {}).get("job")
        samples["marlaas_trainer_busy"].append(({}, 1 if holder else 0))
        if holder:
            samples["marlaas_trainer_lease"].append(({"job": holder}, 1))
        for st, n in snapshot.get("workers", {}).items():
            samples["marlaas_workers"].append(({"station": st}, n))
    out = []
    if not up and snapshot.get("error"):
        out.append("# store unavailable: " + _escape_help(snapshot["error"]))
    for name, (kind, help_) in FAMILIES.items():
        out.append(f"# HELP {name} {_escape_help(help_)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_line(name, labels, value) for labels, value in samples[name])
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ HTTP server (stdlib)
class _StoreRef:
    """The store, opened on first use: the server may start before Redis does (Procfile order)."""

    def __init__(self, url: str | None):
        self.url = url
        self.store = None

    def get(self):
        if self.store is None:
            from marlaas.store import Store

            self.store = Store(self.url)
        return self.store


def make_server(host: str = "127.0.0.1", port: int = 9109, url: str | None = None,
                window_s: float = WINDOW_S, token: str | None = None) -> ThreadingHTTPServer:
    """A bound (not yet serving) metrics server; port 0 picks a free port (see `server_address`).

    The metrics name every tenant's jobs: they are for the operator only. With `token`
    (MARLAAS_METRICS_TOKEN) `/metrics` needs `Authorization: Bearer <token>` from every peer, loopback
    included; a non-loopback bind without a token is refused. The embedded default (no token
    configured) serves loopback peers without one: every user of the host can read it, so a shared
    host sets the token (docs/metrics.md). Tenants read their own jobs' metrics through the API."""
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise MarlaasError(f"refusing to serve every tenant's metrics on {host} without a token: "
                           "set MARLAAS_METRICS_TOKEN (Prometheus sends it as a bearer token)")
    ref = _StoreRef(url)

    class Handler(BaseHTTPRequestHandler):
        server_version = "marlaas-metrics"

        def do_GET(self):  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if token is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", ""), f"Bearer {token}"):
                    return self._send(401, "metrics need the operator's bearer token\n")
                try:
                    snap = collect(ref.get(), window_s=window_s)
                except StoreUnavailable as e:  # no Redis URL yet (collect handles a silent server)
                    snap = {"up": False, "error": str(e)}
                except Exception as e:  # a bug: say so in the response and the log, keep serving
                    log.exception("metrics collection failed")
                    return self._send(500, f"metrics collection failed: {type(e).__name__}: {e}\n")
                return self._send(200, render(snap), CONTENT_TYPE)
            if path == "/healthz":
                try:
                    redis_ok = ref.get().ping()
                except (MarlaasError, redis.RedisError):
                    redis_ok = False
                return self._send(200, f"ok (redis {'up' if redis_ok else 'down'})\n")
            return self._send(404, "not found: try /metrics or /healthz\n")

        def _send(self, code: int, body: str, ctype: str = "text/plain; charset=utf-8"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # scrapes every few seconds: keep them out of the logs
            log.debug("%s %s", self.address_string(), fmt % args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(host: str = "127.0.0.1", port: int = 9109, url: str | None = None, window_s: float = WINDOW_S) -> None:
    """Serve /metrics and /healthz until interrupted."""
    server = make_server(host, port, url, window_s)
    try:
        server.serve_forever()
    finally:
        server.server_close()
