"""The generate station's side of serving, on the tiny base's tokenizer: chat rendering, the engine
request of a serving body, and the choices written back (stop strings left out of the text)."""

import pytest

from marlaas.base.tiny import build_tokenizer
from marlaas.errors import SampleError
from marlaas.generate.tinker_sample import gen_request, render_chat, served
from marlaas.types import AdapterRef, Completion, GenResult

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_a_base_without_a_chat_template_gets_the_raw_contents(tok):
    assert render_chat(tok, [{"role": "user", "content": "12+3="}]) == "12+3="
    assert render_chat(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]) \
        == "be brief\n1+1="
    with pytest.raises(SampleError):
        render_chat(tok, [])


def test_a_chat_template_renders_with_the_generation_prompt(tok):
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
    assert render_chat(tok, [{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_a_serving_body_becomes_an_engine_request(tok):
    body = {"serve": "completion", "prompt": "12+3=", "model": "j4", "version": 2, "n": 3,
            "params": {"temperature": 0, "top_p": 0.9, "max_tokens": 5, "stop": ["\n"], "seed": 7}}
    r = gen_request(tok, "r1", body)
    assert r.prompt_ids == tok("12+3=")["input_ids"] and r.adapter == AdapterRef("j4", 2)
    assert (r.greedy, r.n, r.max_new_tokens, r.stop, r.seed, r.top_p) == (True, 3, 5, ("\n",), 7, 0.9)
    base = gen_request(tok, "r2", {**body, "model": "", "params": {"temperature": 0.7}})
    assert base.adapter is None and not base.greedy and base.temperature == 0.7
    with pytest.raises(SampleError):
        gen_request(tok, "r3", {**body, "prompt": ""})


def test_choices_cut_before_the_stop_string_and_count_every_token(tok):
    ids = tok("15\nxx")["input_ids"]
    res = GenResult("r", [Completion(token_ids=ids, logprobs=[-0.5] * len(ids), text="15\nxx", finished=False),
                          Completion(token_ids=ids[:2] + [tok.eos_token_id], logprobs=[-1.0] * 3, text="15",
                                     finished=True),
                          Completion(token_ids=ids[:2], logprobs=[-1.0] * 2, text="15", finished=False)])
    req = gen_request(tok, "r", {"serve": "completion", "prompt": "1", "params": {"stop": ["\n"]}})
    a, b, c = served(tok, req, res, logprobs=True)
    assert (a["text"], a["finish_reason"], a["completion_tokens"]) == ("15", "stop", 5)
    assert a["token_texts"] == ["1", "5"]
    assert (b["text"], b["finish_reason"]) == ("15", "stop")
    assert (c["text"], c["finish_reason"]) == ("15", "length")
