"""What each station does with one task: generate, verify, train. Idempotent; no Celery here.

The Celery tasks in `tasks/` are thin wrappers that call these with the worker's engine and store,
then kick the scheduler. Every function tolerates redelivery: a duplicate generate overwrites a
group with a fresh attempt (rewards of the old attempt are then refused), a duplicate verify
rewrites the same rewards, and a duplicate train is a no-op because publishing is a
compare-and-set on the version.
"""

from __future__ import annotations

import logging
import time

from marlaas import agentic, episodes, evaluation, scheduler
from marlaas.engines.types import AdapterRef, GenRequest
from marlaas.settings import get_settings
from marlaas.store import Store

log = logging.getLogger("marlaas.stations")


MAX_FAILURES = 3


def count_failure(store: Store, jid: str, station: str, err: BaseException) -> None:
    """Count a station error for one job; after MAX_FAILURES the job (only that job) fails."""
    n = store.incr_field(jid, f"{station}_errors")
    log.error("job %s: %s error %d/%d: %s", jid, station, n, MAX_FAILURES, err)
    if n >= MAX_FAILURES:
        store.set_status(jid, "failed", f"{station} failed {n} times: {type(err).__name__}: {err}")


def adapter_for(jid: str, version: int) -> AdapterRef | None:
    """Version 0 is the base itself (a fresh LoRA has B = 0): served with no adapter."""
    return AdapterRef(jid, version) if version > 0 else None


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
    conts: list[agentic.Continuation] = []  # tool episodes' next turns (marlaas.agentic)
    tool_keys: set[str] = set()  # first turns of tool episodes
    for kind, jid, idx in items:
        status, version = store.job_fields(jid, "status", "version")
        if status not in ("running", "evaluating"):
            continue  # cancelled, failed or gone: drop the work
        spec = store.spec(jid)
        t = int(version)
        stop = episodes.STOP if episodes.tool_of(spec) else ()  # a model turn ends at a tool call
        if kind == "cont":
            cont = agentic.continuation(store, engine.tokenizer, jid, idx, spec, t)
            if cont is not None:
                conts.append(cont)
                reqs += cont.requests
        elif kind == "gen":
            if idx < t * spec.prompts_per_step:
                store.drop_lease(f"gen|{jid}|{idx}")
                continue  # already trained on: a late duplicate
            n = store.n_rows(jid, "train")
            ri = train_row_index(idx, n)
            row = store.row(jid, "train", ri)
            key = f"gen|{jid}|{idx}"
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
    # Evaluation episodes run their tool calls here (blocking; see marlaas.agentic).
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
        if kind == "gen" and res.key in tool_keys:
            comps = agentic.first_turns(res.completions)
        if kind == "gen":
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


def run_verify_many(store: Store, items: list[tuple[str, str, list[int]]]) -> int:
    """Several jobs' (job, kind, idxs) in one task: the tool calls of all the tool jobs' groups go
    out in one concurrent round (agentic.advance_many), then each item is scored as run_verify does.
    A verify task then waits one tool latency for a whole generate batch, not one per job."""
    tool_jobs = []
    for jid, kind, idxs in items:
        if kind == "train" and store.job_fields(jid, "status")[0] in ("running", "evaluating") \
                and episodes.tool_of(store.spec(jid)):
            tool_jobs.append((jid, [(g, r) for g in idxs if (r := store.rollout(jid, g)) is not None]))
    advanced = agentic.advance_many(store, tool_jobs, get_settings().tool_url) if tool_jobs else {}
    return sum(run_verify(store, jid, kind, idxs, advanced=advanced.get(jid) if kind == "train" else None)
               for jid, kind, idxs in items)


def run_verify(store: Store, jid: str, kind: str, idxs: list[int], advanced: list | None = None) -> int:
    """Score groups (kind 'train') or a held-out evaluation (kind 'eval'); returns items accepted.
    `advanced`: a tool job's groups already through their tool calls (run_verify_many)."""
    from marlaas.rewards import score_groups

    status = store.job_fields(jid, "status")[0]
    if status not in ("running", "evaluating"):
        return 0
    spec = store.spec(jid)
    verifier = spec.verifier_name()
    accepted = 0
    if kind == "train":
        if advanced is not None:
            rolls = advanced
        else:
            rolls = [(g, r) for g in idxs if (r := store.rollout(jid, g)) is not None]
            if episodes.tool_of(spec):  # groups with pending tool calls go back to generate (agentic)
                rolls = agentic.advance_groups(store, jid, rolls, get_settings().tool_url)
        scores = score_groups(verifier, [(r["row"], [c["text"] for c in r["completions"]]) for _, r in rolls])
        for (g, roll), res in zip(rolls, scores):
            if res.errors:
                store.incr_field(jid, "verify_errors", res.errors)
                log.warning("job %s group %s: %d verifier errors: %s", jid, g, res.errors, res.error)
            accepted += store.accept_rewards(jid, g, roll["attempt"], {"rewards": res.rewards, "errors": res.errors})
        return accepted
    for v in idxs:
        ev = store.eval_rollout(jid, v)
        if ev is None:
            continue
        # One scoring call per row: the greedy completion first, then its sampled ones (if any).
        scores = score_groups(verifier, [(r["row"], [r["text"], *r.get("samples", [])]) for r in ev["rows"]])
        sampled = [s.rewards[1:] for s in scores] if all(r.get("samples") for r in ev["rows"]) else None
        result = evaluation.summarize([s.rewards[0] for s in scores], sampled)
        # The greedy outputs are kept with the score: an exported adapter must reproduce them.
        result.update(at=time.time(), outputs=[
            {"prompt": r["row"]["prompt"], "text": r["text"], "reward": s.rewards[0],
             "samples_correct": sum(1 for x in s.rewards[1:] if x >= evaluation.CORRECT_AT)}
            for r, s in zip(ev["rows"], scores)])
        store.put_eval_result(jid, v, result)
        accepted += 1
        if all(store.has_evals(jid, scheduler.eval_versions(spec.steps, spec.eval_every))):
            store.set_status(jid, "done")
    return accepted


def train_batch(spec, t: int, rolls: list[dict]) -> tuple[list, list[float], list[int]]:
    """(samples, all rewards, staleness per group) of one step: group-relative advantages per group."""
    import torch

    from marlaas import rl
    from marlaas.engines.training import TrainSample

    samples, rewards_all, staleness = [], [], []
    for r in rolls:
        rewards = r["rewards"]["rewards"]
        rewards_all += rewards
        staleness.append(t - r["version"])
        adv = rl.group_advantages(torch.tensor(rewards, dtype=torch.float32), mode=spec.rl.advantage)
        if spec.rl.drop_zero_advantage and bool((adv == 0).all()):
            continue
        for c, a in zip(r["completions"], adv.tolist()):
            samples.append(TrainSample(prompt=r["row"]["prompt"], completion_ids=c["ids"],
                                       behav_logprobs=c["logprobs"], advantage=float(a),
                                       loss_mask=c.get("mask")))  # tool episodes: 0 on tool tokens
    return samples, rewards_all, staleness


def run_train(store: Store, engine, jid: str, t: int, token: str) -> dict:
    """One policy-gradient step of job `jid` at version t; publishes t+1 exactly once."""
    from marlaas.engines.training import TrainState

    status, version = store.job_fields(jid, "status", "version")
    if status not in ("running",) or version is None or int(version) != t:
        store.release_trainer(token)
        return {"skipped": "not at this version (already published or job stopped)"}
    spec = store.spec(jid)
    groups = scheduler.step_groups(t, spec.prompts_per_step)
    rolls = [store.rollout(jid, g) for g in groups]
    bad = [g for g, r in zip(groups, rolls)
           if r is None or "rewards" not in r or not scheduler.within_staleness(t, r["version"], spec.max_staleness)]
    if bad:
        for g in bad:
            store.invalidate_group(jid, g)
        store.release_trainer(token)
        return {"skipped": f"groups {bad} missing, unverified or too stale: regenerating"}

    samples, rewards_all, staleness = train_batch(spec, t, rolls)
    state = None
    if t > 0:
        opt = store.optimizer_state(jid)
        if opt is not None and opt[0] == t:
            state = TrainState(version=t, adapter=store.adapter(AdapterRef(jid, t)), optimizer=opt[1])
    t0 = time.time()
    out = engine.step(jid, t, spec, samples, state)
    metrics = dict(out.metrics)
    metrics.update(
        step=t + 1,
        reward_mean=sum(rewards_all) / max(len(rewards_all), 1),
        staleness=staleness,
        train_s=time.time() - t0,
        at=time.time(),
    )
    if episodes.tool_of(spec):  # tool-result tokens in this step's episodes: context, masked out of the loss
        metrics["tool_tokens"] = sum(len(c["mask"]) - sum(c["mask"]) for r in rolls for c in r["completions"])
    ok = store.publish(jid, t, out.adapter, out.optimizer, metrics, token, groups, spec.steps, spec.eval_every)
    if ok and t + 1 >= spec.steps:
        store.set_status(jid, "evaluating")
    if not ok:
        store.release_trainer(token)
        return {"skipped": "version moved during the step (published elsewhere): no-op"}
    return metrics
