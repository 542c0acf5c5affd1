"""Admission: what happens to a job spec between a tenant and the store.

`admit(store, tenant, spec, limits)` is the whole path, in this order: make room in the store (`make_room`),
parse and validate the spec, check it against the tenant's quotas, check the base model and LoRA
rank against the deployment, build and split the rows (a built-in task's or the tenant's dataset),
check the rows' sizes against the plan (before any rendering or tokenising, and again as stored),
render prompts with the base's chat template, check every prompt fits the base's context, then
store the job. Each submit renders and tokenises on its own copy of the base's tokenizer
(`_own_tokenizer`): no lock is shared by every submit, so one tenant's large dataset costs only
its own request. Every refusal is one
`MarlaasError` line and stores nothing. Settings are not read here: the caller's process edge passes
its `access.Limits` down; the largest LoRA rank is `access.max_lora_rank`'s, as for the Tinker door.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from marlaas.api import access, tenancy
from marlaas.api.rows import job_rows
from marlaas.errors import BaseModelError, SpecError, StoreFull
from marlaas.spec import JobSpec, parse_spec
from marlaas.store import Store
from marlaas.verify.boundary import check_submit as check_verifiers

_SPARE_LOCK = threading.Lock()  # guards the lists of spare tokenizers only (a pop or an append), never a call
_LOAD_LOCK = threading.Lock()  # a base's tokenizer is loaded once (see _base_tokenizer)
_SPARE: dict[str, list] = {}
MAX_SPARE = 8  # spare tokenizer copies kept per base; more concurrent submits make (and drop) their own
PRESSURE_ROUNDS, PRESSURE_BATCH = 10, 20  # at most 200 ended jobs collected for one submit


def make_room(store: Store, share: float) -> None:
    """StoreFull unless the store is below its admission share. Over it, ended jobs' bulk data
    (intermediate adapters, optimizer state, rows, rollouts: `Store.collect_garbage`) is collected
    first, before its retention period, oldest ended first: new work goes before the leftovers of old
    jobs. Their records, metrics, evaluations and downloadable adapters stay."""
    over, used, cap = store.over_share(share)
    for _ in range(PRESSURE_ROUNDS):
        if not over or not store.collect_garbage(time.time(), 0.0, limit=PRESSURE_BATCH):
            break
        over, used, cap = store.over_share(share)
    if over:
        raise StoreFull(f"the service's store is full ({used >> 20} of {cap >> 20} MiB used, ended jobs' "
                        "bulk data already collected): new jobs are refused until running ones finish; "
                        "try again later")


def admit(store: Store, tenant: str | None, spec: JobSpec | dict, limits: access.Limits) -> str:
    """Validate a tenant's job and store it; returns the job id."""
    make_room(store, limits.admission_memory_fraction)
    spec = tenancy.check_submit(store, tenant, parse_spec(spec))
    check_verifiers(store, tenant, spec.grader, spec.verifier)  # registered names only, for tenants
    dep = store.deployment()
    if spec.base_model and dep.get("base_name") and spec.base_model not in (dep["base_name"], dep.get("base")):
        raise BaseModelError(f"this deployment serves base {dep['base_name']!r}, not {spec.base_model!r}")
    access.check_lora_rank(store, spec.lora.rank, limits.max_lora_rank)
    train, held = job_rows(spec)
    if spec.preflight:  # a preflight samples its first N (shuffled) training prompts, no more
        train = train[:spec.preflight_prompts]
        spec = spec.model_copy(update={"preflight_prompts": len(train)})
    tenancy.check_rows(store, tenant, train, held)  # the size quota before any rendering or tokenising
    with _own_tokenizer(dep.get("base")) as tok:  # this submit's own copy: no lock shared by every submit
        train, held, how = _chat_template(dep.get("base"), spec, train, held, tok)
        _check_context(tok, dep.get("base"), spec, train, held)
    tenancy.check_rows(store, tenant, train, held)  # as stored: prompts rendered
    return store.create_job(spec, train, held, info={"chat_template": how})


def _base_tokenizer(base: str):
    """The tokenizer of a base directory this machine can read, else None. Loaded once, under a lock:
    concurrent first submits would otherwise import transformers' lazy modules from several threads at
    once, which fails ("cannot import name 'AutoTokenizer'"); later calls hit the cache at once."""
    with _LOAD_LOCK:
        return _load_base_tokenizer(base)


@lru_cache(maxsize=4)
def _load_base_tokenizer(base: str):
    from marlaas.base.tiny import load_tokenizer

    return load_tokenizer(base) if (Path(base) / "config.json").is_file() else None


@lru_cache(maxsize=4)
def _context_of(base: str) -> int | None:
    """The context length of a base directory this machine can read, else None."""
    if not (Path(base) / "config.json").is_file():
        return None
    n = json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings")
    return int(n) if n else None


@contextmanager
def _own_tokenizer(base: str | None):
    """A copy of the base's tokenizer that only this submit uses while it is held (None when the base
    is not readable here). HF fast tokenizers refuse concurrent use ("Already borrowed"), so each
    submit tokenises on its own copy instead of queueing behind every other tenant's behind one lock."""
    shared = _base_tokenizer(base) if base else None
    if shared is None:
        yield None
        return
    with _SPARE_LOCK:
        spare = _SPARE.setdefault(base, [])
        tok = spare.pop() if spare else None
    tok = tok if tok is not None else copy.deepcopy(shared)
    try:
        yield tok
    finally:
        with _SPARE_LOCK:
            if len(_SPARE[base]) < MAX_SPARE:
                _SPARE[base].append(tok)


def _chat_template(base: str | None, spec: JobSpec, train: list[dict], held: list[dict], tok=None):
    """(train, held, how): the rows with prompts rendered by the base's chat template when the base
    has one and the job does not opt out (`datasets_io.render_chat`), so generation, training and
    evaluation all see the same text. `how`, recorded in the job as "chat_template": "applied",
    "off" (the job opted out), "none" (the base has no template) or "base not readable here" (the
    submitting machine cannot read the base: prompts stay raw)."""
    from marlaas.api.datasets_io import has_chat_template, render_chat

    if spec.chat_template is False:
        return train, held, "off"
    tok = tok if tok is not None else _base_tokenizer(base) if base else None
    if tok is None or not has_chat_template(tok):
        if spec.chat_template:
            why = "is not readable on this machine" if tok is None else "has no chat template"
            raise SpecError(f"invalid job spec: chat_template is true, but the base model {why}")
        return train, held, "base not readable here" if tok is None else "none"
    return render_chat(train, tok, "dataset"), render_chat(held, tok, "eval_dataset"), "applied"


def _check_context(tok, base: str | None, spec: JobSpec, train: list[dict], held: list[dict]) -> None:
    """Refuse prompts that cannot fit the base's context with max_new_tokens (when the base is local)."""
    ctx = _context_of(base) if base and tok is not None else None
    if ctx is None:
        return
    for split, rows in (("dataset", train), ("eval_dataset", held)):
        for row in rows:
            n = len(tok(row["prompt"])["input_ids"])
            if n + spec.max_new_tokens > ctx:
                raise SpecError(
                    f"{split}: the prompt {row['prompt'][:40]!r} has {n} tokens; with max_new_tokens "
                    f"{spec.max_new_tokens} it exceeds the base model's context of {ctx} tokens"
                )
