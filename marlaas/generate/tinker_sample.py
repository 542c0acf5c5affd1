"""The generate station's side of the Tinker protocol: queued sample requests as engine requests, served
in the jobs' mixed engine calls (Celery-free; tasks/generate.py wraps it).

A sample request names a sampler snapshot (AdapterRef(model, v), stored like a job's adapter) or the
base model, a prompt as token ids and the SDK's SamplingParams. Mapping onto `GenRequest`:
- the prompt's token ids go to the engine as they are (`GenRequest.prompt_ids`: no decode -> encode,
  so any token sequence is sampled exactly);
- temperature 0 is greedy; max_tokens -> max_new_tokens (default 16); seed is honoured; top_k (-1 or
  0: off) and top_p (1.0: off) truncate the distribution sampled from (and its logprobs);
- `stop`: a string or a list of strings (stop strings, which may span tokens: matched on the decoded
  completion) or a list of token ids (stop tokens); the stop stays in the sequence;
- sequences end with "stop" when the model emitted EOS or reached a stop, else "length".
Prompt logprobs (when asked) are the engine's public `prompt_logprobs(ref, tokens, last_n)` (one extra
forward with the same adapter on the HF engine; position 0 and, with `prompt_logprobs_last_n`, the
positions before the last n have None); the vLLM engine refuses them with a SampleError.

Batching: `take` reads the pending requests a generate task took from the store (`TinkerStore.take_samples`
removes them atomically, so each is served by exactly one task) into a `SampleBatch`; the generate
station appends its requests to the jobs' batch (`marlaas.generate.station.run_generate`), so they ride
in the same engine call, and `SampleBatch.finish` writes each future once (`TinkerStore.finish` keeps
the first end of a future). A request that cannot be served fails at once with a one-line reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from marlaas.errors import SampleError
from marlaas.generate.engine import StopMatcher
from marlaas.types import AdapterRef, GenRequest, GenResult

log = logging.getLogger("marlaas.tinker")
DEFAULT_MAX_TOKENS = 16


def _stops(stop) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The SDK's `stop` (str, list of str or list of token ids) as (stop strings, stop token ids)."""
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        return (stop,), ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop), ()
    if isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return (), tuple(stop)
    raise SampleError("sampling_params.stop must be a string, a list of strings or a list of token ids")


def gen_request(tokenizer, rid: str, body: dict) -> GenRequest:
    """The engine request of one Tinker sample request (SampleError when it cannot be served)."""
    tokens = [int(t) for t in body["tokens"]]
    vocab = len(tokenizer)
    if not tokens or not all(0 <= t < vocab for t in tokens):
        raise SampleError(f"the prompt must be token ids of this base's vocabulary (0..{vocab - 1})")
    p = body.get("params") or {}
    top_k, top_p = int(p.get("top_k", -1) if p.get("top_k") is not None else -1), float(p.get("top_p") or 1.0)
    if top_k < -1 or not 0 < top_p <= 1:
        raise SampleError(f"top_k must be -1 (off) or >= 0 and top_p in (0, 1], got {top_k} and {top_p}")
    stop, stop_ids = _stops(p.get("stop"))
    if any(not s for s in stop) or not all(0 <= t < vocab for t in stop_ids):
        raise SampleError("stop strings must not be empty and stop token ids must be in this base's vocabulary")
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and not (body.get("prompt_logprobs") and 1 <= int(last_n) <= len(tokens) - 1):
        raise SampleError(f"prompt_logprobs_last_n needs prompt_logprobs and must be in 1..{len(tokens) - 1} "
                          f"(the prompt has {len(tokens)} tokens), got {last_n}")
    temperature = float(p.get("temperature", 1.0) if p.get("temperature") is not None else 1.0)
    max_tokens = int(p.get("max_tokens") or DEFAULT_MAX_TOKENS)
    if temperature < 0 or max_tokens < 1:
        raise SampleError(f"temperature must be >= 0 and max_tokens >= 1, got {temperature} and {max_tokens}")
    ref = AdapterRef(body["model"], int(body["version"])) if body.get("model") else None
    return GenRequest(key=rid, prompt=tokenizer.decode(tokens), prompt_ids=tokens, adapter=ref,
                      n=int(body.get("n", 1)), temperature=temperature if temperature > 0 else 1.0,
                      greedy=temperature <= 0, max_new_tokens=max_tokens, seed=p.get("seed"),
                      stop=stop, stop_token_ids=stop_ids, top_k=max(0, top_k), top_p=top_p)


@dataclass
class SampleBatch:
    """Tinker sample requests taken for one engine call, and how to write their futures."""

    ts: object
    engine: object
    requests: list[GenRequest] = field(default_factory=list)
    bodies: dict[str, dict] = field(default_factory=dict)
    done: bool = False

    def finish(self, results: list[GenResult]) -> None:
        """Write each request's future from its engine result (in request order)."""
        tok = self.engine.tokenizer
        for r, res in zip(self.requests, results):
            body = self.bodies[r.key]
            stops = StopMatcher(tok, r.stop, r.stop_token_ids)
            try:
                seqs = [{"tokens": c.token_ids, "logprobs": c.logprobs,
                         "stop_reason": "stop" if c.finished or stops.end(c.token_ids) == len(c.token_ids)
                         else "length"} for c in res.completions]
                out: dict = {"sequences": seqs}
                if body.get("prompt_logprobs"):
                    out["prompt_logprobs"] = self.engine.prompt_logprobs(r.adapter, list(body["tokens"]),
                                                                         body.get("prompt_logprobs_last_n"))
                self.ts.finish(r.key, out)
            except (SampleError, ValueError) as e:
                self.ts.fail(r.key, f"{type(e).__name__}: {e}", "user")
            except Exception as e:
                log.exception("tinker sample %s failed", r.key)
                self.ts.fail(r.key, f"{type(e).__name__}: {e}", "server")
        self.done = True

    def fail(self, err: BaseException) -> None:
        """Every request of the batch fails with the engine call's reason (the station goes on)."""
        for r in self.requests:
            self.ts.fail(r.key, f"{type(err).__name__}: {err}", "server")
        self.done = True


def take(ts, engine, rids: list[str]) -> SampleBatch:
    """The still pending requests among `rids` as engine requests; one that cannot be served fails now."""
    batch = SampleBatch(ts, engine)
    for rid in rids:
        try:
            req = ts.request(rid)
            if req["status"] != "pending":
                continue  # cancelled (or already served): never run twice
            batch.requests.append(gen_request(engine.tokenizer, rid, req["body"]))
            batch.bodies[rid] = req["body"]
        except (SampleError, ValueError, KeyError) as e:
            ts.fail(rid, f"{type(e).__name__}: {e}", "user")
    return batch


def run_samples(ts, engine, rids: list[str]) -> int:
    """Serve the pending sample requests `rids` in one engine call of their own (no job work waiting);
    write each future. Returns how many were served."""
    batch = take(ts, engine, rids)
    if not batch.requests:
        return 0
    try:
        results = engine.generate(batch.requests)
    except Exception as e:  # every request of the call fails with the reason; the station goes on
        log.exception("tinker sample batch failed")
        batch.fail(e)
        return len(batch.requests)
    batch.finish(results)
    return len(batch.requests)
