"""Text-similarity metrics of `text_similarity` graders, from well-kept libraries; pure and bounded.

Every metric maps (input, reference) to a float in [0, 1]; callers cap both strings (`MAX_TEXT`
characters in `marlaas.verify.graders`) before calling, and the token metrics compare at most the
first `MAX_TOKENS` tokens of each text (`MAX_LCS_TOKENS` for rouge_l, whose longest common
subsequence costs tokens x tokens: 20,000 one-letter words took 40 s and 1 GB uncapped), so one call
costs at most about 0.2 s of CPU and a few MB whatever the texts.

- `fuzzy_match`: rapidfuzz `fuzz.ratio` / 100, the normalised Indel similarity
  1 - (insertions + deletions) / (len(a) + len(b)) ("abcd" vs "abce": 0.75).
- `bleu`: NLTK `sentence_bleu` (up to 4-grams, uniform weights) on whitespace tokens, with
  smoothing method 1 so short texts without 4-gram overlap do not collapse to exactly 0.
- `gleu`: NLTK `sentence_gleu` (Google-BLEU, 1- to 4-grams) on whitespace tokens.
- `rouge_1` ... `rouge_5`, `rouge_l`: the F-measure of Google's `rouge_score` (its own tokenizer:
  lower case, non-alphanumerics dropped; no stemming).

Not offered: `meteor` (needs WordNet data downloaded at run time) and `cosine` (needs an embedding
model); validation refuses them with one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

MAX_TOKENS = 4096
"""Tokens of each text the n-gram metrics (bleu, gleu, rouge_1..rouge_5) compare: the first ones."""
MAX_LCS_TOKENS = 512
"""Tokens of each text rouge_l compares (the first ones): its cost is quadratic in them."""
METRICS = ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
UNAVAILABLE = {"meteor": "needs WordNet data that this deployment does not download",
               "cosine": "needs an embedding model this deployment does not run"}


def fuzzy_match(a: str, b: str) -> float:
    from rapidfuzz import fuzz

    return fuzz.ratio(a, b) / 100.0


def bleu(a: str, b: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    hyp, ref = a.split()[:MAX_TOKENS], b.split()[:MAX_TOKENS]
    if not hyp or not ref:
        return 1.0 if hyp == ref else 0.0
    return float(sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1))


def gleu(a: str, b: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hyp, ref = a.split()[:MAX_TOKENS], b.split()[:MAX_TOKENS]
    if not hyp or not ref:
        return 1.0 if hyp == ref else 0.0
    return float(sentence_gleu([ref], hyp))


@functools.lru_cache(maxsize=8)
def _rouge_scorer(kind: str):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind], use_stemmer=False)


@functools.lru_cache(maxsize=1)
def _rouge_tokenizer():
    from rouge_score import tokenizers

    return tokenizers.DefaultTokenizer(use_stemmer=False)


def capped_tokens(text: str, limit: int) -> str:
    """`text` as rouge_score's own tokens (lower case, alphanumeric runs), the first `limit` of them,
    joined by spaces: the scorer tokenizes it back to exactly those tokens."""
    return " ".join(_rouge_tokenizer().tokenize(text)[:limit])


def _rouge(kind: str) -> Callable[[str, str], float]:
    limit = MAX_LCS_TOKENS if kind == "rougeL" else MAX_TOKENS

    def score(a: str, b: str) -> float:
        a, b = capped_tokens(a, limit), capped_tokens(b, limit)
        return float(_rouge_scorer(kind).score(b, a)[kind].fmeasure)  # score(target, prediction)

    score.__name__ = kind
    return score


_FNS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match, "bleu": bleu, "gleu": gleu,
    **{f"rouge_{n}": _rouge(f"rouge{n}") for n in range(1, 6)}, "rouge_l": _rouge("rougeL"),
}


def similarity(metric: str, a: str, b: str) -> float:
    """The `metric` similarity of input `a` to reference `b`, in [0, 1]; KeyError for an unknown metric."""
    value = _FNS[metric](a, b)
    return min(1.0, max(0.0, value))
