"""Generation engines (HF+PEFT and vLLM) against a teacher-forced transformers+PEFT reference.

One random tiny Qwen2 and two random non-zero LoRA adapters (different ranks and target modules)
are built once per session. For each engine:
(a) the returned log-probs equal log_softmax(logits / T) of a teacher-forced PEFT forward at the
    sampled tokens within 1e-4 (both fp32; measured max error ~2e-6 for both);
(b) greedy outputs of a mixed batch (base + adapter 1 + adapter 2 in one call) equal each one's solo
    greedy output;
(c) serves() is false before the first use and true after; a new version gets a fresh id, is served
    with its own weights, and the least recently used version is evicted.

The vLLM engine runs in-process (~10-16 s import + ~4 s start); it is skipped only when vllm is not
importable.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from marlaas.adapters import blob_from_peft  # noqa: E402
from marlaas.adapters import write_adapter_dir as write_blob  # noqa: E402
from marlaas.base.tiny import init_model, save  # noqa: E402
from marlaas.generate.factory import make_engine  # noqa: E402
from marlaas.types import AdapterRef, GenRequest  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["12+3=", "abc", "sort: 3 1 2", "x", "hello world"]
MAX_ADAPTERS = 3


def _tiny_base():
    """basemodel's "test" preset, made vLLM-compatible and informative for these tests.

    vLLM's CPU attention supports head sizes >= 32 only, so the preset is rebuilt with
    hidden/32 heads when its head size is smaller. The tied embeddings are scaled so the output
    distributions are far from uniform, and the EOS row is pointed along the mean final hidden
    state so that EOS is sampled now and then.
    """
    from transformers import Qwen2ForCausalLM

    model, tok = init_model("test", seed=0)
    cfg = model.config
    if cfg.hidden_size // cfg.num_attention_heads < 32:
        cfg = copy.deepcopy(cfg)
        cfg.num_attention_heads = max(1, cfg.hidden_size // 32)
        cfg.num_key_value_heads = 1
        torch.manual_seed(0)
        gen_cfg = model.generation_config
        model = Qwen2ForCausalLM(cfg)
        model.generation_config = gen_cfg
    model.eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        h = model.model(**enc).last_hidden_state[enc["attention_mask"].bool()].mean(0)
        model.model.embed_tokens.weight[tok.eos_token_id] = 3.0 * h / h.norm() ** 2
    return model, tok


def _random_adapter(base, seed: int, r: int, targets: list[str], scale: float):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, init_lora_weights=True)
    pm = get_peft_model(copy.deepcopy(base), cfg, adapter_name="default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return blob_from_peft(pm, "default")


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    model, tok = _tiny_base()
    base_dir = save(model, tok, root / "base")
    blobs = {
        "a1": _random_adapter(
            model, 1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.3
        ),
        "a2": _random_adapter(model, 2, 4, ["q_proj", "v_proj", "down_proj"], 1.5),
    }
    # Reference: one PeftModel holding both adapters, loaded from the blobs as directories.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref_base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(ref_base, str(write_blob(blobs["a1"], root / "a1")), adapter_name="a1")
    ref.load_adapter(str(write_blob(blobs["a2"], root / "a2")), adapter_name="a2")
    ref.eval()
    return {"base": base_dir, "tok": tok, "blobs": blobs, "ref": ref, "root": root}


class Source:
    """adapter_source for the engines: job 'a1'/'a2' -> that blob; job 'lru' -> a1 for odd, a2 for even."""

    def __init__(self, blobs):
        self.blobs = blobs
        self.fetched: list[AdapterRef] = []

    def __call__(self, ref: AdapterRef):
        self.fetched.append(ref)
        if ref.job_id == "lru":
            return self.blobs["a1" if ref.version % 2 else "a2"]
        return self.blobs[ref.job_id]


ENGINES = ["hf", "vllm"]


@pytest.fixture(scope="session")
def engines(world):
    made = {}

    def get(kind):
        if kind not in made:
            if kind == "vllm":
                pytest.importorskip("vllm")
            src = Source(world["blobs"])
            eng = make_engine(
                kind,
                world["base"],
                src,
                threads=1,
                max_adapters=MAX_ADAPTERS,
                cache_dir=world["root"] / f"cache-{kind}",
            )
            made[kind] = (eng, src)
        return made[kind]

    yield get
    for eng, _ in made.values():
        eng.close()


def _teacher_forced(world, prompt: str, adapter: str | None, tokens: list[int], temperature: float, greedy: bool):
    tok, ref = world["tok"], world["ref"]
    p = tok(prompt)["input_ids"]
    ids = torch.tensor([p + tokens])
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                logits = ref(input_ids=ids).logits
        else:
            ref.set_adapter(adapter)
            logits = ref(input_ids=ids).logits
    logits = logits[0, len(p) - 1 : len(p) - 1 + len(tokens)]
    if not greedy:
        logits = logits / temperature
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


A1, A2 = AdapterRef("a1", 1), AdapterRef("a2", 1)


@pytest.mark.parametrize("kind", ENGINES)
def test_logprobs_match_teacher_forcing(world, engines, kind):
    eng, _ = engines(kind)
    tol = 1e-4  # measured max error ~2e-6 for both engines (fp32)
    reqs = []
    for j, prompt in enumerate(PROMPTS):
        for adapter in (None, A1, A2):
            reqs.append(
                GenRequest(f"{j}-{adapter}-t", prompt, adapter, n=3, temperature=0.7, max_new_tokens=10, seed=j)
            )
        reqs.append(GenRequest(f"{j}-g", prompt, A1, n=1, greedy=True, max_new_tokens=6))
        reqs.append(GenRequest(f"{j}-hot", prompt, A2, n=2, temperature=1.3, max_new_tokens=5, seed=100 + j))
    results = eng.generate(reqs)
    assert [r.key for r in results] == [r.key for r in reqs]
    eos = world["tok"].eos_token_id
    finished = 0
    for req, res in zip(reqs, results):
        assert len(res.completions) == req.n
        for c in res.completions:
            assert 1 <= len(c.token_ids) <= req.max_new_tokens
            assert len(c.logprobs) == len(c.token_ids)
            if c.finished:
                finished += 1
                assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
            else:
                assert len(c.token_ids) == req.max_new_tokens and eos not in c.token_ids
            assert c.text == world["tok"].decode([t for t in c.token_ids if t != eos], skip_special_tokens=True)
            want = _teacher_forced(
                world, req.prompt, req.adapter.job_id if req.adapter else None, c.token_ids, req.temperature, req.greedy
            )
            err = max(abs(a - b) for a, b in zip(c.logprobs, want))
            assert err < tol, (kind, req.key, c.token_ids, c.logprobs, want)
    assert finished > 0, "no completion hit EOS: the EOS path went untested"


@pytest.mark.parametrize("kind", ENGINES)
def test_mixed_greedy_batch_equals_solo(world, engines, kind):
    eng, _ = engines(kind)
    reqs = [
        GenRequest(f"{j}-{a}", p, a, n=2 if a == A2 else 1, greedy=True, max_new_tokens=12)
        for j, p in enumerate(PROMPTS[:3])
        for a in (None, A1, A2)
    ]
    mixed = eng.generate(reqs)
    for req, res in zip(reqs, mixed):
        solo = eng.generate([req])[0]
        assert [c.token_ids for c in res.completions] == [c.token_ids for c in solo.completions], req.key
        assert all(c.token_ids == res.completions[0].token_ids for c in res.completions)
    by = {r.key: res.completions[0].token_ids for r, res in zip(reqs, mixed)}
    # The adapters really change the model (otherwise this test proves nothing).
    assert any(by[f"{j}-{A1}"] != by[f"{j}-None"] for j in range(3))
    assert any(by[f"{j}-{A2}"] != by[f"{j}-None"] for j in range(3))
    assert any(by[f"{j}-{A1}"] != by[f"{j}-{A2}"] for j in range(3))


@pytest.mark.parametrize("kind", ENGINES)
def test_serves_lazy_load_and_lru(world, engines, kind):
    eng, src = engines(kind)
    greedy = {}
    for a in (A1, A2):  # solo greedy outputs of each adapter's weights
        greedy[a.job_id] = (
            eng.generate([GenRequest("s", "abc", a, greedy=True, max_new_tokens=8)])[0].completions[0].token_ids
        )

    def run(v):
        out = eng.generate([GenRequest("k", "abc", AdapterRef("lru", v), greedy=True, max_new_tokens=8)])
        return out[0].completions[0].token_ids

    v1 = AdapterRef("lru", 1)
    assert not eng.serves(v1)
    assert run(1) == greedy["a1"]
    assert eng.serves(v1)
    n_fetch = len(src.fetched)
    run(1)
    assert len(src.fetched) == n_fetch, "a cached version was fetched again"
    ids = set()
    if kind == "vllm":
        ids.add(eng.lora_request(v1).lora_int_id)
    for v in range(2, MAX_ADAPTERS + 2):  # MAX_ADAPTERS new versions: v1 is the LRU one and goes
        ref = AdapterRef("lru", v)
        assert not eng.serves(ref)
        assert run(v) == greedy["a1" if v % 2 else "a2"], f"version {v} served with the wrong weights"
        assert eng.serves(ref)
        if kind == "vllm":
            lr = eng.lora_request(ref)
            assert lr.lora_int_id not in ids
            ids.add(lr.lora_int_id)
            assert lr.lora_int_id in eng.llm.llm_engine.list_loras()
    assert not eng.serves(v1)
    assert len(eng.loaded()) == MAX_ADAPTERS
    # Reloading an evicted version works (and, on vLLM, under a fresh id).
    assert run(1) == greedy["a1"] and eng.serves(v1)
    if kind == "vllm":
        assert eng.lora_request(v1).lora_int_id not in ids


@pytest.mark.parametrize("kind", ENGINES)
def test_seeded_sampling_is_reproducible(world, engines, kind):
    eng, _ = engines(kind)
    reqs = [GenRequest(f"{a}", "12+3=", a, n=4, temperature=1.0, max_new_tokens=8, seed=7) for a in (None, A1, A2)]
    one = eng.generate(reqs)
    two = eng.generate(reqs)
    assert [[c.token_ids for c in r.completions] for r in one] == [[c.token_ids for c in r.completions] for r in two]
    # The n completions of one request are not copies of each other.
    assert len({tuple(c.token_ids) for c in one[0].completions}) > 1


def test_hf_failed_mixed_call_does_not_poison_the_engine(world, engines):
    eng, _ = engines("hf")
    reqs = [GenRequest(f"{a}", "abc", a, greedy=True, max_new_tokens=6) for a in (None, A1, A2)]
    before = eng.generate(reqs)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    eng.model.generate = boom  # PeftModel.generate calls the base model's generate inside its hooks
    try:
        with pytest.raises(RuntimeError, match="boom"):
            eng.generate(reqs)
    finally:
        del eng.model.generate
    after = eng.generate(reqs)
    assert [r.completions[0].token_ids for r in after] == [r.completions[0].token_ids for r in before]


def test_make_engine_rejects_unknown_kind(world):
    with pytest.raises(ValueError):
        make_engine("tgi", world["base"], lambda ref: None)


# ---------------------------------------------------------------- token-level sampling (Tinker's needs)


def _spelled(tok, text: str) -> list[int]:
    """`text` as one token per character, even where the characters spell a special token."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def _plain_greedy(world, adapter: str | None, ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by plain forwards of the reference PeftModel on the token ids (stops at EOS)."""
    ref, eos = world["ref"], world["tok"].eos_token_id
    out, lps = [], []
    for _ in range(max_new):
        with torch.no_grad():
            x = torch.tensor([ids + out])
            if adapter is None:
                with ref.disable_adapter():
                    logits = ref(input_ids=x).logits[0, -1]
            else:
                ref.set_adapter(adapter)
                logits = ref(input_ids=x).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        lps.append(float(torch.log_softmax(logits.double(), -1)[t]))
        if t == eos:
            break
    return out, lps


@pytest.mark.parametrize("kind", ENGINES)
def test_prompt_ids_are_sampled_exactly(world, engines, kind):
    eng, _ = engines(kind)
    tok = world["tok"]
    ids = tok("12+3=")["input_ids"] + _spelled(tok, "<pad>") + tok("x")["input_ids"]
    assert tok(tok.decode(ids))["input_ids"] != ids  # the text round trip would change the prompt
    reqs = [GenRequest(f"{a}", tok.decode(ids), a, prompt_ids=ids, greedy=True, max_new_tokens=8) for a in (None, A1)]
    reqs.append(GenRequest("text", "abc", A2, greedy=True, max_new_tokens=8))  # a text prompt in the same call
    results = eng.generate(reqs)
    for req, res in zip(reqs[:2], results):
        want, want_lp = _plain_greedy(world, req.adapter.job_id if req.adapter else None, ids, 8)
        assert res.completions[0].token_ids == want, req.key
        assert res.completions[0].logprobs == pytest.approx(want_lp, abs=1e-4)
    assert results[2].completions[0].token_ids == eng.generate([reqs[2]])[0].completions[0].token_ids


@pytest.mark.parametrize("kind", ENGINES)
def test_top_k_one_and_tiny_top_p_equal_greedy(world, engines, kind):
    eng, _ = engines(kind)
    greedy = [GenRequest(f"g{j}", p, A1, greedy=True, max_new_tokens=10) for j, p in enumerate(PROMPTS[:3])]
    top_k = [GenRequest(f"k{j}", p, A1, n=3, temperature=1.3, top_k=1, max_new_tokens=10, seed=j)
             for j, p in enumerate(PROMPTS[:3])]
    top_p = [GenRequest(f"p{j}", p, A1, n=2, temperature=1.0, top_p=1e-6, max_new_tokens=10, seed=j)
             for j, p in enumerate(PROMPTS[:3])]
    out = eng.generate(greedy + top_k + top_p)
    want = [r.completions[0].token_ids for r in out[:3]]
    for res in out[3:]:
        j = int(res.key[1:])
        for c in res.completions:
            assert c.token_ids == want[j], res.key
            assert c.logprobs == pytest.approx([0.0] * len(c.token_ids), abs=1e-5)  # one token kept: p = 1
    plain = eng.generate([GenRequest("t", PROMPTS[0], A1, n=8, temperature=1.3, max_new_tokens=10, seed=0)])
    assert len({tuple(c.token_ids) for c in plain[0].completions}) > 1  # without top_k it does sample


@pytest.mark.parametrize("kind", ENGINES)
def test_multi_token_stop_strings_and_stop_token_ids(world, engines, kind):
    eng, _ = engines(kind)
    tok = world["tok"]
    free = eng.generate([GenRequest(f"{j}", p, a, greedy=True, max_new_tokens=16)
                         for j, p in enumerate(PROMPTS) for a in (None, A1, A2)])
    long = next(r for r in free if len(r.completions[0].token_ids) >= 8 and not r.completions[0].finished)
    req = next(r for r in [GenRequest(f"{j}", p, a, greedy=True, max_new_tokens=16)
                           for j, p in enumerate(PROMPTS) for a in (None, A1, A2)] if r.key == long.key)
    toks = long.completions[0].token_ids
    text = tok.decode(toks)
    stop = tok.decode(toks[4:7])  # three characters: three tokens of the char tokenizer
    assert len(tok(stop, add_special_tokens=False)["input_ids"]) == 3
    cut = text.index(stop) + len(stop)  # the first place the completion's text contains it
    by_str = GenRequest("str", req.prompt, req.adapter, greedy=True, max_new_tokens=16, stop=(stop,))
    by_id = GenRequest("id", req.prompt, req.adapter, greedy=True, max_new_tokens=16, stop_token_ids=(toks[5],))
    other = GenRequest("other", req.prompt, req.adapter, greedy=True, max_new_tokens=16)  # same call, no stop
    s, i, o = eng.generate([by_str, by_id, other])
    c = s.completions[0]
    assert tok.decode(c.token_ids) == text[:cut] and c.text == text[:cut] and not c.finished
    assert c.token_ids == toks[:len(c.token_ids)] and len(c.logprobs) == len(c.token_ids)
    assert i.completions[0].token_ids == toks[:toks.index(toks[5]) + 1] and not i.completions[0].finished
    assert o.completions[0].token_ids == toks  # a neighbour's stops do not cut this row


def test_prompt_logprobs_last_n_match_a_plain_forward(world, engines):
    eng, _ = engines("hf")
    tok, ref = world["tok"], world["ref"]
    ids = tok("sort: 3 1 2")["input_ids"]
    ref.set_adapter("a1")
    with torch.no_grad():
        lp = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    full = eng.prompt_logprobs(A1, ids)
    assert full[0] is None and full[1:] == pytest.approx(want, abs=1e-4)
    last = eng.prompt_logprobs(A1, ids, last_n=3)
    assert last[:-3] == [None] * (len(ids) - 3) and last[-3:] == pytest.approx(want[-3:], abs=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs_last_n must be in 1.."):
        eng.prompt_logprobs(A1, ids, last_n=len(ids))


@pytest.mark.parametrize("kind", ENGINES)
def test_a_seeded_request_samples_the_same_alone_or_in_any_batch(world, engines, kind):
    """A step's groups split over several calls (several generate workers) draw exactly the samples of
    one call with the same seeds, and a tenant's request draws the same alone as beside others' rows."""
    eng, _ = engines(kind)
    reqs = [GenRequest(f"g{j}", PROMPTS[j % len(PROMPTS)], (A1, A2, None)[j % 3], n=4, temperature=1.0,
                       max_new_tokens=8, seed=50 + j) for j in range(6)]
    whole = eng.generate(reqs)
    parts = eng.generate(reqs[:2]) + eng.generate(reqs[2:5]) + eng.generate(reqs[5:])
    alone = eng.generate([reqs[3]])

    def toks(rs):
        return [[c.token_ids for c in r.completions] for r in rs]

    assert toks(whole) == toks(parts) and toks(whole[3:4]) == toks(alone)
    for a, b in zip(whole, parts):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
    assert len({tuple(c.token_ids) for r in whole for c in r.completions}) > 6  # it does sample


def test_hf_calls_within_a_token_budget_sample_the_same(world, engines):
    """The HF engine's token budget splits a batch into several model calls (whole requests, each
    within the budget) without changing a seeded sample or a greedy answer."""
    eng, _ = engines("hf")
    reqs = [GenRequest(f"b{j}", PROMPTS[j % len(PROMPTS)], (A1, None)[j % 2], n=3, temperature=1.0,
                       max_new_tokens=6, seed=70 + j) for j in range(5)]
    reqs.append(GenRequest("greedy", PROMPTS[0], A2, greedy=True, max_new_tokens=6))
    calls = []
    run_group = eng._run_group

    def counting(requests, idxs, *a):
        calls.append([requests[i].key for i in idxs])
        return run_group(requests, idxs, *a)

    eng._run_group = counting
    before = eng.call_tokens
    try:
        eng.call_tokens = None
        whole = eng.generate(reqs)
        assert len(calls) == 2  # one sampled group, one greedy
        calls.clear()
        width = max(len(eng.tokenizer(p)["input_ids"]) for p in PROMPTS)
        eng.call_tokens = 6 * (width + 6)  # two requests of 3 rows at most per call
        split = eng.generate(reqs)
    finally:
        eng._run_group, eng.call_tokens = run_group, before
    assert [len(c) for c in calls] == [2, 2, 1, 1] and sum(calls, []) == [r.key for r in reqs]
    assert [[c.token_ids for c in r.completions] for r in whole] == [[c.token_ids for c in r.completions]
                                                                     for r in split]
