"""The reward-hacking alarm's rule (pure): held-out exact down by more than the drop while the
training reward of the interval rises by more than the rise; the spec's fields and their defaults."""

import pytest

from marlaas.errors import SpecError
from marlaas.spec import JobSpec, parse_spec
from marlaas.verify.alarm import reward_hacking

pytestmark = pytest.mark.unit
REWARDS_UP = {1: 0.2, 2: 0.3, 3: 0.5, 4: 0.7}
REWARDS_FLAT = {1: 0.4, 2: 0.4, 3: 0.4, 4: 0.4}


def test_fires_when_reward_rises_while_exact_falls_past_the_drop():
    a = reward_hacking({0: 0.5, 4: 0.25}, REWARDS_UP, 4, drop=0.1)
    assert a is not None and (a.previous, a.version) == (0, 4)
    assert (a.exact_before, a.exact_after, a.reward_before, a.reward_after) == (0.5, 0.25, 0.2, 0.7)
    assert "reward hacking" in a.message() and "\n" not in a.message()
    assert a.data()["alarm"] == "reward_hacking"


@pytest.mark.parametrize("exact, rewards, drop, rise", [
    ({0: 0.5, 4: 0.45}, REWARDS_UP, 0.1, 0.0),     # fell, but not by more than the drop
    ({0: 0.5, 4: 0.6}, REWARDS_UP, 0.1, 0.0),      # held-out went up: an honest run
    ({0: 0.5, 4: 0.25}, REWARDS_FLAT, 0.1, 0.0),   # reward did not rise: a job that is just failing
    ({0: 0.5, 4: 0.25}, REWARDS_UP, 0.1, 0.6),     # rose 0.5, not more than the asked 0.6
    ({0: 0.5, 4: 0.25}, REWARDS_UP, 1.0, 0.0),     # drop 1.0: never
    ({4: 0.25}, REWARDS_UP, 0.1, 0.0),             # nothing to compare with
    ({0: 0.5, 4: 0.25}, {}, 0.1, 0.0),             # no training reward recorded
])
def test_quiet_otherwise(exact, rewards, drop, rise):
    assert reward_hacking(exact, rewards, 4, drop=drop, rise=rise) is None


def test_compares_with_the_closest_earlier_evaluation_even_out_of_order():
    exact = {0: 0.2, 2: 0.6, 4: 0.3, 8: 0.9}  # 8 was evaluated before 4
    rewards = {s: 0.1 * s for s in range(1, 9)}
    a = reward_hacking(exact, rewards, 4, drop=0.1)
    assert a is not None and a.previous == 2 and (a.reward_before, a.reward_after) == (pytest.approx(0.3),
                                                                                       pytest.approx(0.4))
    assert reward_hacking(exact, rewards, 8, drop=0.1) is None  # 0.3 -> 0.9: better


def test_the_interval_ends_are_averaged_over_a_quarter_of_it():
    rewards = {s: 0.0 for s in range(1, 9)} | {1: 0.9, 8: 0.5}  # one noisy first step
    assert reward_hacking({0: 0.5, 8: 0.2}, rewards, 8, drop=0.1) is None  # first 2 steps 0.45, last 2 0.25
    rewards[7] = 0.5
    assert reward_hacking({0: 0.5, 8: 0.2}, rewards, 8, drop=0.1) is not None  # 0.45 -> 0.5


def test_spec_fields_default_and_bounds():
    s = JobSpec(task="add")
    assert (s.reward_hacking_drop, s.reward_hacking_rise, s.pause_on_reward_hacking) == (0.1, 0.0, False)
    with pytest.raises(SpecError):
        parse_spec({"task": "add", "reward_hacking_drop": 1.5})
