"""Tool episodes across the stations: the impure half of `marlaas.tools.episodes` (store, engine, tool).

A group of a tool task (`families.tool_of(spec)`) goes around the stations until every episode is
final; the generate station never waits on the tool:

    generate  turn 1 of every completion, stopping at a tool call      put_rollout   (lease gen -> ver)
    verify    calls the tool for every pending call (concurrently), sets the results pending,
              hands the group back                                     request_continuation (ver -> cont, due now)
    scheduler dispatches the due ("cont", job, g) item to generate with the other generation work
    generate  appends each result's tokens (mask 0) and samples the next turn of the unfinished
              completions only, with the group's OWN adapter version   put_continuation (cont -> ver)
    ...       until every episode is final; then verify scores the group as usual.

Every write is a compare-and-set on the attempt the writer read, so a redelivered, duplicated or
stale continuation (or verify) writes nothing; a continuation that finds the group no longer
awaiting one drops its lease atomically (`Store.drop_cont_lease`). A group whose version fell out
of the job's staleness bound (or whose adapter is gone) before its next turn is regenerated and
counted (`invalidate_group`), never continued with another policy version: every model token of
an episode has its behaviour log-prob from one version, and staleness counts from it.

Evaluation episodes (greedy held-out rows, and sampled pass@k rows) run their tool calls inside
the generate station instead (`finish_eval_episodes`, blocking on the tool): evaluations are rare
and small, and routing them through verify would need a second round trip per turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from marlaas.control import scheduler
from marlaas.settings import Settings
from marlaas.tools import calculator, episodes
from marlaas.types import (
    AdapterRef,
    Completion,
    GenRequest,
    GenResult,
    ItemKind,
    adapter_for,
    is_eval_request,
    item_name,
)

log = logging.getLogger("marlaas.tools.agentic")
DEFAULT_TOOL_URL: str = Settings.model_fields["tool_url"].default
"""The stations' default tool server (Settings' default); the process edges pass the configured one."""


def first_turns(completions: list[Completion]) -> list[dict]:
    """The group's episodes after their first model turn (generate station, gen items)."""
    return [episodes.start({"ids": c.token_ids, "logprobs": c.logprobs, "text": c.text}, c.finished)
            for c in completions]


def _tool_ids(tokenizer, segment: str) -> list[int]:
    return tokenizer(segment, add_special_tokens=False)["input_ids"]


@dataclass
class Continuation:
    """One group's next model turn, between building its requests and storing its results."""

    jid: str
    g: int
    attempt: str
    data: dict
    keys: dict[str, int] = field(default_factory=dict)  # request key -> completion index
    requests: list[GenRequest] = field(default_factory=list)


def continuation(store, tokenizer, jid: str, g: int, spec, t: int) -> Continuation | None:
    """Requests for the next turn of group g's unfinished episodes (generate station, cont items);
    None when there is nothing to continue (late duplicate, regenerated or too stale group)."""

    roll = store.rollout(jid, g)
    if roll is None or not roll.get("awaiting_cont"):
        store.drop_cont_lease(jid, g)
        return None
    v = roll["version"]
    if not scheduler.within_staleness(t, v, spec.max_staleness) or not store.has_adapter(AdapterRef(jid, v)):
        log.info("job %s group %s: version %d is out of reach at %d: regenerating", jid, g, v, t)
        store.invalidate_group(jid, g)
        return None
    data = {k: val for k, val in roll.items() if k not in ("attempt", "version", "awaiting_cont", "rewards")}
    comps = [episodes.append_pending(c, _tool_ids(tokenizer, c["pending"])) if c.get("pending") is not None else c
             for c in data["completions"]]
    data["completions"] = comps
    cont = Continuation(jid, g, roll["attempt"], data)
    prompt = data["row"]["prompt"]
    for i, c in enumerate(comps):
        if c.get("done", True):
            continue
        key = f"{item_name(ItemKind.CONT, jid, g)}|{i}"  # one request per unfinished episode
        cont.keys[key] = i
        cont.requests.append(GenRequest(
            key=key, prompt=episodes.context(prompt, c), adapter=adapter_for(jid, v), n=1,
            temperature=spec.temperature, max_new_tokens=spec.max_new_tokens, stop=episodes.STOP,
            seed=(spec.seed * 1_000_003 + g * 1009 + c["turns"] * 101 + i) % 2**31))
    return cont


def store_continuations(store, conts: list[Continuation], results: list[GenResult]) -> list[tuple[str, int]]:
    """Append each sampled turn to its episode and store the groups; returns the (job, group)s
    stored (to verify next). A group whose attempt moved meanwhile is not written."""
    by_key = {r.key: r for r in results}
    stored = []
    for cont in conts:
        comps = list(cont.data["completions"])
        for key, i in cont.keys.items():
            c = by_key[key].completions[0]
            comps[i] = episodes.add_turn(comps[i], c.token_ids, c.logprobs, c.text, c.finished)
        data = dict(cont.data, completions=comps)
        if store.put_continuation(cont.jid, cont.g, cont.attempt, data):
            stored.append((cont.jid, cont.g))
        else:
            log.info("job %s group %s: continuation of a stale attempt dropped", cont.jid, cont.g)
    return stored


def advance_groups(store, jid: str, rolls: list[tuple[int, dict]], tool_url: str) -> list[tuple[int, dict]]:
    """Verify side: call the tool for every pending call of these groups (one concurrent batch),
    hand the groups with calls back to generate, and return the groups whose episodes are all
    final (to score). Groups awaiting a continuation are skipped (a redelivered verify)."""
    return advance_many(store, [(jid, rolls)], tool_url)[jid]


def advance_many(store, jobs: list[tuple[str, list[tuple[int, dict]]]], tool_url: str) -> dict[str, list]:
    """`advance_groups` for several jobs' groups at once: every pending call of all of them goes out
    in ONE concurrent batch, so a verify task waits one tool latency however many jobs it serves.
    Returns each job's groups whose episodes are all final."""
    final: dict[str, list] = {jid: [] for jid, _ in jobs}
    calls = []
    for jid, rolls in jobs:
        for g, roll in rolls:
            if roll.get("awaiting_cont"):
                continue
            pend = [(i, e) for i, c in enumerate(roll["completions"]) if (e := episodes.pending_call(c)) is not None]
            if pend:
                calls.append((jid, g, roll, pend))
            else:
                final[jid].append((g, roll))
    exprs = [e for *_, pend in calls for _, e in pend]
    values = iter(calculator.call_many(tool_url, exprs))
    n_calls: dict[str, int] = {}
    n_err: dict[str, int] = {}
    for jid, g, roll, pend in calls:
        comps = list(roll["completions"])
        for i, _ in pend:
            val = next(values)
            n_calls[jid] = n_calls.get(jid, 0) + 1
            n_err[jid] = n_err.get(jid, 0) + (val is None)
            comps[i] = episodes.with_tool_result(comps[i], val)
        data = {k: v for k, v in roll.items() if k not in ("attempt", "version", "awaiting_cont", "rewards")}
        data["completions"] = comps
        if not store.request_continuation(jid, g, roll["attempt"], data):
            log.info("job %s group %s: verify of a stale attempt: nothing handed back", jid, g)
    for jid, n in n_calls.items():
        store.incr_field(jid, "tool_calls", n)
        if n_err[jid]:
            store.incr_field(jid, "tool_errors", n_err[jid])
            log.warning("job %s: %d of %d tool calls failed (episodes go on with an error result)", jid, n_err[jid], n)
    return final


def finish_eval_episodes(engine, requests: list[GenRequest], results: list[GenResult], tool_url: str,
                         max_turns: int = episodes.MAX_TURNS) -> list[GenResult]:
    """Run the tool loop of evaluation requests (key "eval..." with stop strings) to the end, in
    the generate station; their completions become whole episodes. Other results pass through."""
    reqs = {r.key: r for r in requests}
    eps: dict[tuple[int, int], dict] = {}
    for ri, res in enumerate(results):
        req = reqs[res.key]
        if req.stop and is_eval_request(req.key):
            for ci, ep in enumerate(first_turns(res.completions)):
                eps[(ri, ci)] = ep
    for _turn in range(max_turns - 1):
        pend = [(k, e) for k, ep in eps.items() if (e := episodes.pending_call(ep)) is not None]
        if not pend:
            break
        values = calculator.call_many(tool_url, [e for _, e in pend])
        nxt = []
        for (k, _), val in zip(pend, values):
            ep = episodes.with_tool_result(eps[k], val)
            ep = episodes.append_pending(ep, _tool_ids(engine.tokenizer, ep["pending"]))
            eps[k] = ep
            req = reqs[results[k[0]].key]
            nxt.append(GenRequest(key=f"{req.key}#{k[1]}", prompt=episodes.context(req.prompt, ep),
                                  adapter=req.adapter, n=1, temperature=req.temperature, greedy=req.greedy,
                                  max_new_tokens=req.max_new_tokens, stop=req.stop,
                                  seed=None if req.seed is None else (req.seed + 7919 * (k[1] + 1)) % 2**31))
        for (k, _), out in zip(pend, engine.generate(nxt)):
            c = out.completions[0]
            eps[k] = episodes.add_turn(eps[k], c.token_ids, c.logprobs, c.text, c.finished, max_turns)
    for (ri, ci), ep in eps.items():
        results[ri].completions[ci] = Completion(token_ids=ep["ids"], logprobs=ep["logprobs"], text=ep["text"],
                                                 finished=ep["done"])
    return results


__all__ = ["Continuation", "advance_groups", "continuation", "finish_eval_episodes", "first_turns",
           "store_continuations"]
