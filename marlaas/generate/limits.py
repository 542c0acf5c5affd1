"""vLLM engine limits derived from the model config and the host's memory (pure arithmetic).

`vllm_limits` sizes the KV cache from what the jobs need instead of letting the engine take a
fraction of the machine (a CPU engine once asked for 112.5 GiB):

- block_size = 16 tokens (vLLM's paged KV block);
- max_model_len = max_prompt_tokens + max_new_tokens rounded up to a whole block, capped at the
  model's max_position_embeddings; a request longer than max_position_embeddings is an error;
- KV bytes per token = 2 (K and V) * num_hidden_layers * num_key_value_heads * head_dim * dtype_bytes,
  head_dim = config head_dim, else hidden_size / num_attention_heads;
- bytes per sequence = KV bytes per token * max_model_len rounded up to whole blocks;
- kv_cache_bytes = min(kv_fraction * host_available_bytes rounded down to whole blocks,
  max_seqs_wanted * bytes per sequence);
- max_num_seqs = min(max_seqs_wanted, kv_cache_bytes // bytes per sequence).

Invariants: kv_cache_bytes <= kv_fraction * host_available_bytes, always; the cache holds at least
one full sequence (max_num_seqs >= 1) -- when even one sequence does not fit in that budget,
`LimitsError` says so in one line instead of returning a cache the host cannot give.

`host_available_bytes()` reads MemAvailable from /proc/meminfo, lowered to the cgroup v2 memory
limit's headroom (memory.max - memory.current) inside a container; without /proc it falls back to
os.sysconf's available physical pages.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from marlaas.errors import LimitsError

BLOCK_SIZE = 16
GiB = 1 << 30



def _text_config(config: dict) -> dict:
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def _positive_int(config: dict, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LimitsError(f"model config has no positive integer {key!r} (got {value!r})")
    return value


def kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """Bytes of K and V cache one token takes across all layers."""
    cfg = _text_config(config)
    layers = _positive_int(cfg, "num_hidden_layers")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim")
    if not head_dim:
        hidden = _positive_int(cfg, "hidden_size")
        if hidden % heads:
            raise LimitsError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return 2 * layers * int(kv_heads) * int(head_dim) * dtype_bytes


def vllm_limits(config: dict, *, max_prompt_tokens: int, max_new_tokens: int, max_seqs_wanted: int,
                host_available_bytes: int, dtype_bytes: int = 4, kv_fraction: float = 0.25) -> dict:
    """{"max_model_len", "max_num_seqs", "kv_cache_bytes", "block_size"} for this model on this host."""
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens", max_new_tokens),
                        ("max_seqs_wanted", max_seqs_wanted), ("host_available_bytes", host_available_bytes),
                        ("dtype_bytes", dtype_bytes)):
        if not isinstance(value, int) or value <= 0:
            raise LimitsError(f"{name} must be a positive integer, got {value!r}")
    if not 0.0 < kv_fraction <= 1.0:
        raise LimitsError(f"kv_fraction must be in (0, 1], got {kv_fraction!r}")
    cfg = _text_config(config)
    max_pos = _positive_int(cfg, "max_position_embeddings")
    wanted_len = max_prompt_tokens + max_new_tokens
    if wanted_len > max_pos:
        raise LimitsError(
            f"max_prompt_tokens + max_new_tokens = {wanted_len} exceeds the model's max_position_embeddings {max_pos}"
        )
    max_model_len = min(max_pos, math.ceil(wanted_len / BLOCK_SIZE) * BLOCK_SIZE)
    per_token = kv_bytes_per_token(cfg, dtype_bytes)
    block_bytes = per_token * BLOCK_SIZE
    per_seq = math.ceil(max_model_len / BLOCK_SIZE) * block_bytes
    budget = int(kv_fraction * host_available_bytes) // block_bytes * block_bytes
    if per_seq > budget:
        raise LimitsError(
            f"one sequence of {max_model_len} tokens needs {per_seq / GiB:.3g} GiB of KV cache, more than the "
            f"{budget / GiB:.3g} GiB budget ({kv_fraction:g} of {host_available_bytes / GiB:.3g} GiB available): "
            f"lower max_prompt_tokens/max_new_tokens or free memory"
        )
    kv_cache_bytes = min(budget, max_seqs_wanted * per_seq)
    return {
        "max_model_len": max_model_len,
        "max_num_seqs": min(max_seqs_wanted, kv_cache_bytes // per_seq),
        "kv_cache_bytes": kv_cache_bytes,
        "block_size": BLOCK_SIZE,
    }


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    limit_file, used_file = root / "memory.max", root / "memory.current"
    if not limit_file.is_file() or not used_file.is_file():
        return None
    limit = limit_file.read_text().strip()
    if limit == "max":
        return None
    return max(int(limit) - int(used_file.read_text().strip()), 0)


def host_available_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of memory this process can still use (MemAvailable, capped by the cgroup v2 headroom)."""
    available: int | None = None
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                available = int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)
                break
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom(cgroup_root)
    return min(available, headroom) if headroom is not None else available
