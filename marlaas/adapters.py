"""Adapters on disk: the PEFT directory format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

from marlaas.engines.types import AdapterBlob

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def write_adapter_dir(blob: AdapterBlob, out_dir: Path | str, base_path: str | None = None) -> Path:
    """Write a blob as a PEFT adapter directory that PeftModel.from_pretrained and vLLM load."""
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
