"""Automatic just-in-time generation (marlaas.control.jit) on hand-computed cases, and in the cluster
simulator against the two fixed settings."""

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from marlaas.control.jit import AUTO_JOBS, JitGauge, gen_busy_share, jit_jobs

pytestmark = pytest.mark.unit


def spells(g: JitGauge, t: float, n: int, busy_s: float, idle_s: float, gen: float) -> float:
    """n trainer steps of busy_s seconds with idle_s between, the generate station at `gen`; the
    time after them."""
    for _ in range(n):
        g.observe(t, gen, 1.0)
        t += busy_s
        g.observe(t, gen, 0.0)
        t += idle_s
    return t


def test_the_averages_weigh_each_observation_by_how_long_it_held():
    g = JitGauge(step_s=1.0)  # tau = 10 steps of 1 s = 10 s
    assert g.tau_s == 10.0
    g.observe(0.0, 0.5, 0.0)  # the first observation only starts the clock
    assert (g.gen, g.train) == (1.0, 1.0)
    g.observe(10.0, 1.0, 1.0)  # (0.5, 0.0) held for one time constant
    assert g.gen == pytest.approx(1.0 - 0.5 * (1 - math.exp(-1)))
    assert g.train == pytest.approx(math.exp(-1))
    g.observe(5.0, 0.0, 0.0)  # time going backwards counts as no time
    assert g.train == pytest.approx(math.exp(-1))


def test_the_time_constant_follows_the_trainer_steps_within_bounds():
    g = JitGauge()
    assert g.tau_s == g.tau_max_s  # no step seen yet
    spells(g, 0.0, 1, 2.0, 1.0, 0.0)
    assert g.step_s == 2.0 and g.tau_s == 20.0
    spells(g, 10.0, 1, 7.0, 1.0, 0.0)
    assert g.step_s == pytest.approx(2.0 + 0.2 * (7.0 - 2.0))  # a moving average of the spells
    assert JitGauge(step_s=0.001).tau_s == 0.5 and JitGauge(step_s=1000.0).tau_s == 300.0


def test_it_starts_just_in_time_and_waits_for_enough_trainer_steps():
    g = JitGauge()
    assert g.jit
    t = spells(g, 0.0, g.min_spells - 1, 0.1, 9.9, 0.1)  # both stations idle, but only 9 steps seen
    assert g.observe(t + 1000.0, 0.1, 0.0) is True


def test_groups_ahead_where_neither_station_is_busy_and_back_once_one_is():
    g = JitGauge()
    # ten 1 s steps every 10 s, half the generate workers busy: both stations have room
    t = spells(g, 0.0, 30, 1.0, 9.0, 0.5)
    assert not g.jit and max(g.gen, g.train) < g.off
    off_at = g.since
    assert 0 < off_at < t
    # the generate station saturates: back to just in time once its average reaches `on`
    seen = []
    for k in range(1, 200):
        seen.append((g.observe(t + k, 1.0, 0.0), g.gen))
    turned = next(i for i, (choice, _) in enumerate(seen) if choice)
    assert seen[turned][1] >= g.on and seen[turned - 1][1] < g.on


def test_hysteresis_and_the_hold_keep_the_choice_from_flapping():
    # between off and on: the choice stays whichever it is
    for jit in (True, False):
        g = JitGauge(gen=0.7, train=0.1, step_s=1.0, spells=10, last=100.0, held=(0.7, 0.1), jit=jit)
        assert g.observe(100.5, 0.7, 0.1) is jit
    # a new choice is held for one time constant (10 s here) even if the stations go idle at once
    g = JitGauge(gen=0.3, train=0.1, step_s=1.0, spells=10, last=0.0, held=(1.0, 1.0), jit=False, since=-100.0)
    assert g.observe(20.0, 0.0, 0.0) is True  # averages 1 - 0.7 e^-2 = 0.905, 1 - 0.9 e^-2 = 0.878
    assert g.since == 20.0
    assert g.observe(29.0, 0.0, 0.0) is True  # averages now below `off`, but within the hold
    assert max(g.gen, g.train) < g.off
    assert g.observe(30.5, 0.0, 0.0) is False


def test_a_lone_job_is_not_observed_and_the_crowd_choice_carries_over():
    g = JitGauge()
    t = spells(g, 0.0, 30, 1.0, 9.0, 0.5)  # a crowd with room at both stations: groups ahead
    assert not g.jit
    before = (g.gen, g.train, g.step_s, g.spells)
    # a lone job for a long while: the stations idle, nothing observed, the choice kept
    for k in range(100):
        assert g.observe(t + 10.0 * k, 0.0, 1.0 if k % 2 else 0.0, crowd=False) is False
    assert (g.gen, g.train, g.step_s, g.spells) == before and g.last is None
    # the next crowd starts a fresh interval: its first observation only restarts the clock
    t2 = t + 5000.0
    g.observe(t2, 1.0, 1.0)
    assert (g.gen, g.train) == before[:2]
    # a fresh gauge that saw only lone jobs is still just in time when the first crowd comes
    g = JitGauge()
    spells_seen = [g.observe(float(k), 0.0, float(k % 2), crowd=False) for k in range(1000)]
    assert all(spells_seen) and g.spells == 0 and jit_jobs("auto", 0.0, g, 1000.0, 0.0, 0.0, 2) == AUTO_JOBS
    assert jit_jobs("auto", 0.0, g, 1001.0, 0.0, 0.0, 1) == AUTO_JOBS and g.last is None


def test_jit_jobs_a_number_overrides_and_min_fill_excludes():
    g = JitGauge()
    assert jit_jobs(3, 0.0, g, 1.0, 1.0, 1.0) == 3 and jit_jobs(0, 0.0, g, 1.0, 1.0, 1.0) == 0
    assert g.last is None  # a number setting never consults the gauge
    assert jit_jobs("auto", 0.0, g, 1.0, 1.0, 1.0) == AUTO_JOBS == 2
    assert jit_jobs("auto", 0.9, g, 2.0, 1.0, 1.0) == 0 and g.jit  # one device: never just in time
    g.jit, g.spells, g.step_s, g.gen, g.train = False, 10, 1.0, 0.1, 0.1
    assert jit_jobs("auto", 0.0, g, 2.5, 0.1, 0.0) == 0


def test_gen_busy_share():
    assert gen_busy_share(3, 2) == 1.0 and gen_busy_share(1, 2) == 0.5 and gen_busy_share(0, 2) == 0.0
    assert gen_busy_share(1, 0) == 0.0


def test_settings_auto_by_default_a_number_overrides(monkeypatch):
    from pydantic import ValidationError

    from marlaas.settings import Settings

    monkeypatch.delenv("MARLAAS_GEN_JIT_JOBS", raising=False)
    assert Settings().gen_jit_jobs == "auto"
    monkeypatch.setenv("MARLAAS_GEN_MIN_FILL", "0.9")
    assert Settings().gen_jit_jobs == "auto"  # auto with a minimum fill: never just in time
    for bad in ("-1", "two"):
        monkeypatch.setenv("MARLAAS_GEN_JIT_JOBS", bad)
        with pytest.raises(ValidationError):
            Settings()


def test_in_the_simulator_auto_matches_the_better_fixed_setting():
    """The cluster simulator (the real scheduler policy over simulated time) on the CPU machine's
    tiny-model costs and on one H200 shared with a minimum fill: auto is just in time where that was
    the better hand-tuned setting (CPU: every trained sample fresh) and never with the minimum fill."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.costmodel import cpu_workload, fit_cpu, h200_params, h200_workload, load_throughput
    from bench.project_gpu import cpu_cluster, h200_cluster
    from bench.sim_engine import simulate

    tp = load_throughput()
    p, w, c = fit_cpu(tp), cpu_workload(tp), cpu_cluster(tp["machine"]["cores"])
    fixed = simulate(p, w, 8, replace(c, jit_jobs=2), "marlaas")
    auto = simulate(p, w, 8, replace(c, jit_jobs="auto"), "marlaas")
    assert set(auto.staleness_hist) == {0} and auto.makespan_s == pytest.approx(fixed.makespan_s, rel=0.02)
    hp, hw = h200_params(), h200_workload(20)
    ahead = simulate(hp, hw, 2, replace(h200_cluster(), jit_jobs=0), "marlaas")
    auto = simulate(hp, hw, 2, replace(h200_cluster(), jit_jobs="auto"), "marlaas")
    assert auto.jit_on_s == 0.0 and auto.makespan_s == ahead.makespan_s
