"""The protobuf bodies of the Tinker wire protocol, read and written by the protobuf runtime with the
schema the pinned SDK publishes (`tinker.proto.tinker_public_pb2`): no hand-written wire code.

The SDK sends `forward_backward` bodies as a `ForwardBackwardRequest` and asks for `ForwardBackwardOutput`
and `SampleResponse` results as protobuf (Accept: application/x-protobuf). This module turns the request
into the JSON-ready payload a worker runs, and the workers' results into those two messages.

Invariants: only dense tensors of dtype float32 / int64 / int32 and token (`encoded_text`) chunks are
accepted; anything else (sparse tensors, images, audio, a body that does not parse) is a `WireError`
with one line saying what. Unknown fields of a newer SDK are ignored by the runtime, as protobuf does.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32,
       pb.DTYPE_UNSPECIFIED: np.float32}
_DTYPE_OF = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}


class WireError(ValueError):
    """A protobuf body that is not a message this server understands."""


# ---------------------------------------------------------------- reading
def read_tensor(msg: pb.Tensor) -> np.ndarray:
    """A dense Tensor as a numpy array of its shape (sparse tensors are refused)."""
    if msg.WhichOneof("encoding") == "sparse_csr":
        raise WireError("sparse tensors are not supported in loss_fn_inputs")
    if msg.dtype not in _NP:
        raise WireError(f"tensor dtype {pb.DType.Name(msg.dtype)} is not supported")
    if len(msg.dense) % np.dtype(_NP[msg.dtype]).itemsize:
        raise WireError(f"tensor bytes ({len(msg.dense)}) are not whole {pb.DType.Name(msg.dtype)} values")
    arr = np.frombuffer(msg.dense, dtype=_NP[msg.dtype])
    try:
        return arr.reshape(list(msg.shape)) if len(msg.shape) else arr
    except ValueError:
        raise WireError(f"tensor of {arr.size} values does not have shape {list(msg.shape)}") from None


def _datum(d: pb.Datum) -> dict:
    tokens: list[int] = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError("only token (encoded_text) chunks are supported, not images or audio")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"token bytes ({len(raw)}) are not whole int32 token ids")
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    return {"tokens": tokens, "inputs": {k: read_tensor(v).tolist() for k, v in d.loss_fn_inputs.items()}}


def read_forward_backward(body: bytes) -> tuple[dict, dict]:
    """({model_id, seq_id}, payload {loss_fn, loss_fn_config, data, forward_only}) of a
    ForwardBackwardRequest body. `loss_fn_config_v2` wins over `loss_fn_config` where both set a key."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"not a ForwardBackwardRequest ({e})") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    payload = {"loss_fn": msg.loss_fn or "cross_entropy", "loss_fn_config": config,
               "data": [_datum(d) for d in msg.data], "forward_only": msg.forward_only}
    return {"model_id": msg.model_id, "seq_id": msg.seq_id}, payload


# ---------------------------------------------------------------- writing
def write_forward_backward_output(outputs: list[dict[str, tuple[str, list]]], metrics: dict[str, float],
                                  output_type: str = "ArrayRecord") -> bytes:
    """A ForwardBackwardOutput: `outputs[i]` maps a field name to (dtype "float32"|"int64", 1-D values)
    for datum i; every datum must have the same fields. One ArrayRecord holds all datums."""
    record = pb.ArrayRecord(num_datums=len(outputs))
    for name in (list(outputs[0]) if outputs else []):
        dtype = outputs[0][name][0]
        parts = [np.asarray(o[name][1], dtype=_NP[_DTYPE_OF[dtype]]).reshape(-1).tobytes() for o in outputs]
        offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64).tobytes()
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(parts), offsets=offsets,
                                                      dtype=_DTYPE_OF[dtype]))
    out = pb.ForwardBackwardOutput(loss_fn_output_type=output_type, loss_fn_outputs=[record],
                                   metrics={k: float(v) for k, v in metrics.items()})
    return out.SerializeToString()


def write_sample_response(sequences: list[dict], prompt_logprobs: list[float | None] | None = None) -> bytes:
    """A SampleResponse: each sequence {"tokens", "logprobs", "stop_reason": "stop"|"length"};
    prompt logprobs as float32 with NaN where there is none (the first token)."""
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add(stop_reason=pb.STOP_REASON_LENGTH if s["stop_reason"] == "length"
                                else pb.STOP_REASON_STOP,
                                tokens=np.asarray(s["tokens"], dtype=np.int32).tobytes())
        if s.get("logprobs") is not None:
            seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([np.nan if x is None else x for x in prompt_logprobs],
                                         dtype=np.float32).tobytes()
    return msg.SerializeToString()
