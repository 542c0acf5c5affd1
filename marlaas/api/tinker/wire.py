"""Tinker request bodies as marlaas payloads: parsing and validation, no store access.

JSON bodies are parsed by the pydantic models of `tinker.models` (the SDK's request types, field for
field); protobuf bodies by the protobuf runtime (`tinker.protowire`). Every function returns the payload
a worker will run, or raises `SpecError` (HTTP 422) with one line saying what is wrong. Only token
(`encoded_text`) chunks are accepted; images and audio are refused, not dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request

from marlaas.api.tinker import models, protowire
from marlaas.errors import SpecError

PROTO = "application/x-protobuf"
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
MAX_SAMPLES = 128
MAX_TTL_S = 10 * 365 * 86_400
UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
M = TypeVar("M", bound=models.Body)


def loads(raw: bytes) -> dict:
    """A raw body as a JSON object (an empty body is {})."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise SpecError("invalid request: the body is not JSON") from None
    if not isinstance(body, dict):
        raise SpecError("invalid request: expected a JSON object")
    return body


async def body_json(request: Request) -> dict:
    """The request's JSON object (an empty body is {})."""
    return loads(await request.body())


async def body(request: Request, model: type[M]) -> M:
    """The request's JSON body as `model` (422 with one line when it is not one)."""
    return models.parse(model, loads(await request.body()))


def chunk_tokens(chunk: Any) -> list[int]:
    """The token ids of one model-input chunk."""
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
        raise SpecError("invalid request: only token (encoded_text) chunks are supported, not images or audio")
    return models.parse(models.Chunk, chunk).tokens


def input_tokens(model_input: models.ModelInput | dict | None) -> list[int]:
    """The token ids of a ModelInput ({"chunks": [...]}), chunks concatenated."""
    if isinstance(model_input, dict):
        model_input = models.parse(models.ModelInput, model_input)
    return [tok for c in (model_input.chunks if model_input else []) for tok in chunk_tokens(c)]


def json_fwdbwd(inp: models.FwdBwdInput, forward_only: bool) -> dict:
    """The queued payload of a JSON forward / forward_backward input (the SDK's JSON shape)."""
    data = []
    for d in inp.data:
        inputs = {k: (v.get("data") if isinstance(v, dict) else v) for k, v in d.loss_fn_inputs.items()}
        data.append({"tokens": input_tokens(d.model_input), "inputs": inputs})
    return {"loss_fn": inp.loss_fn, "loss_fn_config": inp.loss_fn_config or {}, "data": data,
            "forward_only": forward_only}


def fwdbwd_request(raw: bytes, content_type: str, content_encoding: str) -> tuple[dict, dict]:
    """({model_id, seq_id}, payload) of a forward_backward body, protobuf or JSON. Compressed bodies
    are refused: the server's client config turns the SDK's zstd off."""
    if content_encoding not in ("identity", ""):
        raise SpecError("compressed request bodies are not supported (this server turns zstd off)")
    if PROTO in content_type:
        try:
            return protowire.read_forward_backward(raw)
        except protowire.WireError as e:
            raise SpecError(f"invalid forward_backward body: {e}") from None
    req = models.parse(models.ForwardBackwardRequest, loads(raw))
    return ({"model_id": req.model_id, "seq_id": req.seq_id or 0},
            json_fwdbwd(req.forward_backward_input, forward_only=False))


def checkpoint_name(name: Any) -> str:
    """A checkpoint name as the client gave it, checked (it becomes part of a tinker:// path)."""
    if not NAME.match(str(name)):
        raise SpecError(f"invalid checkpoint name {name!r}: letters, digits, '_', '.', '-'")
    return str(name)


def ttl(ttl_seconds: int | None) -> int | None:
    """A checkpoint TTL as the client gave it, checked (None: the checkpoint never expires)."""
    if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
        raise SpecError(f"invalid ttl_seconds {ttl_seconds}: 1..{MAX_TTL_S} (10 years), or none")
    return ttl_seconds


def lora_request(req: models.CreateModelRequest, max_rank: int) -> dict:
    """The create_model body's LoRA config, checked: LoRA only, rank 1..max_rank, adamw only."""
    if req.lora_config is None:
        raise SpecError("invalid request: only LoRA training models are served (lora_config.rank >= 1)")
    optimizer(req.optimizer_config)
    if req.lora_config.rank > max_rank:
        raise SpecError(f"invalid request: LoRA rank {req.lora_config.rank} over this deployment's maximum {max_rank}")
    return req.lora_config.model_dump()


def optimizer(config: dict | None) -> None:
    """Refuse an optimizer other than AdamW."""
    if (config or {}).get("type", "adamw") != "adamw":
        raise SpecError(f"invalid request: only the adamw optimizer is supported, not {config.get('type')!r}")


def sample_payload(req: models.SampleRequest, model: str | None, version: int | None) -> dict:
    """The queued payload of an asample request for adapter `version` of `model` (None: the base)."""
    if not 1 <= req.num_samples <= MAX_SAMPLES:
        raise SpecError(f"invalid request: num_samples must be in 1..{MAX_SAMPLES}")
    for unsupported in UNSUPPORTED_SAMPLE_FIELDS:
        if getattr(req, unsupported):
            raise SpecError(f"invalid request: {unsupported} is not supported by this server")
    if req.target_prompt_logprobs is not None:
        raise SpecError("invalid request: target_prompt_logprobs is not supported by this server")
    tokens = input_tokens(req.prompt)
    if not tokens:
        raise SpecError("invalid request: the prompt has no tokens")
    return {"model": model, "version": version, "tokens": tokens, "n": req.num_samples,
            "params": req.sampling_params.model_dump(exclude_none=True),
            "prompt_logprobs": bool(req.prompt_logprobs)}
