"""The generate station: sample a mixed-tenant batch in one engine call, store rollouts, say what to verify.

Idempotent and Celery-free (tasks/generate.py wraps it): a duplicate generate overwrites a group with a
fresh attempt (rewards of the old attempt are then refused). One job's failure never stops the
others in its batch: `run_generate_isolated` retries job by job and charges only the failing job.

Tinker sample requests and serving requests taken by the same task (`marlaas.generate.tinker_sample.SampleBatch`)
ride in the jobs' engine call: one `engine.generate` over theirs FIRST, then the jobs' requests. They are
the latency class: while training work is waiting they take at most `serve_share` of the call's rows
(MARLAAS_SERVE_SHARE, passed by the edge; the rest wait at the front of the queue for the next call).

Work in, work out, in the one vocabulary of marlaas.types: GEN, CONT and EVAL items come in; VER and
EVALVER items (the same kinds the leases name) come out, and `verify_messages` turns them into the
verify station's messages. Settings come in as arguments (`tool_url`), read by the process edge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from marlaas import families
from marlaas.generate.tinker_sample import SampleBatch, serving_rows
from marlaas.store import Store
from marlaas.tools import agentic, episodes
from marlaas.types import (
    ACTIVE_STATUSES,
    GenRequest,
    GenResult,
    ItemKind,
    WorkItem,
    adapter_for,
    eval_request_key,
    is_eval_request,
    parse_eval_request,
)

log = logging.getLogger("marlaas.generate")


def eval_seed(seed: int, version: int, row: int) -> int:
    """Sampling seed of the pass@k completions of held-out row `row` at version `version`: fixed per
    (job seed, version, row), so a re-generated evaluation draws the same samples."""
    return (seed * 1_000_003 + 2**30 + version * 100_003 + row) % 2**31


def train_row_index(g: int, n_rows: int) -> int:
    """Rows are shuffled once at submit (by the job's seed); group g uses row g mod n."""
    return g % n_rows


@dataclass
class _Batch:
    """The requests of one engine call and what each one's result is stored as."""

    requests: list[GenRequest] = field(default_factory=list)
    groups: dict[str, tuple[WorkItem, int, int, dict]] = field(default_factory=dict)  # key -> item, version, row
    tool_groups: set[str] = field(default_factory=set)  # first turns of tool episodes
    eval_rows: dict[str, dict] = field(default_factory=dict)  # eval request key -> its held-out row
    conts: list[agentic.Continuation] = field(default_factory=list)  # tool episodes' next turns


def _group_requests(store: Store, batch: _Batch, item: WorkItem, spec, t: int, stop: tuple[str, ...]) -> None:
    """One group of a job's training step: `group_size` completions of its row at version t."""
    if item.idx < t * spec.prompts_per_step:
        store.drop_lease(item.name)
        return  # already trained on: a late duplicate
    ri = train_row_index(item.idx, store.n_rows(item.job, "train"))
    row = store.row(item.job, "train", ri)
    batch.requests.append(GenRequest(key=item.name, prompt=row["prompt"], adapter=adapter_for(item.job, t),
                                     n=spec.group_size, temperature=spec.temperature,
                                     max_new_tokens=spec.max_new_tokens, stop=stop,
                                     seed=(spec.seed * 1_000_003 + item.idx) % 2**31))
    batch.groups[item.name] = (item, t, ri, row)
    if stop:
        batch.tool_groups.add(item.name)


def _eval_requests(store: Store, batch: _Batch, item: WorkItem, spec, stop: tuple[str, ...]) -> None:
    """The evaluation of version item.idx: per held-out row one greedy completion and, with eval_k,
    eval_k sampled ones (seeded per row: a re-generated evaluation draws the same samples)."""
    jid, v = item.job, item.idx
    temp = spec.eval_temperature or spec.temperature
    for ri, row in enumerate(store.rows(jid, "eval")):
        key = eval_request_key(jid, v, ri, sampled=False)
        batch.requests.append(GenRequest(key=key, prompt=row["prompt"], adapter=adapter_for(jid, v), n=1,
                                         max_new_tokens=spec.max_new_tokens, greedy=True, stop=stop))
        batch.eval_rows[key] = row
        if spec.eval_k > 0:
            key = eval_request_key(jid, v, ri, sampled=True)
            batch.requests.append(GenRequest(key=key, prompt=row["prompt"], adapter=adapter_for(jid, v),
                                             n=spec.eval_k, temperature=temp, max_new_tokens=spec.max_new_tokens,
                                             seed=eval_seed(spec.seed, v, ri), stop=stop))
            batch.eval_rows[key] = row


def _continuation_requests(store: Store, engine, batch: _Batch, item: WorkItem, spec, t: int) -> None:
    """A tool episode's next model turn (marlaas.tools.agentic)."""
    cont = agentic.continuation(store, engine.tokenizer, item.job, item.idx, spec, t)
    if cont is not None:
        batch.conts.append(cont)
        batch.requests += cont.requests


def _requests(store: Store, engine, items: list[WorkItem]) -> _Batch:
    """The batch's requests, item by item; a job no longer active has its work dropped."""
    batch = _Batch()
    for item in items:
        status, version = store.job_fields(item.job, "status", "version")
        if status not in ACTIVE_STATUSES:
            continue  # cancelled, failed or gone: drop the work
        spec = store.spec(item.job)
        t = int(version)
        stop = episodes.STOP if families.tool_of(spec) else ()  # a model turn ends at a tool call
        if item.kind == ItemKind.CONT:
            _continuation_requests(store, engine, batch, item, spec, t)
        elif item.kind == ItemKind.GEN:
            _group_requests(store, batch, item, spec, t, stop)
        elif item.kind == ItemKind.EVAL:
            _eval_requests(store, batch, item, spec, stop)
        else:
            log.error("generate got a %s item (%s): not generate work, dropped", item.kind, item.name)
    return batch


def _store_results(store: Store, batch: _Batch, results: list[GenResult]) -> list[WorkItem]:
    """Store continued groups, groups and evaluations; returns the items to verify next."""
    out = [WorkItem(ItemKind.VER, jid, g) for jid, g in agentic.store_continuations(store, batch.conts, results)]
    evals: dict[tuple[str, int], dict[int, dict]] = {}
    for res in results:
        comps = [{"ids": c.token_ids, "logprobs": c.logprobs, "text": c.text} for c in res.completions]
        if res.key in batch.groups:
            item, t, ri, row = batch.groups[res.key]
            if res.key in batch.tool_groups:
                comps = agentic.first_turns(res.completions)
            store.put_rollout(item.job, item.idx, t, {"row": row, "row_idx": ri, "completions": comps})
            out.append(WorkItem(ItemKind.VER, item.job, item.idx))
        elif is_eval_request(res.key):
            jid, v, ri, sampled = parse_eval_request(res.key)
            rec = evals.setdefault((jid, v), {}).setdefault(ri, {"row": batch.eval_rows[res.key]})
            if sampled:
                rec["samples"] = [c["text"] for c in comps]
            else:
                rec["text"] = comps[0]["text"]
        # else: a continuation's request, stored above
    for (jid, v), by_row in evals.items():
        store.put_eval_rollout(jid, v, {"rows": [by_row[ri] for ri in sorted(by_row)]})
        out.append(WorkItem(ItemKind.EVALVER, jid, v))
    return out


def run_generate(store: Store, engine, items: list[WorkItem] | list[list],
                 tool_url: str = agentic.DEFAULT_TOOL_URL, samples: SampleBatch | None = None,
                 serve_share: float = 0.5) -> list[WorkItem]:
    """Sample every item of a mixed-tenant batch in one engine call; store rollouts. Returns the
    VER / EVALVER items to verify next. `items`: WorkItems or their wire form [kind, job, idx];
    `tool_url`: the tool server evaluation episodes call (Settings.tool_url, passed by the edge);
    `samples`: Tinker sample and serving requests that go first in the same engine call (their
    futures are written as soon as the call returns, `SampleBatch.finish`), at most `serve_share`
    of its rows when the batch has training work (Settings.serve_share, passed by the edge)."""
    batch = _requests(store, engine, [WorkItem.of(it) for it in items])
    if samples is not None and not samples.done and batch.requests:
        samples.limit(serving_rows(sum(r.n for r in batch.requests), serve_share))
    extra = samples.requests if samples is not None and not samples.done else []
    if not batch.requests and not extra:
        return []
    results = engine.generate(extra + batch.requests)
    if extra:
        samples.finish(results[:len(extra)])
        results = results[len(extra):]
    if not batch.requests:
        return []
    # Evaluation episodes run their tool calls here (blocking; see marlaas.tools.agentic).
    results = agentic.finish_eval_episodes(engine, batch.requests, results, tool_url)
    served = {r.adapter: engine.serves(r.adapter) for r in batch.requests if r.adapter is not None}
    missing = [ref.name for ref, ok in served.items() if not ok]
    if missing:
        raise RuntimeError(f"engine does not serve adapter versions it just used: {missing}")
    return _store_results(store, batch, results)


def _samples_alone(engine, samples: SampleBatch | None) -> None:
    """Tinker samples of a failed mixed call, in one engine call of their own (each future written once)."""
    if samples is None or samples.done or not samples.requests:
        return
    try:
        samples.finish(engine.generate(samples.requests))
    except Exception as e:
        log.exception("tinker samples failed alone too")
        samples.fail(e)


def run_generate_isolated(store: Store, engine, items: list[WorkItem] | list[list],
                          tool_url: str = agentic.DEFAULT_TOOL_URL,
                          samples: SampleBatch | None = None, serve_share: float = 0.5) -> list[WorkItem]:
    """`run_generate`, with per-job failure isolation: when the mixed batch fails, each job's items are
    retried alone, and only a job whose own items fail is charged (`Store.count_failure`); Tinker
    samples not yet served are retried alone too, and fail their futures if that fails. A batch of one
    job re-raises after charging it (the task then fails visibly)."""
    items = [WorkItem.of(it) for it in items]
    jobs = sorted({it.job for it in items})
    try:
        return run_generate(store, engine, items, tool_url, samples, serve_share)
    except Exception as err:
        _samples_alone(engine, samples)
        if len(jobs) == 1:
            store.count_failure(jobs[0], "generate", err)
            raise
        if not jobs:
            return []
        log.warning("mixed generate batch failed (%s: %s); retrying job by job", type(err).__name__, err)
    out: list[WorkItem] = []
    for jid in jobs:
        try:
            out += run_generate(store, engine, [it for it in items if it.job == jid], tool_url)
        except Exception as e:
            store.count_failure(jid, "generate", e)
    return out


def verify_messages(store: Store, items: list[WorkItem]) -> list[tuple[str, list]]:
    """The verify station's messages for VER / EVALVER items: [job, kind, idxs] per job and kind. A
    tool task's groups of the whole batch go in one `marlaas.verify_many` message (their tool calls
    then overlap); every other job's in its own `marlaas.verify` (the CPU pool's processes share those)."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for kind, jid, idx in items:
        grouped.setdefault((jid, ItemKind(kind).value), []).append(idx)
    messages: list[tuple[str, list]] = []
    tool: list[list] = []
    uses_tool: dict[str, bool] = {}
    for (jid, kind), idxs in grouped.items():
        if kind == ItemKind.VER and jid not in uses_tool:
            uses_tool[jid] = families.tool_of(store.spec(jid)) is not None
        if kind == ItemKind.VER and uses_tool[jid]:
            tool.append([jid, kind, idxs])
        else:
            messages.append(("marlaas.verify", [jid, kind, idxs]))
    return messages + ([("marlaas.verify_many", [tool])] if tool else [])
