"""The preflight on hand-computed cases: its figures and verdict from group rewards, the scheduler's
treatment of a preflight job (its N groups at version 0, never the trainer, never an evaluation),
the tick's table row of one, and the spec fields."""

import pytest

from marlaas.control.memory import TableJob
from marlaas.control.scheduler import JobState, Snapshot, choose_trainer, lane_weights, plan
from marlaas.errors import SpecError
from marlaas.spec import JobSpec, parse_spec
from marlaas.types import ItemKind
from marlaas.verify import preflight

pytestmark = pytest.mark.unit


def test_summary_hand_values():
    # 3 groups of 4: [1,0,0,0] has signal, [0,0,0,0] none, [0.5,0.5,1,0] signal.
    s = preflight.summarize([[1, 0, 0, 0], [0, 0, 0, 0], [0.5, 0.5, 1, 0]], errors=2)
    assert s["prompts"] == 3 and s["group_size"] == 4 and s["completions"] == 12
    assert s["exact"] == pytest.approx(2 / 12)  # two completions with full reward
    assert s["mean_reward"] == pytest.approx(3 / 12)  # 1 + 0.5 + 0.5 + 1 = 3
    assert s["partial"] == pytest.approx(2 / 12)  # the two 0.5s
    assert s["signal"] == pytest.approx(2 / 3) and s["groups_with_signal"] == 2
    assert s["grader_errors"] == 2
    assert s["ok"] is True
    assert s["verdict"].startswith("ok: 67% of groups have signal")
    assert "grader failed on 2 completions" in s["verdict"]


def test_verdict_no_signal_never_rewarded():
    s = preflight.summarize([[0.0] * 8] * 32)
    assert s["ok"] is False and s["signal"] == 0 and s["exact"] == 0 and s["mean_reward"] == 0
    assert s["verdict"] == preflight.NO_SIGNAL_ZERO
    assert "make the task easier or give partial credit" in s["verdict"]


def test_verdict_no_signal_all_full_or_all_equal():
    s = preflight.summarize([[1.0, 1.0], [1.0, 1.0]])
    assert not s["ok"] and "already earns full reward" in s["verdict"] and s["exact"] == 1.0
    s = preflight.summarize([[0.3, 0.3], [0.5, 0.5]])
    assert not s["ok"] and "same reward" in s["verdict"] and s["partial"] == 1.0


def test_verdict_partial_credit_only_and_weak():
    s = preflight.summarize([[0.2, 0.4], [0.0, 0.0]])  # signal in 1 of 2 groups, nothing exact
    assert s["ok"] and s["verdict"].startswith("only partial credit: 50% of groups have signal")
    groups = [[1.0, 0.0]] + [[0.0, 0.0]] * 9  # 10% with signal, one exact answer
    s = preflight.summarize(groups)
    assert s["ok"] and s["verdict"].startswith("weak: only 10% of groups have signal")
    assert s["exact"] == pytest.approx(1 / 20)


def test_summary_refuses_no_groups():
    with pytest.raises(ValueError):
        preflight.summarize([])
    with pytest.raises(ValueError):
        preflight.summarize([[1.0], []])


def test_has_signal():
    assert preflight.has_signal([0, 1]) and not preflight.has_signal([1, 1]) and not preflight.has_signal([])


def pf(jid="j1", n=6, **kw):
    base = dict(id=jid, version=0, steps=1, staleness=0, groups_per_step=n, group_size=4, dispatched=0,
                preflight=True, eval_rows=10)
    base.update(kw)
    return JobState(**base)


def job(jid="j2", **kw):
    base = dict(id=jid, version=0, steps=10, staleness=1, groups_per_step=2, group_size=4, dispatched=0)
    base.update(kw)
    return JobState(**base)


def test_plan_dispatches_a_preflights_groups_at_version_0_only():
    p = plan(Snapshot(jobs=(pf(),), gen_capacity=4, batch_rows=1000))
    items = [it for b in p.gen_batches for it in b]
    assert items == [(ItemKind.GEN, "j1", g) for g in range(6)]  # exactly its N groups
    assert p.dispatched == {"j1": 6}
    p = plan(Snapshot(jobs=(pf(dispatched=6),), gen_capacity=4, batch_rows=1000))
    assert p.gen_batches == [] and p.train is None  # all out: nothing more, and no trainer


def test_preflight_never_gets_the_trainer_nor_an_evaluation():
    ready_pf = pf(dispatched=6, ready=True, pass_value=0.0, need_eval=(0,))
    assert choose_trainer([ready_pf]) is None
    p = plan(Snapshot(jobs=(ready_pf,), gen_capacity=2, batch_rows=1000))
    assert p.train is None and not any(it[0] == ItemKind.EVAL for b in p.gen_batches for it in b)
    other = job(ready=True, pass_value=5.0, dispatched=4)
    p = plan(Snapshot(jobs=(ready_pf, other), gen_capacity=2, batch_rows=1000))
    assert p.train == ("j2", 0)  # the job behind the preflight trains, at its pass


def test_preflight_takes_no_lane_share():
    w = lane_weights([pf(tenant="a"), job(tenant="a", weight=2.0)])
    assert w["j2"] == 2.0  # the tenant's one training job gets the tenant's whole weight


def _spec(**kw):
    d = dict(task="sort", steps=30, prompts_per_step=4, group_size=4, max_staleness=2, eval_every=10)
    d.update(kw)
    return JobSpec(**d)


def test_table_row_of_a_preflight():
    e = TableJob(["j3", "running", "0", "0", "0", "1.0"], _spec(preflight=True, preflight_prompts=7), "u", set())
    s = e.state
    assert s.preflight and s.steps == 1 and s.staleness == 0 and s.groups_per_step == 7 and s.group_size == 4
    assert e.ready_line is None and e.eval_line is None  # no trainer candidate, no evaluation looked up
    e = TableJob(["j4", "running", "0", "0", "0", "1.0"], _spec(), "u", set())
    assert not e.state.preflight and e.state.steps == 30 and e.ready_line == "j4 0 4" and e.eval_line


def test_spec_fields_and_bounds():
    s = _spec()
    assert (s.preflight, s.preflight_prompts, s.no_signal_steps, s.stop_without_signal) == (False, 32, 5, False)
    with pytest.raises(SpecError, match="preflight_prompts"):
        parse_spec({"task": "sort", "preflight": True, "preflight_prompts": 0})
    with pytest.raises(SpecError, match="preflight_prompts"):
        parse_spec({"task": "sort", "preflight": True, "preflight_prompts": 10_000})
    with pytest.raises(SpecError, match="no_signal_steps"):
        parse_spec({"task": "sort", "no_signal_steps": -1})
