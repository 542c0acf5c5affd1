"""The Tinker wire: every message the SDK sends round-trips through the server's parsers (protobuf by the
runtime with the SDK's schema, JSON by the pydantic models), and the models name exactly the fields of
the SDK's own request types (a new SDK field is one diff here)."""

import dataclasses

import pytest
from pydantic import BaseModel

from marlaas.api.tinker import models, protowire, wire
from marlaas.errors import SpecError

pytestmark = pytest.mark.unit
tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

PAIRS = [  # (our model, the SDK's request type)
    (models.CreateSessionRequest, T.CreateSessionRequest),
    (models.SessionHeartbeatRequest, T.SessionHeartbeatRequest),
    (models.CreateModelRequest, T.CreateModelRequest), (models.GetInfoRequest, T.GetInfoRequest),
    (models.ForwardRequest, T.ForwardRequest), (models.ForwardBackwardRequest, T.ForwardBackwardRequest),
    (models.FwdBwdInput, T.ForwardBackwardInput), (models.OptimStepRequest, T.OptimStepRequest),
    (models.SaveWeightsRequest, T.SaveWeightsRequest),
    (models.SaveWeightsForSamplerRequest, T.SaveWeightsForSamplerRequest),
    (models.LoadWeightsRequest, T.LoadWeightsRequest),
    (models.CreateSamplingSessionRequest, T.CreateSamplingSessionRequest),
    (models.SampleRequest, T.SampleRequest), (models.FutureRetrieveRequest, T.FutureRetrieveRequest),
    (models.LoraConfig, T.LoraConfig), (models.AdamParams, T.AdamParams), (models.SamplingParams, T.SamplingParams),
]


def _wire_names(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    return set(cls.model_fields)


@pytest.mark.parametrize(("ours", "sdk"), PAIRS, ids=[p[1].__name__ for p in PAIRS])
def test_models_name_the_sdks_fields(ours, sdk):
    assert _wire_names(ours) == _wire_names(sdk)


def _dump(req: BaseModel) -> dict:
    from tinker._compat import model_dump  # how the SDK's resources serialize a request body

    return model_dump(req, exclude_unset=False, exclude_none=True, mode="json")


def test_every_json_request_the_sdk_sends_parses():
    prompt = T.ModelInput.from_ints([1, 2, 3])
    sent = [
        (models.CreateSessionRequest, T.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0")),
        (models.SessionHeartbeatRequest, T.SessionHeartbeatRequest(session_id="ts1")),
        (models.CreateModelRequest, T.CreateModelRequest(session_id="ts1", model_seq_id=0, base_model="b",
                                                         lora_config=T.LoraConfig(rank=4, seed=1))),
        (models.GetInfoRequest, T.GetInfoRequest(model_id="ts1:train:0")),
        (models.OptimStepRequest, T.OptimStepRequest(optim_params=T.AdamParams(learning_rate=0.5), model_id="m",
                                                     seq_id=3)),
        (models.SaveWeightsRequest, T.SaveWeightsRequest(model_id="m", path="ck", seq_id=1, ttl_seconds=3600)),
        (models.SaveWeightsForSamplerRequest, T.SaveWeightsForSamplerRequest(model_id="m", path="s0", seq_id=2)),
        (models.LoadWeightsRequest, T.LoadWeightsRequest(session_id="ts1", model_seq_id=1,
                                                         path="tinker://m/weights/ck", optimizer=True)),
        (models.CreateSamplingSessionRequest,
         T.CreateSamplingSessionRequest(session_id="ts1", sampling_session_seq_id=0,
                                        model_path="tinker://m/sampler_weights/s")),
        (models.SampleRequest, T.SampleRequest(prompt=prompt, num_samples=2, sampling_session_id="ss1",
                                               sampling_params=T.SamplingParams(max_tokens=3, stop=["\n"], seed=4),
                                               prompt_logprobs=True)),
        (models.FutureRetrieveRequest, T.FutureRetrieveRequest(request_id="r1")),
    ]
    for ours, req in sent:
        body = _dump(req)
        got = models.parse(ours, body)
        for k, v in body.items():  # every field the SDK sent arrives with its value
            value = getattr(got, "optim_params" if k == "adam_params" else k)
            assert (value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value) == v, (ours, k)
    sample = models.parse(models.SampleRequest, _dump(sent[-2][1]))
    assert wire.sample_payload(sample, "m", 1)["tokens"] == [1, 2, 3]
    assert models.parse(models.OptimStepRequest, _dump(sent[4][1])).optim_params.learning_rate == 0.5


def test_a_malformed_json_body_is_one_clear_line():
    with pytest.raises(SpecError, match=r"invalid GetInfoRequest body: model_id: Field required"):
        models.parse(models.GetInfoRequest, {})
    with pytest.raises(SpecError, match=r"lora_config.rank"):
        models.parse(models.CreateModelRequest, {"session_id": "s", "lora_config": {"rank": "x"}})
    with pytest.raises(SpecError, match="not JSON"):
        wire.loads(b"{")
    with pytest.raises(SpecError, match="ttl_seconds"):
        wire.ttl(0)


def _datum(tokens: list[int]) -> "T.Datum":
    n = len(tokens)
    return T.Datum(model_input=T.ModelInput.from_ints(tokens),
                   loss_fn_inputs={
                       "target_tokens": T.TensorData(data=[t + 1 for t in tokens], dtype="int64", shape=[n]),
                       "advantages": T.TensorData(data=[1.0, -0.5, 2.0][:n], dtype="float32", shape=[n])})


def test_the_sdks_forward_backward_request_roundtrips_through_the_protobuf_runtime():
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=[_datum([5, 6, 7]), _datum([9, 8])], loss_fn="ppo",
                                                      loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="ts3:train:0", seq_id=4)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    head, got = protowire.read_forward_backward(msg.SerializeToString())
    assert head == {"model_id": "ts3:train:0", "seq_id": 4}
    assert (got["loss_fn"], got["forward_only"]) == ("ppo", True)
    assert got["loss_fn_config"] == {"clip_low_threshold": pytest.approx(0.7)}
    assert [d["tokens"] for d in got["data"]] == [[5, 6, 7], [9, 8]]
    assert got["data"][0]["inputs"]["target_tokens"] == [6, 7, 8]
    assert got["data"][1]["inputs"]["advantages"] == pytest.approx([1.0, -0.5])


def test_refused_protobuf_bodies_say_why():
    from tinker.proto import tinker_public_pb2 as pb

    with pytest.raises(protowire.WireError, match="not a ForwardBackwardRequest"):
        protowire.read_forward_backward(b"\x0a\x05ab")
    msg = pb.ForwardBackwardRequest(model_id="m")
    msg.data.add().model_input.add().image.data = b"png"
    with pytest.raises(protowire.WireError, match="only token"):
        protowire.read_forward_backward(msg.SerializeToString())
    msg = pb.ForwardBackwardRequest(model_id="m")
    msg.data.add().loss_fn_inputs["w"].sparse_csr.values = b"\0\0\0\0"
    with pytest.raises(protowire.WireError, match="sparse"):
        protowire.read_forward_backward(msg.SerializeToString())


def test_the_sdk_reads_our_forward_backward_output():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    body = protowire.write_forward_backward_output(
        [{"logprobs": ("float32", [-1.0, -2.0])}, {"logprobs": ("float32", [-0.5])}], {"loss:sum": 3.5})
    out = deserialize_forward_backward_output(body)
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]


def test_the_sdk_reads_our_sample_response():
    from tinker.proto.response_conv import deserialize_sample_response

    body = protowire.write_sample_response(
        [{"tokens": [1, 2], "logprobs": [-0.25, -0.5], "stop_reason": "length"},
         {"tokens": [3], "logprobs": [-1.0], "stop_reason": "stop"}], [None, -1.5])
    out = deserialize_sample_response(body)
    assert [s.tokens for s in out.sequences] == [[1, 2], [3]]
    assert [s.stop_reason for s in out.sequences] == ["length", "stop"]
    assert out.sequences[0].logprobs == pytest.approx([-0.25, -0.5])
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] == pytest.approx(-1.5)
