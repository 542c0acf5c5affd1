"""The ONE adapter format: a PEFT directory (adapter_config.json + adapter_model.safetensors).

Every writer and reader of adapters goes through here: the trainer turns its PEFT adapter into an
`AdapterBlob` (`blob_from_peft`), the store keeps blobs, the engines and tenants write them out as
directories (`write_adapter_dir`) that `PeftModel.from_pretrained` and vLLM's `LoRARequest` load.
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


def lora_config_from_dict(config: dict):
    """A PEFT LoraConfig from an adapter_config.json dict (unknown keys from newer PEFTs dropped)."""
    import dataclasses

    from peft import LoraConfig

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in config.items() if k in fields}
    kwargs.pop("peft_type", None)
    kwargs["inference_mode"] = True
    return LoraConfig(**kwargs)
