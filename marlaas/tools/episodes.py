"""Multi-turn tool episodes, the pure part: parse a tool call, extend an episode, its loss mask.

An episode is one completion of a group that may alternate model turns and tool results:

    prompt  "calc:47*38="
    turn 1  "[47*38]"        (model; generation stops at the call's closing "]", a stop token)
    tool    "=1786;"         (the tool's result segment, appended on the verify side)
    turn 2  "1786" + EOS     (model; final answer)

Grammar: a tool call is `CALL_OPEN expr CALL_CLOSE` at the END of a model turn; its result
segment is `RESULT_OPEN value RESULT_CLOSE` ("=" value ";"); an unreachable tool or a bad
expression gives the value `ERROR_VALUE` and the episode goes on. At most `MAX_TURNS` model turns:
a call at the last turn gets no result (the episode ends with it, its final answer is empty).

The episode is stored as one completion dict, a superset of a single-turn completion:

    ids, logprobs, text   the whole completion after the prompt: every model AND tool token (text
                          excludes EOS); tool tokens get a placeholder log-prob 0.0
    mask                  1 per model token (an action: trained on), 0 per tool token (context)
    turns                 model turns so far;  done: the episode is final (EOS, no call, length cap,
                          or the turn limit);  calls / tool_errors: tool calls made / failed
    pending               a tool result segment (text) not yet appended: the verify side sets it,
                          the generate side tokenizes and appends it before the next model turn

Invariants: len(ids) == len(logprobs) == len(mask); the mask is 0 exactly on tool-result tokens;
the reward reads only `final_answer(text)`, the text after the last tool exchange. Every model
token of an episode is sampled with one adapter version (the group's), so its behaviour
log-prob is from one policy. With a character tokenizer, prompt + text re-tokenizes to exactly
the stored ids; with subword tokenizers a continuation's context is re-tokenized from text (the
usual multi-turn approximation).
"""

from __future__ import annotations

import re

CALL_OPEN, CALL_CLOSE = "[", "]"
RESULT_OPEN, RESULT_CLOSE = "=", ";"
ERROR_VALUE = "err"
MAX_TURNS = 3
STOP = (CALL_CLOSE,)  # the stop strings a model turn of a tool episode is generated with

_CALL_AT_END = re.compile(r"\[([^\[\]]*)\]$")
_EXCHANGE = re.compile(r"\[[^\[\]]*\](?:=[^;\[\]]*;)?")


def parse_call(turn_text: str) -> str | None:
    """The expression of a tool call ending this model turn, or None (no call)."""
    m = _CALL_AT_END.search(turn_text)
    return m.group(1) if m else None


def result_segment(value: str | None) -> str:
    """The tool-result text appended after a call: "=" value ";" (None: the error value)."""
    v = ERROR_VALUE if value is None else str(value)
    if any(c in v for c in "[];"):
        raise ValueError(f"a tool value must not contain '[', ']' or ';': {v!r}")
    return f"{RESULT_OPEN}{v}{RESULT_CLOSE}"


def final_answer(text: str) -> str:
    """The answer an episode gives: the text after its last tool exchange (call + result).

    "[47*38]=1786;1786" -> "1786";  "1786" -> "1786";  "[47*38]" (unanswered call) -> "".
    """
    ends = [m.end() for m in _EXCHANGE.finditer(text)]
    return text[ends[-1]:] if ends else text


def action_mask(text: str) -> list[int]:
    """Per character of an episode's text: 0 inside tool-result segments, else 1 (pretraining's
    label mask; with a character tokenizer one character is one token).

    "[4*5]=20;20" -> [1,1,1,1,1, 0,0,0,0, 1,1]
    """
    mask = [1] * len(text)
    for m in _EXCHANGE.finditer(text):
        close = text.index(CALL_CLOSE, m.start())
        for i in range(close + 1, m.end()):
            mask[i] = 0
    return mask


def start(comp: dict, finished: bool, max_turns: int = MAX_TURNS) -> dict:
    """An episode from a first model turn {"ids", "logprobs", "text"} (finished: it ended in EOS)."""
    ep = {"ids": list(comp["ids"]), "logprobs": list(comp["logprobs"]), "text": comp["text"],
          "mask": [1] * len(comp["ids"]), "turns": 1, "calls": 0, "tool_errors": 0}
    ep["done"] = _is_done(comp["text"], finished, 1, max_turns)
    return ep


def _is_done(turn_text: str, finished: bool, turns: int, max_turns: int) -> bool:
    return finished or parse_call(turn_text) is None or turns >= max_turns


def pending_call(ep: dict) -> str | None:
    """The expression the tool must evaluate next, or None (final, or its result is pending)."""
    if ep.get("done", True) or ep.get("pending") is not None:
        return None
    return parse_call(ep["text"])


def with_tool_result(ep: dict, value: str | None) -> dict:
    """The episode with a tool result pending (value None = the tool failed: counted, goes on)."""
    out = dict(ep)
    out["pending"] = result_segment(value)
    out["calls"] = ep.get("calls", 0) + 1
    out["tool_errors"] = ep.get("tool_errors", 0) + (value is None)
    return out


def append_pending(ep: dict, tool_ids: list[int]) -> dict:
    """Move the pending tool result into the sequence: its tokens are context (mask 0, logprob 0)."""
    seg = ep["pending"]
    out = {k: v for k, v in ep.items() if k != "pending"}
    out["ids"] = ep["ids"] + list(tool_ids)
    out["logprobs"] = ep["logprobs"] + [0.0] * len(tool_ids)
    out["mask"] = ep["mask"] + [0] * len(tool_ids)
    out["text"] = ep["text"] + seg
    return out


def context(prompt: str, ep: dict) -> str:
    """The prompt of the next model turn: the row's prompt followed by the episode so far."""
    if ep.get("pending") is not None:
        raise ValueError("append the pending tool result before continuing the episode")
    return prompt + ep["text"]


def add_turn(ep: dict, ids: list[int], logprobs: list[float], text: str, finished: bool,
             max_turns: int = MAX_TURNS) -> dict:
    """The episode after one more model turn (its tokens are actions: mask 1)."""
    if len(ids) != len(logprobs):
        raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
    out = dict(ep)
    out["ids"] = ep["ids"] + list(ids)
    out["logprobs"] = ep["logprobs"] + list(logprobs)
    out["mask"] = ep["mask"] + [1] * len(ids)
    out["text"] = ep["text"] + text
    out["turns"] = ep["turns"] + 1
    out["done"] = _is_done(text, finished, out["turns"], max_turns)
    return out


def loss_mask(comp: dict) -> list[int]:
    """1 per token the policy is trained on; a single-turn completion is all ones."""
    mask = comp.get("mask")
    return list(mask) if mask is not None else [1] * len(comp["ids"])


def all_done(completions: list[dict]) -> bool:
    return all(c.get("done", True) for c in completions)


__all__ = [
    "MAX_TURNS", "STOP", "action_mask", "add_turn", "all_done", "append_pending", "context", "final_answer",
    "loss_mask", "parse_call", "pending_call", "result_segment", "start", "with_tool_result",
]
