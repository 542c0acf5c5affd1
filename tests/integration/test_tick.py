"""The fast tick: lazy interleaving equals the full sort, the workers registry keeps TTL semantics,
the per-job lease index drops exactly a job's leases, and the scripted snapshot reads the truth."""

import json
import random
import time
from dataclasses import replace

import pytest

from marlaas.control import dispatch, scheduler
from marlaas.control.scheduler import JobState, admission_limit
from marlaas.spec import JobSpec
from marlaas.store import GEN_INFLIGHT, item_name


def reference_interleave(jobs):
    """The pre-heap algorithm: every admissible group keyed ((k + 1) * group_size / w, urgency rank),
    sorted; w is the tenant's weight split evenly over the tenant's jobs still training."""
    def urgency(j):
        blocked = j.dispatched < min((j.version + 1) * j.groups_per_step, j.steps * j.groups_per_step)
        return (0 if blocked else 1, j.pass_value, int(j.id[1:]))

    training = [j.tenant for j in jobs if j.version < j.steps]
    keyed = []
    for rank, j in enumerate(sorted(jobs, key=urgency)):
        w = j.weight / max(1, training.count(j.tenant))
        for k, g in enumerate(range(j.dispatched, admission_limit(j.version, j.staleness, j.groups_per_step, j.steps))):
            keyed.append(((k + 1) * (j.group_size / w), rank, ("gen", j.id, g)))
    keyed.sort(key=lambda x: (x[0], x[1]))
    return [it for _, _, it in keyed]


def random_jobs(rng, n):
    out = []
    for i in range(n):
        steps, p, s = rng.randint(1, 6), rng.randint(1, 4), rng.randint(0, 2)
        t = rng.randint(0, steps)
        d = rng.randint(min(t * p, steps * p), admission_limit(t, s, p, steps))
        out.append(JobState(id=f"j{i + 1}", tenant=rng.choice("abc"), version=t, steps=steps, staleness=s,
                            groups_per_step=p, group_size=rng.choice([2, 4, 8]), dispatched=d,
                            weight=rng.choice([0.5, 1.0, 2.0, 3.0]), pass_value=rng.choice([0.0, 0.5, 1.0]),
                            eval_rows=4))
    return tuple(out)


@pytest.mark.unit
def test_lazy_interleave_equals_the_full_sort():
    rng = random.Random(0)
    for _ in range(200):
        jobs = random_jobs(rng, rng.randint(0, 12))
        assert scheduler._interleave(jobs) == reference_interleave(jobs)


@pytest.mark.unit
def test_plan_fills_batches_from_the_lazy_stream_in_order():
    # two jobs, group size 4, batch of 8 rows -> 2 groups a batch; capacity 2 batches
    a = JobState(id="j1", version=0, steps=4, staleness=1, groups_per_step=2, group_size=4, dispatched=0)
    b = JobState(id="j2", version=0, steps=4, staleness=1, groups_per_step=2, group_size=4, dispatched=0,
                 weight=2.0)
    plan = scheduler.plan(scheduler.Snapshot(jobs=(a, b), gen_capacity=2, batch_rows=8, trainer_free=False))
    # step 0's groups first, job by job in trainer order (equal pass: j1 by id), 2 groups a batch;
    # the groups ahead (step 1's, interleaved by weight) would come next but the 2 batches are full
    assert plan.gen_batches == [[("gen", "j1", 0), ("gen", "j1", 1)], [("gen", "j2", 0), ("gen", "j2", 1)]]
    assert plan.dispatched == {"j1": 2, "j2": 2}
    # once both are past step 0: keys j1 -> 1, 2, 3 ; j2 (w=2) -> .5, 1, 1.5 ; ties: lower rank (j1)
    ahead = scheduler.plan(scheduler.Snapshot(jobs=(replace(a, dispatched=2), replace(b, dispatched=2)),
                                              gen_capacity=2, batch_rows=8, trainer_free=False))
    assert ahead.gen_batches == [[("gen", "j2", 2), ("gen", "j1", 2)], [("gen", "j2", 3), ("gen", "j1", 3)]]


@pytest.mark.integration
def test_workers_registry_keeps_ttl_semantics(st):
    st.heartbeat("generate@h:1", "generate", ttl=0.3)
    st.heartbeat("train@h:2", "train", ttl=30)
    assert set(st.workers()) == {"generate@h:1", "train@h:2"}
    time.sleep(0.5)
    assert set(st.workers()) == {"train@h:2"}  # the heartbeat key expired: dead
    assert {x.decode() for x in st.r.smembers("m:workers")} == {"train@h:2"}  # pruned
    st.heartbeat("generate@h:1", "generate", ttl=30)  # beats again: alive again
    assert st.workers()["generate@h:1"]["station"] == "generate"


def make_job(st, tenant="a", **kw):
    spec = JobSpec(**{"tenant": tenant, "task": "sort", "steps": 3, "prompts_per_step": 2, "group_size": 4,
                      "max_staleness": 1, "eval_size": 2, **kw})
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(6)]
    return st.create_job(spec, rows, rows[:2])


@pytest.mark.integration
def test_set_status_drops_exactly_the_jobs_leases(st):
    a, b = make_job(st, "a"), make_job(st, "b")
    st.lease([item_name("gen", a, 0), item_name("gen", a, 1), item_name("gen", b, 0), item_name("eval", a, 0)], 60)
    st.put_rollout(a, 0, 0, {"row": {}, "completions": []})  # gen|a|0 -> ver|a|0
    st.r.zadd("m:leases", {item_name("cont", a, 1): 0})  # a writer that does not index: same family
    st.put_eval_rollout(a, 0, {"row": {}, "completions": []})  # eval|a|0 -> evalver|a|0
    st.set_status(a, "cancelled")
    left = sorted(x.decode() for x in st.r.zrange("m:leases", 0, -1))
    assert left == [item_name("gen", b, 0)]
    assert not st.r.exists(f"m:job:{a}:leases")


@pytest.mark.integration
def test_record_dispatch_writes_leases_index_batches_and_counters(st):
    a = make_job(st)
    st.record_dispatch([item_name("gen", a, 0), item_name("eval", a, 0)], 60, ["b1", "b2"], {a: 1})
    assert st.leased([item_name("gen", a, 0), item_name("eval", a, 0), item_name("gen", a, 1)]) == [True, True, False]
    assert {x.decode() for x in st.r.smembers(f"m:job:{a}:leases")} == {item_name("gen", a, 0), item_name("eval", a, 0)}
    assert st.gen_inflight(time.time()) == 2
    assert st.job(a).dispatched == 1


@pytest.mark.integration
def test_snapshot_reads_ready_and_needed_evals(st):
    a, b = make_job(st, "a"), make_job(st, "b")
    st.heartbeat("generate@h:1", "generate")
    st.advance_dispatched(a, 2)
    for g in (0, 1):  # a's step-0 groups dispatched and verified: ready
        att = st.put_rollout(a, g, 0, {"row": {}, "completions": []})
        st.accept_rewards(a, g, att, {"rewards": [1.0]})
    st.lease([item_name("eval", b, 0)], 60)  # b's base evaluation in flight: not needed again
    snap = dispatch.snapshot(st, time.time())
    by = {j.id: j for j in snap.jobs}
    assert (by[a].ready, by[a].need_eval) == (True, (0,))
    assert (by[b].ready, by[b].need_eval) == (False, ())
    assert (snap.gen_capacity, snap.trainer_free) == (2, True)
    # lane busy (held by a live worker): readiness is not read; evals still are
    tok = st.take_trainer(a, 0, 60)
    st.heartbeat("train@h:2", "train")
    st.claim_trainer(tok, "train@h:2")
    snap = dispatch.snapshot(st, time.time())
    by = {j.id: j for j in snap.jobs}
    assert snap.trainer_free is False and by[a].ready is False and by[a].need_eval == (0,)
    # expired eval lease shows up as expired work, and the eval is not also listed as needed
    snap = dispatch.snapshot(st, time.time() + 120)
    assert ("eval", b, 0) in snap.expired
    assert {j.id: j for j in snap.jobs}[b].need_eval == ()
    # a stored evaluation is no longer needed (and is remembered as done)
    st.put_eval_result(a, 0, {"acc": 0.5, "n": 2})
    for _ in range(2):
        assert {j.id: j for j in dispatch.snapshot(st, time.time()).jobs}[a].need_eval == ()


@pytest.mark.integration
def test_scheduling_table_follows_every_writer(st):
    from marlaas.types import AdapterBlob

    def rows(epoch="", seq="0"):
        s = st.tick_state(time.time(), epoch, seq)
        return s, {r.split("\t", 1)[0]: r.split("\t")[1:4] for r in s["rows"]}

    a, b = make_job(st, "a"), make_job(st, "b")
    s0, got = rows()
    assert s0["full"] and got == {a: ["running", "0", "0"], b: ["running", "0", "0"]}
    st.advance_dispatched(a, 2)
    st.publish(b, 0, AdapterBlob({"r": 1}, b"w"), b"o", {}, "-", [], 3)
    s1, got = rows(s0["epoch"], s0["seq"])  # only the rows changed since s0
    assert not s1["full"] and got == {a: ["running", "0", "2"], b: ["running", "1", "0"]}
    st.advance_dispatched(a, 2)  # the same row: no change
    st.set_status(b, "evaluating")
    s2, got = rows(s1["epoch"], s1["seq"])
    assert got == {b: ["evaluating", "1", "0"]}
    st.set_status(b, "done")  # leaves the table: its row comes back empty
    s3, _ = rows(s2["epoch"], s2["seq"])
    assert s3["rows"] == [f"{b}\t"] and set(st.r.hkeys("m:sched:jobs")) == {a.encode()}
    st.r.srem("m:jobs:active", a)  # by hand: the table no longer matches the set: rebuilt, new epoch
    s4, got = rows(s3["epoch"], s3["seq"])
    assert s4["full"] and s4["epoch"] != s3["epoch"] and got == {}
    st.r.delete("m:sched:epoch")  # a flushed database starts a new epoch: everything is read again
    assert rows(s4["epoch"], s4["seq"])[0]["full"]


@pytest.mark.integration
def test_snapshot_marks_only_the_trainers_pick_ready(st):
    jobs = [make_job(st, t) for t in "abc"]
    for jid in jobs:
        st.advance_dispatched(jid, 2)
        for g in (0, 1):
            st.accept_rewards(jid, g, st.put_rollout(jid, g, 0, {"row": {}, "completions": []}), {"rewards": [1.0]})
    st.advance_pass(jobs[0], 1.0)  # a's pass 1: b and c tie at 0, b has the lower id
    snap = dispatch.snapshot(st, time.time())
    assert [j.id for j in snap.jobs if j.ready] == [jobs[1]]
    full = scheduler.Snapshot(jobs=tuple(JobState(**{**j.__dict__, "ready": True}) for j in snap.jobs),
                              trainer_free=True)
    assert scheduler.plan(snap).train == scheduler.plan(full).train == (jobs[1], 0)
    st.r.srem(f"m:job:{jobs[1]}:verified", 1)  # b no longer ready: c is the pick
    assert [j.id for j in dispatch.snapshot(st, time.time()).jobs if j.ready] == [jobs[2]]


@pytest.mark.integration
def test_eval_lookups_stop_where_the_batches_are_full(st):
    config = dispatch.TickConfig(gen_batch_rows=4)  # eval rows 2 * (1 + 0): 2 evals a batch
    jobs = [make_job(st, f"t{i}", eval_k=0) for i in range(8)]  # every base evaluation needed
    snap = dispatch.snapshot(st, time.time(), config)  # no generate worker: capacity 2 batches
    asked = [j.id for j in snap.jobs if j.need_eval]
    # budget 2 batches * max(4 rows, largest item 4) = 8 rows; a line is answered while the needed
    # rows so far are <= 8: after 2, 4, 6, 8 -> the 5th is still answered, then 10 > 8 stops
    assert asked == jobs[:5]
    full = scheduler.Snapshot(jobs=tuple(JobState(**{**j.__dict__, "need_eval": (0,)}) for j in snap.jobs),
                              gen_capacity=snap.gen_capacity, batch_rows=4, trainer_free=True)
    assert scheduler.plan(snap).gen_batches == scheduler.plan(full).gen_batches


@pytest.mark.integration
def test_tick_bench_publishes_through_celery(st, monkeypatch):
    """bench/tick.py --publish sends the tick's messages through the service's sender, which
    really puts them, in one batch, on the broker's queues."""
    from bench.tick import _publisher, measure_tick
    from marlaas.settings import get_settings

    monkeypatch.setenv("MARLAAS_REDIS_URL", st.url)  # _publisher points the sender at the scratch DB
    try:
        send = _publisher(st.url)
        send([("marlaas.verify", ["j1", "ver", [0, 1]]), ("marlaas.generate", ["b1", [["gen", "j1", 2]]]),
              ("marlaas.verify", ["j2", "evalver", [3]])])
        assert (st.r.llen("verify"), st.r.llen("generate")) == (2, 1)  # Celery's Redis queues are lists
        body = json.loads(st.r.lindex("generate", 0))
        assert body["headers"]["task"] == "marlaas.generate" and "batch=b1" in body["headers"]["argsrepr"]
        out = measure_tick(10, st.url, repeats=2, case="steady", publish=True)
        assert out["messages"] == "published through Celery" and out["messages_per_tick_median"] > 0
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


@pytest.mark.integration
def test_expired_verifications_go_out_one_message_per_job(st):
    """The recovery tick re-sends a job's lost verifications as one verify message (the task takes a
    list), not one message per group: 4 expired groups of one job -> 1 message with 4 indices."""
    from bench.tick import WORKERS, build

    build(st, 5, time.time(), case="expired")  # the third job ("expired" kind) lost verify 12..15
    for name, station in WORKERS:
        st.heartbeat(name, station, ttl=60)
    sent: list = []
    dispatch.tick(st, sent.extend)
    verify = [a for n, a in sent if n == "marlaas.verify"]
    assert len(verify) == 1 and verify[0][1] == "ver" and sorted(verify[0][2]) == [12, 13, 14, 15]


@pytest.mark.integration
def _watch(st, now: float, memory) -> list[str]:
    """A tick's first two steps: the snapshot (reads only), then the watchdog (stall_s 100 s)."""
    dispatch.snapshot(st, now, memory=memory)
    return dispatch.watchdog(st, now, 100.0, memory)


@pytest.mark.integration
def test_watchdog_fails_a_job_that_makes_no_progress(st):
    stuck, moving = make_job(st, "a"), make_job(st, "b")
    memory = dispatch.TickMemory()
    t0 = time.time()
    assert _watch(st, t0, memory) == []
    st.advance_dispatched(moving, 1)  # progress: its clock starts again
    assert _watch(st, t0 + 60, memory) == []
    snap = dispatch.snapshot(st, t0 + 101, memory=memory)  # reading fails nobody
    assert {j.id for j in snap.jobs} == {stuck, moving} and st.job(stuck).status == "running"
    assert dispatch.watchdog(st, t0 + 101, 100.0, memory) == [stuck]
    assert [j.id for j in dispatch.snapshot(st, t0 + 102, memory=memory).jobs] == [moving]
    rec = st.job(stuck)
    assert rec.status == "failed" and rec.extra["error"].startswith("no progress for 100 s")
    assert st.job(moving).status == "running"


@pytest.mark.integration
def test_the_tick_plans_without_the_jobs_its_watchdog_failed(st):
    stuck = make_job(st, "a")
    memory, config = dispatch.TickMemory(), dispatch.TickConfig(stall_s=100.0)
    t0 = time.time()
    dispatch.tick(st, lambda msgs: None, config, now=t0, memory=memory)
    st.r.hset(f"m:job:{stuck}", "dispatched", 0)  # as if its work had never gone out: no progress
    st.sync_rows([stuck])
    st.r.delete(GEN_INFLIGHT)  # the generate station is free: without the watchdog, group 0 would go out
    sent: list = []
    plan = dispatch.tick(st, sent.extend, config, now=t0 + 101, memory=memory)
    assert st.job(stuck).status == "failed"
    assert plan is not None and plan.gen_batches == [] and plan.dispatched == {} and sent == []


def make_ready(st, jobs: list[str], P: int) -> None:
    """Verify every group of each job's next step (P groups a step): each wants the trainer lane."""
    for jid in jobs:
        t = st.job(jid).version
        for g in range(t * P, (t + 1) * P):
            if st.rollout(jid, g) is None:
                att = st.put_rollout(jid, g, t, {"row": {}, "completions": []})
                st.accept_rewards(jid, g, att, {"rewards": [1.0]})


@pytest.mark.integration
def test_trainer_shares_are_fair_per_tenant_over_the_real_tick(st):
    """Two tenants of equal plans, one with 8 jobs and one with 1, all always ready: over the real
    tick (snapshot, plan, the store's scripts), each tenant gets half of the trainer's steps (10%)."""
    from marlaas.types import AdapterBlob

    many = [make_job(st, "many", steps=1000) for _ in range(8)]
    one = make_job(st, "one", steps=1000)
    P = 2
    picks: dict[str, int] = {}
    for _ in range(90):
        make_ready(st, [*many, one], P)  # every job's next step is verified: all want the lane
        sent = []
        dispatch.tick(st, sent.extend)
        train = [args for name, args in sent if name == "marlaas.train"]
        assert len(train) == 1, sent
        jid, t, token = train[0]
        tenant = st.job(jid).tenant
        picks[tenant] = picks.get(tenant, 0) + 1
        assert st.publish(jid, t, AdapterBlob({}, b""), b"", {"step": t + 1}, token, list(range(t * P, (t + 1) * P)),
                          1000)
    assert picks["many"] + picks["one"] == 90
    assert abs(picks["many"] - picks["one"]) <= 9, picks  # within 10% of the 90 steps


@pytest.mark.integration
def test_a_tinker_model_shares_the_trainer_lane_fairly_with_jobs(st):
    """A Tinker client that always has ops queued, next to two tenants' jobs that are always ready:
    over the real tick each of the three tenants (equal plans) gets a third of the trainer's steps."""
    from marlaas.store.keys import model_key
    from marlaas.store.tinker import PENDING_TRAIN, TinkerStore
    from marlaas.types import AdapterBlob

    jobs = [make_job(st, "a", steps=1000), make_job(st, "b", steps=1000), make_job(st, "b", steps=1000)]
    mid = "tk_test1"
    st.r.hset(model_key(mid), mapping={"tenant": "c"})
    P, picks = 2, {}
    for _ in range(60):
        TinkerStore(st).mark_pending(mid)  # the client keeps sending forward_backward + optim_step
        make_ready(st, jobs, P)
        sent = []
        dispatch.tick(st, sent.extend)
        trains = [(name, args) for name, args in sent if name in ("marlaas.train", "marlaas.tinker_train")]
        assert len(trains) == 1, sent
        name, args = trains[0]
        if name == "marlaas.tinker_train":
            assert args[0] == mid and not st.r.sismember(PENDING_TRAIN, mid)  # taken off the candidates
            picks["c"] = picks.get("c", 0) + 1
            st.release_trainer(args[1])  # the task's step is done
        else:
            jid, t, token = args
            tenant = st.job(jid).tenant
            picks[tenant] = picks.get(tenant, 0) + 1
            assert st.publish(jid, t, AdapterBlob({}, b""), b"", {"step": t + 1}, token,
                              list(range(t * P, (t + 1) * P)), 1000)
    assert sorted(picks) == ["a", "b", "c"] and all(abs(n - 20) <= 2 for n in picks.values()), picks


@pytest.mark.integration
def test_watchdog_spares_a_job_waiting_for_its_trainer_turn(st):
    from marlaas.store import VT

    waiting = make_job(st, "a")
    st.r.hset(f"m:job:{waiting}", "pass", 5.0)  # other tenants are ahead of it on the lane
    st.sync_rows([waiting])
    st.r.set(VT, 2.0)
    memory = dispatch.TickMemory()
    t0 = time.time()
    assert _watch(st, t0, memory) == [] and _watch(st, t0 + 101, memory) == []
    assert st.job(waiting).status == "running"
    st.r.set(VT, 6.0)  # its turn came and went: now it is stalled
    assert _watch(st, t0 + 202, memory) == [waiting]  # its clock restarted at t0 + 101
    assert st.job(waiting).status == "failed"


@pytest.mark.integration
def test_a_tinker_model_comes_back_at_the_virtual_time_and_it_never_moves_back(st):
    """A model earns no lane credit while it has nothing queued: never charged or idle, it is picked
    at the virtual time (not from 0, which let a new model hold the lane until it caught up with
    every job); a job picked with credit (it waited for generation) keeps it, and the virtual time
    does not move back."""
    from marlaas.store import VT

    jid = make_job(st, "a")
    st.r.hset(f"m:job:{jid}", "pass", 100.0)
    st.sync_rows([jid])
    st.r.set(VT, 100.0)
    st.r.hset("m:job:tk-idle", "pass", 5.0)  # charged long ago, then nothing queued
    assert st.lane_passes(["tk-new", "tk-idle"]) == {"tk-new": 100.0, "tk-idle": 100.0}
    for mid in ("tk-new", "tk-idle"):
        token = st.tick_write([], [], 10, [], {}, (mid, 0, 1.0, 30, True))
        assert token is not None and float(st.r.hget(f"m:job:{mid}", "pass")) == 101.0
        st.release_trainer(token)
    st.r.hset(f"m:job:{jid}", "pass", 60.0)  # a job with credit: it is charged from where it was
    st.sync_rows([jid])
    token = st.tick_write([], [], 10, [], {}, (jid, 0, 0.5, 30))
    assert token is not None and float(st.r.hget(f"m:job:{jid}", "pass")) == 62.0
    assert float(st.r.get(VT)) == 100.0  # not back to 60
    st.release_trainer(token)
    st.advance_pass(jid, 1.0)
    assert float(st.r.get(VT)) == 100.0


@pytest.mark.integration
def test_the_tick_chooses_just_in_time_by_itself_and_a_number_overrides(st):
    """MARLAAS_GEN_JIT_JOBS=auto (TickConfig's default): two jobs training get only their next
    step's groups (staleness 0) while the gauge says a station is busy (its starting choice); the
    gauge's choice of groups ahead, or the setting 0, lets groups ahead out as far as the bound."""
    a, b = make_job(st, "a"), make_job(st, "b")  # 3 steps of 2 groups, staleness 1: 4 groups admissible
    st.heartbeat("generate@h:1", "generate")
    st.heartbeat("generate@h:2", "generate")
    assert dispatch.TickConfig().gen_jit_jobs == "auto"
    memory = dispatch.TickMemory()
    plan = dispatch.tick(st, lambda msgs: None, dispatch.TickConfig(), memory=memory)
    assert plan is not None and plan.dispatched == {a: 2, b: 2}
    assert memory.gauge(st.url).jit and memory.gauge(st.url).last is not None  # two jobs training: observed
    # the gauge switches to groups ahead: the next tick sends each job's step-1 groups
    g = memory.gauge(st.url)
    g.jit, g.since, g.spells, g.step_s, g.gen, g.train = False, time.time(), 10, 100.0, 0.0, 0.0
    st.r.delete(GEN_INFLIGHT)
    plan = dispatch.tick(st, lambda msgs: None, dispatch.TickConfig(), memory=memory)
    assert plan is not None and plan.dispatched == {a: 4, b: 4}
    # a number overrides the gauge: 0 always ahead (a third job, fresh memory that would choose jit)
    c = make_job(st, "c")
    st.r.delete(GEN_INFLIGHT)
    plan = dispatch.tick(st, lambda msgs: None, dispatch.TickConfig(gen_jit_jobs=0), memory=dispatch.TickMemory())
    assert plan is not None and plan.dispatched == {c: 4}
