"""Tool episodes across the stations, against a real Redis, the real HF engine on the tiny base and
a real calculator service: attempts and leases of continuations, stop tokens, the loss mask."""

import threading
import time

import pytest

from marlaas.base.tiny import load_tokenizer
from marlaas.generate.station import run_generate
from marlaas.spec import JobSpec
from marlaas.store import LEASES, item_name
from marlaas.tools import calculator, episodes
from marlaas.train.station import train_batch
from marlaas.types import GenRequest, ItemKind, WorkItem
from marlaas.verify.station import run_verify, run_verify_many

pytestmark = pytest.mark.integration

ROW = {"prompt": "calc:47*38=", "answer": "1786"}


@pytest.fixture(scope="module")
def calc_url():
    """A calculator server; its URL is passed to the stations (as the workers pass Settings.tool_url)."""
    server = calculator.make_server("127.0.0.1", 0, latency_ms=10)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def engine(tiny_base):
    from marlaas.generate.hf import HFEngine

    return HFEngine(tiny_base, lambda ref: None, threads=1)


def _episode(tok, text: str, finished: bool = False) -> dict:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return episodes.start({"ids": ids, "logprobs": [-0.5] * len(ids), "text": text}, finished)


def _lease(st, kind, jid, g):
    return st.r.zscore(LEASES, item_name(kind, jid, g))


def test_stop_token_ends_a_turn_without_finishing_it(engine):
    reqs = [GenRequest(key="a", prompt="calc:47*38=", adapter=None, n=24, max_new_tokens=8, seed=3,
                       stop=episodes.STOP),
            GenRequest(key="b", prompt="calc:47*38=", adapter=None, n=1, max_new_tokens=8, greedy=True)]
    out = engine.generate(reqs)
    calls = 0
    for c in out[0].completions:
        assert "]" not in c.text[:-1]  # generation stopped at the first "]"
        if c.text.endswith("]"):
            calls += 1
            assert not c.finished and c.token_ids[-1] == engine.tokenizer.convert_tokens_to_ids("]")
        assert len(c.token_ids) == len(c.logprobs)
    assert calls > 0  # the pretrained base samples tool calls
    two = engine.generate([GenRequest(key="c", prompt="x", adapter=None, stop=("]]",))])[0].completions[0]
    assert "]]" not in two.text[:-1]  # a stop string of two tokens is served (matched on the decoded text)


def test_a_group_goes_around_verify_and_generate_until_final(st, engine, calc_url):
    spec = JobSpec(task="calc", steps=1, prompts_per_step=1, group_size=3, eval_size=1, max_staleness=1)
    jid = st.create_job(spec, [ROW], [ROW])
    tok = engine.tokenizer
    comps = [_episode(tok, "[47*38]"), _episode(tok, "1200", finished=True), _episode(tok, "[47*]")]
    first = st.put_rollout(jid, 0, 0, {"row": ROW, "row_idx": 0, "completions": comps})

    # verify: two calls (one refused by the calculator: an error result), the group goes back to generate
    assert run_verify(st, jid, "ver", [0], calc_url) == 0
    roll = st.rollout(jid, 0)
    assert roll["awaiting_cont"] and roll["attempt"] != first and "rewards" not in roll
    assert [c.get("pending") for c in roll["completions"]] == ["=1786;", None, "=err;"]
    assert _lease(st, "cont", jid, 0) == 0 and _lease(st, "ver", jid, 0) is None
    assert st.job_fields(jid, "tool_calls", "tool_errors") == ["2", "1"]
    # a redelivered verify of the same group while it awaits its continuation does nothing
    assert run_verify(st, jid, "ver", [0], calc_url) == 0
    assert st.rollout(jid, 0)["attempt"] == roll["attempt"]

    # generate continues the two unfinished episodes with the group's own version
    to_verify = run_generate(st, engine, [["cont", jid, 0]], calc_url)
    assert to_verify == [WorkItem(ItemKind.VER, jid, 0)]
    cont = st.rollout(jid, 0)
    assert not cont["awaiting_cont"] and cont["version"] == 0
    assert _lease(st, "cont", jid, 0) is None and _lease(st, "ver", jid, 0) > time.time()
    c0, c1, c2 = cont["completions"]
    assert c1 == comps[1]  # a finished episode is untouched
    assert c0["text"].startswith("[47*38]=1786;") and c2["text"].startswith("[47*]=err;")
    for c in (c0, c2):
        assert c["turns"] == 2 and len(c["ids"]) == len(c["logprobs"]) == len(c["mask"])
        assert c["mask"] == episodes.action_mask(c["text"]) + [1] * (len(c["ids"]) - len(c["text"]))
        assert tok.decode(c["ids"], skip_special_tokens=True) == c["text"]
        assert c["mask"][7:13] == [0] * 6 if c is c0 else c["mask"][5:10] == [0] * 5

    # a duplicated continuation is a no-op and drops its own lease (the group awaits none)
    st.lease([item_name("cont", jid, 0)], 60)
    assert run_generate(st, engine, [["cont", jid, 0]], calc_url) == []
    assert st.rollout(jid, 0)["attempt"] == cont["attempt"] and _lease(st, "cont", jid, 0) is None

    # verify again until every episode is final, then the group is scored on final answers
    for _ in range(episodes.MAX_TURNS):
        if run_verify(st, jid, "ver", [0], calc_url):
            break
        assert run_generate(st, engine, [["cont", jid, 0]], calc_url) == [(ItemKind.VER, jid, 0)]
    final = st.rollout(jid, 0)
    assert episodes.all_done(final["completions"]) and "rewards" in final
    want = [1.0 if episodes.final_answer(c["text"]) == "1786" else 0.0 for c in final["completions"]]
    assert final["rewards"]["rewards"] == want and want[1] == 0.0

    # training: tool-result tokens are masked out of the loss
    samples, _, _ = train_batch(spec.model_copy(update={"rl": spec.rl.model_copy(
        update={"drop_zero_advantage": False})}), 0, [final])
    assert [s.loss_mask for s in samples] == [c["mask"] for c in final["completions"]]
    assert samples[0].n_actions == len(samples[0].completion_ids) - 6


def test_stale_writes_are_refused_and_regeneration_clears_continuations(st, engine):
    spec = JobSpec(task="calc", steps=2, prompts_per_step=1, group_size=2, eval_size=1, max_staleness=0)
    jid = st.create_job(spec, [ROW], [ROW])
    tok = engine.tokenizer
    a1 = st.put_rollout(jid, 0, 0, {"row": ROW, "row_idx": 0, "completions": [_episode(tok, "[1+1]")] * 2})
    data = {"row": ROW, "row_idx": 0, "completions": [episodes.with_tool_result(_episode(tok, "[1+1]"), "2")] * 2}
    assert not st.request_continuation(jid, 0, "not-the-attempt", data)
    assert st.request_continuation(jid, 0, a1, data)
    assert not st.request_continuation(jid, 0, a1, data)  # a duplicate verify of the old attempt
    a2 = st.rollout(jid, 0)["attempt"]
    assert not st.put_continuation(jid, 0, a1, data)  # a continuation of an attempt that moved on
    assert not st.drop_cont_lease(jid, 0) and _lease(st, "cont", jid, 0) == 0  # still awaited: kept
    # a redelivered generate of the group replaces it: the continuation finds nothing to continue
    st.put_rollout(jid, 0, 0, {"row": ROW, "row_idx": 0, "completions": [_episode(tok, "2", True)] * 2})
    assert not st.put_continuation(jid, 0, a2, data)
    assert run_generate(st, engine, [["cont", jid, 0]]) == [] and _lease(st, "cont", jid, 0) is None
    # a group whose version fell out of the staleness bound is regenerated, not continued
    a3 = st.rollout(jid, 0)["attempt"]
    assert st.request_continuation(jid, 0, a3, data)
    st.r.hset(f"m:job:{jid}", "version", 1)  # the job moved on (S = 0)
    assert run_generate(st, engine, [["cont", jid, 0]]) == []
    assert st.rollout(jid, 0) is None and _lease(st, "cont", jid, 0) is None and _lease(st, "gen", jid, 0) == 0
    assert st.job_fields(jid, "regenerated") == ["1"]


def test_training_engine_masks_tool_tokens(tiny_base):
    import torch

    from marlaas.adapters import lora_config_from_spec
    from marlaas.spec import LoraSpec
    from marlaas.train.engine import TrainingEngine, TrainSample

    tok = load_tokenizer(tiny_base)
    eng = TrainingEngine(tiny_base, threads=1)
    ids = tok("[4*5]=20;20", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    mask = episodes.action_mask("[4*5]=20;20") + [1]
    s = TrainSample(prompt="calc:4*5=", completion_ids=ids, behav_logprobs=[-1.0] * len(ids), advantage=1.0,
                    loss_mask=mask)
    plain = TrainSample(prompt="sort:31=", completion_ids=ids[:3], behav_logprobs=[-1.0] * 3, advantage=-1.0)
    eng.adapter("job", lora_config_from_spec(LoraSpec()))
    seen = {}

    def capture(f):  # the loss sees the batch the engine built: its mask and behaviour log-probs
        seen["f"] = f
        return f.logp_B_T.sum() * 0.0, {}

    eng.forward_backward("job", [s, plain], capture, backward=False)
    mask_B_T, behav_B_T = seen["f"].mask_B_T, seen["f"].behav_B_T
    T = mask_B_T.shape[1]
    assert mask_B_T[0].tolist() == [float(m) for m in mask]
    assert mask_B_T[1].tolist() == [0.0] * (T - 3) + [1.0] * 3
    assert int(mask_B_T.sum()) == s.n_actions + plain.n_actions == 8 + 3
    with pytest.raises(ValueError, match="mask values"):
        eng.forward_backward("job", [TrainSample(prompt="x", completion_ids=[5, 6], behav_logprobs=[0.0, 0.0],
                                                 advantage=1.0, loss_mask=[1])], capture, backward=False)
    assert torch.isfinite(behav_B_T).all()


def test_one_verify_task_calls_the_tool_once_for_several_jobs(st, engine, calc_url, monkeypatch):
    """run_verify_many: the pending calls of two tool jobs and a plain job's group in one task: one
    concurrent round of tool calls for both tool jobs, each job's groups handed back or scored."""
    spec = JobSpec(task="calc", steps=1, prompts_per_step=1, group_size=2, eval_size=1, max_staleness=1)
    a, b = st.create_job(spec, [ROW], [ROW]), st.create_job(spec, [ROW], [ROW])
    plain = st.create_job(JobSpec(task="sort", steps=1, prompts_per_step=1, group_size=2, eval_size=1),
                          [{"prompt": "sort:2 1=", "answer": "1 2"}], [{"prompt": "sort:2 1=", "answer": "1 2"}])
    tok = engine.tokenizer
    st.put_rollout(a, 0, 0, {"row": ROW, "row_idx": 0, "completions": [_episode(tok, "[47*38]"),
                                                                           _episode(tok, "9", finished=True)]})
    st.put_rollout(b, 0, 0, {"row": ROW, "row_idx": 0, "completions": [_episode(tok, "[2*3]"), _episode(tok, "[4+4]")]})
    done = [_episode(tok, "1 2", finished=True), _episode(tok, "2", finished=True)]
    st.put_rollout(plain, 0, 0, {"row": {"prompt": "sort:2 1=", "answer": "1 2"}, "row_idx": 0, "completions": done})
    rounds = []
    real = calculator.call_many
    monkeypatch.setattr(calculator, "call_many",
                        lambda url, exprs, **kw: rounds.append(list(exprs)) or real(url, exprs, **kw))
    accepted = run_verify_many(st, [(a, "ver", [0]), (b, "ver", [0]), (plain, "ver", [0])], calc_url)
    assert rounds == [["47*38", "2*3", "4+4"]]  # one round for both tool jobs
    assert accepted == 1 and "rewards" in st.rollout(plain, 0)  # the plain job's group is scored
    for jid, want in ((a, ["=1786;", None]), (b, ["=6;", "=8;"])):
        roll = st.rollout(jid, 0)
        assert roll["awaiting_cont"] and [c.get("pending") for c in roll["completions"]] == want
    assert st.job_fields(a, "tool_calls")[0] == "1" and st.job_fields(b, "tool_calls")[0] == "2"
