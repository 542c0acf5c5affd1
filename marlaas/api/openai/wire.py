"""The OpenAI wire format of the serving door: request bodies, the sample requests they become, the
response bodies, server-sent-event chunks and the error shape (pure: plain data in and out).

Invariants:
- A request is validated whole before anything is queued; a parameter marlaas does not serve
  (tools, response_format, logit_bias, penalties other than 0, top logprobs, echo, suffix, token-id
  prompts) is a 400 naming it, never silently ignored.
- temperature 0 is greedy; `seed` makes sampled choices reproducible; `stop` strings end a choice and
  are left out of its text (finish_reason "stop", as on EOS; else "length").
- Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}` with the status the official SDK
  maps to its exceptions (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError,
  404 NotFoundError, 409 ConflictError, 429 RateLimitError, 5xx InternalServerError).
- `system_fingerprint` is the sha256 of the adapter weights the generate engine sampled with (the
  same as the `x-marlaas-adapter-sha256` header); "base" for the base model.
"""

from __future__ import annotations

import json
import math
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from marlaas.errors import MarlaasError, RateLimited, SpecError

MAX_N = 16
MAX_PROMPTS = 16
DEFAULT_CHAT_MAX_TOKENS = 128
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's own default for /v1/completions
HEADER = "x-marlaas-adapter-sha256"


class _Request(BaseModel):
    """Parameters both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=300)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=32_768)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties are not served by marlaas (send 0 or leave them out)")
        return v

    def params(self, max_tokens: int | None) -> dict:
        """The sampling parameters of the sample request."""
        return {"temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": self.top_p, "max_tokens": max_tokens, "stop": list(self.stop or []), "seed": self.seed}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as text: a list of parts must be text parts only."""
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
            raise SpecError("invalid request: messages: only text content is served by marlaas")
        return "".join(p["text"] for p in parts)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, le=32_768)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top(cls, v):
        if v:
            raise ValueError("top logprobs are not served by marlaas (logprobs: true gives the sampled tokens')")
        return v
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None

    def body(self, target_job: str | None, version: int | None) -> dict:
        return {"serve": "chat", "messages": [{"role": m.role, "content": m.text()} for m in self.messages],
                "model": target_job or "", "version": version or 0, "n": self.n,
                "logprobs": bool(self.logprobs),
                "params": self.params(self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS)}


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if len(prompts) > MAX_PROMPTS or any(not isinstance(p, str) or not p for p in prompts):
            raise ValueError(f"prompt must be a non-empty string or a list of at most {MAX_PROMPTS} of them")
        return prompts

    @field_validator("echo", "suffix")
    @classmethod
    def _unserved(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not served by marlaas")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_top(cls, v):
        if v:
            raise ValueError("top logprobs are not served by marlaas (logprobs: 0 gives the sampled tokens')")
        return v

    def bodies(self, target_job: str | None, version: int | None) -> list[dict]:
        if self.best_of not in (None, self.n):
            raise SpecError("invalid request: best_of: only best_of = n (or none) is served by marlaas")
        return [{"serve": "completion", "prompt": p, "model": target_job or "", "version": version or 0,
                 "n": self.n, "logprobs": self.logprobs is not None,
                 "params": self.params(self.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)} for p in self.prompt]


def fingerprint(sha: str | None) -> str:
    return sha or "base"


def usage(results: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    completion = sum(c["completion_tokens"] for r in results for c in r["choices"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(c: dict) -> dict:
    pieces = c.get("token_texts") or []
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(pieces, c["logprobs"])], "refusal": None}


def completion_logprobs(c: dict) -> dict:
    pieces = c.get("token_texts") or []
    offsets, at = [], 0
    for t in pieces:
        offsets.append(at)
        at += len(t)
    return {"tokens": pieces, "token_logprobs": c["logprobs"][:len(pieces)], "top_logprobs": None,
            "text_offset": offsets}


def chat_body(rid: str, model: str, result: dict, logprobs: bool) -> dict:
    """The chat.completion of one served request."""
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(result["adapter_sha256"]),
            "choices": [{"index": i, "message": {"role": "assistant", "content": c["text"], "refusal": None},
                         "logprobs": chat_logprobs(c) if logprobs else None, "finish_reason": c["finish_reason"]}
                        for i, c in enumerate(result["choices"])],
            "usage": usage([result])}


def completion_body(rid: str, model: str, results: list[dict], logprobs: bool) -> dict:
    """The text_completion of served requests (one per prompt; choice index = prompt x n + j)."""
    choices = [c for r in results for c in r["choices"]]
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint(results[0]["adapter_sha256"]),
            "choices": [{"index": i, "text": c["text"], "logprobs": completion_logprobs(c) if logprobs else None,
                         "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)],
            "usage": usage(results)}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def chat_chunks(body: dict, include_usage: bool) -> list[str]:
    """A finished chat.completion as OpenAI's stream of chat.completion.chunk events: per choice its
    role, its content, its end; then the usage (when asked) and [DONE]."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    chunk = {**head, "object": "chat.completion.chunk"}
    out = []
    for c in body["choices"]:
        i = c["index"]
        out.append(sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}))
        out.append(sse({**chunk, "choices": [{"index": i, "delta": {"content": c["message"]["content"]},
                                              "logprobs": c["logprobs"], "finish_reason": None}]}))
        out.append(sse({**chunk, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                              "finish_reason": c["finish_reason"]}]}))
    if include_usage:
        out.append(sse({**chunk, "choices": [], "usage": body["usage"]}))
    return out + [sse("[DONE]")]


def completion_chunks(body: dict, include_usage: bool) -> list[str]:
    """A finished text_completion as OpenAI's stream of text_completion events."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    chunk = {**head, "object": "text_completion"}
    out = []
    for c in body["choices"]:
        out.append(sse({**chunk, "choices": [{"index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
                                              "finish_reason": None}]}))
        out.append(sse({**chunk, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                              "finish_reason": c["finish_reason"]}]}))
    if include_usage:
        out.append(sse({**chunk, "choices": [], "usage": body["usage"]}))
    return out + [sse("[DONE]")]


class OpenAIErrorDetail(BaseModel):
    """One error in OpenAI's shape."""

    message: str
    """One line for the user."""
    type: str
    """invalid_request_error, permission_error, rate_limit_error or server_error."""
    param: str | None
    """The request parameter at fault, if known."""
    code: str | None
    """invalid_api_key, model_not_found, not_found, rate_limit_exceeded, or None."""


class OpenAIErrorOut(BaseModel):
    """The body of every error of the OpenAI-compatible routes (what `error` builds)."""

    error: OpenAIErrorDetail
    """What went wrong."""


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "invalid_request_error", 409: "invalid_request_error", 410: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


def error(err: MarlaasError | str, status: int | None = None, param: str | None = None) -> tuple[int, dict, dict]:
    """(status, body, headers) of an error in OpenAI's shape. A marlaas SpecError (422) is a 400 here:
    the SDK's BadRequestError."""
    message = err if isinstance(err, str) else (str(err).strip().splitlines() or [type(err).__name__])[0]
    status = status or (err.status if isinstance(err, MarlaasError) else 400)
    if status == 422:
        status = 400
    code = ERROR_CODES.get(status)
    if status == 404 and "model" not in message:
        code = "not_found"
    headers = {}
    if isinstance(err, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return status, {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                              "param": param, "code": code}}, headers
