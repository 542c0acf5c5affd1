"""Promotion in the store (real Redis): `@best` follows the held-out exact (ties: the later version),
a pin wins until dropped, and an evaluation racing a promote never leaves `@best` half moved; serving
requests a generate call has no room for go back to the front of the sample queue."""

import json
import random
import threading

import pytest

from marlaas.errors import Conflict, NotFound
from marlaas.generate.tinker_sample import SampleBatch
from marlaas.store import adapter_key
from marlaas.store.tinker import TinkerStore
from marlaas.types import GenRequest

pytestmark = pytest.mark.integration


def _ev(exact: float) -> dict:
    return {"exact": exact, "mean_reward": exact, "acc": exact, "n": 4, "k": 0}


def _stored(st, jid: str, *versions: int) -> None:
    for v in versions:  # an adapter version's record (pin_best checks only that it is stored)
        st.r.hset(adapter_key(jid, v), mapping={"config": "{}", "ref": "x"})


def test_best_follows_the_highest_exact_with_ties_to_the_later_version(st):
    jid = "jbest"
    assert st.best_version(jid) is None
    st.put_eval_result(jid, 0, _ev(0.25))
    assert st.best_version(jid) == 0  # the base itself, until a version beats it
    st.put_eval_result(jid, 4, _ev(0.5))
    st.put_eval_result(jid, 2, _ev(0.5))  # evaluated late, ties with 4: the later version stays
    assert st.best_version(jid) == 4
    st.put_eval_result(jid, 6, _ev(0.5))
    assert st.best_version(jid) == 6
    st.put_eval_result(jid, 8, _ev(0.375))  # worse: @best stays
    assert st.best(jid) == {"version": 6, "auto": 6, "pinned": None,
                            "exact": {0: 0.25, 2: 0.5, 4: 0.5, 6: 0.5, 8: 0.375}}
    assert st.evals(jid)[8]["exact"] == 0.375  # the evaluation itself is stored as before
    st.put_eval_result(jid, 6, _ev(0.0))  # a version re-scored lower loses its place
    assert st.best_version(jid) == 4


def test_pin_needs_an_evaluated_stored_version_and_wins_until_unpinned(st):
    jid = "jpin"
    _stored(st, jid, 2, 3)
    st.put_eval_result(jid, 0, _ev(0.0))
    st.put_eval_result(jid, 2, _ev(0.5))
    st.put_eval_result(jid, 3, _ev(0.75))
    with pytest.raises(NotFound):
        st.pin_best(jid, 1)  # never evaluated
    st.put_eval_result(jid, 5, _ev(0.1))
    with pytest.raises(Conflict):
        st.pin_best(jid, 5)  # evaluated, but its adapter is gone
    st.pin_best(jid, 2)
    st.put_eval_result(jid, 7, _ev(1.0))
    assert st.best(jid)["version"] == 2 and st.best(jid)["auto"] == 7
    st.unpin_best(jid)
    assert st.best_version(jid) == 7
    st.pin_best(jid, 0)  # the base needs no adapter
    assert st.best_version(jid) == 0


def test_an_evaluation_racing_a_promote_never_leaves_best_half_moved(st):
    jid, versions = "jrace", list(range(1, 41))
    _stored(st, jid, *versions)
    rng = random.Random(0)
    scores = {v: rng.choice([0.0, 0.25, 0.5, 0.75]) for v in versions}
    stop, seen, errors = threading.Event(), [], []

    def evaluate():
        for v in versions:
            st.put_eval_result(jid, v, _ev(scores[v]))
        stop.set()

    def promote():
        i = 0
        while not stop.is_set():
            done = [v for v in versions if st.has_evals(jid, [v])[0]]
            if done:
                st.pin_best(jid, done[i % len(done)])
            if i % 3 == 2:
                st.unpin_best(jid)
            i += 1

    def read():
        while True:
            last = stop.is_set()  # one more read after the last evaluation, so a reader always sees some
            b = st.best(jid)
            if b["exact"]:
                want = max(b["exact"], key=lambda v: (b["exact"][v], v))
                seen.append(b["auto"] == want)
                if b["pinned"] is not None and b["pinned"] not in b["exact"]:
                    errors.append(f"pinned {b['pinned']} was never evaluated")
            if last:
                break

    threads = [threading.Thread(target=f) for f in (evaluate, promote, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert seen and all(seen), "a reader saw an evaluation without @best moved with it"
    assert not errors
    b = st.best(jid)
    assert b["auto"] == max(versions, key=lambda v: (scores[v], v))
    assert b["exact"] == scores
    st.pin_best(jid, 3)  # a final promote after the race: the rollback holds
    assert st.best_version(jid) == 3


def test_requests_over_the_share_wait_at_the_front_of_the_queue(st):
    ts = TinkerStore(st)
    rids = [ts.enqueue_sample("t1", {"serve": "completion", "prompt": "x", "n": n}) for n in (3, 2, 4, 1)]
    assert ts.take_samples() == rids
    later = ts.enqueue_sample("t1", {"serve": "completion", "prompt": "y", "n": 1})
    batch = SampleBatch(ts, engine=None, requests=[GenRequest(key=r, prompt="x", adapter=None, n=n)
                                                   for r, n in zip(rids, (3, 2, 4, 1))],
                        bodies={r: {} for r in rids})
    assert batch.limit(5) == rids[2:]  # 3 + 2 rows fit, the 4-row request does not
    assert [r.key for r in batch.requests] == rids[:2] and batch.rows() == 5
    assert ts.take_samples() == rids[2:] + [later]  # first in line for the next call
    one = SampleBatch(ts, engine=None, requests=[GenRequest(key="rbig", prompt="x", adapter=None, n=9)],
                      bodies={"rbig": {}})
    assert one.limit(2) == [] and one.rows() == 9  # one request always rides: serving never starves


def test_the_alarm_is_a_warning_notice_once_and_pauses_when_asked(st):
    from marlaas.spec import JobSpec
    from marlaas.store import metrics_key
    from marlaas.verify.station import check_reward_hacking

    rows = [{"prompt": "1+1=", "answer": "2"}]
    for pause in (False, True):
        spec = JobSpec(task="add", steps=8, eval_every=4, pause_on_reward_hacking=pause)
        jid = st.create_job(spec, rows, rows)
        st.put_eval_result(jid, 0, _ev(0.5))
        for s, reward in enumerate((0.1, 0.2, 0.6, 0.8), start=1):  # the per-step metrics a publish writes
            st.r.rpush(metrics_key(jid), json.dumps({"step": s, "reward_mean": reward}))
        st.put_eval_result(jid, 4, _ev(0.5))
        assert not check_reward_hacking(st, jid, spec, 4)  # exact held: quiet
        st.put_eval_result(jid, 4, _ev(0.25))
        assert check_reward_hacking(st, jid, spec, 4)
        assert not check_reward_hacking(st, jid, spec, 4)  # a duplicate evaluation: one notice
        notes = [n for n in st.notices(jid) if n["data"].get("alarm") == "reward_hacking"]
        assert len(notes) == 1 and notes[0]["type"] == "warning" and notes[0]["data"]["version"] == 4
        assert notes[0]["data"]["paused"] is pause
        assert st.job(jid).status == ("paused" if pause else "running")
    # training over (final evaluations pending): nothing to stop, the notice says it did not pause
    spec = JobSpec(task="add", steps=8, eval_every=4, pause_on_reward_hacking=True)
    jid = st.create_job(spec, rows, rows)
    st.put_eval_result(jid, 0, _ev(0.5))
    for s, reward in enumerate((0.1, 0.2, 0.6, 0.8), start=1):
        st.r.rpush(metrics_key(jid), json.dumps({"step": s, "reward_mean": reward}))
    st.transition_status(jid, ("running",), "evaluating")
    st.put_eval_result(jid, 4, _ev(0.25))
    assert check_reward_hacking(st, jid, spec, 4)
    notes = [n for n in st.notices(jid) if n["data"].get("alarm") == "reward_hacking"]
    assert len(notes) == 1 and notes[0]["data"]["paused"] is False
    assert st.job(jid).status == "evaluating"
    # out of order: version 4's evaluation is stored (and checked) before version 0's; the later-stored
    # one checks the interval above it, so (0, 4] is not left unchecked
    spec = JobSpec(task="add", steps=8, eval_every=4)
    jid = st.create_job(spec, rows, rows)
    for s, reward in enumerate((0.1, 0.2, 0.6, 0.8), start=1):
        st.r.rpush(metrics_key(jid), json.dumps({"step": s, "reward_mean": reward}))
    st.put_eval_result(jid, 4, _ev(0.25))
    assert not check_reward_hacking(st, jid, spec, 4)  # nothing below 4 evaluated yet
    st.put_eval_result(jid, 0, _ev(0.5))
    assert check_reward_hacking(st, jid, spec, 0)
    notes = [n["data"] for n in st.notices(jid) if n["data"].get("alarm") == "reward_hacking"]
    assert [(n["previous"], n["version"]) for n in notes] == [(0, 4)]
    assert not check_reward_hacking(st, jid, spec, 4) and not check_reward_hacking(st, jid, spec, 0)  # once


def test_evaluations_are_paged_by_the_time_they_were_stored(st):
    from marlaas.store import eval_times_key, evals_key

    jid = "jpage"
    for v, at in ((0, 10.0), (6, 30.0), (2, 20.0), (4, 40.0)):  # stored out of version order
        st.put_eval_result(jid, v, {**_ev(v / 10), "at": at})
    assert [v for v, _ in st.evals_after(jid, 0.0, 10)] == [0, 2, 6, 4]  # by time, not by version
    assert [v for v, _ in st.evals_after(jid, 20.0, 2)] == [6, 4]  # strictly after, at most `count`
    assert st.evals_after(jid, 40.0, 10) == []
    (v, ev), = st.evals_after(jid, 25.0, 1)
    assert (v, ev["exact"], ev["at"]) == (6, 0.6, 30.0)
    st.put_eval_result(jid, 6, {**_ev(0.0), "at": 50.0})  # re-scored: its newer time and result
    assert [(v, e["exact"]) for v, e in st.evals_after(jid, 35.0, 10)] == [(4, 0.4), (6, 0.0)]
    assert st.evals_of(jid, [0, 6, 8]) == {0: st.evals(jid)[0], 6: st.evals(jid)[6]}  # 8: not evaluated
    assert st.evals_of(jid, []) == {}
    # a job evaluated before the times were kept: its times come from its results, once
    old = "jold"
    st.r.hset(evals_key(old), mapping={"0": json.dumps({**_ev(0.5), "at": 5.0}), "3": json.dumps(_ev(0.7))})
    assert [v for v, _ in st.evals_after(old, 1.0, 10)] == [0]  # one without a time counts as stored at 0
    assert st.r.zcard(eval_times_key(old)) == 2
    assert [v for v, _ in st.evals_after(old, -1.0, 10)] == [3, 0]
