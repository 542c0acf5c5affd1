"""bench/parity.py: quality parity with TRL over several seeds, computed by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.parity import ParityError, parity, repeat  # noqa: E402

pytestmark = pytest.mark.unit

SIZES = {"steps": 30, "eval_size": 200}


def race(seed: int, finals: dict[str, tuple[float, float]], sizes: dict = SIZES) -> dict:
    """One bench/real.py result: finals maps task -> (async final, trl final)."""
    return {"command": f"bench/real.py --steps 30 --seed {seed} --modes async,trl", "sizes": dict(sizes),
            "tasks": {t: {"async": {"final_acc": a}, "trl": {"final_acc": b}} for t, (a, b) in finals.items()}}


def test_mean_gap_interval_spread_and_eval_noise():
    out = parity([race(0, {"a": (0.30, 0.25), "b": (0.10, 0.20)}),
                  race(1, {"a": (0.20, 0.25), "b": (0.14, 0.20)})])
    assert out["seeds"] == [0, 1]
    a = out["tasks"]["a"]
    assert a["mean_final"] == {"async": 0.25, "trl": 0.25}
    assert a["spread_points"] == {"async": 10.0, "trl": 0.0}
    g = a["async_minus_trl_points"]
    # gaps +5 and -5: mean 0, sample variance 50, standard error sqrt(50 / 2) = 5, t(1) = 12.706
    assert g["per_seed"] == [5.0, -5.0] and g["mean"] == 0.0 and g["se"] == 5.0
    assert g["ci95"] == [-63.5, 63.5]
    # sqrt((0.3 * 0.7 + 0.25 * 0.75) / 200) = 0.04458
    assert g["eval_se_per_seed"][0] == 4.5
    b = out["tasks"]["b"]["async_minus_trl_points"]
    assert b["per_seed"] == [-10.0, -6.0] and b["mean"] == -8.0
    goal = out["async_goal"]
    assert goal["mean_within_limit_every_task"] is False  # b's mean gap is -8
    assert goal["mean_no_lower_than_minus_limit_every_task"] is False
    assert goal["mean_gap_over_tasks"] == -4.0
    assert "sync_goal" not in out  # no sync mode in the inputs


def test_goal_met_when_every_mean_gap_is_inside_the_limit():
    out = parity([race(0, {"a": (0.30, 0.25)}), race(3, {"a": (0.22, 0.25)})], limit=5.0)
    assert out["tasks"]["a"]["async_minus_trl_points"]["mean"] == 1.0
    assert out["async_goal"]["mean_within_limit_every_task"] is True


def test_refuses_mixed_sizes_repeated_seeds_and_missing_trl():
    with pytest.raises(ParityError, match="seed 1 ran with other sizes \\(steps\\)"):
        parity([race(0, {"a": (0.3, 0.2)}), race(1, {"a": (0.3, 0.2)}, {"steps": 20, "eval_size": 200})])
    with pytest.raises(ParityError, match="seeds repeat"):
        parity([race(0, {"a": (0.3, 0.2)}), race(0, {"a": (0.3, 0.2)})])
    no_trl = race(1, {"a": (0.3, 0.2)})
    del no_trl["tasks"]["a"]["trl"]
    with pytest.raises(ParityError, match="task a: a seed has no TRL final"):
        parity([race(0, {"a": (0.3, 0.2)}), no_trl])
    with pytest.raises(ParityError, match="no --seed"):
        parity([{"command": "x", "sizes": SIZES, "tasks": {}}])


def test_repeat_gives_each_tasks_gap_between_two_draws_of_one_seed():
    a = race(6, {"a": (0.30, 0.25), "b": (0.10, 0.20)})
    b = race(6, {"a": (0.28, 0.32), "b": (0.12, 0.17)})
    b["trl_seed_offset"] = 1000
    out = repeat(a, b, limit=5.0)
    assert out["seed"] == 6 and out["trl_seed_offsets"] == [0, 1000]
    assert out["tasks"]["a"]["trl"] == {"finals": [0.25, 0.32], "gap_points": -7.0}
    assert out["modes"]["trl"]["gaps_points"] == {"a": -7.0, "b": 3.0}
    assert out["modes"]["trl"]["max_abs_gap_points"] == 7.0
    assert out["modes"]["trl"]["every_task_within_limit"] is False  # a: 7 points apart
    assert out["modes"]["async"]["gaps_points"] == {"a": 2.0, "b": -2.0}
    assert out["modes"]["async"]["every_task_within_limit"] is True


def test_repeat_refuses_other_seeds_sizes_and_the_same_draws():
    a = race(6, {"a": (0.3, 0.2)})
    with pytest.raises(ParityError, match="got seeds 6 and 7"):
        repeat(a, dict(race(7, {"a": (0.3, 0.2)}), trl_seed_offset=1))
    with pytest.raises(ParityError, match="differ in sizes \\(steps\\)"):
        repeat(a, dict(race(6, {"a": (0.3, 0.2)}, {"steps": 20, "eval_size": 200}), trl_seed_offset=1))
    with pytest.raises(ParityError, match="seed offset 0 and skip_no_signal False: the same run"):
        repeat(a, race(6, {"a": (0.3, 0.2)}))
    with pytest.raises(ParityError, match="share no task"):
        repeat(a, dict(race(6, {"z": (0.3, 0.2)}), trl_seed_offset=1))


def test_repeat_sets_the_first_runs_modes_against_the_second_runs_trl():
    a = race(6, {"a": (0.33, 0.02)})
    b = race(6, {"a": (0.0, 0.30)})
    del b["tasks"]["a"]["async"]
    b["trl_skip_no_signal"] = True
    out = repeat(a, b)
    assert out["trl_skip_no_signal"] == [False, True] and out["trl_seed_offsets"] == [0, 0]
    assert out["modes"]["trl"]["gaps_points"] == {"a": -28.0}
    assert out["modes"]["async_minus_second_trl"]["gaps_points"] == {"a": 3.0}
    assert out["modes"]["async_minus_second_trl"]["every_task_within_limit"] is True
    assert "async" not in out["modes"]  # the second run has no async final
