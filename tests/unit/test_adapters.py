"""marlaas.adapters' one LoRA config builder: every path ends in `lora_config`, alpha defaults to the spec's."""

import pytest

from marlaas.adapters import (
    config_json,
    default_alpha,
    lora_config,
    lora_config_from_dict,
    lora_config_from_spec,
    lora_config_from_tinker,
    tinker_targets,
)
from marlaas.spec import LoraSpec

pytestmark = pytest.mark.unit


def test_alpha_defaults_to_the_spec_default():
    assert default_alpha() == LoraSpec().alpha
    assert lora_config(4, ["q_proj"]).lora_alpha == LoraSpec().alpha
    assert lora_config(4, ["q_proj"], alpha=8).lora_alpha == 8.0


def test_from_spec_keeps_rank_alpha_targets_and_dropout():
    cfg = lora_config_from_spec(LoraSpec(rank=8, alpha=4.0, targets=["q_proj", "v_proj"], dropout=0.1))
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules), cfg.lora_dropout) == (8, 4.0, {"q_proj", "v_proj"}, 0.1)
    assert cfg.bias == "none" and not cfg.inference_mode
    assert lora_config_from_spec(LoraSpec()).target_modules == "all-linear"


def test_from_dict_round_trips_an_adapter_config_and_drops_unknown_keys():
    cfg = lora_config_from_spec(LoraSpec(rank=2, alpha=3.0, targets=["k_proj"]))
    d = {**config_json(cfg), "a_field_of_a_newer_peft": 1}
    back = lora_config_from_dict(d)
    assert (back.r, back.lora_alpha, set(back.target_modules), back.inference_mode) == (2, 3.0, {"k_proj"}, True)
    assert lora_config_from_dict(d, inference_mode=False).inference_mode is False
    no_alpha = {k: v for k, v in d.items() if k != "lora_alpha"}
    assert lora_config_from_dict(no_alpha).lora_alpha == default_alpha()


def test_tinker_flags_pick_the_modules_the_base_has():
    have = {"q_proj", "v_proj", "up_proj", "lm_head", "embed_tokens"}
    assert tinker_targets({}, have) == ["q_proj", "v_proj", "up_proj", "lm_head"]
    assert tinker_targets({"train_mlp": 0, "train_unembed": 0}, have) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="trains no module"):
        tinker_targets({"train_attn": 0, "train_mlp": 0, "train_unembed": 0}, have)
    cfg = lora_config_from_tinker({"rank": 4, "train_unembed": 0}, have)
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (4, default_alpha(), {"q_proj", "v_proj", "up_proj"})
