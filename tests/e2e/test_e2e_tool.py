"""End to end: a calc (multi-turn tool) job through real worker processes and the real calculator
service (the Procfile's `tool` line): episodes alternate generate and verify, evaluations run the
tool loop, tool-result tokens are masked out of training."""

import re

import pytest

from marlaas import JobSpec
from marlaas.api.client import Client
from marlaas.families import FAMILIES
from marlaas.tools import episodes

pytestmark = [pytest.mark.e2e]


def test_calc_job_calls_the_tool_and_finishes(worker_stack):
    client = Client(worker_stack.url)
    spec = JobSpec(tenant="agent", task="calc", steps=2, prompts_per_step=2, group_size=6, eval_size=4,
                   max_staleness=1, seed=3, rl={"drop_zero_advantage": False})
    job = client.submit(spec)
    final = job.wait(timeout=300)
    assert final["status"] == "done", final
    assert int(final["tool_calls"]) > 0  # the verify station called the service
    assert int(final.get("tool_errors", 0)) < int(final["tool_calls"])  # the service answered
    m = job.metrics()
    assert [s["step"] for s in m["steps"]] == [1, 2]
    assert all(0 <= x <= spec.max_staleness for s in m["steps"] for x in s["staleness"])
    # trained episodes held tool-result tokens, and those were masked out of the loss
    assert sum(s["tool_tokens"] for s in m["steps"]) > 0
    # held-out evaluations ran whole episodes (the tool loop in the generate station), scored on
    # their final answers
    calc = FAMILIES["calc"]
    outs = [o for ev in m["evals"].values() for o in ev["outputs"]]
    assert outs and any(re.search(r"\]=[^;\[\]]*;", o["text"]) for o in outs), outs
    for o in outs:
        right = episodes.final_answer(o["text"]) == calc.answer(calc.parse(o["prompt"]))
        assert o["reward"] == (1.0 if right else 0.0)
