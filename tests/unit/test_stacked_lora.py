"""The stacked multi-LoRA forward equals PEFT's per-row adapter path, row by row."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _peft_with_adapters(ranks: list[int], seed: int = 0, uniform: bool = False, base=None):
    from peft import LoraConfig, PeftModel

    from marlaas.base.tiny import init_model

    model, tok = base if base is not None else init_model("test", seed=seed)
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    names = []
    peft = None
    for k, r in enumerate(ranks):
        name = f"a{k}"
        # Different ranks, alphas and target sets: the stacked path pads ranks and zero-fills layers
        # an adapter does not have.
        # (`uniform`: one config for all, only the weights differ.)
        targets = ["q_proj", "v_proj", "down_proj"] if k % 2 and not uniform else "all-linear"
        cfg = LoraConfig(r=r, lora_alpha=2.0 * r + (0 if uniform else k), target_modules=targets, lora_dropout=0.0)
        if peft is None:
            peft = PeftModel(model, cfg, adapter_name=name)
        else:
            peft.add_adapter(name, cfg)
        with torch.no_grad():
            for pname, p in peft.named_parameters():
                if f".{name}." in pname and ("lora_B" in pname or "lora_A" in pname):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        names.append(name)
    peft.eval()
    return peft, tok, names


def test_row_layout_hand_computed():
    from marlaas.generate.stacked_lora import row_layout

    # rows: b a base b ; names [a, b] -> m = 2; a's rows [1], b's rows [0, 3]
    perm, inv, m = row_layout(["b", "a", "base", "b"], ["a", "b"])
    assert m == 2
    assert perm.tolist() == [1, 4, 0, 3]  # 4 = the zero pad row (rows = 4)
    assert inv.tolist() == [2, 0, 4, 3]  # base row -> zero output row U*m = 4


def test_stacked_forward_equals_peft_per_row():
    from marlaas.generate.stacked_lora import base_only, stacked_lora

    peft, tok, names = _peft_with_adapters([4, 8, 16])
    rows = ["a2", "__base__", "a0", "a1", "a0", "a2", "a1", "__base__", "a2"]
    prompts = [f"sort:{i}{i + 3}{i + 1}=" for i in range(len(rows))]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        ref = peft(**enc, adapter_names=rows).logits
        with stacked_lora(peft, rows, "__base__"):  # puts the LoRA layers in base-only mode itself
            got = peft(**enc).logits
        with peft.disable_adapter():
            base = peft(**enc).logits
        with base_only(peft):
            assert torch.equal(peft(**enc).logits, base)  # the cheap switch equals PEFT's
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # The adapters really change the output (so equality above is not base == base).
    assert (ref[0] - base[0]).abs().max() > 1e-3
    assert torch.allclose(ref[1], base[1], atol=1e-6)
    # No base rows and as many rows per adapter: the layout needs no zero row either way.
    even = ["a0", "a1", "a2", "a1", "a2", "a0"]
    enc2 = tok(prompts[:len(even)], return_tensors="pt", padding=True)
    with torch.inference_mode():
        ref2 = peft(**enc2, adapter_names=even).logits
        with stacked_lora(peft, even, "__base__"):
            assert torch.allclose(peft(**enc2).logits, ref2, atol=1e-5)
    # Hooks are gone after the context, and the adapters are enabled again.
    with torch.inference_mode(), peft.disable_adapter():
        assert torch.allclose(peft(**enc).logits, base)
    with torch.inference_mode():
        assert torch.allclose(peft(**enc, adapter_names=rows).logits, ref)
        assert not any(m.disable_adapters for m in peft.modules() if hasattr(m, "lora_A"))


def test_stacked_forward_equals_peft_on_a_llama_with_a_bpe_tokenizer(tmp_path):
    """The same on real Llama modules (q/k/v/o and gate/up/down projections), ranks 4, 8 and 16 in
    one batch, prompts through the model's chat template and byte-level BPE tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlaas.generate.stacked_lora import stacked_lora
    from tests.helpers_models import make_tiny_llama

    src = make_tiny_llama(tmp_path / "llama")
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    peft, tok, names = _peft_with_adapters([4, 8, 16], base=(model, tok))
    rows = ["a1", "__base__", "a0", "a2", "a2", "a0"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 7}?"}], tokenize=False,
                                       add_generation_prompt=True) for i in range(len(rows))]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        ref = peft(**enc, adapter_names=rows).logits
        with stacked_lora(peft, rows, "__base__"):
            got = peft(**enc).logits
        with peft.disable_adapter():
            base = peft(**enc).logits
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert (ref[0] - base[0]).abs().max() > 1e-3 and torch.allclose(ref[1], base[1], atol=1e-6)


def test_engine_stacked_and_peft_paths_agree(tmp_path):
    """Greedy completions and their log-probs through HFEngine agree between the two mixed paths."""
    from marlaas.adapters import blob_from_peft
    from marlaas.base.tiny import init_model, save
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterRef, GenRequest

    save(*init_model("test", seed=0), tmp_path / "base")  # the same (deterministic) base the adapters sit on
    peft, tok, names = _peft_with_adapters([4, 8, 16])
    blobs = {AdapterRef("j", k + 1): blob_from_peft(peft, n) for k, n in enumerate(names)}
    reqs = [GenRequest(key=str(i), prompt=f"rev:{i}{i + 2}{i + 4}=", adapter=ref, n=2, greedy=True,
                       max_new_tokens=6)
            for i, ref in enumerate([*blobs, None, *blobs])]
    out = {}
    for path in ("stacked", "peft"):
        eng = HFEngine(tmp_path / "base", blobs.__getitem__, mixed_path=path)
        out[path] = eng.generate(reqs)
    for a, b in zip(out["stacked"], out["peft"]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4


def _reqs(refs):
    """Greedy requests, one prompt per adapter ref (None: the base)."""
    from marlaas.types import GenRequest

    return [GenRequest(key=str(i), prompt=f"rev:{i}{i + 2}{i + 4}=", adapter=ref, n=2, greedy=True,
                       max_new_tokens=6) for i, ref in enumerate(refs)]


def _assert_same(got, want, tol=1e-5):
    for a, b in zip(got, want):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < tol


def test_full_cache_reuses_a_slot_in_place(tmp_path):
    """With the adapter cache full, a new adapter goes into the least recently used slot (no new PEFT
    adapter); its outputs equal a fresh engine's, single-adapter and mixed, and the evicted one is gone."""
    from marlaas.adapters import blob_from_peft
    from marlaas.base.tiny import init_model, save
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterRef

    save(*init_model("test", seed=0), tmp_path / "base")
    peft, tok, names = _peft_with_adapters([8, 8, 8], uniform=True)  # one LoRA shape: slots interchangeable
    blobs = {AdapterRef(f"j{k}", 1): blob_from_peft(peft, n) for k, n in enumerate(names)}  # three jobs
    v1, v2, v3 = blobs

    eng = HFEngine(tmp_path / "base", blobs.__getitem__, max_adapters=2)
    eng.generate(_reqs([v1, v2]))
    slot_of_v1 = eng._cache[v1]
    got_solo = eng.generate(_reqs([v3]))  # the cache is full: v3 overwrites v1's slot (the LRU)
    assert eng._cache[v3] == slot_of_v1 and not eng.serves(v1) and eng.serves(v2) and eng.serves(v3)
    assert len(eng.peft.peft_config) == 2
    got_mixed = eng.generate(_reqs([v3, v2, None]))
    fresh = HFEngine(tmp_path / "base", blobs.__getitem__, max_adapters=8)
    for got, refs in ((got_solo, [v3]), (got_mixed, [v3, v2, None])):
        _assert_same(got, fresh.generate(_reqs(refs)))
    # v3's outputs differ from v1's (so the equality above is not the old slot's weights).
    v1_out = fresh.generate(_reqs([v1]))[0].completions[0].logprobs
    assert max(abs(x - y) for x, y in zip(v1_out, got_solo[0].completions[0].logprobs)) > 1e-4


def test_a_new_version_takes_its_predecessors_slot(tmp_path):
    """A job's new version overwrites its older version's slot (no PEFT add_adapter, whose cost grows
    with the adapters registered) even while the cache has room; a batch that uses both versions
    keeps both; outputs equal a fresh engine's."""
    from marlaas.adapters import blob_from_peft
    from marlaas.base.tiny import init_model, save
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterRef

    save(*init_model("test", seed=0), tmp_path / "base")
    peft, tok, names = _peft_with_adapters([8, 8, 8, 8], uniform=True)
    refs = [AdapterRef("a", 1), AdapterRef("a", 2), AdapterRef("a", 3), AdapterRef("b", 1)]
    blobs = {r: blob_from_peft(peft, n) for r, n in zip(refs, names)}
    a1, a2, a3, b1 = refs

    eng = HFEngine(tmp_path / "base", blobs.__getitem__, max_adapters=8)
    eng.generate(_reqs([a1, b1]))
    slot = eng._cache[a1]
    got = eng.generate(_reqs([a2, b1]))  # a2 takes a1's slot: the cache has room, but a1 is superseded
    assert eng._cache[a2] == slot and not eng.serves(a1) and set(eng.loaded()) == {a2, b1}
    assert len(eng.peft.peft_config) == 2
    eng.generate(_reqs([a2, a3]))  # both versions in one batch: a2 is kept, a3 gets a new slot
    assert eng.serves(a2) and eng.serves(a3) and len(eng.peft.peft_config) == 3
    _assert_same(got, HFEngine(tmp_path / "base", blobs.__getitem__, max_adapters=8).generate(_reqs([a2, b1])))


def test_an_adapter_with_nan_weights_reaches_only_its_own_rows():
    # A hostile tenant's adapter may hold inf/NaN. Its rows are garbage, but no other row of the
    # mixed batch (another adapter's, padding slots included, or the base's) may see any of it.
    from marlaas.generate.stacked_lora import stacked_lora

    peft, tok, names = _peft_with_adapters([4, 8, 16], uniform=True)
    rows = ["a0", "__base__", "a1", "a1", "a1", "a2", "a0"]  # a0 and a2 have padding slots (m = 3)
    prompts = [f"sort:{i}{i + 2}{i + 5}=" for i in range(len(rows))]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        ref = peft(**enc, adapter_names=rows).logits
        for pname, p in peft.named_parameters():
            if ".a2." in pname and "lora_B" in pname:
                p.fill_(float("nan"))
        with stacked_lora(peft, rows, "__base__"):
            got = peft(**enc).logits
    mine = [i for i, a in enumerate(rows) if a == "a2"]
    assert all(torch.isnan(got[i]).any() for i in mine)
    for i in range(len(rows)):
        if i not in mine:
            assert torch.allclose(got[i], ref[i], atol=1e-5), (i, rows[i])


def test_static_kv_cache_generates_what_the_dynamic_one_does(tmp_path):
    """The CPU default (a static KV cache per call, allocated at its final length) gives the tokens and
    log-probs of transformers' growing cache: mixed adapters, left-padded prompts of several lengths,
    greedy and seeded sampling, stop strings; and a call leaves no cache length behind for the next."""
    from marlaas.adapters import blob_from_peft
    from marlaas.base.tiny import init_model, save
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterRef, GenRequest

    save(*init_model("test", seed=0), tmp_path / "base")
    peft, tok, names = _peft_with_adapters([4, 8])
    blobs = {AdapterRef("j", k + 1): blob_from_peft(peft, n) for k, n in enumerate(names)}
    refs = [*blobs, None]
    reqs = [GenRequest(key=str(i), prompt="rev:" + "1234567"[: 1 + i % 7] + "=", adapter=refs[i % 3], n=3,
                       greedy=i % 2 == 0, temperature=0.9, seed=100 + i, max_new_tokens=4 + i % 5,
                       stop=["9"] if i == 3 else [])
            for i in range(8)]
    engines = {kind: HFEngine(tmp_path / "base", blobs.__getitem__, kv_cache=kind) for kind in ("static", "dynamic")}
    assert HFEngine(tmp_path / "base", blobs.__getitem__).kv_cache == "static"  # auto on the CPU
    got, want = engines["static"].generate(reqs), engines["dynamic"].generate(reqs)
    _assert_same(got, want, tol=1e-4)
    assert any(c.token_ids for r in got for c in r.completions)
    short = engines["static"].generate(reqs[:1])  # after longer calls: sized by its own prompt only
    _assert_same(short, engines["dynamic"].generate(reqs[:1]), tol=1e-4)
    assert getattr(engines["static"].model, "_previous_max_cache_length", None) is None
    with pytest.raises(ValueError, match="kv_cache"):
        HFEngine(tmp_path / "base", blobs.__getitem__, kv_cache="paged")


def test_idle_adapter_slots_stay_within_the_byte_budget(tmp_path):
    """With `adapter_bytes` = 2.5 slots: a third job's adapter takes over the least recently used idle
    slot (no new PEFT adapter); a batch that needs three at once gets all three (outputs equal an
    unbounded engine's), and the next new job takes over a slot again."""
    from marlaas.adapters import blob_from_peft
    from marlaas.base.tiny import init_model, save
    from marlaas.generate.hf import HFEngine
    from marlaas.types import AdapterRef

    save(*init_model("test", seed=0), tmp_path / "base")
    peft, tok, names = _peft_with_adapters([8, 8, 8, 8], uniform=True)
    blobs = {AdapterRef(f"j{k}", 1): blob_from_peft(peft, n) for k, n in enumerate(names)}  # four jobs
    v1, v2, v3, v4 = blobs
    free = HFEngine(tmp_path / "base", blobs.__getitem__, adapter_bytes=None)
    free.generate(_reqs([v1]))
    slot = free._bytes[free._cache[v1]]
    assert slot > 0
    eng = HFEngine(tmp_path / "base", blobs.__getitem__, adapter_bytes=int(2.5 * slot))
    eng.generate(_reqs([v1]))
    eng.generate(_reqs([v2]))
    slot_of_v1 = eng._cache[v1]
    eng.generate(_reqs([v3]))  # a third slot would pass the budget: v3 takes over v1's (the LRU)
    assert eng.loaded() == [v2, v3] and eng._cache[v3] == slot_of_v1 and len(eng.peft.peft_config) == 2
    got = eng.generate(_reqs([v1, v2, v3, None]))  # the batch needs three: the budget yields to it
    assert set(eng.loaded()) == {v1, v2, v3}
    _assert_same(got, free.generate(_reqs([v1, v2, v3, None])))
    eng.generate(_reqs([v4]))  # a new job takes over the LRU slot (v1's), and the budget trims v2's
    assert eng.loaded() == [v3, v4] and len(eng.peft.peft_config) == 2
    _assert_same(eng.generate(_reqs([v4, v3])), free.generate(_reqs([v4, v3])))
    assert HFEngine(tmp_path / "base", blobs.__getitem__).adapter_bytes > 0  # auto: bounded on the CPU
