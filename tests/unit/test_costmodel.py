"""The cost model and the discrete-event simulator on hand-computable cases."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import sim_engine  # noqa: E402
from bench.costmodel import CostParams, Workload, fit_cpu  # noqa: E402
from bench.sim_engine import Cluster, simulate  # noqa: E402

pytestmark = pytest.mark.unit

# 1 step, 1 group of 2 rows, eval 2 rows; every cost a round number.
W = Workload(steps=1, groups_per_step=1, group_size=2, prompt_tokens=0, new_tokens=1, eval_rows=2, staleness=0)
P = CostParams(name="hand", gen_task_s=1.0, verify_task_s=0.5, train_task_s=2.0)


def test_cost_functions_hand_values():
    p = CostParams(name="x", gen_task_s=1, decode_step_s=0.5, decode_row_s=0.25, prefill_token_s=0.1,
                   adapter_load_s=2, lora_factor=2, mix_slope=0.5, verify_task_s=1, verify_row_s=0.5,
                   train_task_s=3, train_token_s=0.01)
    w = Workload(steps=1, groups_per_step=2, group_size=4, prompt_tokens=10, new_tokens=2)
    # 1 + 2*1 + 0.1*3*10 + 2*(0.5 + 0.25*8)*2*(1 + 0.5*log2(4)) = 1 + 2 + 3 + 20 = 26
    assert p.generate_s(w, rows=8, prompts=3, distinct=4, new_versions=1) == pytest.approx(26.0)
    assert p.verify_s(6) == pytest.approx(4.0)
    assert p.train_s(w) == pytest.approx(3 + 0.01 * 2 * 4 * 12)


def test_long_tail_batch_decodes_until_its_longest_completion():
    w = Workload(new_tokens=100, length_sigma=0.5, max_new_tokens=400)
    assert w.longest(1) == 100.0
    # z = Phi^-1(1 - 1/64) = 2.1539 -> 100 * exp(0.5 * 2.1539 - 0.125) = 259.07
    assert w.longest(63) == pytest.approx(259.07, rel=1e-3)
    assert w.longest(10**6) == 400.0  # the cap
    assert Workload(new_tokens=100).longest(63) == 100.0  # fixed length
    p = CostParams(name="x", decode_step_s=0.01, decode_row_s=0.001)
    # 259.07 steps * 0.01 + 0.001 * 63 rows * 100 mean tokens = 2.5907 + 6.3
    assert p.generate_s(w, rows=63, prompts=0, distinct=1, new_versions=0) == pytest.approx(8.8907, rel=1e-4)


def test_one_job_one_step_makespan():
    # gen(eval v0 + group 0) 1 -> verify 0.5 (both kinds, in parallel) -> train 2 -> gen(eval v1) 1
    # -> verify 0.5: 5.0 s
    r = simulate(P, W, 1, Cluster(verify_slots=4), "marlaas")
    assert r.makespan_s == pytest.approx(5.0)
    assert r.steps_trained == 1
    assert r.busy_s == pytest.approx({"generate": 2.0, "verify": 1.0, "train": 2.0})


def test_dispatch_and_client_gaps_add_up():
    p = CostParams(name="hand", gen_task_s=1.0, verify_task_s=0.5, train_task_s=2.0, dispatch_s=0.1, submit_gap_s=0.25)
    # five dispatches on the chain (gen, verify, train, gen, verify) + the client's poll
    assert simulate(p, W, 1, Cluster(verify_slots=4), "sequential").makespan_s == pytest.approx(5.0 + 0.5 + 0.25)


def test_dispatch_as_control_work_on_a_shared_core():
    """control_slots: every dispatch is dispatch_s of CPU work sharing the one core with the stations;
    the core never idles, so the makespan is all the work: stations 1 + (0.5 + 0.5) + 2 + 1 + 0.5 and
    six dispatches (gen, verify x2 (train and eval kinds), train, gen, verify) of 0.1."""
    p = CostParams(name="hand", gen_task_s=1.0, verify_task_s=0.5, train_task_s=2.0, dispatch_s=0.1)
    one_core = Cluster(verify_slots=4, control_slots=1, shared={"cpu": 1.0},
                       placement={"generate": "cpu", "verify": "cpu", "train": "cpu", "control": "cpu"})
    assert simulate(p, W, 1, one_core, "marlaas").makespan_s == pytest.approx(5.5 + 6 * 0.1)
    delay_only = Cluster(verify_slots=4, shared={"cpu": 1.0},
                         placement={"generate": "cpu", "verify": "cpu", "train": "cpu"})
    assert simulate(p, W, 1, delay_only, "marlaas").makespan_s == pytest.approx(5.5 + 5 * 0.1)  # verifies overlap


def test_sequential_is_the_sum_of_jobs():
    p = CostParams(name="hand", gen_task_s=1.0, verify_task_s=0.5, train_task_s=2.0, submit_gap_s=0.25)
    one = simulate(p, W, 1, Cluster(verify_slots=4), "sequential").makespan_s
    three = simulate(p, W, 3, Cluster(verify_slots=4), "sequential").makespan_s
    assert one == pytest.approx(5.25)
    assert three == pytest.approx(3 * 5.25)


def test_marlaas_overlaps_two_jobs():
    # Two jobs in one batch: gen 1 (both groups and both evals, one task) -> verify -> train j0 2,
    # train j1 2 (one lane) ; final evals overlap the second train: < sequential 10.
    r = simulate(P, W, 2, Cluster(verify_slots=4), "marlaas")
    assert r.makespan_s == pytest.approx(1 + 0.5 + 2 + 2 + 1 + 0.5)
    assert r.makespan_s < simulate(P, W, 2, Cluster(verify_slots=4), "sequential").makespan_s


def test_processor_sharing_slows_co_running_tasks():
    # Two jobs on one shared GPU (capacity 1). At 3.5 job 0's final eval (1 s of work) starts while
    # job 1 trains (2 s): both run at rate 1/2 until the eval ends at 5.5, then the train's last 1 s
    # runs alone to 6.5; job 1's eval 6.5-7.5, its verify 7.5-8.0. Unshared: 7.0 (see above).
    c = Cluster(verify_slots=4, shared={"gpu": 1.0}, placement={"generate": "gpu", "train": "gpu"})
    assert simulate(P, W, 2, c, "marlaas").makespan_s == pytest.approx(8.0)
    assert simulate(P, W, 2, Cluster(verify_slots=4), "marlaas").makespan_s == pytest.approx(7.0)


def test_drives_the_real_scheduler_and_respects_staleness(monkeypatch):
    calls = []
    real = sim_engine.scheduler.plan

    def spy(s):
        calls.append(s)
        return real(s)

    monkeypatch.setattr(sim_engine.scheduler, "plan", spy)
    p = CostParams(name="fast-gen", gen_task_s=0.1, verify_task_s=0.05, train_task_s=1.0, dispatch_s=0.01)
    w = Workload(steps=12, groups_per_step=2, group_size=2, eval_rows=2, staleness=2)
    r = simulate(p, w, 3, Cluster(verify_slots=4, batch_rows=4), "marlaas", trace=True)
    assert calls and all(isinstance(s, sim_engine.scheduler.Snapshot) for s in calls)
    assert r.steps_trained == 36 and r.violations == 0
    # Generation is fast, so admission control is what holds it back: the bound is reached, never passed.
    assert r.max_staleness == 2
    assert max(r.staleness_hist) <= 2


def test_two_lanes_train_two_jobs_at_once():
    r1 = simulate(P, W, 2, Cluster(verify_slots=4, train_lanes=1), "marlaas")
    r2 = simulate(P, W, 2, Cluster(verify_slots=4, train_lanes=2), "marlaas")
    assert r1.makespan_s - r2.makespan_s == pytest.approx(2.0)


def test_bad_mode_is_one_clear_error():
    with pytest.raises(ValueError, match="mode must be"):
        simulate(P, W, 1, Cluster(), "parallel")


def test_cpu_fit_arithmetic_on_a_hand_made_benchmark():
    tp = {"command": "bench/throughput.py --tenants 1 --steps 2 --staleness 2",
          "workload": {"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 1, "eval_size": 1},
          "workloads": {"compute": [{"tenants": 1, "speedup": 1.0,
                    "sequential": {"makespan_s": 10.0, "busy_s": {"generate": 3.0, "verify": 1.0, "train": 4.0}},
                    "marlaas": {"busy_s": {"generate": 3.0, "verify": 1.0, "train": 4.0}}}]}}
    p = fit_cpu(tp, adapter_load_s=0.5, mix_slope=0.0)
    # rows per job = 2*1*2 + 2*1 = 6; decode_row_s = (3 - 2*0.5) / (6*1) ; train 4/2; verify 1/6
    assert p.decode_row_s == pytest.approx(2 / 6)
    assert p.train_task_s == pytest.approx(2.0)
    assert p.verify_row_s == pytest.approx(1 / 6)
    # overhead 10 - 8 = 2 s = 0.01 (client's gap to the next job) + dispatch_s * (3*2 + 2)
    assert p.dispatch_s == pytest.approx(1.99 / 8)
    assert p.mix_slope == 0.0
