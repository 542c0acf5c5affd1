"""The plan's per-tenant budgets (`PlanLimiter`, in memory here; the API uses the same over Redis):
costs add up per tenant and name within 60 s, a refusal takes nothing from any budget, and one tenant's
use leaves another's budget whole."""

import pytest

from marlaas.api.ratelimit import PlanLimiter

pytestmark = pytest.mark.unit


def test_costs_add_up_and_a_refusal_takes_nothing():
    lim = PlanLimiter()
    budgets = lambda tokens: [("req", 3, 1), ("tok", 100, tokens)]  # noqa: E731
    assert lim.take("a", budgets(60)) is None  # req 1/3, tok 60/100
    name, wait = lim.take("a", budgets(50))  # 110 > 100: refused, nothing taken
    assert name == "tok" and 0 < wait <= 60
    assert lim.take("a", budgets(40)) is None  # req 2/3 (the refusal took no request), tok 100/100
    assert lim.take("a", budgets(1))[0] == "tok"
    assert lim.take("a", budgets(0)) is None  # req 3/3
    assert lim.take("a", budgets(0))[0] == "req"


def test_tenants_have_their_own_budgets():
    lim = PlanLimiter()
    assert lim.take("a", [("req", 1, 1)]) is None
    assert lim.take("a", [("req", 1, 1)])[0] == "req"
    assert lim.take("b", [("req", 1, 1)]) is None
