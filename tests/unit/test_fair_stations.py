"""Every station fair per tenant: the verify pool's shares (`pool_share`, `may_take_slot`) and the
generate batches' mix across tenants (`_interleave` by rows and per-tenant weight)."""

from collections import Counter

import pytest

from marlaas.control.scheduler import JobState, Snapshot, may_take_slot, plan, pool_share

pytestmark = pytest.mark.unit


def test_pool_share_splits_by_weight_and_gives_at_least_one():
    assert pool_share("a", 4, {}, {"b"}) == 2
    assert pool_share("a", 4, {"a": 3.0, "b": 1.0}, {"b"}) == 3
    assert pool_share("b", 4, {"a": 3.0, "b": 1.0}, {"a"}) == 1
    assert pool_share("a", 2, {}, {"b", "c", "d"}) == 1  # never 0: every tenant makes progress
    assert pool_share("a", 8, {}, set()) == 8  # alone: the whole pool


def test_alone_a_tenant_uses_the_whole_pool():
    assert may_take_slot("a", 4, {}, {"a": 3}, waiting={"a"})
    assert may_take_slot("a", 4, {}, {"a": 3}, waiting=set())


def test_slow_tenant_is_held_to_its_share_while_another_waits():
    # a slow grader's tenant holds 2 of 4 processes; the victim waits: no third for the attacker
    assert not may_take_slot("attacker", 4, {}, {"attacker": 2}, waiting={"attacker", "victim"})
    assert may_take_slot("attacker", 4, {}, {"attacker": 1}, waiting={"victim"})
    # the victim always gets its share
    assert may_take_slot("victim", 4, {}, {"attacker": 2}, waiting={"attacker", "victim"})
    assert may_take_slot("victim", 4, {}, {"attacker": 2, "victim": 1}, waiting={"attacker"})
    assert not may_take_slot("victim", 4, {}, {"attacker": 2, "victim": 2}, waiting={"attacker"})


def test_a_tenant_holding_processes_competes_even_when_not_asking_now():
    # b holds a process and a third tenant waits: a's share is a third of the pool
    assert not may_take_slot("a", 3, {}, {"a": 1, "b": 1}, waiting={"c"})
    assert may_take_slot("a", 3, {}, {"b": 1}, waiting={"c"})


def test_weights_bound_shares():
    w = {"gold": 3.0, "free": 1.0}
    assert may_take_slot("gold", 4, w, {"gold": 2}, waiting={"free"})
    assert not may_take_slot("gold", 4, w, {"gold": 3}, waiting={"free"})
    assert not may_take_slot("free", 4, w, {"free": 1}, waiting={"gold"})


def simulate(capacity, weights, slow, fast, rounds=200):
    """Tenants' tasks arrive FIFO, an attacker's flood first; each round a process frees (the slow
    tenant's tasks take 10 rounds, the fast one's 1) and the next task that may take it runs."""
    running: dict[str, list[int]] = {t: [] for t in weights}
    done = Counter()
    for now in range(rounds):
        for t in running:
            ends = running[t]
            done[t] += sum(1 for e in ends if e <= now)
            running[t] = [e for e in ends if e > now]
        queue = [slow] * 50 + [fast] * 50  # both tenants always have work waiting
        for t in queue:
            if sum(len(v) for v in running.values()) >= capacity:
                break
            counts = {k: len(v) for k, v in running.items()}
            if may_take_slot(t, capacity, weights, counts, waiting={slow, fast}):
                running[t].append(now + (10 if t == slow else 1))
    return done


def test_slow_grader_delays_only_its_own_tenant():
    done = simulate(4, {"slow": 1.0, "fast": 1.0}, "slow", "fast")
    # the fast tenant keeps half the pool: about 2 tasks per round, whatever the slow one does
    assert done["fast"] >= 0.9 * 2 * 200
    assert done["slow"] >= 0.9 * 2 * 200 / 10


def job(jid, tenant, **kw):
    base = dict(id=jid, version=0, steps=100, staleness=4, groups_per_step=8, group_size=8, dispatched=0,
                tenant=tenant)
    base.update(kw)
    return JobState(**base)


def rows_by_tenant(p, jobs):
    by_id = {j.id: j for j in jobs}
    rows = Counter()
    for batch in p.gen_batches:
        for _, jid, _ in batch:
            rows[by_id[jid].tenant] += by_id[jid].group_size
    return rows


def test_generate_rows_are_shared_per_tenant_not_per_job():
    # tenant a runs 8 jobs, tenant b one: equal weights, so about equal generated rows (groups ahead)
    jobs = tuple(job(f"j{i}", "a", dispatched=8) for i in range(1, 9)) + (job("j9", "b", dispatched=8),)
    p = plan(Snapshot(jobs=jobs, gen_capacity=1, batch_rows=256))
    rows = rows_by_tenant(p, jobs)
    assert abs(rows["a"] - rows["b"]) <= 16, rows


def test_generate_rows_are_shared_by_rows_not_groups():
    # tenant a asks groups of 64 completions, tenant b of 8: equal rows per round, not equal groups
    jobs = (job("j1", "a", group_size=64, dispatched=8), job("j2", "b", group_size=8, dispatched=8))
    p = plan(Snapshot(jobs=jobs, gen_capacity=2, batch_rows=256))
    rows = rows_by_tenant(p, jobs)
    assert abs(rows["a"] - rows["b"]) <= 64, rows
