"""The calculator tool: a real local HTTP service standing for a remote tool, and its client.

Server (`marlaas tool-server`, the Procfile's `tool` line): a threaded stdlib HTTP server.

    POST /calc  {"expr": "47*38"}  ->  200 {"value": "1786"}
                                   ->  400 {"error": "..."}   (not arithmetic, too large, 1/0, bad JSON)
    GET  /healthz                  ->  200 {"ok": true, "latency_ms": L}

Every /calc call first sleeps the configured per-call latency (`--latency-ms`, default
`DEFAULT_LATENCY_MS` = 100 ms), standing for a remote tool's round trip; calls are served on their
own threads, so concurrent calls overlap. Expressions are evaluated by walking their `ast`
(numbers, + - * / // %, parentheses; `families.safe_eval`), never by `eval`. Values are integers
when integral, else rounded to 6 decimals.

Client: `call(url, expr)` returns the value or None when the tool fails (unreachable, timeout,
error answer): a tool failure is part of the episode (an error result), never a crash.
`call_many` runs calls concurrently on a thread pool (the verify station's use).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from marlaas.families import safe_eval

log = logging.getLogger("marlaas.tools.calculator")

DEFAULT_LATENCY_MS = 100.0
MAX_BODY = 4096
CALL_TIMEOUT_S = 10.0


def calculate(expr: str) -> str:
    """The calculator's value of an arithmetic expression as text; ValueError when it has none."""
    v = safe_eval(expr, max_abs=1e12)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("no finite value")
        if v.is_integer():
            v = int(v)
        else:
            return f"{round(v, 6):.6f}".rstrip("0").rstrip(".")
    return str(v)


class _Handler(BaseHTTPRequestHandler):
    server_version = "marlaas-tool/1"
    latency_s = DEFAULT_LATENCY_MS / 1000

    def _send(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/healthz":
            self._send(200, {"ok": True, "latency_ms": self.latency_s * 1000})
        else:
            self._send(404, {"error": f"no such path {self.path}"})

    def do_POST(self):  # noqa: N802
        if self.path != "/calc":
            self._send(404, {"error": f"no such path {self.path}"})
            return
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            self._send(413, {"error": f"body over {MAX_BODY} bytes"})
            return
        raw = self.rfile.read(n)
        time.sleep(self.latency_s)  # the documented per-call latency of a remote tool
        try:
            expr = json.loads(raw)["expr"]
            if not isinstance(expr, str):
                raise TypeError("expr must be a string")
        except (ValueError, KeyError, TypeError) as e:
            self._send(400, {"error": f"bad request: {e}"})
            return
        try:
            self._send(200, {"value": calculate(expr)})
        except ValueError as e:
            self._send(400, {"error": str(e)})

    def log_message(self, fmt, *args):  # one debug line per call, not stderr noise
        log.debug("%s " + fmt, self.address_string(), *args)


def make_server(host: str = "127.0.0.1", port: int = 0, latency_ms: float = DEFAULT_LATENCY_MS) -> ThreadingHTTPServer:
    """A calculator server bound to (host, port) (port 0: any free one); call `serve_forever()`."""
    if latency_ms < 0:
        raise ValueError("latency_ms must be >= 0")
    handler = type("CalcHandler", (_Handler,), {"latency_s": latency_ms / 1000})
    return _Server((host, port), handler)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # a verify batch opens one connection per call at once (default 5 resets some)


def call(url: str, expr: str, timeout: float = CALL_TIMEOUT_S) -> str | None:
    """The tool's value of `expr`, or None when the tool fails (logged; never raises)."""
    req = urllib.request.Request(url.rstrip("/") + "/calc", data=json.dumps({"expr": expr}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return str(json.loads(resp.read())["value"])
    except urllib.error.HTTPError as e:
        log.info("tool at %s refused %r: HTTP %s", url, expr, e.code)
    except (OSError, ValueError, KeyError) as e:
        log.warning("tool at %s failed for %r: %s", url, expr, e)
    return None


def call_many(url: str, exprs: list[str], max_workers: int = 32, timeout: float = CALL_TIMEOUT_S) -> list[str | None]:
    """`call` for every expression, concurrently; values in order (None where the tool failed)."""
    if not exprs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(exprs)))) as pool:
        return list(pool.map(lambda e: call(url, e, timeout), exprs))


__all__ = ["DEFAULT_LATENCY_MS", "calculate", "call", "call_many", "make_server"]
