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

Serving (the OpenAI-compatible door, `marlaas.api.routes.openai`): a sample request whose body has
`serve` ("chat" | "completion") carries text, not tokens: chat messages are rendered here with the
base's chat template (a base without one: the messages' contents joined by newlines, so a single user
message is exactly the raw prompt a job trained on), then tokenized as the engines tokenize a text
prompt. Its result carries per-choice text (cut before the first stop string, which OpenAI leaves
out), tokens, logprobs, the prompt's token count, and the sha256 of the adapter weights the engine
loaded for it (`RecordingSource`). Sample requests are the latency class of a generate batch: they go
first in the engine call, and while training work is waiting they take at most `serve_share` of its
rows (`serving_rows`; at least one request rides, so serving never starves); the rest go back to the
front of the queue (`SampleBatch.limit`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
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
    if body.get("serve"):
        return serve_request(tokenizer, rid, body)
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


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Chat messages ({role, content: str}) as the prompt text: the base's chat template with the
    generation prompt; a base without a template gets the contents joined by newlines."""
    if not messages or not all(isinstance(m.get("content"), str) for m in messages):
        raise SampleError("messages must be a non-empty list of {role, content} with text content")
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(m["content"] for m in messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template is Jinja shipped with the base: its error is the request's
        raise SampleError(f"the base model's chat template fails on these messages ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(text, str) or not text:
        raise SampleError("the base model's chat template gave no text for these messages")
    return text


def serve_request(tokenizer, rid: str, body: dict) -> GenRequest:
    """The engine request of one serving request (`body["serve"]`: "chat" | "completion")."""
    text = render_chat(tokenizer, body.get("messages") or []) if body["serve"] == "chat" else body.get("prompt")
    if not isinstance(text, str) or not text:
        raise SampleError("the prompt must be a non-empty string")
    ids = list(tokenizer(text)["input_ids"])
    if not ids:
        raise SampleError("the prompt has no tokens")
    p = body.get("params") or {}
    temperature = float(1.0 if p.get("temperature") is None else p["temperature"])
    top_p = float(1.0 if p.get("top_p") is None else p["top_p"])
    max_tokens = int(p.get("max_tokens") or DEFAULT_MAX_TOKENS)
    stop = tuple(p.get("stop") or ())
    if temperature < 0 or not 0 < top_p <= 1 or max_tokens < 1 or any(not s for s in stop):
        raise SampleError("temperature must be >= 0, top_p in (0, 1], max_tokens >= 1 and stop strings "
                          "non-empty")
    ref = AdapterRef(body["model"], int(body["version"])) if body.get("model") else None
    return GenRequest(key=rid, prompt=text, prompt_ids=ids, adapter=ref, n=int(body.get("n", 1)),
                      temperature=temperature if temperature > 0 else 1.0, greedy=temperature <= 0,
                      max_new_tokens=max_tokens, seed=p.get("seed"), stop=stop, top_p=top_p)


def serving_rows(train_rows: int, share: float) -> float:
    """The most rows sample requests may take in a generate call with `train_rows` rows of training
    work waiting, so that they are at most `share` of the call's rows: share / (1 - share) x train_rows
    (no bound without training work or with share 1)."""
    if train_rows <= 0 or share >= 1:
        return math.inf
    return math.floor(max(share, 0.0) * train_rows / (1.0 - share) + 1e-9)


class RecordingSource:
    """An engine's adapter source that remembers the sha256 of the weights it handed the engine for
    each version (the last `keep` versions): what a served request was sampled with."""

    def __init__(self, source, keep: int = 4096):
        self.source, self.keep = source, keep
        self.hashes: OrderedDict[AdapterRef, str] = OrderedDict()

    def __call__(self, ref: AdapterRef):
        blob = self.source(ref)
        self.hashes[ref] = hashlib.sha256(blob.weights).hexdigest()
        self.hashes.move_to_end(ref)
        while len(self.hashes) > self.keep:
            self.hashes.popitem(last=False)
        return blob


def record_adapters(engine) -> RecordingSource:
    """The engine's adapter source, wrapped in a `RecordingSource` once (engines fetch adapters only
    through their public `adapter_source`)."""
    if not isinstance(engine.adapter_source, RecordingSource):
        engine.adapter_source = RecordingSource(engine.adapter_source)
    return engine.adapter_source


def adapter_sha256(engine, ref: AdapterRef | None) -> str | None:
    """The sha256 of the weights the engine loaded for `ref` (None: the base model). A version loaded
    before it was recorded is hashed from its source: a published version's bytes never change."""
    if ref is None:
        return None
    src = record_adapters(engine)
    if ref not in src.hashes:
        return hashlib.sha256(src.source(ref).weights).hexdigest()
    return src.hashes[ref]


def served(tokenizer, r: GenRequest, res: GenResult, logprobs: bool) -> list[dict]:
    """The choices of a serving request: text cut before the first stop string (finish "stop", as on
    EOS; else "length"), its tokens and their logprobs (and each token's text when `logprobs`)."""
    out = []
    for c in res.completions:
        text, finish = c.text, "stop" if c.finished else "length"
        cuts = [i for i in (text.find(s) for s in r.stop) if i >= 0]
        if cuts:
            text, finish = text[:min(cuts)], "stop"
        choice = {"text": text, "tokens": c.token_ids, "logprobs": c.logprobs, "finish_reason": finish,
                  "completion_tokens": len(c.token_ids)}
        if logprobs:
            pieces, acc = [], 0
            for t in c.token_ids:
                if acc >= len(text):
                    break
                piece = tokenizer.decode([t], skip_special_tokens=True)
                pieces.append(piece)
                acc += len(piece)
            choice["token_texts"] = pieces
        out.append(choice)
    return out


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
                if body.get("serve"):
                    self.ts.finish(r.key, {"choices": served(tok, r, res, bool(body.get("logprobs"))),
                                           "prompt_tokens": len(r.prompt_ids or ()),
                                           "adapter_sha256": adapter_sha256(self.engine, r.adapter)})
                    continue
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

    def rows(self) -> int:
        return sum(r.n for r in self.requests)

    def limit(self, max_rows: float) -> list[str]:
        """Keep the requests (in queue order) that fit in `max_rows` rows, at least the first; the rest
        go back to the front of the sample queue, for the next engine call. Returns their ids."""
        kept, rows = [], 0
        for r in self.requests:
            if kept and rows + r.n > max_rows:
                break
            kept.append(r)
            rows += r.n
        rest = [r.key for r in self.requests[len(kept):]]
        if rest:
            self.requests = kept
            self.bodies = {r.key: self.bodies[r.key] for r in kept}
            self.ts.store.requeue_samples(rest)
        return rest

    def fail(self, err: BaseException) -> None:
        """Every request of the batch fails with the engine call's reason (the station goes on)."""
        for r in self.requests:
            self.ts.fail(r.key, f"{type(err).__name__}: {err}", "server")
        self.done = True


def take(ts, engine, rids: list[str]) -> SampleBatch:
    """The still pending requests among `rids` as engine requests; one that cannot be served fails now."""
    batch = SampleBatch(ts, engine)
    record_adapters(engine)
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
