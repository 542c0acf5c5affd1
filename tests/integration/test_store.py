"""The store and the scheduler tick against a real Redis server (no workers)."""

import time

import pytest

from marlaas.control import dispatch
from marlaas.spec import JobSpec
from marlaas.types import AdapterBlob, AdapterRef

pytestmark = pytest.mark.integration


def make_job(st, **kw):
    spec = JobSpec(task="sort", steps=3, prompts_per_step=2, group_size=4, max_staleness=1, eval_size=2, **kw)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(10)]
    return st.create_job(spec, rows, rows[:2]), spec


def blob(x=b"w"):
    return AdapterBlob(config={"r": 1}, weights=x)


def test_publish_is_compare_and_set(st):
    jid, spec = make_job(st)
    tok = st.take_trainer(jid, 0, 30)
    assert tok and st.take_trainer(jid, 0, 30) is None  # one lane
    assert st.publish(jid, 0, blob(b"v1"), b"opt1", {"step": 1}, tok, [0, 1], spec.steps)
    assert st.trainer_lease() is None  # released by the publish
    # a redelivered train task for the same step is a no-op
    assert not st.publish(jid, 0, blob(b"dup"), b"opt-dup", {"step": 1}, tok, [0, 1], spec.steps)
    assert st.job(jid).version == 1
    assert st.adapter(AdapterRef(jid, 1)).weights == b"v1"
    assert st.optimizer_state(jid) == (1, b"opt1")
    assert len(st.metrics(jid)) == 1


def test_old_adapter_versions_are_pruned_but_final_kept(st):
    jid, spec = make_job(st)
    for t in range(3):
        st.publish(jid, t, blob(f"v{t + 1}".encode()), b"o", {}, "x", [], spec.steps)
    assert st.job(jid).version == 3
    for v in (1, 2, 3):  # KEEP_VERSIONS_EXTRA = 2 older versions + newest
        assert st.adapter(AdapterRef(jid, v)).weights == f"v{v}".encode()


def test_rewards_accepted_only_for_current_attempt(st):
    jid, _ = make_job(st)
    a1 = st.put_rollout(jid, 0, 0, {"row": {}, "completions": []})
    a2 = st.put_rollout(jid, 0, 0, {"row": {}, "completions": []})  # regenerated
    assert not st.accept_rewards(jid, 0, a1, {"rewards": [1.0]})
    assert st.verified(jid, [0]) == [False]
    assert st.accept_rewards(jid, 0, a2, {"rewards": [0.5]})
    assert st.verified(jid, [0]) == [True]
    assert st.rollout(jid, 0)["rewards"] == {"rewards": [0.5]}


def test_tick_dispatches_within_admission_then_waits(st):
    jid, spec = make_job(st)
    sent = []
    plan = dispatch.tick(st, sent.extend)
    gen = [a for n, a in sent if n == "marlaas.generate"]
    items = [tuple(it) for _, batch in gen for it in batch]
    # S=1, P=2 -> groups 0..3 plus the base evaluation
    assert sorted(i for k, _, i in items if k == "gen") == [0, 1, 2, 3]
    assert ("eval", jid, 0) in items
    assert st.job(jid).dispatched == 4
    assert plan.train is None
    sent.clear()
    dispatch.tick(st, sent.extend)
    assert [n for n, _ in sent if n == "marlaas.generate"] == []  # admission reached, nothing new
    # leases expire -> the same work is dispatched again
    sent.clear()
    for b in list(st.r.zrange("m:gen:inflight", 0, -1)):
        st.end_gen_batch(b.decode())
    dispatch.tick(st, sent.extend, now=time.time() + 600)  # past the lease, within the watchdog
    again = sorted(tuple(it) for n, a in sent if n == "marlaas.generate" for it in a[1])
    assert [it for it in again if it[0] == "gen"] == [("gen", jid, g) for g in range(4)]


def test_tick_gives_trainer_to_ready_job(st):
    jid, spec = make_job(st)
    dispatch.tick(st, lambda msgs: None)
    for g in (0, 1):
        att = st.put_rollout(jid, g, 0, {"row": {}, "completions": []})
        st.accept_rewards(jid, g, att, {"rewards": [1.0]})
    sent = []
    plan = dispatch.tick(st, sent.extend)
    assert plan.train == (jid, 0)
    assert [a[:2] for n, a in sent if n == "marlaas.train"] == [[jid, 0]]
    assert st.trainer_lease()["job"] == jid


def test_lease_of_a_dead_trainer_is_broken_at_once(st):
    jid, spec = make_job(st)
    tok = st.take_trainer(jid, 0, 300)
    assert st.claim_trainer(tok, "train@ghost:1")
    assert st.trainer_lease()["worker"] == "train@ghost:1"
    assert st.r.pttl("m:trainer:lease") > 290_000  # claiming keeps the TTL
    st.heartbeat("train@alive:2", "train")
    dispatch.tick(st, lambda msgs: None)
    assert st.trainer_lease() is None  # no heartbeat from train@ghost:1
    tok = st.take_trainer(jid, 0, 300)
    st.claim_trainer(tok, "train@alive:2")
    dispatch.tick(st, lambda msgs: None)
    assert st.trainer_lease()["token"] == tok  # a live worker keeps its lease


def test_trainer_ticks_after_its_step_itself(st, monkeypatch):
    """After a step the train task runs the tick in its own process: the next step's train message
    is sent from there (no kicked tick on the control worker in between); when another tick holds
    the lock, a tick is kicked instead."""
    import tasks.train as tt

    jid, _ = make_job(st)
    sent, kicks = [], []
    monkeypatch.setattr(tt, "store", lambda: st)
    monkeypatch.setattr(tt, "send", sent.extend)
    monkeypatch.setattr(tt, "kick", lambda: kicks.append(1))
    tt.tick_here()
    assert any(n == "marlaas.generate" for n, _ in sent) and not kicks  # it ticked: generation sent
    for g in (0, 1):
        att = st.put_rollout(jid, g, 0, {"row": {}, "completions": []})
        st.accept_rewards(jid, g, att, {"rewards": [1.0]})
    sent.clear()
    tt.tick_here()
    train = [a for n, a in sent if n == "marlaas.train"]
    assert [a[:2] for a in train] == [[jid, 0]] and st.trainer_lease()["token"] == train[0][2] and not kicks
    st.release_trainer(train[0][2])
    lock = st.acquire_lock()
    sent.clear()
    tt.tick_here()
    assert sent == [] and kicks == [1]
    st.release_lock(lock)


def test_new_job_wakes_the_scheduler_and_an_ended_job_wakes_its_waiters(st):
    jid, _ = make_job(st)
    make_job(st)
    assert st.wait_wake(0.05) is True  # two submissions, one wake-up call pending (the list holds one)
    assert st.wait_wake(0.05) is False
    assert st.wait_end(jid, 0.05) is None  # still running: returns after the timeout
    st.set_status(jid, "cancelled")
    assert st.wait_end(jid, 0.05) == "cancelled"
    assert st.wait_end(jid, 0.05) == "cancelled"  # the marker stays for every waiter
    assert 0 < st.r.ttl(f"m:job:{jid}:end") <= 3600


@pytest.mark.integration
def test_an_ended_jobs_bulk_data_goes_after_the_retention_period(st):
    from marlaas.store import adapter_key, optim_key, roll_key, rows_key
    from marlaas.types import AdapterBlob

    spec = JobSpec(tenant="t", task="sort", steps=3, prompts_per_step=2, group_size=4, eval_every=2, eval_size=2)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(6)]
    jid = st.create_job(spec, rows, rows[:2])
    for t in range(3):
        st.publish(jid, t, AdapterBlob({"r": 4}, b"w%d" % t), b"opt", {"step": t + 1}, "x", [], 3, 2)
    st.advance_dispatched(jid, 8)
    st.put_rollout(jid, 6, 3, {"row": {}, "completions": []})  # a group left over
    st.put_eval_result(jid, 3, {"acc": 1.0, "n": 2})
    st.set_status(jid, "done")
    t_end = time.time()
    assert st.collect_garbage(t_end + 10, retention_s=3600) == []  # within retention: kept
    assert st.collect_garbage(t_end + 3601, retention_s=3600) == [jid]
    assert not st.r.exists(rows_key(jid, "train"), rows_key(jid, "eval"), optim_key(jid), roll_key(jid, 6))
    assert st.r.exists(adapter_key(jid, 2)) and st.r.exists(adapter_key(jid, 3))  # evaluated and final stay
    assert not st.r.exists(adapter_key(jid, 1))
    rec = st.job(jid)
    assert rec.status == "done" and rec.extra["collected"] == "1"
    assert st.evals(jid)[3]["acc"] == 1.0 and len(st.metrics(jid)) == 3  # the record of what happened stays
    assert st.collect_garbage(t_end + 7200, retention_s=3600) == []  # once only


@pytest.mark.integration
def test_the_tick_collects_ended_jobs_early_while_the_store_is_over_its_share(st):
    from marlaas.store import adapter_key, optim_key

    spec = JobSpec(tenant="t", task="sort", steps=2, prompts_per_step=2, group_size=4, eval_size=2)
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(4)]
    jid = st.create_job(spec, rows, rows[:2])
    for t in range(2):
        st.publish(jid, t, AdapterBlob({"r": 4}, b"w%d" % t), b"opt", {"step": t + 1}, "x", [], 2, 0)
    st.set_status(jid, "done")
    used, cap = st.memory_use()
    assert cap > 0
    memory = dispatch.TickMemory()
    dispatch.tick(st, lambda msgs: None, memory=memory)  # under the share: within retention, kept
    assert st.r.exists(adapter_key(jid, 1), optim_key(jid)) == 2
    over = dispatch.TickConfig(admission_memory_fraction=used / cap / 2)
    dispatch.tick(st, lambda msgs: None, over, now=time.time() + dispatch.GC_EVERY_S + 1, memory=memory)
    assert st.r.exists(adapter_key(jid, 1), optim_key(jid)) == 0
    assert st.r.exists(adapter_key(jid, 2)) and st.job(jid).extra["collected"] == "1"


@pytest.mark.integration
def test_rollouts_reference_their_row_instead_of_copying_it(st):
    from marlaas.store import roll_key

    rows = [{"prompt": "sort:" + "9" * 5000, "answer": "9" * 5000}, {"prompt": "sort:1=", "answer": "1"}]
    jid = st.create_job(JobSpec(tenant="t", task="sort", steps=2, eval_size=1), rows, rows[1:])
    st.put_rollout(jid, 0, 0, {"row": rows[0], "row_idx": 0, "completions": [{"ids": [1], "logprobs": [0.0],
                                                                              "text": "x"}]})
    assert len(st.r.hget(roll_key(jid, 0), "data")) < 200  # the 10 kB row is not in the rollout
    assert st.rollout(jid, 0)["row"] == rows[0]
