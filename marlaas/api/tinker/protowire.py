"""The protobuf messages of the Tinker wire protocol, read and written by hand (no protobuf runtime).

The Tinker SDK sends `forward_backward` bodies as a protobuf `ForwardBackwardRequest` and asks for
`ForwardBackwardOutput` and `SampleResponse` results as protobuf (Accept: application/x-protobuf).
Only those three messages are needed, so this module implements the protobuf wire format (varints,
length-delimited fields, fixed64 doubles) for exactly their fields, with the public field numbers:

    ForwardBackwardRequest  1 model_id  2 seq_id  3 data (Datum)  4 loss_fn  5 loss_fn_config (map str->double)
                            6 forward_only  7 loss_fn_config_v2 (map str->{1 number, 2 text})
    Datum                   1 model_input (Chunk)  2 loss_fn_inputs (map str->Tensor)
    Chunk                   1 encoded_text {1 tokens: int32 bytes}   (2 image, 3 dmel: refused)
    Tensor                  1 dense bytes  2 sparse_csr  3 dtype  4 shape (packed)
    ForwardBackwardOutput   1 loss_fn_output_type  2 loss_fn_outputs (ArrayRecord)  3 metrics (map str->double)
    ArrayRecord             1 type_tag  2 fields (map str->BatchedTensor)  3 num_datums
    BatchedTensor           1 data  2 offsets (int64 byte offsets, n+1)  3 dtype  4 trailing_shape
    SampleResponse          1 sequences  2 prompt_logprobs (float32 bytes, NaN where none)
    SampledSequence         1 stop_reason (0 stop, 1 length)  2 tokens (int32 bytes)  3 logprobs (float32 bytes)

DType: 1 float32, 2 int64, 3 int32, 4 bfloat16. Tensors here are numpy arrays; unknown fields are skipped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

FLOAT32, INT64, INT32, BFLOAT16 = 1, 2, 3, 4
_NP = {FLOAT32: np.float32, INT64: np.int64, INT32: np.int32}
_DTYPE_OF = {"float32": FLOAT32, "int64": INT64}


class WireError(ValueError):
    """A protobuf body that is not a message this server understands."""


# ---------------------------------------------------------------- reading
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out, shift = 0, 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of every field: int for varints, bytes for the rest (fixed as raw bytes)."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
            out.append((num, v))
        elif wt == 1:
            out.append((num, buf[i:i + 8]))
            i += 8
        elif wt == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise WireError("truncated length-delimited field")
            out.append((num, buf[i:i + n]))
            i += n
        elif wt == 5:
            out.append((num, buf[i:i + 4]))
            i += 4
        else:
            raise WireError(f"unsupported wire type {wt}")
    return out


def _str(v: int | bytes) -> str:
    if not isinstance(v, bytes):
        raise WireError("expected a string field")
    return v.decode("utf-8")


def _double(v: int | bytes) -> float:
    if not isinstance(v, bytes) or len(v) != 8:
        raise WireError("expected a double field")
    return struct.unpack("<d", v)[0]


def _packed_ints(vals: list[int | bytes]) -> list[int]:
    out: list[int] = []
    for v in vals:
        if isinstance(v, int):
            out.append(v)
            continue
        i = 0
        while i < len(v):
            x, i = _varint(v, i)
            out.append(x - (1 << 64) if x >= 1 << 63 else x)
    return out


def read_tensor(buf: bytes) -> np.ndarray:
    """A dense Tensor as a numpy array of its shape (sparse tensors are refused)."""
    dense, dtype, shape_vals = None, FLOAT32, []
    for num, v in fields(buf):
        if num == 1:
            dense = v
        elif num == 2:
            raise WireError("sparse tensors are not supported in loss_fn_inputs")
        elif num == 3:
            dtype = int(v) if isinstance(v, int) else FLOAT32
        elif num == 4:
            shape_vals.append(v)
    if dtype not in _NP:
        raise WireError(f"tensor dtype {dtype} is not supported")
    arr = np.frombuffer(dense or b"", dtype=_NP[dtype])
    shape = _packed_ints(shape_vals)
    return arr.reshape(shape) if shape else arr


@dataclass
class FwdBwd:
    """A decoded ForwardBackwardRequest."""

    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    data: list[dict] = field(default_factory=list)
    """Per datum: {"tokens": list[int], "inputs": {name: list (nested by shape)}} (JSON-ready)."""


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, val = "", None
    for num, v in fields(buf):
        if num == 1:
            key = _str(v)
        elif num == 2:
            val = v
    return key, val


def _datum(buf: bytes) -> dict:
    tokens: list[int] = []
    inputs: dict[str, list] = {}
    for num, v in fields(buf):
        if num == 1:
            for cnum, cv in fields(v):  # type: ignore[arg-type]
                if cnum != 1:
                    raise WireError("only token (encoded_text) chunks are supported, not images or audio")
                for tnum, tv in fields(cv):  # type: ignore[arg-type]
                    if tnum == 1:
                        tokens.extend(np.frombuffer(tv, dtype=np.int32).tolist())  # type: ignore[arg-type]
        elif num == 2:
            name, tv = _map_entry(v)  # type: ignore[arg-type]
            inputs[name] = read_tensor(tv or b"").tolist()  # type: ignore[arg-type]
    return {"tokens": tokens, "inputs": inputs}


def read_forward_backward(body: bytes) -> FwdBwd:
    """Decode a ForwardBackwardRequest body."""
    out, v2 = FwdBwd(), {}
    for num, v in fields(body):
        if num == 1:
            out.model_id = _str(v)
        elif num == 2:
            out.seq_id = int(v)  # type: ignore[arg-type]
        elif num == 3:
            out.data.append(_datum(v))  # type: ignore[arg-type]
        elif num == 4:
            out.loss_fn = _str(v)
        elif num == 5:
            k, dv = _map_entry(v)  # type: ignore[arg-type]
            out.loss_fn_config[k] = _double(dv or b"\0" * 8)
        elif num == 6:
            out.forward_only = bool(v)
        elif num == 7:
            k, cv = _map_entry(v)  # type: ignore[arg-type]
            for cnum, x in fields(cv or b""):  # type: ignore[arg-type]
                v2[k] = _double(x) if cnum == 1 else _str(x)
    out.loss_fn_config.update(v2)  # v2 wins where both are set
    return out


# ---------------------------------------------------------------- writing
def _enc_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wt: int) -> bytes:
    return _enc_varint(num << 3 | wt)


def _ld(num: int, payload: bytes) -> bytes:
    return _key(num, 2) + _enc_varint(len(payload)) + payload


def _vi(num: int, n: int) -> bytes:
    return _key(num, 0) + _enc_varint(n)


def _dbl(num: int, x: float) -> bytes:
    return _key(num, 1) + struct.pack("<d", x)


def _packed(num: int, ns: list[int]) -> bytes:
    return _ld(num, b"".join(_enc_varint(n) for n in ns)) if ns else b""


def write_forward_backward_output(outputs: list[dict[str, tuple[str, list]]], metrics: dict[str, float],
                                  output_type: str = "ArrayRecord") -> bytes:
    """A ForwardBackwardOutput: `outputs[i]` maps a field name to (dtype "float32"|"int64", 1-D values)
    for datum i; every datum must have the same fields. One ArrayRecord holds all datums."""
    record = b""
    names = list(outputs[0]) if outputs else []
    for name in names:
        dtype = outputs[0][name][0]
        np_dtype = _NP[_DTYPE_OF[dtype]]
        parts = [np.asarray(o[name][1], dtype=np_dtype).reshape(-1).tobytes() for o in outputs]
        offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64).tobytes()
        bt = _ld(1, b"".join(parts)) + _ld(2, offsets) + _vi(3, _DTYPE_OF[dtype])
        record += _ld(2, _ld(1, name.encode()) + _ld(2, bt))
    record += _vi(3, len(outputs))
    out = _ld(1, output_type.encode()) + _ld(2, record)
    for k, v in metrics.items():
        out += _ld(3, _ld(1, k.encode()) + _dbl(2, float(v)))
    return out


def write_sample_response(sequences: list[dict], prompt_logprobs: list[float | None] | None = None) -> bytes:
    """A SampleResponse: each sequence {"tokens", "logprobs", "stop_reason": "stop"|"length"}."""
    out = b""
    for s in sequences:
        msg = b""
        if s["stop_reason"] == "length":
            msg += _vi(1, 1)
        msg += _ld(2, np.asarray(s["tokens"], dtype=np.int32).tobytes())
        if s.get("logprobs") is not None:
            msg += _ld(3, np.asarray(s["logprobs"], dtype=np.float32).tobytes())
        out += _ld(1, msg)
    if prompt_logprobs is not None:
        vals = [np.nan if x is None else x for x in prompt_logprobs]
        out += _ld(2, np.asarray(vals, dtype=np.float32).tobytes())
    return out


def write_tensor(values: list, dtype: str = "float32") -> bytes:
    """A dense Tensor message (tests build requests with it)."""
    arr = np.asarray(values, dtype=_NP[_DTYPE_OF[dtype]])
    return _ld(1, arr.tobytes()) + _vi(3, _DTYPE_OF[dtype]) + _packed(4, list(arr.shape))
