"""The HF engine's per-row seeded sampler (marlaas.generate.hf.RowSampler): an exact sample of the
warped distribution per row, from the row's own stream."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from marlaas.generate.sampling import RowSampler, row_seeds  # noqa: E402

LOGITS = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))


def _draw(n: int, **kw) -> tuple[list[int], list[float]]:
    sampler = RowSampler([s for k in range(n) for s in row_seeds(k, 1)], kw.get("temperature", 1.0),
                          kw.get("top_k", 0), kw.get("top_p", 1.0))
    out = sampler(torch.zeros((n, 1), dtype=torch.long), LOGITS.repeat(n, 1))
    chosen = out.argmax(-1).tolist()
    assert torch.isinf(out).sum().item() == n * 3  # every other token is -inf: the call's argmax is the pick
    return chosen, sampler.logprobs[0].tolist()


def test_rows_sample_the_distribution_and_keep_its_logprobs():
    n = 8000
    chosen, lps = _draw(n)
    for tok, p in enumerate([0.1, 0.2, 0.3, 0.4]):
        share = chosen.count(tok) / n
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / n), (tok, share)
    assert all(lp == pytest.approx(math.log([0.1, 0.2, 0.3, 0.4][t]), abs=1e-5) for t, lp in zip(chosen, lps))


def test_temperature_and_top_k_warp_before_the_pick():
    chosen, lps = _draw(4000, top_k=2)
    assert set(chosen) == {2, 3}  # top-2 keeps the two likeliest
    assert all(lp == pytest.approx(math.log([0, 0, 3 / 7, 4 / 7][t]), abs=1e-5) for t, lp in zip(chosen, lps))
    hot, _ = _draw(4000, temperature=100.0)
    assert abs(hot.count(0) / 4000 - 0.25) < 0.03  # near uniform


def test_a_rows_stream_is_its_own():
    """Row k of seed s picks the same token whatever rows surround it."""
    seeds = row_seeds(7, 4)
    alone = [RowSampler([sd], 1.0, 0, 1.0) for sd in seeds]
    together = RowSampler(seeds[::-1] + row_seeds(8, 3), 1.0, 0, 1.0)
    picks_alone = [s(torch.zeros((1, 1), dtype=torch.long), LOGITS[None]).argmax(-1).item() for s in alone]
    picks = together(torch.zeros((7, 1), dtype=torch.long), LOGITS.repeat(7, 1)).argmax(-1).tolist()
    assert picks[:4] == picks_alone[::-1]
    assert len(set(row_seeds(7, 4))) == 4 and row_seeds(7, 4) != row_seeds(8, 4)
