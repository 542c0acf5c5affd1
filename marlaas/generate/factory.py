"""Build the configured generation engine (`MARLAAS_ENGINE`): the hf or the vllm engine.

The factory is apart from the engine interface (engine.py) so that neither engine module and the
interface import each other in a cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from marlaas.generate.engine import AdapterSource, GenerationEngine


def make_engine(
    kind: Literal["hf", "vllm"],
    base_path: str | Path,
    adapter_source: AdapterSource,
    *,
    threads: int = 1,
    max_adapters: int = 64,
    cache_dir: str | Path | None = None,
    **kwargs,
) -> GenerationEngine:
    """Build a generation engine. Extra keyword arguments go to the engine's constructor."""
    if kind == "hf":
        from marlaas.generate.hf import HFEngine

        return HFEngine(base_path, adapter_source, threads=threads, max_adapters=max_adapters, **kwargs)
    if kind == "vllm":
        from marlaas.generate.vllm import VLLMEngine

        return VLLMEngine(
            base_path, adapter_source, threads=threads, max_adapters=max_adapters, cache_dir=cache_dir, **kwargs
        )
    raise ValueError(f"unknown engine kind {kind!r} (expected 'hf' or 'vllm')")
