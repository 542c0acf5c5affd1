"""The hand-written protobuf codec against the Tinker SDK's own encoders and decoders (the oracle)."""

import math

import numpy as np
import pytest

from marlaas.api.tinker import protowire as pw

pytestmark = pytest.mark.unit
tinker = pytest.importorskip("tinker")


def test_reads_the_sdks_forward_backward_request():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[6, 7, 8], dtype="int64", shape=[3]),
                        "advantages": types.TensorData(data=[1.0, -0.5, 2.0], dtype="float32", shape=[3])},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum, datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="tk3", seq_id=4)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    got = pw.read_forward_backward(msg.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("tk3", 4, "ppo", True)
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert len(got.data) == 2
    assert got.data[0]["tokens"] == [5, 6, 7]
    assert got.data[0]["inputs"]["target_tokens"] == [6, 7, 8]
    assert got.data[0]["inputs"]["advantages"] == pytest.approx([1.0, -0.5, 2.0])


def test_the_sdk_reads_our_forward_backward_output():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    body = pw.write_forward_backward_output(
        [{"logprobs": ("float32", [-1.0, -2.0])}, {"logprobs": ("float32", [-0.5])}], {"loss:sum": 3.5})
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]


def test_the_sdk_reads_our_sample_response():
    from tinker.proto.response_conv import deserialize_sample_response

    body = pw.write_sample_response(
        [{"tokens": [1, 2], "logprobs": [-0.25, -0.5], "stop_reason": "length"},
         {"tokens": [3], "logprobs": [-1.0], "stop_reason": "stop"}], [None, -1.5])
    out = deserialize_sample_response(body)
    assert [s.tokens for s in out.sequences] == [[1, 2], [3]]
    assert [s.stop_reason for s in out.sequences] == ["length", "stop"]
    assert out.sequences[0].logprobs == pytest.approx([-0.25, -0.5])
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] == pytest.approx(-1.5)


def test_tensor_roundtrip_and_errors():
    arr = pw.read_tensor(pw.write_tensor([[1.0, 2.0], [3.0, math.pi]]))
    assert arr.shape == (2, 2) and arr.dtype == np.float32
    with pytest.raises(pw.WireError, match="truncated"):
        pw.fields(b"\x0a\x05ab")
