"""Tinker request bodies as marlaas payloads: parsing and validation, no store access.

Every function takes a request body (the JSON object or protobuf bytes the Tinker SDK 0.38 sends) and
returns the payload a worker will run, or raises `SpecError` (HTTP 422) with one line saying what is
wrong. Only token (`encoded_text`) chunks are accepted; images and audio are refused, not dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from marlaas.api.tinker import protowire
from marlaas.errors import SpecError

PROTO = "application/x-protobuf"
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
MAX_SAMPLES = 128
UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


async def body_json(request: Request) -> dict:
    """The request's JSON object (an empty body is {})."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise SpecError("invalid request: the body is not JSON") from None
    if not isinstance(body, dict):
        raise SpecError("invalid request: expected a JSON object")
    return body


def chunk_tokens(chunk: Any) -> list[int]:
    """The token ids of one model-input chunk."""
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
        raise SpecError("invalid request: only token (encoded_text) chunks are supported, not images or audio")
    return [int(x) for x in chunk.get("tokens") or []]


def input_tokens(model_input: Any) -> list[int]:
    """The token ids of a ModelInput ({"chunks": [...]}), chunks concatenated."""
    chunks = (model_input or {}).get("chunks") if isinstance(model_input, dict) else None
    return [tok for c in chunks or [] for tok in chunk_tokens(c)]


def json_fwdbwd(body: dict, forward_only: bool) -> dict:
    """The queued payload of a JSON forward / forward_backward request (the SDK's JSON shape)."""
    inp = body.get("forward_backward_input") or body.get("forward_input") or {}
    data = []
    for d in inp.get("data") or []:
        inputs = {k: (v.get("data") if isinstance(v, dict) else v) for k, v in (d.get("loss_fn_inputs") or {}).items()}
        data.append({"tokens": input_tokens(d.get("model_input")), "inputs": inputs})
    return {"loss_fn": inp.get("loss_fn") or "cross_entropy", "loss_fn_config": inp.get("loss_fn_config") or {},
            "data": data, "forward_only": forward_only}


def fwdbwd_request(raw: bytes, content_type: str, content_encoding: str) -> tuple[dict, dict]:
    """({model_id, seq_id}, payload) of a forward_backward body, protobuf or JSON. Compressed bodies
    are refused: the server's client config turns the SDK's zstd off."""
    if content_encoding not in ("identity", ""):
        raise SpecError("compressed request bodies are not supported (this server turns zstd off)")
    if PROTO in content_type:
        try:
            fb = protowire.read_forward_backward(raw)
        except protowire.WireError as e:
            raise SpecError(f"invalid forward_backward body: {e}") from None
        payload = {"loss_fn": fb.loss_fn, "loss_fn_config": fb.loss_fn_config, "data": fb.data,
                   "forward_only": fb.forward_only}
        return {"model_id": fb.model_id, "seq_id": fb.seq_id}, payload
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise SpecError("invalid request: the body is not JSON") from None
    if not isinstance(body, dict):
        raise SpecError("invalid request: expected a JSON object")
    return body, json_fwdbwd(body, forward_only=False)


def adam_params(body: dict) -> dict:
    """The optim_step payload: the client's Adam parameters."""
    params = body.get("adam_params") or body.get("optim_params")
    if not isinstance(params, dict):
        raise SpecError("invalid request: optim_step needs adam_params (only Adam is supported)")
    return {"adam": params}


def checkpoint_name(name: Any) -> str:
    """A checkpoint name as the client gave it, checked (it becomes part of a tinker:// path)."""
    if not NAME.match(str(name)):
        raise SpecError(f"invalid checkpoint name {name!r}: letters, digits, '_', '.', '-'")
    return str(name)


def lora_request(body: dict, max_rank: int) -> dict:
    """The create_model body's LoRA config, checked: LoRA only, rank 1..max_rank, adamw only."""
    lora = body.get("lora_config")
    if not isinstance(lora, dict) or int(lora.get("rank") or 0) < 1:
        raise SpecError("invalid request: only LoRA training models are served (lora_config.rank >= 1)")
    if (body.get("optimizer_config") or {}).get("type", "adamw") != "adamw":
        raise SpecError("invalid request: only the adamw optimizer is supported")
    if int(lora["rank"]) > max_rank:
        raise SpecError(f"invalid request: LoRA rank {lora['rank']} over this deployment's maximum {max_rank}")
    return lora


def sample_payload(body: dict, model: str | None, version: int | None) -> dict:
    """The queued payload of an asample request for adapter `version` of `model` (None: the base)."""
    n = int(body.get("num_samples") or 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise SpecError(f"invalid request: num_samples must be in 1..{MAX_SAMPLES}")
    for unsupported in UNSUPPORTED_SAMPLE_FIELDS:
        if body.get(unsupported):
            raise SpecError(f"invalid request: {unsupported} is not supported by this server")
    if body.get("target_prompt_logprobs") is not None:
        raise SpecError("invalid request: target_prompt_logprobs is not supported by this server")
    tokens = input_tokens(body.get("prompt"))
    if not tokens:
        raise SpecError("invalid request: the prompt has no tokens")
    return {"model": model, "version": version, "tokens": tokens, "n": n,
            "params": body.get("sampling_params") or {}, "prompt_logprobs": bool(body.get("prompt_logprobs"))}
