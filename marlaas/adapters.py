"""The ONE adapter format: a PEFT directory (adapter_config.json + adapter_model.safetensors).

Every writer and reader of adapters goes through here: the trainer turns its PEFT adapter into an
`AdapterBlob` (`blob_from_peft`), the store keeps blobs, the engines and tenants write them out as
directories (`write_adapter_dir`) that `PeftModel.from_pretrained` and vLLM's `LoRARequest` load.
Every PEFT LoraConfig is built by `lora_config` (from a job's LoraSpec, a Tinker model's flags or an
adapter_config dict), its alpha default the spec's (`LoraSpec.alpha`).
A config value that is not JSON-able raises at blob time (`config_json`), never at upload time.
peft and safetensors are imported lazily (this module is imported by light processes too).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from marlaas.types import AdapterBlob

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return sorted(_jsonable(v) for v in obj)
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"adapter config value {obj!r} is not JSON-able")


def config_json(config) -> dict:
    """A PEFT config as adapter_config.json's dict (sets sorted into lists, inference_mode on, as
    `PeftModel.save_pretrained` writes it)."""
    d = _jsonable(config.to_dict())
    d["inference_mode"] = True
    json.dumps(d)  # fail here, not at upload time
    return d


def blob_from_peft(peft_model, adapter_name: str = "default") -> AdapterBlob:
    """The named adapter of a PeftModel as an AdapterBlob, as `save_pretrained` would write it (PEFT
    key names without the adapter name; CPU tensors, so any host can load it)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    return AdapterBlob(config=config_json(peft_model.peft_config[adapter_name]),
                       weights=save(tensors, metadata={"format": "pt"}))


def write_adapter_dir(blob: AdapterBlob, out_dir: Path | str, base_path: str | None = None) -> Path:
    """Write a blob as a PEFT adapter directory (the weights file replaced atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(blob.config)
    if base_path is not None:
        cfg["base_model_name_or_path"] = str(base_path)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    tmp.write_bytes(blob.weights)
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


def read_adapter_dir(directory: Path | str) -> AdapterBlob:
    """A PEFT adapter directory as a blob."""
    d = Path(directory)
    return AdapterBlob(config=json.loads((d / CONFIG_NAME).read_text()), weights=(d / WEIGHTS_NAME).read_bytes())


# Tinker's LoRA flags -> the module names they train (those the base has).
TINKER_TARGETS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


def default_alpha() -> float:
    """LoRA alpha when none is given: the job spec's default (`LoraSpec.alpha`), the one source."""
    from marlaas.spec import LoraSpec

    return float(LoraSpec.model_fields["alpha"].default)


def lora_config(rank: int, targets, *, alpha: float | None = None, dropout: float = 0.0,
                inference_mode: bool = False, **extra):
    """THE PEFT LoraConfig builder (the helpers below all end here): rank r, `targets` (module names
    or "all-linear"), alpha (default `default_alpha()`), no bias, a causal LM; `extra` are further
    LoraConfig fields."""
    from peft import LoraConfig

    params = {"bias": "none", "task_type": "CAUSAL_LM", **extra}
    return LoraConfig(r=int(rank), lora_alpha=float(default_alpha() if alpha is None else alpha),
                      target_modules=targets, lora_dropout=float(dropout), inference_mode=inference_mode, **params)


def lora_config_from_spec(lora) -> object:
    """The PEFT LoraConfig of a job's `LoraSpec`."""
    targets = "all-linear" if lora.targets == "all-linear" else list(lora.targets)
    return lora_config(lora.rank, targets, alpha=lora.alpha, dropout=lora.dropout)


def tinker_targets(flags: dict, module_names: set[str]) -> list[str]:
    """The LoRA target module names of a Tinker model's flags (train_attn / train_mlp / train_unembed,
    each on unless 0) that exist in the base; ValueError when that is none."""
    want = [n for flag, names in TINKER_TARGETS.items() if int(flags.get(flag, 1)) for n in names
            if n in module_names]
    if not want:
        raise ValueError("the LoRA config trains no module of this base (train_attn / train_mlp / train_unembed)")
    return want


def lora_config_from_tinker(meta: dict, module_names: set[str]) -> object:
    """The PEFT LoraConfig of a Tinker training model (`rank`, optional `alpha`, the target flags)."""
    return lora_config(int(meta["rank"]), tinker_targets(meta, module_names), alpha=meta.get("alpha"))


def lora_config_from_dict(config: dict, inference_mode: bool = True) -> object:
    """A PEFT LoraConfig from an adapter_config.json dict (unknown keys from newer PEFTs dropped)."""
    import dataclasses

    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    kw = {k: v for k, v in config.items() if k in fields and k not in ("peft_type", "inference_mode")}
    return lora_config(kw.pop("r"), kw.pop("target_modules"), alpha=kw.pop("lora_alpha", None),
                       dropout=kw.pop("lora_dropout", 0.0) or 0.0, inference_mode=inference_mode, **kw)
