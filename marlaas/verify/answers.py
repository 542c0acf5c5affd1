r"""Honest final-answer extraction and numeric comparison for the `math` verifier (stdlib only).

Why: scoring the whole completion with a symbolic parser pays for restating the question ("To find
64 + 57, we can start by adding the" parses as `64 + 57` = 121). Here only ONE extracted answer is
ever compared, and a restated operand is never an answer.

Extraction rule (`extract_answer`), first that applies:

(a) the content of the LAST `\boxed{...}` (braces balanced; `\fbox{...}` too);
(b) else the text after the LAST explicit answer marker -- "final answer:", "answer:", "answer is",
    "####" (case-insensitive) -- up to the end of that line (the next non-empty line when the
    marker ends its line), cleaned of `$`, `\(`, `\)`, `**`, `\text{}`, redundant outer braces and
    trailing punctuation. If that text is a number, or LaTeX (contains a backslash), it is the
    answer; else if it holds numbers, the answer is the FIRST of them that is not an operand
    (below); else the text itself (a word answer);
(c) else, when the whole completion is one LaTeX number (`\frac{14}{2}`), that number;
(d) else the LAST number in the completion that is not an operand (nor a list item's number: "1. ...").

An operand is a number joined to another number by an arithmetic operator (`+ - * / x × ÷ ^`) on
either side: in "64 + 57" both 64 and 57 are operands, in "64 + 57 = 121" only 121 is not (`=` is
not an operator). So a restated question ("What is 64 + 57?") yields no answer at all.

Numbers: optional sign (a `-` right before the digits and not after a digit or `)`, where it is
subtraction), digits with optional thousands commas ("1,234") and decimals ("121.0"), or a fraction
written without spaces ("1/2", "-3/4": one number; "64 / 8" with spaces is an expression).

Comparison (`answers_match`): when the gold parses as a number, the prediction must parse as a
number (int, decimal, "a/b", `\frac{a}{b}`, thousands commas removed) equal to it exactly or within
1e-9 relative; a prediction that is LaTeX but no plain number (e.g. `\sqrt{4}`) is handed to
math_verify -- the extracted answer string only, never the completion -- imported lazily. A gold
that is not a number is compared as a stripped, case-insensitive string.

Invariant: pure and deterministic; no import outside the standard library at module load.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction

_MARKER = re.compile(r"final\s+answer\s*:|answer\s*:|answer\s+is\b\s*:?|####", re.IGNORECASE)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number token: digits with optional thousands groups and decimals, or a spaceless fraction.
_NUM = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?(?![\w]|,\d{3})")
_OPS = "+-*/x×÷^"
_AFTER_OP = re.compile(rf"\s*[{re.escape(_OPS)}]\s*[-(]?\s*\d")
_BEFORE_OP = re.compile(rf"\d\s*\)?\s*[{re.escape(_OPS)}]\s*\(?\s*$")
_PLAIN = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?$|^[+-]?\.\d+$")
_FRAC = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*/\s*([+-]?\d+(?:\.\d+)?)$")
_TEX_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}$")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\s*\{([^{}]*)\}")
_MATH_TIMEOUT_S = 5


def _last_boxed(text: str) -> str | None:
    found = None
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end(): i - 1]
    return found


def _clean(s: str) -> str:
    s = s.strip()
    for a, b in (("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("$", ""), ("**", ""), ("`", "")):
        s = s.replace(a, b)
    s = _TEXT.sub(r"\1", s).strip()
    while len(s) > 1 and s[0] == "{" and s[-1] == "}" and _last_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1].strip()  # redundant outer braces: "{121}" is 121
    while s and s[-1] in ".,;:!?" and not s.endswith("..."):
        s = s[:-1].rstrip()
    if s.endswith("..."):
        s = s[:-3].rstrip()
    return s


def _numbers(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, is_operand) of every number token, the sign included in the span."""
    out = []
    for m in _NUM.finditer(text):
        start = m.start()
        if start > 0 and text[start - 1] == "-":
            before = text[: start - 1].rstrip()
            if not before or not (before[-1].isdigit() or before[-1] == ")"):
                start -= 1  # a sign, not subtraction
        operand = bool(_AFTER_OP.match(text, m.end())) or bool(_BEFORE_OP.search(text[:start]))
        out.append((start, m.end(), operand))
    return out


_LIST_ITEM = re.compile(r"[.)]\s")


def _answer_numbers(text: str) -> list[str]:
    """Numbers that may be an answer: not an operand, and not a list item's number ("1. First ...":
    at the start of a line, followed by '.' or ')' and a space)."""
    out = []
    for s, e, operand in _numbers(text):
        line_start = text.rfind("\n", 0, s) + 1
        if operand or (not text[line_start:s].strip() and _LIST_ITEM.match(text, e)):
            continue
        out.append(text[s:e])
    return out


def _marker_tail(text: str) -> str | None:
    matches = list(_MARKER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    rest = text[last.end():]
    for line in rest.split("\n"):
        if line.strip():
            return line
    return ""


def extract_answer_rule(text: str) -> tuple[str | None, str | None]:
    """(answer, rule) where rule is "boxed", "marker", "whole" or "number": which of (a)-(d) gave it."""
    if not isinstance(text, str):
        return None, None
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed), "boxed"
    tail = _marker_tail(text)
    if tail is not None:
        tail = _clean(tail)
        if tail:
            if parse_number(tail) is not None or "\\" in tail:
                return tail, "marker"
            nums = _answer_numbers(tail)
            if nums:
                return nums[0], "marker"
            if not _numbers(tail):
                return tail, "marker"
    whole = _clean(text)
    if whole.startswith("\\") and parse_number(whole) is not None:  # the completion is one LaTeX number
        return whole, "whole"
    nums = _answer_numbers(text)
    return (nums[-1], "number") if nums else (None, None)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion by the module's rule, or None when it gives none."""
    return extract_answer_rule(text)[0]


def numbers_in(text: str) -> list[str]:
    """Every number token of `text` (operands included), as written."""
    return [text[s:e] for s, e, _ in _numbers(text)]


def parse_number(s: str) -> Fraction | float | None:
    """An exact Fraction (or a float for inf-free scientific forms) for a plain numeric string, else None."""
    s = _clean(str(s))
    if not s:
        return None
    m = _TEX_FRAC.match(s)
    if m:
        sign, num, den = m.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign == "-" else 1)
    m = _FRAC.match(s)
    if m:
        num, den = Fraction(m.group(1)), Fraction(m.group(2))
        return None if den == 0 else num / den
    if _PLAIN.match(s):
        return Fraction(s.replace(",", ""))
    return None


def _close(a: Fraction | float, b: Fraction | float) -> bool:
    return a == b or math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    timeout = _MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    g = parse(f"${gold}$", parsing_timeout=timeout)
    p = parse(f"${pred}$", parsing_timeout=timeout)
    return bool(g and p and verify(g, p, timeout_seconds=timeout))


def answers_match(pred: str | None, gold: object) -> bool:
    """True when the extracted answer `pred` equals the gold answer (module docstring's rule)."""
    if pred is None:
        return False
    gold_s = str(gold)
    g = gold if isinstance(gold, int | float) and not isinstance(gold, bool) else parse_number(gold_s)
    if g is not None:
        if isinstance(g, float) and not math.isfinite(g):
            return False
        p = parse_number(pred)
        if p is not None:
            return _close(p, Fraction(g) if isinstance(g, int) else g)
        if "\\" in pred:
            return _math_verify_equal(pred, gold_s)
        return False
    return _clean(pred).casefold() == _clean(gold_s).casefold()


def math_reward(completion: str, row: dict) -> float:
    """1.0 when the completion's extracted final answer matches `row["answer"]`, else 0.0.

    A non-numeric gold may also match the completion's last non-empty line (word answers with no
    marker, e.g. "Paris").
    """
    gold = row["answer"]
    if not str(gold).strip():
        raise ValueError("cannot parse the gold answer: it is empty")
    if answers_match(extract_answer(completion), gold):
        return 1.0
    if parse_number(str(gold)) is None and isinstance(completion, str):
        lines = [ln for ln in completion.strip().split("\n") if ln.strip()]
        if lines and answers_match(lines[-1], gold):
            return 1.0
    return 0.0
