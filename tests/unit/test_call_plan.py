"""How the HF generate engine splits a group of requests into model calls (marlaas.generate.calls)."""

from types import SimpleNamespace

import pytest

from marlaas.generate.calls import call_plan, call_token_budget

pytestmark = pytest.mark.unit


def test_rows_only_whole_requests_in_order():
    # (rows, prompt length): 3 + 2 fit 5 rows; 4 opens a new call; 6 alone exceeds and gets its own
    assert call_plan([(3, 10), (2, 10), (4, 10), (6, 10), (1, 10)], 4, 5, None) == [[0, 1], [2], [3], [4]]


def test_tokens_count_the_padded_width_of_the_call():
    # max_new 4, 100 row-tokens: 2 rows x (10 + 4) = 28; + 2 rows of 20 -> 4 x 24 = 96 fits;
    # + 1 row of 5 -> 5 x 24 = 120 > 100: new call; it and a row of 30 -> 2 x 34 = 68 fits
    sized = [(2, 10), (2, 20), (1, 5), (1, 30)]
    assert call_plan(sized, 4, 1024, 100) == [[0, 1], [2, 3]]
    # a long prompt widens the whole call: 1 row of 5, then 3 rows of 40 -> 4 x 44 = 176 > 100
    assert call_plan([(1, 5), (3, 40)], 4, 1024, 100) == [[0], [1]]
    assert call_plan([], 4, 8, 100) == []
    assert call_plan([(50, 50)], 4, 8, 10) == [[0]]  # too large alone: still one call of its own


def test_token_budget_from_the_model_config():
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, MLP 1536, float32:
    # 4 B x (2 x 2 x 30 x 3 x 64 + 3 x 1536) = 4 x (23040 + 4608) = 110592 B per row-token
    cfg = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          intermediate_size=1536)
    assert call_token_budget(cfg, 4, 110592 * 100) == 100
    assert call_token_budget(cfg, 4, 110592 * 100 - 1) == 99
    # no KV heads given: every head has its keys and values; head_dim from hidden / heads
    mha = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=256)
    assert call_token_budget(mha, 2, 2 * (2 * 2 * 2 * 4 * 16 + 3 * 256) * 7) == 7
    assert call_token_budget(mha, 2, 1) == 1  # at least one
