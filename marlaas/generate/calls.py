"""How a CPU generate engine splits a batch into model calls: whole requests per call, within a
number of rows and of row-tokens (rows x (padded prompt + new tokens)), which set a call's working
memory (its KV cache and the prefill's activations). Pure."""

from __future__ import annotations


def call_token_budget(config, dtype_bytes: int, budget_bytes: float) -> int:
    """Row-tokens (rows x (padded prompt + new tokens)) one call may hold in `budget_bytes`: per
    row-token twice its KV cache (keys and values of every layer; transformers' growing cache copies
    it at every token, the CPU engine's static one does not, so there that half is headroom) and the
    prefill's MLP activations of one layer (three intermediate-size vectors)."""
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(getattr(config, "hidden_size", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    per_token = dtype_bytes * (2 * 2 * layers * kv_heads * head_dim + 3 * inter)
    return max(1, int(budget_bytes // per_token))


def call_plan(rows_and_lengths: list[tuple[int, int]], max_new: int, max_rows: int,
              max_tokens: int | None) -> list[list[int]]:
    """Split requests (each `(rows, prompt length)`, in order) into calls of whole requests: a call
    holds at most `max_rows` rows and, with `max_tokens`, at most that many row-tokens, counted as
    its rows x (its longest prompt + `max_new`) as left padding lays them out. A request that alone
    exceeds a limit gets a call of its own. Returns the requests' indices per call."""
    calls: list[list[int]] = []
    batch: list[int] = []
    rows = width = 0
    for i, (n, length) in enumerate(rows_and_lengths):
        r, w = rows + n, max(width, length)
        if batch and (r > max_rows or (max_tokens is not None and r * (w + max_new) > max_tokens)):
            calls.append(batch)
            batch, r, w = [], n, length
        batch.append(i)
        rows, width = r, w
    if batch:
        calls.append(batch)
    return calls
