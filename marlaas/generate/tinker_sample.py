"""The generate station's side of the Tinker protocol: serve queued sample requests in ONE engine call
(Celery-free; tasks/tinker.py wraps it).

A sample request names a sampler snapshot (AdapterRef(model, v), stored like a job's adapter) or the
base model, a prompt as token ids and the SDK's SamplingParams. Mapping onto `GenRequest`:
- the prompt is decoded to text and must encode back to the same ids (engines take text), else the
  request fails with a clear error (true for the built-in character-level base);
- temperature 0 is greedy; max_tokens -> max_new_tokens (default 16); seed is honoured;
- stop strings / stop token ids must each be ONE token (engine limit); top_k / top_p other than off
  are refused;
- sequences end with "stop" when the model emitted EOS or a stop token, else "length".
Prompt logprobs (when asked) are the engine's public `prompt_logprobs(ref, tokens)` (one extra forward
with the same adapter on the HF engine; position 0 has none: None); the vLLM engine refuses them
with a SampleError.
"""

from __future__ import annotations

import logging

from marlaas.errors import SampleError
from marlaas.types import AdapterRef, GenRequest

log = logging.getLogger("marlaas.tinker")
DEFAULT_MAX_TOKENS = 16


def gen_request(tokenizer, rid: str, body: dict) -> GenRequest:
    """The engine request of one Tinker sample request (SampleError when it cannot be served)."""
    tokens = list(body["tokens"])
    text = tokenizer.decode(tokens)
    if tokenizer(text)["input_ids"] != tokens:
        raise SampleError("the prompt's token ids do not survive decode/encode with this base's tokenizer")
    p = body.get("params") or {}
    if int(p.get("top_k", -1) or -1) not in (-1, 0) or float(p.get("top_p", 1.0) or 1.0) != 1.0:
        raise SampleError("top_k / top_p are not supported: sample from the full distribution")
    stop = p.get("stop")
    stops: list[str] = []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        stops = [tokenizer.decode([s]) if isinstance(s, int) else str(s) for s in stop]
    temperature = float(p.get("temperature", 1.0))
    ref = AdapterRef(body["model"], int(body["version"])) if body.get("model") else None
    return GenRequest(key=rid, prompt=text, adapter=ref, n=int(body.get("n", 1)),
                      temperature=temperature if temperature > 0 else 1.0, greedy=temperature <= 0,
                      max_new_tokens=int(p.get("max_tokens") or DEFAULT_MAX_TOKENS),
                      seed=p.get("seed"), stop=tuple(stops))


def run_samples(ts, engine, rids: list[str]) -> int:
    """Serve the pending sample requests `rids` in one engine call; write each future. Returns how many."""
    reqs, bodies = [], {}
    for rid in rids:
        try:
            req = ts.request(rid)
            if req["status"] != "pending":
                continue
            bodies[rid] = req["body"]
            reqs.append(gen_request(engine.tokenizer, rid, req["body"]))
        except (SampleError, ValueError, KeyError) as e:
            ts.fail(rid, f"{type(e).__name__}: {e}", "user")
    if not reqs:
        return 0
    try:
        results = engine.generate(reqs)
    except Exception as e:  # every request of the call fails with the reason; the station goes on
        log.exception("tinker sample batch failed")
        for r in reqs:
            ts.fail(r.key, f"{type(e).__name__}: {e}", "server")
        return len(reqs)
    for r, res in zip(reqs, results):
        body = bodies[r.key]
        try:
            seqs = [{"tokens": c.token_ids, "logprobs": c.logprobs,
                     "stop_reason": "stop" if c.finished or (r.stop and c.token_ids and
                                                             engine.tokenizer.decode(c.token_ids[-1:]) in r.stop)
                     else "length"} for c in res.completions]
            out: dict = {"sequences": seqs}
            if body.get("prompt_logprobs"):
                out["prompt_logprobs"] = engine.prompt_logprobs(r.adapter, list(body["tokens"]))
            ts.finish(r.key, out)
        except SampleError as e:
            ts.fail(r.key, f"SampleError: {e}", "user")
        except Exception as e:
            log.exception("tinker sample %s failed", r.key)
            ts.fail(r.key, f"{type(e).__name__}: {e}", "server")
    return len(reqs)
