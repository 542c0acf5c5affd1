"""The Tinker SDK's JSON request bodies as pydantic models: every JSON route parses its body with one of
these (`parse`), so a malformed body is a 422 with one line, never a KeyError deeper in.

Each model names the fields of the SDK's own request type (`tinker.types.<Name>`):
`tests/unit/test_tinker_protowire.py` checks the sets are equal, so a field a new SDK adds shows up
there as one diff. Fields the server does not serve are still declared (and refused where they matter,
in `wire`); unknown extra fields are ignored, as a newer SDK may send them.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from marlaas.errors import SpecError


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInput(Body):
    chunks: list[dict[str, Any]] = []


class LoraConfig(Body):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class AdamParams(Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class SamplingParams(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class CreateSessionRequest(Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None
    type: str = "create_session"


class SessionHeartbeatRequest(Body):
    session_id: str
    type: str = "session_heartbeat"


class SessionFinishRequest(Body):
    """POST /sessions/{id}/finish (the SDK sends it from ServiceClient.close, no request type)."""

    reason: dict[str, Any] = {}
    detail: str | None = None


class CreateModelRequest(Body):
    session_id: str
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] | None = None
    type: str = "create_model"


class GetInfoRequest(Body):
    model_id: str
    type: str = "get_info"


class Datum(Body):
    """One datum of a JSON forward / forward_backward: its tokens and its loss inputs (TensorData
    objects {"data", "dtype", "shape"} or plain lists)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, dict[str, Any] | list[Any]] = {}


class FwdBwdInput(Body):
    data: list[Datum] = []
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] | None = None


class ForwardRequest(Body):
    forward_input: FwdBwdInput
    model_id: str
    seq_id: int | None = None


class ForwardBackwardRequest(Body):
    forward_backward_input: FwdBwdInput
    model_id: str
    seq_id: int | None = None


class OptimStepRequest(Body):
    optim_params: AdamParams = Field(validation_alias=AliasChoices("adam_params", "optim_params"))
    """The SDK sends its AdamParams as `adam_params` (other optimizers are refused: a missing field)."""
    model_id: str
    seq_id: int | None = None
    type: str = "optim_step"


class SaveWeightsRequest(Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: str = "save_weights"


class SaveWeightsForSamplerRequest(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: str = "save_weights_for_sampler"


class LoadWeightsRequest(Body):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None
    type: str = "load_weights"


class CreateSamplingSessionRequest(Body):
    session_id: str | None = None
    sampling_session_seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    type: str = "create_sampling_session"


class SampleRequest(Body):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams = SamplingParams()
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: str = "sample"


class FutureRetrieveRequest(Body):
    request_id: str
    allow_metadata_only: bool = False


class CancelFutureRequest(Body):
    """POST /cancel_future (the SDK posts {"request_id"}, no request type)."""

    request_id: str


M = TypeVar("M", bound=Body)


def parse(model: type[M], body: dict) -> M:
    """`body` as a `model`, or SpecError (HTTP 422) naming the first bad field in one line."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        raise SpecError(f"invalid {model.__name__} body: {where}: {err.get('msg')}") from None
