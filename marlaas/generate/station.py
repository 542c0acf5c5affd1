"""The generate station's task: sample a mixed-tenant batch in one engine call and store rollouts.

Idempotent and Celery-free (tasks/generate.py wraps it): a duplicate generate overwrites a group with a
fresh attempt (rewards of the old attempt are then refused). One job's failure never stops the
others in its batch: `run_generate_isolated` retries job by job and charges only the failing job.
"""

from __future__ import annotations

import logging

from marlaas import families
from marlaas.settings import get_settings
from marlaas.store import Store
from marlaas.tools import agentic, episodes
from marlaas.types import ACTIVE_STATUSES, GenRequest, ItemKind, adapter_for, item_name

log = logging.getLogger("marlaas.generate")


def eval_seed(seed: int, version: int, row: int) -> int:
    """Sampling seed of the pass@k completions of held-out row `row` at version `version`: fixed per
    (job seed, version, row), so a re-generated evaluation draws the same samples."""
    return (seed * 1_000_003 + 2**30 + version * 100_003 + row) % 2**31


def train_row_index(g: int, n_rows: int) -> int:
    """Rows are shuffled once at submit (by the job's seed); group g uses row g mod n."""
    return g % n_rows


def run_generate(store: Store, engine, items: list[list]) -> dict[tuple[str, str], list[int]]:
    """Sample every item of a mixed-tenant batch in one engine call; store rollouts.

    Returns {(job, 'train'|'eval'): [indices]} to verify next.
    """
    reqs: list[GenRequest] = []
    meta: dict[str, tuple] = {}
    conts: list[agentic.Continuation] = []  # tool episodes' next turns (marlaas.tools.agentic)
    tool_keys: set[str] = set()  # first turns of tool episodes
    for kind, jid, idx in items:
        status, version = store.job_fields(jid, "status", "version")
        if status not in ACTIVE_STATUSES:
            continue  # cancelled, failed or gone: drop the work
        spec = store.spec(jid)
        t = int(version)
        stop = episodes.STOP if families.tool_of(spec) else ()  # a model turn ends at a tool call
        if kind == ItemKind.CONT:
            cont = agentic.continuation(store, engine.tokenizer, jid, idx, spec, t)
            if cont is not None:
                conts.append(cont)
                reqs += cont.requests
        elif kind == ItemKind.GEN:
            if idx < t * spec.prompts_per_step:
                store.drop_lease(item_name(ItemKind.GEN, jid, idx))
                continue  # already trained on: a late duplicate
            n = store.n_rows(jid, "train")
            ri = train_row_index(idx, n)
            row = store.row(jid, "train", ri)
            key = item_name(ItemKind.GEN, jid, idx)
            reqs.append(GenRequest(key=key, prompt=row["prompt"], adapter=adapter_for(jid, t),
                                   n=spec.group_size, temperature=spec.temperature,
                                   max_new_tokens=spec.max_new_tokens, stop=stop,
                                   seed=(spec.seed * 1_000_003 + idx) % 2**31))
            meta[key] = (kind, jid, idx, t, ri, row)
            if stop:
                tool_keys.add(key)
        else:  # eval of version idx: per held-out row one greedy completion + eval_k sampled ones
            rows = store.rows(jid, "eval")
            temp = spec.eval_temperature or spec.temperature
            for ri, row in enumerate(rows):
                key = f"eval|{jid}|{idx}|{ri}"
                reqs.append(GenRequest(key=key, prompt=row["prompt"], adapter=adapter_for(jid, idx), n=1,
                                       max_new_tokens=spec.max_new_tokens, greedy=True, stop=stop))
                meta[key] = (kind, jid, idx, idx, ri, row)
                if spec.eval_k > 0:
                    key = f"evalk|{jid}|{idx}|{ri}"
                    reqs.append(GenRequest(key=key, prompt=row["prompt"], adapter=adapter_for(jid, idx),
                                           n=spec.eval_k, temperature=temp, max_new_tokens=spec.max_new_tokens,
                                           seed=eval_seed(spec.seed, idx, ri), stop=stop))
                    meta[key] = ("evalk", jid, idx, idx, ri, row)
    if not reqs:
        return {}
    results = engine.generate(reqs)
    # Evaluation episodes run their tool calls here (blocking; see marlaas.tools.agentic).
    results = agentic.finish_eval_episodes(engine, reqs, results, get_settings().tool_url)
    served = {r.adapter: engine.serves(r.adapter) for r in reqs if r.adapter is not None}
    missing = [ref.name for ref, ok in served.items() if not ok]
    if missing:
        raise RuntimeError(f"engine does not serve adapter versions it just used: {missing}")
    to_verify: dict[tuple[str, str], list[int]] = {}
    evals: dict[tuple[str, int], dict[int, dict]] = {}
    for jid, g in agentic.store_continuations(store, conts, results):
        to_verify.setdefault((jid, "train"), []).append(g)
    for res in results:
        if res.key not in meta:
            continue  # a continuation, stored above
        kind, jid, idx, v, ri, row = meta[res.key]
        comps = [{"ids": c.token_ids, "logprobs": c.logprobs, "text": c.text} for c in res.completions]
        if kind == ItemKind.GEN and res.key in tool_keys:
            comps = agentic.first_turns(res.completions)
        if kind == ItemKind.GEN:
            store.put_rollout(jid, idx, v, {"row": row, "row_idx": ri, "completions": comps})
            to_verify.setdefault((jid, "train"), []).append(idx)
        else:
            rec = evals.setdefault((jid, idx), {}).setdefault(ri, {"row": row})
            if kind == "evalk":
                rec["samples"] = [c["text"] for c in comps]
            else:
                rec["text"] = comps[0]["text"]
    for (jid, v), by_row in evals.items():
        store.put_eval_rollout(jid, v, {"rows": [by_row[ri] for ri in sorted(by_row)]})
        to_verify.setdefault((jid, "eval"), []).append(v)
    return to_verify


def run_generate_isolated(store: Store, engine, items: list[list]) -> dict[tuple[str, str], list[int]]:
    """`run_generate`, with per-job failure isolation: when the mixed batch fails, each job's items are
    retried alone, and only a job whose own items fail is charged (`Store.count_failure`). A batch of
    one job re-raises after charging it (the task then fails visibly)."""
    jobs = sorted({it[1] for it in items})
    try:
        return run_generate(store, engine, items)
    except Exception as err:
        if len(jobs) == 1:
            store.count_failure(jobs[0], "generate", err)
            raise
        log.warning("mixed generate batch failed (%s: %s); retrying job by job", type(err).__name__, err)
    to_verify: dict[tuple[str, str], list[int]] = {}
    for jid in jobs:
        try:
            to_verify.update(run_generate(store, engine, [it for it in items if it[1] == jid]))
        except Exception as e:
            store.count_failure(jid, "generate", e)
    return to_verify
