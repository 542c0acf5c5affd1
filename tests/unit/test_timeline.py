import pytest

from marlaas.ops.timeline import busy_fractions, idle_gaps, overlap_fraction, steady_busy, steady_window, union_length

pytestmark = pytest.mark.unit


def test_union_length_hand_values():
    # [0,2] u [1,3] = [0,3] -> 3 ; [5,6] -> 1 ; clipped to [0, 5.5]: 3 + 0.5
    iv = [(1, 3), (0, 2), (5, 6)]
    assert union_length(iv, 0, 10) == 4
    assert union_length(iv, 0, 5.5) == 3.5
    assert union_length([], 0, 1) == 0


def test_busy_fractions_and_overlap():
    ev = [
        {"station": "generate", "start": 0, "end": 4},
        {"station": "train", "start": 2, "end": 6},
        {"station": "verify", "start": 9, "end": 10},
    ]
    assert busy_fractions(ev, 0, 10) == {"generate": 0.4, "verify": 0.1, "train": 0.4}
    # generate busy [0,4], train busy during [2,4] of it -> 0.5
    assert overlap_fraction(ev, "generate", "train", 0, 10) == 0.5
    assert overlap_fraction(ev, "verify", "train", 0, 10) == 0.0


def test_idle_gaps_hand_values():
    ev = [
        {"station": "train", "start": 1, "end": 2},
        {"station": "train", "start": 1.5, "end": 3},  # overlaps: merged into [1, 3]
        {"station": "train", "start": 4, "end": 5},
        {"station": "train", "start": 7.5, "end": 8},
        {"station": "generate", "start": 3, "end": 7},
    ]
    # train busy [1,3], [4,5], [7.5,8]: gaps 1 and 2.5; the wait before 1 is not a gap
    assert idle_gaps(ev, "train", 0, 10) == [1.0, 2.5]
    assert idle_gaps(ev, "train", 0, 6) == [1.0]  # clipped window
    assert idle_gaps(ev, "verify", 0, 10) == []


def test_steady_window_runs_from_the_first_step_to_the_first_job_done():
    ev = [
        {"station": "generate", "start": 0.0, "end": 2.0, "jobs": ["a", "b"]},
        {"station": "train", "start": 2.0, "end": 3.0, "jobs": ["a"]},
        {"station": "train", "start": 3.5, "end": 4.5, "jobs": ["b"]},  # 0.5 s gap
        {"station": "train", "start": 4.5, "end": 6.0, "jobs": ["a"]},  # a is done at 6.0
        {"station": "train", "start": 9.0, "end": 10.0, "jobs": ["b"]},  # the tail: only b left
    ]
    assert steady_window(ev) == (2.0, 6.0)
    assert steady_busy(ev) == 0.875  # busy 1 + 1 + 1.5 = 3.5 of 4 s
    assert steady_window(ev, "verify") is None and steady_busy(ev, "verify") is None
