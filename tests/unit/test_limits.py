"""vLLM limits from the model config and host memory: hand-computed numbers and the budget invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marlaas.generate.limits import GiB, LimitsError, host_available_bytes, kv_bytes_per_token, vllm_limits

pytestmark = pytest.mark.unit

SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "hidden_size": 576, "max_position_embeddings": 8192}
TINY = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "hidden_size": 64, "max_position_embeddings": 64}


def test_smollm2_numbers():
    assert kv_bytes_per_token(SMOLLM2) == 2 * 30 * 3 * 64 * 4 == 46_080
    # 256 + 256 = 512 tokens (already whole blocks): 512 * 46_080 = 23_592_960 bytes per sequence.
    # 64 sequences = 1_509_949_440 bytes < 0.25 * 8 GiB = 2_147_483_648: all 64 fit.
    assert vllm_limits(SMOLLM2, max_prompt_tokens=256, max_new_tokens=256, max_seqs_wanted=64,
                       host_available_bytes=8 * GiB) == {
        "max_model_len": 512, "max_num_seqs": 64, "kv_cache_bytes": 1_509_949_440, "block_size": 16}
    # 4 GiB host: budget 1 GiB = 1_073_741_824 -> whole blocks of 16 * 46_080 = 737_280 bytes:
    # 1456 blocks = 1_073_479_680 bytes; // 23_592_960 = 45 sequences.
    assert vllm_limits(SMOLLM2, max_prompt_tokens=256, max_new_tokens=256, max_seqs_wanted=64,
                       host_available_bytes=4 * GiB) == {
        "max_model_len": 512, "max_num_seqs": 45, "kv_cache_bytes": 1_073_479_680, "block_size": 16}
    # 100 + 50 = 150 -> 160 tokens; fp16: 2 * 30 * 3 * 64 * 2 = 23_040 bytes/token; 160 * 23_040 = 3_686_400.
    assert vllm_limits(SMOLLM2, max_prompt_tokens=100, max_new_tokens=50, max_seqs_wanted=10,
                       host_available_bytes=2 * GiB, dtype_bytes=2) == {
        "max_model_len": 160, "max_num_seqs": 10, "kv_cache_bytes": 36_864_000, "block_size": 16}


def test_tiny_numbers():
    # head_dim = 64 / 2 = 32; 2 * 2 * 1 * 32 * 4 = 512 bytes/token; 20 + 20 = 40 -> 48 tokens; 48 * 512 = 24_576.
    assert kv_bytes_per_token(TINY) == 512
    assert vllm_limits(TINY, max_prompt_tokens=20, max_new_tokens=20, max_seqs_wanted=8,
                       host_available_bytes=GiB) == {
        "max_model_len": 48, "max_num_seqs": 8, "kv_cache_bytes": 196_608, "block_size": 16}
    # 30 + 30 = 60 -> 64 = max_position_embeddings; 64 * 512 = 32_768 per sequence.
    # host 400_000 bytes, 0.25 -> 100_000 -> whole 8_192-byte blocks: 12 blocks = 98_304 -> 3 sequences.
    assert vllm_limits(TINY, max_prompt_tokens=30, max_new_tokens=30, max_seqs_wanted=8,
                       host_available_bytes=400_000) == {
        "max_model_len": 64, "max_num_seqs": 3, "kv_cache_bytes": 98_304, "block_size": 16}


def test_errors():
    with pytest.raises(LimitsError, match="exceeds the model's max_position_embeddings 64"):
        vllm_limits(TINY, max_prompt_tokens=40, max_new_tokens=30, max_seqs_wanted=1, host_available_bytes=GiB)
    with pytest.raises(LimitsError, match="one sequence of 512 tokens needs .* GiB of KV cache"):
        vllm_limits(SMOLLM2, max_prompt_tokens=256, max_new_tokens=256, max_seqs_wanted=4,
                    host_available_bytes=50_000_000)
    with pytest.raises(LimitsError, match="num_hidden_layers"):
        vllm_limits({"max_position_embeddings": 64}, max_prompt_tokens=1, max_new_tokens=1, max_seqs_wanted=1,
                    host_available_bytes=GiB)
    with pytest.raises(LimitsError, match="kv_fraction"):
        vllm_limits(TINY, max_prompt_tokens=1, max_new_tokens=1, max_seqs_wanted=1, host_available_bytes=GiB,
                    kv_fraction=1.5)


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 128), heads=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
       kv_div=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([32, 64, 80, 128, 256]),
       max_pos=st.integers(16, 131_072),
       prompt=st.integers(1, 65_536), new=st.integers(1, 65_536), seqs=st.integers(1, 4096),
       host=st.integers(1, 2048 * GiB), dtype_bytes=st.sampled_from([1, 2, 4]),
       frac=st.floats(0.01, 1.0))
def test_budget_is_never_exceeded(layers, heads, kv_div, head_dim, max_pos, prompt, new, seqs, host, dtype_bytes,
                                  frac):
    cfg = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(heads // kv_div, 1),
           "head_dim": head_dim, "hidden_size": heads * head_dim, "max_position_embeddings": max_pos}
    try:
        out = vllm_limits(cfg, max_prompt_tokens=prompt, max_new_tokens=new, max_seqs_wanted=seqs,
                          host_available_bytes=host, dtype_bytes=dtype_bytes, kv_fraction=frac)
    except LimitsError as e:
        assert "\n" not in str(e)
        return
    assert out["kv_cache_bytes"] <= frac * host
    assert 1 <= out["max_num_seqs"] <= seqs
    assert prompt + new <= out["max_model_len"] <= max_pos
    assert out["max_model_len"] % 16 == 0 or out["max_model_len"] == max_pos
    per_seq = -(-out["max_model_len"] // 16) * 16 * kv_bytes_per_token(cfg, dtype_bytes)
    assert out["max_num_seqs"] * per_seq <= out["kv_cache_bytes"]


def test_old_112_gib_request_cannot_happen():
    # SmolLM2 on a 16 GiB host asking for 4096 sequences of 8192 tokens: the old fixed-fraction engine
    # asked for 112.5 GiB; now the cache stays within a quarter of what the host has.
    out = vllm_limits(SMOLLM2, max_prompt_tokens=4096, max_new_tokens=4096, max_seqs_wanted=4096,
                      host_available_bytes=16 * GiB)
    assert out["kv_cache_bytes"] <= 4 * GiB and out["max_num_seqs"] == 4 * GiB // (8192 * 46_080)


def test_host_available_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:        1000 kB\nMemAvailable:   2000000 kB\n")
    assert host_available_bytes(meminfo, tmp_path / "no-cgroup") == 2_000_000 * 1024
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("1073741824\n")
    (cg / "memory.current").write_text("73741824\n")
    assert host_available_bytes(meminfo, cg) == 1_000_000_000
    (cg / "memory.max").write_text("max\n")
    assert host_available_bytes(meminfo, cg) == 2_000_000 * 1024
    assert host_available_bytes(tmp_path / "no-meminfo", tmp_path / "no-cgroup") > 0  # os.sysconf fallback
    assert host_available_bytes() > 0
