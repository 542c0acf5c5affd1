"""Scheduler policy on hand-computed cases, plus a randomised simulation of the staleness invariant."""

import random
from collections import Counter

import pytest

from marlaas.control.scheduler import (
    JobState,
    Snapshot,
    admission_limit,
    choose_trainer,
    plan,
    step_groups,
    within_staleness,
)

pytestmark = pytest.mark.unit


def job(jid="j1", **kw):
    base = dict(id=jid, version=0, steps=10, staleness=1, groups_per_step=4, group_size=8, dispatched=0)
    base.update(kw)
    return JobState(**base)


def test_admission_limit_hand_values():
    # (t + S + 1) * P, capped at steps * P
    assert admission_limit(0, 0, 4, 10) == 4
    assert admission_limit(0, 1, 4, 10) == 8
    assert admission_limit(3, 2, 8, 100) == 48
    assert admission_limit(9, 4, 4, 10) == 40


def test_step_groups_and_bound():
    assert step_groups(2, 3) == [6, 7, 8]
    assert within_staleness(5, 3, 2)
    assert not within_staleness(5, 2, 2)
    assert not within_staleness(2, 3, 5)  # a rollout from the future is never valid


def test_plan_dispatches_up_to_admission_and_interleaves_jobs():
    s = Snapshot(jobs=(job("j1"), job("j2")), gen_capacity=1, batch_rows=1000)
    p = plan(s)
    assert len(p.gen_batches) == 1
    batch = p.gen_batches[0]
    # S=1, P=4: 8 groups each; first step 0's groups job by job in trainer order (j1 then j2: equal
    # pass, lower id first), then step 1's interleaved j1, j2, j1, j2, ...
    assert [it[1] for it in batch[:8]] == ["j1"] * 4 + ["j2"] * 4
    assert [it[1] for it in batch[8:12]] == ["j1", "j2", "j1", "j2"]
    assert Counter(it[1] for it in batch) == {"j1": 8, "j2": 8}
    assert p.dispatched == {"j1": 8, "j2": 8}


def test_plan_respects_batch_rows_and_capacity():
    s = Snapshot(jobs=(job("j1", staleness=0),), gen_capacity=3, gen_inflight=1, batch_rows=16)
    p = plan(s)
    # 4 admissible groups of 8 rows, 16 rows per batch, 2 free slots -> 2 batches of 2 groups
    assert [len(b) for b in p.gen_batches] == [2, 2]
    assert p.dispatched == {"j1": 4}


def test_nothing_new_when_admission_reached():
    s = Snapshot(jobs=(job("j1", version=2, dispatched=16),))
    assert plan(s).gen_batches == []


def test_expired_work_goes_first_and_verify_is_redispatched():
    s = Snapshot(
        jobs=(job("j1", dispatched=8),),
        expired=(("gen", "j1", 3), ("ver", "j1", 5), ("gen", "gone", 1)),
        batch_rows=8,
    )
    p = plan(s)
    assert p.gen_batches[0] == [("gen", "j1", 3)]
    assert p.verify == [("ver", "j1", 5)]


def test_weighted_round_robin_shares():
    # Stride scheduling over 300 picks: weight 2 gets twice the steps of weight 1.
    passes = {"j1": 0.0, "j2": 0.0, "j3": 0.0}
    weights = {"j1": 1.0, "j2": 1.0, "j3": 2.0}
    picks = Counter()
    for _ in range(300):
        jobs = [job(j, ready=True, weight=weights[j], pass_value=passes[j]) for j in passes]
        chosen = choose_trainer(jobs)
        picks[chosen.id] += 1
        passes[chosen.id] += 1 / weights[chosen.id]
    assert picks == {"j1": 75, "j2": 75, "j3": 150}


def test_trainer_only_for_ready_and_free():
    jobs = (job("j1", ready=False), job("j2", ready=True, pass_value=5.0))
    assert plan(Snapshot(jobs=jobs)).train == ("j2", 0)
    assert plan(Snapshot(jobs=jobs, trainer_free=False)).train is None
    assert choose_trainer([job("j1", ready=True, version=10, steps=10)]) is None


def test_eval_items_are_dispatched_with_their_rows():
    s = Snapshot(jobs=(job("j1", staleness=0, need_eval=(0,), eval_rows=64),), batch_rows=79)
    p = plan(s)
    # step 0's four groups (32 rows) first; 32 + 64 > 79: the evaluation opens the second batch
    assert p.gen_batches == [[("gen", "j1", g) for g in range(4)], [("eval", "j1", 0)]]


def test_next_steps_groups_then_evaluations_then_the_rest():
    """The groups the trainer waits on go first, job by job in the order the trainer takes them
    (lowest pass first), then evaluations, then the groups further ahead (interleaved by weight)."""
    jobs = (job("j1", groups_per_step=2, need_eval=(0,), eval_rows=4, pass_value=1.0),
            job("j2", groups_per_step=2, dispatched=1, need_eval=(0,), eval_rows=4))
    p = plan(Snapshot(jobs=jobs, gen_capacity=1, batch_rows=1000))
    assert p.gen_batches == [[("gen", "j2", 1), ("gen", "j1", 0), ("gen", "j1", 1),
                              ("eval", "j1", 0), ("eval", "j2", 0),
                              ("gen", "j2", 2), ("gen", "j1", 2), ("gen", "j2", 3), ("gen", "j1", 3)]]  # ties: pass
    assert p.dispatched == {"j1": 4, "j2": 4}


def _simulate(rng, staleness: int, P: int, steps: int, rows: list[int], gen_capacity: int = 1, jit_jobs: int = 0):
    """Two jobs through `plan` with random completion order and a random version at generation time.
    Returns (both jobs reached `steps`, [(both still training, trained version, sampled version)] per
    trained group)."""
    jobs = {"j1": dict(version=0, dispatched=0), "j2": dict(version=0, dispatched=0)}
    pending: list[tuple[str, int]] = []  # dispatched, not generated yet
    sampled: dict[tuple[str, int], int] = {}
    trained = []
    for _ in range(5000):
        snap = Snapshot(
            jobs=tuple(
                job(j, staleness=staleness, groups_per_step=P, steps=steps, **st,
                    ready=all((j, g) in sampled for g in step_groups(st["version"], P)))
                for j, st in jobs.items()
            ),
            gen_capacity=gen_capacity,
            batch_rows=rng.choice(rows),
            jit_jobs=jit_jobs,
        )
        p = plan(snap)
        for b in p.gen_batches:
            pending += [(it[1], it[2]) for it in b]
        for j, d in p.dispatched.items():
            jobs[j]["dispatched"] = d
        # generation happens later, at whatever version is current then
        rng.shuffle(pending)
        for _ in range(rng.randint(0, len(pending))):
            j, g = pending.pop()
            sampled[(j, g)] = jobs[j]["version"]
        if p.train:
            j, t = p.train
            both = all(st["version"] < steps for st in jobs.values())
            trained += [(both, t, sampled[(j, g)]) for g in step_groups(t, P)]
            jobs[j]["version"] += 1
        if all(st["version"] == steps for st in jobs.values()):
            break
    return all(st["version"] == steps for st in jobs.values()), trained


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_simulated_asynchrony_never_breaks_staleness(staleness):
    """Random completion order and random version at generation time: every trained group obeys the bound."""
    done, trained = _simulate(random.Random(staleness), staleness, 3, 12, [8, 24, 64])
    assert done
    assert all(within_staleness(t, v, staleness) for _, t, v in trained)
    trained_staleness = [t - v for _, t, v in trained]
    assert max(trained_staleness) <= staleness
    if staleness > 0:
        assert max(trained_staleness) >= 1  # asynchrony actually happened


def test_generation_share_follows_weights():
    s = Snapshot(jobs=(job("j1", weight=1.0, staleness=4), job("j2", weight=3.0, staleness=4)),
                 gen_capacity=1, batch_rows=16 * 8)
    batch = plan(s).gen_batches[0]
    # first each job's next step (4 groups each), then the groups ahead by weight:
    # keys j1 -> 1, 2, 3, ... ; j2 -> 1/3, 2/3, 1, 4/3, ... : 8 more groups = 6 of j2 and 2 of j1
    assert Counter(it[1] for it in batch[:8]) == {"j2": 4, "j1": 4}
    assert Counter(it[1] for it in batch[8:]) == {"j2": 6, "j1": 2}


def test_groups_ahead_wait_for_a_full_batch_when_asked():
    """min_batch_rows (generate and train on one device): a batch of groups no step waits on yet is
    held back until it has that many rows; a batch with a group the trainer needs, or an evaluation,
    goes at once and carries the groups ahead with it."""
    ahead = job("j1", dispatched=4)  # step 0's groups out; step 1's (4 groups, 32 rows) ahead
    held = plan(Snapshot(jobs=(ahead,), batch_rows=64, min_batch_rows=64))
    assert held.gen_batches == [] and held.dispatched == {}
    sent = plan(Snapshot(jobs=(ahead, job("j2", dispatched=4)), batch_rows=64, min_batch_rows=64))
    assert [len(b) for b in sent.gen_batches] == [8] and sent.dispatched == {"j1": 8, "j2": 8}  # 64 rows
    blocked = plan(Snapshot(jobs=(job("j1"),), batch_rows=1000, min_batch_rows=1000))
    assert blocked.gen_batches == [[("gen", "j1", g) for g in range(8)]]  # step 0 needed: goes with step 1
    ev = plan(Snapshot(jobs=(job("j1", dispatched=4, need_eval=(0,), eval_rows=4),), batch_rows=1000,
                       min_batch_rows=1000))
    assert ev.gen_batches == [[("eval", "j1", 0)] + [("gen", "j1", g) for g in range(4, 8)]]
    # capacity 2 batches of 4 groups: the first holds step 0 (needed), the second only step 1's groups
    # ahead: sent when 32 rows are enough, held when 48 are asked for
    two = [plan(Snapshot(jobs=(job("j1", staleness=2),), gen_capacity=2, batch_rows=32, min_batch_rows=m))
           for m in (32, 48)]
    assert [len(b) for b in two[0].gen_batches] == [4, 4] and two[0].dispatched == {"j1": 8}
    assert [len(b) for b in two[1].gen_batches] == [4] and two[1].dispatched == {"j1": 4}


def test_lane_weights_split_a_tenants_weight_over_its_training_jobs():
    from marlaas.control.scheduler import JobState, lane_weights

    def job(i, tenant, weight=1.0, version=0):
        return JobState(id=f"j{i}", version=version, steps=4, staleness=1, groups_per_step=2, group_size=4,
                        dispatched=0, weight=weight, tenant=tenant)

    jobs = [job(1, "a"), job(2, "a"), job(3, "a", version=4), job(4, "b", weight=3.0), job(5, "c", weight=2.0),
            job(6, "c", weight=2.0), job(7, "c", weight=2.0), job(8, "c", weight=2.0)]
    # a: 2 jobs still training (j3 is done) -> 1/2 each; b: 3; c: 2/4 each
    assert lane_weights(jobs) == {"j1": 0.5, "j2": 0.5, "j3": 0.5, "j4": 3.0, "j5": 0.5, "j6": 0.5, "j7": 0.5,
                                  "j8": 0.5}


def test_just_in_time_generates_only_next_steps_from_jit_jobs_training():
    """gen_jit_jobs: with at least that many jobs training, only the groups each job's next step
    needs are generated (staleness 0); with fewer, groups ahead within the bound as before."""
    two = (job("j1", staleness=2, groups_per_step=2), job("j2", staleness=2, groups_per_step=2))
    assert plan(Snapshot(jobs=two, gen_capacity=1, batch_rows=1000)).dispatched == {"j1": 6, "j2": 6}  # off
    jit = plan(Snapshot(jobs=two, gen_capacity=1, batch_rows=1000, jit_jobs=2))
    assert jit.gen_batches == [[("gen", "j1", 0), ("gen", "j1", 1), ("gen", "j2", 0), ("gen", "j2", 1)]]
    assert plan(Snapshot(jobs=two, gen_capacity=1, batch_rows=1000, jit_jobs=3)).dispatched == {"j1": 6, "j2": 6}
    # a job whose training is over does not count: one job training left, so it pipelines again
    over = (job("j1", staleness=2, groups_per_step=2, version=1, dispatched=2),
            job("j2", staleness=2, groups_per_step=2, version=10, steps=10, dispatched=20))
    assert plan(Snapshot(jobs=over, gen_capacity=1, batch_rows=1000, jit_jobs=2)).dispatched == {"j1": 8}
    # a job whose next step is out already gets nothing new; evaluations still go
    out = (job("j1", groups_per_step=2, dispatched=2, need_eval=(0,), eval_rows=4), job("j2", groups_per_step=2))
    p = plan(Snapshot(jobs=out, gen_capacity=1, batch_rows=1000, jit_jobs=2))
    assert p.gen_batches == [[("gen", "j2", 0), ("gen", "j2", 1), ("eval", "j1", 0)]] and p.dispatched == {"j2": 2}


def test_just_in_time_trains_every_group_at_staleness_0():
    """The randomised simulation above with jit_jobs = 2 on two jobs at staleness 2: every trained
    group was sampled at the version it trains at."""
    P, steps = 3, 8
    done, trained = _simulate(random.Random(7), 2, P, steps, [8, 24], gen_capacity=2, jit_jobs=2)
    seen = [(both, t - v) for both, t, v in trained]
    assert done and len(seen) == 2 * steps * P
    # while both train, every group at staleness 0; the job left alone at the end pipelines (<= 2)
    assert {s for both, s in seen if both} == {0} and max(s for _, s in seen) <= 2
    assert sum(both for both, _ in seen) >= steps * P


def test_just_in_time_and_min_fill_exclude_each_other(monkeypatch):
    from pydantic import ValidationError

    from marlaas.settings import Settings

    monkeypatch.setenv("MARLAAS_GEN_JIT_JOBS", "2")
    assert Settings().gen_jit_jobs == 2 and Settings().gen_min_fill == 0.0
    monkeypatch.setenv("MARLAAS_GEN_MIN_FILL", "0.9")
    with pytest.raises(ValidationError, match="MARLAAS_GEN_JIT_JOBS and MARLAAS_GEN_MIN_FILL exclude each other"):
        Settings()


def model(mid="m1", **kw):
    """A Tinker model wanting the trainer lane, as the tick's snapshot reads it."""
    base = dict(id=mid, version=0, steps=1 << 30, staleness=0, groups_per_step=1, group_size=1, dispatched=0,
                ready=True)
    base.update(kw)
    return JobState(**base)


def test_the_lane_goes_to_the_job_or_the_tinker_model_first_in_trainer_order():
    jobs = (job("j1", ready=True, pass_value=2.0, tenant="a"), job("j2", pass_value=0.0, tenant="a"))
    behind = plan(Snapshot(jobs=jobs, tinker=(model("m1", pass_value=1.0, tenant="b", weight=2.0),)))
    assert (behind.train, behind.tinker, behind.lane_weight) == (None, "m1", 2.0)  # lowest pass: the model
    ahead = plan(Snapshot(jobs=jobs, tinker=(model("m1", pass_value=3.0, tenant="b"),)))
    # the job wins; its tenant's weight 1 is split over its 2 jobs still training
    assert (ahead.train, ahead.tinker, ahead.lane_weight) == (("j1", 0), None, 0.5)
    tie = plan(Snapshot(jobs=jobs, tinker=(model("m1", pass_value=2.0, tenant="b"),)))
    assert (tie.train, tie.tinker) == (("j1", 0), None)  # equal pass: ties by (id number, id): (1, "j1") first
    busy = plan(Snapshot(jobs=jobs, trainer_free=False, tinker=(model("m1", tenant="b"),)))
    assert (busy.train, busy.tinker) == (None, None)
    assert choose_trainer(jobs, (model("m1", pass_value=1.5),)).id == "m1"
    assert choose_trainer((), ()) is None


def test_a_tinker_model_shares_its_tenants_weight_with_the_tenants_jobs():
    jobs = (job("j1", ready=True, pass_value=9.0, tenant="a", weight=3.0),)
    p = plan(Snapshot(jobs=jobs, tinker=(model("m7", tenant="a", weight=3.0),)))
    assert (p.tinker, p.lane_weight) == ("m7", 1.5)  # tenant a's weight 3 over its job and its model


def test_stride_scheduling_over_jobs_and_tinker_models_keeps_the_shares():
    """300 lane grants between two jobs of tenant a (weight 1) and one model of tenant b (weight 1):
    per-tenant fairness, the model alone gets tenant b's half."""
    passes = {"j1": 0.0, "j2": 0.0, "m3": 0.0}
    picks = Counter()
    for _ in range(300):
        jobs = tuple(job(j, ready=True, tenant="a", pass_value=passes[j]) for j in ("j1", "j2"))
        p = plan(Snapshot(jobs=jobs, tinker=(model("m3", tenant="b", pass_value=passes["m3"]),)))
        pick = p.train[0] if p.train else p.tinker
        picks[pick] += 1
        passes[pick] += 1 / p.lane_weight
    assert picks == {"j1": 75, "j2": 75, "m3": 150}


def test_a_plan_is_frozen():
    p = plan(Snapshot(jobs=(job("j1", ready=True),)))
    with pytest.raises(AttributeError):
        p.train = None


def test_work_items_and_their_wire_forms():
    from marlaas.types import ItemKind, WorkItem, eval_request_key, is_eval_request, parse_eval_request

    it = WorkItem(ItemKind.VER, "j3", 12)
    assert it.name == "ver|j3|12" and WorkItem.parse(it.name) == it == ("ver", "j3", 12)
    assert WorkItem.parse(b"evalver|j3|4").kind is ItemKind.EVALVER
    assert WorkItem.of(["gen", "j1", 5]) == WorkItem(ItemKind.GEN, "j1", 5) and list(it) == ["ver", "j3", 12]
    with pytest.raises(ValueError):
        WorkItem.parse("train|j3|12")  # the old verify word is not a kind
    with pytest.raises(ValueError):
        WorkItem.of(["eval", "j1"])
    greedy, sampled = eval_request_key("j2", 3, 7, sampled=False), eval_request_key("j2", 3, 7, sampled=True)
    assert greedy != sampled and is_eval_request(greedy) and is_eval_request(sampled)
    assert not is_eval_request(WorkItem(ItemKind.GEN, "j2", 3).name) and not is_eval_request("evalver|j2|3")
    assert parse_eval_request(greedy) == ("j2", 3, 7, False) and parse_eval_request(sampled) == ("j2", 3, 7, True)


def test_the_default_plan_weight_is_the_stores_fallback():
    from marlaas.api.tenancy import Quotas
    from marlaas.store.tenants import DEFAULT_PLAN_WEIGHT

    assert Quotas().weight == DEFAULT_PLAN_WEIGHT


def test_a_lone_jobs_step_is_spread_over_the_idle_generate_workers():
    lone = job("j1", staleness=0)  # 4 groups of 8 rows: one batch of 256 rows would hold them all
    assert [len(b) for b in plan(Snapshot(jobs=(lone,), gen_capacity=4, gen_workers=2)).gen_batches] == [2, 2]
    four = plan(Snapshot(jobs=(lone,), gen_capacity=8, gen_workers=4)).gen_batches
    assert [[it[2] for it in b] for b in four] == [[0], [1], [2], [3]]  # in order, one group each
    # one worker busy: one idle worker, one batch; workers unknown: one batch as before
    busy = plan(Snapshot(jobs=(lone,), gen_capacity=4, gen_workers=2, gen_inflight=1))
    assert [len(b) for b in busy.gen_batches] == [4]
    assert [len(b) for b in plan(Snapshot(jobs=(lone,), gen_capacity=4)).gen_batches] == [4]
    # more workers than groups: one group per batch, no empty batch
    assert [len(b) for b in plan(Snapshot(jobs=(lone,), gen_capacity=16, gen_workers=8)).gen_batches] == [1] * 4
    # the spread never exceeds the free batches, and leaves full batches as they are
    assert len(plan(Snapshot(jobs=(lone,), gen_capacity=2, gen_inflight=1, gen_workers=8)).gen_batches) == 1
    full = plan(Snapshot(jobs=(job("j1", staleness=0), job("j2", staleness=0)), gen_capacity=4, gen_workers=2,
                         batch_rows=32))
    assert [len(b) for b in full.gen_batches] == [4, 4] and full.dispatched == {"j1": 4, "j2": 4}


def test_a_spread_keeps_the_order_and_balances_rows():
    ev = job("j1", staleness=0, need_eval=(0,), eval_rows=24)  # the evaluation (24 rows) and 4 groups of 8
    b = plan(Snapshot(jobs=(ev,), gen_capacity=4, gen_workers=2)).gen_batches
    flat = [it for x in b for it in x]
    assert flat == [it for x in plan(Snapshot(jobs=(ev,), gen_capacity=4)).gen_batches for it in x]
    assert [sum(24 if it[0] == "eval" else 8 for it in x) for x in b] == [32, 24]


def test_a_tinker_model_waits_for_a_job_before_it_whose_next_step_is_near():
    """A job is ready only between generation and training; a model with ops is ready all the time. Had
    the lane gone to the model in every gap, a fast job would have got a step per grant, whatever the
    passes (bench/neighbours.py: 0.21 of its steps under a forward_backward flood)."""
    m = (model("m1", pass_value=5.0, tenant="b"),)
    near = (job("j1", pass_value=2.0, tenant="a", stepping=True),)  # not ready yet, its step is moments away
    assert choose_trainer(near, m) is None
    p = plan(Snapshot(jobs=near, tinker=m))
    assert (p.train, p.tinker) == (None, None)  # the lane waits
    stuck = (job("j1", pass_value=2.0, tenant="a"),)  # not stepping (e.g. a slow grader): never holds the lane
    assert choose_trainer(stuck, m).id == "m1"
    caught_up = (job("j1", pass_value=6.0, tenant="a", stepping=True),)  # past the model's pass: the model's turn
    assert choose_trainer(caught_up, m).id == "m1"
    ready = (job("j1", pass_value=2.0, tenant="a", stepping=True, ready=True),)
    assert choose_trainer(ready, m).id == "j1"
    # between jobs nothing waits: job steps are short, the ready one goes
    two = (job("j1", pass_value=1.0, stepping=True), job("j2", pass_value=3.0, ready=True))
    assert choose_trainer(two).id == "j2"


def test_stride_with_a_stepping_job_gives_the_model_its_share_and_no_more():
    """A job ready every other tick (its generation between) and a model always ready, equal weights:
    the job gets its turns as if it were always ready."""
    passes, picks = {"j1": 0.0, "m1": 0.0}, Counter()
    for t in range(400):
        jobs = (job("j1", ready=t % 2 == 0, stepping=True, tenant="a", pass_value=passes["j1"]),)
        pick = choose_trainer(jobs, (model("m1", tenant="b", pass_value=passes["m1"]),))
        if pick is not None:
            picks[pick.id] += 1
            passes[pick.id] += 1.0
    assert abs(picks["j1"] - picks["m1"]) <= 2 and picks["j1"] >= 130, picks
