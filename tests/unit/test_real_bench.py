"""bench/real.py's pure parts: step-latency percentiles and the comparison with the TRL peer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.real import peak_rises, peer_summary  # noqa: E402
from bench.trl_peer import percentiles  # noqa: E402

pytestmark = pytest.mark.unit


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"p50": None, "p95": None, "n": 0}
    assert percentiles([3.0]) == {"p50": 3.0, "p95": 3.0, "n": 1}
    xs = [float(i) for i in range(1, 21)]  # 1..20: rank ceil(0.5*20)=10, ceil(0.95*20)=19
    assert percentiles(list(reversed(xs))) == {"p50": 10.0, "p95": 19.0, "n": 20}


def test_peer_summary_ratios_gaps_and_goals():
    sync = {"a": {"final_acc": 0.40}, "b": {"final_acc": 0.20}}
    asy = {"a": {"final_acc": 0.36}, "b": {"final_acc": 0.30}}
    trl = {"a": {"final_acc": 0.38, "wall_s": 700.0}, "b": {"final_acc": 0.24, "wall_s": 500.0}}
    state = {"trl_wall_s": 1200.0, "async_wall_s": 600.0, "sync_wall_s": 1500.0,
             "busy": {"async": {"share_of_ceiling": 0.9}}}
    out = peer_summary(["a", "b"], sync, asy, trl, state)
    assert out["async_over_trl"] == 2.0 and out["sync_over_trl"] == 0.8
    assert out["async_minus_trl_points"] == {"a": -2.0, "b": 6.0}
    assert out["sync_minus_trl_points"] == {"a": 2.0, "b": -4.0}
    assert out["goal"] == {"async_over_trl_1_3": True, "sync_over_trl_0_9": False,
                           "async_within_5_points_every_task": False,
                           "async_no_more_than_5_points_below_every_task": True,
                           "async_at_0_85_of_ceiling": True}
    asy["b"]["final_acc"] = 0.18  # 6 points below TRL's 0.24
    assert not peer_summary(["a", "b"], sync, asy, trl, state)["goal"]["async_no_more_than_5_points_below_every_task"]


def test_peak_rises_names_the_tasks_that_raised_each_workers_peak():
    ev = [  # out of order on purpose; two workers; one event without the field (an older worker)
        {"worker": "g1", "station": "generate", "start": 9.0, "end": 10.0, "peak_rss_mb": 1000.0, "kinds": ["eval"]},
        {"worker": "g1", "station": "generate", "start": 1.0, "end": 2.0, "peak_rss_mb": 900.0, "kinds": ["gen"]},
        {"worker": "g1", "station": "generate", "start": 11.0, "end": 12.0, "peak_rss_mb": 1003.0, "items": 4},
        {"worker": "t", "station": "train", "start": 5.0, "end": 6.0, "peak_rss_mb": 800.0, "version": 3},
        {"worker": "t", "station": "train", "start": 7.0, "end": 8.0},
        {"worker": "t", "station": "train", "start": 13.0, "end": 14.0, "peak_rss_mb": 810.0, "version": 4},
    ]
    out = peak_rises(ev, t0=5.0)
    # g1's first task (900 MB) ended before t0: it is the baseline, not a rise; +3 MB is under 5 MB
    assert out["g1"] == [{"at_s": 5.0, "seconds": 1.0, "station": "generate", "from_mb": 900.0, "to_mb": 1000.0,
                          "kinds": ["eval"]}]
    assert [(r["from_mb"], r["to_mb"], r["version"]) for r in out["t"]] == [(None, 800.0, 3), (800.0, 810.0, 4)]


def test_the_trl_peers_optimiser_skips_steps_whose_gradient_is_all_zero():
    """TRL's optimiser made to skip a no-signal step, as a marlaas step without advantage is a no-op:
    after a real step, an all-zero gradient leaves the weights and Adam's moments as they were (the
    plain AdamW keeps moving on its first moment); a non-zero gradient steps as before."""
    import torch

    from bench.trl_peer import skip_steps_without_signal

    def pair():
        w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        return w, torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)

    w, opt = pair()
    v, plain = pair()
    skip_steps_without_signal(opt)
    for p, o in ((w, opt), (v, plain)):
        p.grad = torch.tensor([0.5, -0.25])
        o.step()
    assert torch.equal(w, v)  # the first step is AdamW's own
    assert opt.skipped_steps == 0
    moments = opt.state[w]["exp_avg"].clone(), opt.state[w]["exp_avg_sq"].clone(), float(opt.state[w]["step"])
    before = w.detach().clone()
    for p, o in ((w, opt), (v, plain)):
        p.grad = torch.zeros(2)
        o.step()
    assert torch.equal(w, before)  # skipped: the same weights
    assert torch.equal(opt.state[w]["exp_avg"], moments[0]) and float(opt.state[w]["step"]) == moments[2]
    assert not torch.equal(v, before)  # plain AdamW moved with a zero gradient
    w.grad = None
    opt.step()
    assert torch.equal(w, before)  # no gradient at all: skipped too
    w.grad = torch.tensor([0.0, 1e-3])
    opt.step()
    assert not torch.equal(w, before) and opt.skipped_steps == 2  # any signal steps
