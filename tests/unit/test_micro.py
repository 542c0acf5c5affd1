"""The trainer's micro-batch plan and merges, on hand-computed shapes and values."""

import pytest
import torch

from marlaas.train import micro
from marlaas.train.records import Forward, Part, Result

pytestmark = pytest.mark.unit


def test_plan_cuts_where_the_padded_cost_passes_the_budget():
    # cost of a micro-batch = rows x (longest x 10 + (most positions + 1) x 100)
    shapes = [(5, 2), (6, 1), (4, 3), (20, 1), (3, 1)]
    # rows 0-1: 2 x (60 + 300) = 720; + row 2: 3 x (60 + 400) = 1380 > 1000 -> cut before row 2
    # rows 2: 440; + row 3: 2 x (200 + 400) = 1200 > 1000 -> cut; row 3: 400; + row 4: 2 x (200 + 200) = 800
    assert micro.plan(shapes, 10, 100, 1000) == [range(0, 2), range(2, 3), range(3, 5)]
    assert micro.plan(shapes, 10, 100, 1) == [range(i, i + 1) for i in range(5)]  # a row alone may exceed it
    assert micro.plan(shapes, 10, 100, None) == [range(0, 5)]
    assert micro.plan([], 10, 100, 1000) == []


def test_row_bytes_from_a_config():
    class Config:
        num_hidden_layers, hidden_size, intermediate_size, vocab_size = 2, 8, 16, 50

    per_token, per_position = micro.row_bytes(Config, 4)
    assert per_token == 4 * 2 * (micro.HIDDEN_VECTORS * 8 + micro.INTER_VECTORS * 16)
    assert per_position == 4 * micro.LOGIT_COPIES * 50


def test_recompute_layers_takes_the_fewest_layers_that_fit_the_budget():
    class Config:
        num_hidden_layers, hidden_size, intermediate_size, vocab_size = 4, 8, 16, 50

    layers, per_layer, kept = micro.layer_bytes(Config, 4)
    assert (layers, kept) == (4, 32.0) and per_layer == micro.row_bytes(Config, 4)[0] / 4
    # a pass over 10 row-tokens costing 1000 bytes; a recomputing layer keeps 2 of its 12 bytes a token,
    # so each saves 10 x 10 = 100
    assert micro.recompute_layers(1000, 1000, 10, 4, 12, 2) == 0  # fits
    assert micro.recompute_layers(1000, None, 10, 4, 12, 2) == 0  # no budget
    assert micro.recompute_layers(1000, 900, 10, 4, 12, 2) == 1
    assert micro.recompute_layers(1000, 850, 10, 4, 12, 2) == 2  # 150 over: two layers' 200
    assert micro.recompute_layers(1000, 600, 10, 4, 12, 2) == 4
    assert micro.recompute_layers(1000, 1, 10, 4, 12, 2) == 4  # never more than there are
    assert micro.recompute_layers(1000, 1, 10, 4, 2, 2) == 4  # nothing to save: all, as checkpointing does
    assert micro.pass_bytes(3, 5, 2, 10, 100) == 3 * (50 + 200)


def test_split_parts_maps_ranges_onto_each_part():
    parts = [Part("a", [0, 1, 2], None), Part("b", [0, 1], None)]
    got = micro.split_parts(parts, [range(0, 2), range(2, 4), range(4, 5)])
    assert got == [[(0, range(0, 2))], [(0, range(2, 3)), (1, range(0, 1))], [(1, range(1, 2))]]


def test_merge_stats_weights_by_tokens():
    merged = micro.merge_stats([{"clip_frac": 0.5, "kl": 1.0, "tag": "x"}, {"clip_frac": 0.0, "kl": 4.0}], [3.0, 1.0])
    assert merged == {"clip_frac": pytest.approx(0.375), "kl": pytest.approx(1.75), "tag": "x"}
    assert micro.merge_stats([{"kl": 2.0}], [0.0]) == {"kl": 2.0}


def test_merge_results_pads_columns_left_and_sums_losses():
    f1 = Forward(["r0"], torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2))
    f2 = Forward(["r1", "r2"], torch.tensor([[-3.0], [-4.0]]), torch.tensor([[1.0], [1.0]]), torch.zeros(2, 1))
    out = micro.merge_results([Result(0.5, {"kl": 1.0}, f1), Result(0.25, {"kl": 4.0}, f2)], ["r0", "r1", "r2"])
    assert out.loss == pytest.approx(0.75)
    assert out.stats == {"kl": pytest.approx(2.5)}  # (1 x 2 tokens + 4 x 2 tokens) / 4
    assert torch.equal(out.forward.logp_B_T, torch.tensor([[-1.0, -2.0], [0.0, -3.0], [0.0, -4.0]]))
    assert torch.equal(out.forward.mask_B_T, torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 1.0]]))
    assert out.forward.ref_B_T is None and out.forward.samples == ["r0", "r1", "r2"]
