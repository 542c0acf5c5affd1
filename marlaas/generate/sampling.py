"""Sampling each row from a stream of its own (the HF engine's seeded calls).

transformers samples a whole call from one RNG, so a row's tokens depend on every other row of the
call. `RowSampler` replaces that draw: one uniform per row and token from the row's own generator
(seeded by `row_seeds`: the request's seed and the row's index in it), inverse CDF of the warped
distribution. Invariant: a row's samples depend only on its seed, its prompt, its adapter and the
sampling settings, never on the batch it is generated in.

Both processors here keep one log-prob per row and step, never the call's scores: transformers'
`output_scores` keeps a [rows, vocab] tensor per step (200 greedy evaluation rows x 12 tokens of a
49,152-token vocabulary: 470 MB, three copies to take their log-softmax).
"""

from __future__ import annotations


class RowSampler:
    """A transformers LogitsProcessor for sampled calls with seeds: warps each step's scores as
    transformers' sampler does (temperature, then top-k, then top-p), picks each row's token from its
    own stream (one uniform per row and step from the row's generator, inverse CDF of the warped
    distribution: an exact sample), keeps the token's log-prob under the warped distribution, and
    returns scores whose argmax is that token (the call runs greedy)."""

    def __init__(self, row_seeds: list[int], temperature: float, top_k: int, top_p: float):
        import torch
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.gens = [torch.Generator().manual_seed(int(sd) & 0x7FFFFFFFFFFFFFFF) for sd in row_seeds]
        self.logprobs: list = []  # one [rows] tensor per step

    def __call__(self, input_ids, scores):
        import torch

        for w in self.warpers:
            scores = w(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = 1.0 - torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.gens])  # (0, 1]
        target = (u.to(cdf.device) * cdf[:, -1].double()).float().unsqueeze(-1)
        chosen = torch.searchsorted(cdf, target).clamp_(max=scores.shape[-1] - 1)  # first token with cdf >= target
        self.logprobs.append(torch.log_softmax(scores.float(), dim=-1).gather(-1, chosen).squeeze(-1))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, chosen, 0.0)


class GreedyLogprobs:
    """A transformers LogitsProcessor for greedy calls, last in the list: keeps each row's log-prob of
    the token greedy decoding picks (the argmax of the processed scores: the max of their log-softmax)
    and returns the scores unchanged."""

    def __init__(self):
        self.logprobs: list = []  # one [rows] tensor per step

    def __call__(self, input_ids, scores):
        import torch

        self.logprobs.append(torch.log_softmax(scores.float(), dim=-1).amax(dim=-1))
        return scores


def row_seeds(seed: int, n: int) -> list[int]:
    """The streams of a request's n sampled rows: each from (seed, row index) only."""
    return [_derive_seed([seed, k], ()) for k in range(n)]


def _derive_seed(seeds: list[int], salt: tuple) -> int:
    h = 1469598103934665603
    for v in (*seeds, *[hash(x) & 0xFFFFFFFF for x in salt]):
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF
