"""Multi-turn tool episodes: the pure module (marlaas.tools.episodes), the calculator service
(marlaas.tools.calculator, real HTTP on a free port), the calc family, stop tokens and the loss mask."""

import json
import threading
import urllib.request

import pytest

from marlaas import families
from marlaas.families import FAMILIES, correct
from marlaas.tools import calculator, episodes

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- pure episode logic

@pytest.mark.parametrize("text,call", [
    ("[47*38]", "47*38"), ("12[3+4]", "3+4"), ("[47*38]=1786;[1786+1]", "1786+1"),
    ("1786", None), ("[47*38", None), ("[47*38]1", None), ("", None), ("[]", ""),
])
def test_parse_call(text, call):
    assert episodes.parse_call(text) == call


@pytest.mark.parametrize("text,answer", [
    ("[47*38]=1786;1786", "1786"), ("1786", "1786"), ("[47*38]", ""), ("[1+1]=2;[2*3]=6;6", "6"),
    ("[1+1]=err;5", "5"), ("12]3", "12]3"),
])
def test_final_answer(text, answer):
    assert episodes.final_answer(text) == answer


def test_result_segment_and_action_mask():
    assert episodes.result_segment("1786") == "=1786;"
    assert episodes.result_segment(None) == "=err;"
    with pytest.raises(ValueError):
        episodes.result_segment("1;2")
    assert episodes.action_mask("[4*5]=20;20") == [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert episodes.action_mask("20") == [1, 1]
    assert episodes.action_mask("[4*5]") == [1] * 5  # a call without a result: all actions


def test_episode_turns_mask_and_limits():
    ep = episodes.start({"ids": [10, 11, 12], "logprobs": [-0.1, -0.2, -0.3], "text": "[4*5]"}, finished=False)
    assert ep["mask"] == [1, 1, 1] and ep["turns"] == 1 and not ep["done"]
    assert episodes.pending_call(ep) == "4*5"
    ep = episodes.with_tool_result(ep, "20")
    assert ep["pending"] == "=20;" and ep["calls"] == 1 and ep["tool_errors"] == 0
    assert episodes.pending_call(ep) is None  # its result is pending: no second call
    with pytest.raises(ValueError):
        episodes.context("calc:4*5=", ep)
    ep = episodes.append_pending(ep, [20, 21, 22, 23])
    assert "pending" not in ep
    assert ep["ids"] == [10, 11, 12, 20, 21, 22, 23]
    assert ep["mask"] == [1, 1, 1, 0, 0, 0, 0]
    assert ep["logprobs"] == [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, 0.0]
    assert episodes.context("calc:4*5=", ep) == "calc:4*5=[4*5]=20;"
    ep = episodes.add_turn(ep, [30, 31, 1], [-0.5, -0.6, -0.7], "20", finished=True)
    assert ep["done"] and ep["turns"] == 2 and ep["text"] == "[4*5]=20;20"
    assert ep["mask"] == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert len(ep["ids"]) == len(ep["logprobs"]) == len(ep["mask"]) == 10
    assert episodes.loss_mask(ep) == ep["mask"]
    assert episodes.loss_mask({"ids": [1, 2]}) == [1, 1]
    assert episodes.final_answer(ep["text"]) == "20"


def test_episode_ends_without_call_eos_or_at_the_turn_limit():
    assert episodes.start({"ids": [1], "logprobs": [0.0], "text": "20"}, finished=False)["done"]  # length cap
    assert episodes.start({"ids": [1], "logprobs": [0.0], "text": "[1+1]"}, finished=True)["done"]
    ep = episodes.start({"ids": [1], "logprobs": [0.0], "text": "[1+1]"}, finished=False, max_turns=2)
    ep = episodes.append_pending(episodes.with_tool_result(ep, None), [5, 6, 7, 8, 9])
    assert ep["tool_errors"] == 1 and ep["text"] == "[1+1]=err;"
    ep = episodes.add_turn(ep, [2], [0.0], "[2+2]", finished=False, max_turns=2)
    assert ep["done"] and episodes.pending_call(ep) is None  # the turn limit: no more calls
    assert episodes.final_answer(ep["text"]) == ""
    assert episodes.all_done([ep]) and not episodes.all_done([ep, {"done": False}])
    with pytest.raises(ValueError):
        episodes.add_turn(ep, [1, 2], [0.0], "x", True)


def test_calc_family_and_tool_verifier():
    from marlaas.spec import JobSpec
    from marlaas.verify.verifiers import score_group

    fam = FAMILIES["calc"]
    x = fam.parse("calc:47*38=")
    assert x == (47, 38) and fam.answer(x) == "1786"
    assert fam.correct_label(x) == "[47*38]=1786;1786" and fam.wrong(x) == "1200"
    assert fam.wrong((20, 50)) == "1010"  # the estimate would be exact: +10
    assert correct("calc", "calc:47*38=", "[47*38]=1786;1786") and correct("calc", "calc:47*38=", "1786")
    assert not correct("calc", "calc:47*38=", "[47*38]=1786;") and not correct("calc", "calc:47*38=", "1200")
    row = {"prompt": "calc:47*38=", "answer": "1786"}
    assert score_group("tool", row, ["[47*38]=1786;1786", "1786", "[47*38]", "1200", "[47*38]=err;17"]).rewards \
        == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert families.tool_of(JobSpec(task="calc")) == "calc"
    assert families.tool_of(JobSpec(task="sort")) is None
    assert JobSpec(task="calc").verifier_name() == "tool"


# ---------------------------------------------------------------- the calculator service

@pytest.fixture(scope="module")
def calc_url():
    server = calculator.make_server("127.0.0.1", 0, latency_ms=5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("expr,value", [
    ("47*38", "1786"), ("1786+1", "1787"), ("(3+4)*2", "14"), ("7/2", "3.5"), ("1/3", "0.333333"),
    ("-5", "-5"), ("8/4", "2"), ("7//2", "3"), (" 2 * 3 ", "6"),
])
def test_calculate(expr, value):
    assert calculator.calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "x", "2**10", "1/0", "9" * 20 + "*" + "9" * 20, "", "1;2"])
def test_calculate_refuses(expr):
    with pytest.raises(ValueError):
        calculator.calculate(expr)


def test_tool_server_answers_and_refuses(calc_url):
    assert calculator.call(calc_url, "47*38") == "1786"
    assert calculator.call(calc_url, "__import__('os').getcwd()") is None  # refused: an error result
    assert calculator.call(calc_url, "1/0") is None
    with urllib.request.urlopen(calc_url + "/healthz", timeout=5) as r:
        assert json.loads(r.read()) == {"ok": True, "latency_ms": 5.0}
    req = urllib.request.Request(calc_url + "/calc", data=b"not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400
    exprs = [f"{a}*{b}" for a in range(10, 20) for b in range(10, 14)]
    assert calculator.call_many(calc_url, exprs) == [str(a * b) for a in range(10, 20) for b in range(10, 14)]
    assert calculator.call_many(calc_url, []) == []


def test_unreachable_tool_is_an_error_value_not_a_crash():
    from marlaas.ops.embedded import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert calculator.call(url, "1+1", timeout=2) is None
    assert calculator.call_many(url, ["1+1", "2+2"], timeout=2) == [None, None]
    with pytest.raises(ValueError):
        calculator.make_server(latency_ms=-1)


# ---------------------------------------------------------------- scheduler: continuations first

def test_scheduler_dispatches_due_continuations_first():
    from marlaas.control import scheduler

    j = scheduler.JobState(id="j1", version=0, steps=4, staleness=1, groups_per_step=2, group_size=4,
                           dispatched=4)
    plan = scheduler.plan(scheduler.Snapshot(jobs=(j,), expired=(("cont", "j1", 1), ("ver", "j1", 0)),
                                             gen_capacity=1, batch_rows=8))
    assert plan.gen_batches == [[("cont", "j1", 1)]]  # 4 rows; admission is full (4 of 4 groups dispatched)
    assert plan.verify == [("ver", "j1", 0)] and plan.dispatched == {}
