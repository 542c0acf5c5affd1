"""The verify pool's per-tenant slots on a real Redis (`marlaas.store.slots.PoolSlots` deciding with
`scheduler.may_take_slot`, as tasks/verify.py does): a tenant past its share is refused while another
waits; alone it may use the whole pool; racing takes never exceed a share."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest

from marlaas.control.scheduler import may_take_slot
from marlaas.store.slots import PoolSlots

pytestmark = pytest.mark.integration


def decide(tenant, state):
    return may_take_slot(tenant, state.capacity, {}, state.running, state.waiting)


def test_alone_a_tenant_takes_every_process(st):
    pool = PoolSlots(st, "verify")
    assert all(pool.take("a", f"p{i}", partial(decide, "a"), now=100.0) for i in range(4))
    assert pool.state(100.0).running == {"a": 4}
    assert pool.state(100.0).capacity == 4


def test_a_slow_tenant_is_held_to_half_while_a_victim_waits(st):
    pool = PoolSlots(st, "verify")
    for i in range(4):  # the pool's four processes are seen (they ran something earlier)
        pool.take("x", f"p{i}", lambda s: False, now=10.0)
    now = 100.0
    assert pool.take("victim", "p0", partial(decide, "victim"), now=now)  # the victim asked: it waits
    pool.release("p0")
    assert pool.take("attacker", "p1", partial(decide, "attacker"), now=now)
    assert pool.take("attacker", "p2", partial(decide, "attacker"), now=now)
    assert not pool.take("attacker", "p3", partial(decide, "attacker"), now=now)  # past its half
    assert pool.take("victim", "p3", partial(decide, "victim"), now=now)
    # once the victim has asked nothing for want_s, the attacker may use the whole pool again
    pool.release("p3")
    later = now + pool.want_s + 1
    assert pool.take("attacker", "p3", partial(decide, "attacker"), now=later)
    assert pool.take("attacker", "p0", partial(decide, "attacker"), now=later)


def test_a_tenant_whose_last_job_ended_reserves_nothing(st):
    """Job after job of different tenants (one user's runs, the benches' sequential line): the tenant
    whose job just ended asked a moment ago, but with no job left it has nothing to verify, so the
    next tenant alone gets the whole pool at once, not half of it (and not after want_s)."""
    from marlaas.spec import JobSpec

    rows = [{"prompt": "p", "answer": "1"}]
    pool = PoolSlots(st, "verify")
    for i in range(2):
        pool.take("x", f"p{i}", lambda s: False, now=10.0)
    first = st.create_job(JobSpec(dataset=rows, tenant="first", steps=1, prompts_per_step=1, group_size=2,
                                  eval_size=1), rows, rows)
    second = st.create_job(JobSpec(dataset=rows, tenant="first", steps=1, prompts_per_step=1, group_size=2,
                                   eval_size=1), rows, rows)
    now = time.time()
    assert pool.take("first", "p0", partial(decide, "first"), now=now)
    pool.release("p0")
    assert pool.take("next", "p0", partial(decide, "next"), now=now)
    assert not pool.take("next", "p1", partial(decide, "next"), now=now)  # "first" still has a job: half
    pool.release("p0"), pool.release("p1")
    st.set_status(first, "done")
    assert "first" in pool.state(now).waiting  # its other job still runs: the reservation stays
    st.set_status(second, "cancelled")
    assert "first" not in pool.state(now).waiting
    assert pool.take("next", "p0", partial(decide, "next"), now=now)
    assert pool.take("next", "p1", partial(decide, "next"), now=now)


def test_a_process_holds_one_slot_and_a_lost_hold_ends(st):
    pool = PoolSlots(st, "verify", hold_s=5.0)
    pool.take("a", "p0", lambda s: True, now=100.0)
    pool.take("a", "p0", lambda s: True, now=101.0)  # the same process: its earlier task ended
    assert pool.state(101.0).running == {"a": 1}
    assert pool.state(107.0).running == {}  # a process killed mid-task holds nothing past hold_s


def test_racing_takes_never_exceed_a_share(st):
    pool = PoolSlots(st, "verify")
    for i in range(8):  # eight processes seen (tenant x's want mark is long gone by now)
        pool.take("x", f"p{i}", lambda s: False, now=10.0)
    pool.take("victim", "p7", lambda s: False, now=100.0)  # the victim waits
    got = []

    def ask(i):
        got.append(PoolSlots(st, "verify").take("attacker", f"p{i}", partial(decide, "attacker"), now=100.0))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    capacity = pool.state(100.0).capacity
    assert capacity == 8
    assert sum(got) == 4, got


SLEEPY = "def grade(sample, item):\n    import time\n    time.sleep(0.6)\n    return 1.0\n"


def test_grader_seconds_past_the_plan_score_as_errors_with_a_notice(st):
    from marlaas.api.tenancy import Quotas, add_tenant
    from marlaas.spec import JobSpec
    from marlaas.verify.job_scoring import score_job

    add_tenant(st, "slow", Quotas(max_grader_s_per_step=3.0))  # a batch's programs may run one by one
    from tests.integration.test_python_grader import ROWS

    spec = JobSpec(dataset=ROWS, grader={"type": "python", "source": SLEEPY, "timeout_s": 2}, tenant="slow",
                   steps=2, prompts_per_step=1, group_size=2, eval_size=1, max_grader_error_groups=50)
    jid = st.create_job(spec, ROWS, ROWS[:1])
    items = [({"prompt": "p", "answer": "1"}, ["1", "2"])]
    first = score_job(st, jid, spec, items, key=0)  # within the bound: scored
    assert first is not None and first[0].errors == 0
    second = score_job(st, jid, spec, items * 6, key=0)  # past it (12 x 0.6 s): stopped at the bound, errors
    assert second is not None and all(s.errors == 2 for s in second)
    third = score_job(st, jid, spec, items, key=0)
    assert third is None or third[0].errors == 2  # not run at all now
    assert any("grader seconds" in str(n["data"]) for n in st.notices(jid) if n["type"] == "warning")
