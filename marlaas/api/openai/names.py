"""Model names of the OpenAI-compatible door: which adapter version a `model` string names.

    parse("j12@best", base_names=("smollm2-135m-instruct",))   # ModelName(kind="best", job="j12")
    resolve(store, ts, tenant, "j12/3")                         # Target("j12/3", AdapterRef("j12", 3))

Names (docs/serving.md):
- the deployment's base name (or its path): the base model itself, no adapter;
- `JOB`: the job's latest published version; `JOB/V`: version V while it is stored (`JOB/0` is the
  base); `JOB@best`: the job's promoted version (`Store.best_version`: pinned, else the evaluated
  version with the highest held-out exact);
- `tinker://MODEL/sampler_weights/NAME`: a Tinker sampler snapshot, resolved as the Tinker door does;
- a tenant's alias (`PUT /v1/aliases/NAME {"model": ...}`): stands for any name above, resolved at each
  request (`prod -> j12@best` follows the promotion). An alias is a plain name that is no job id
  (`j` + digits) and no base name; its target is checked when it is set and is never an alias itself.

Invariants: `parse` is pure (plain strings in, a ModelName out); `resolve` reads only through the
access policy (`marlaas.api.access.job`) and `TinkerStore`'s tenant-checked reads, so another tenant's
job or model is NotFound with exactly the message of an unknown one. Every NotFound names the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from marlaas.api import access
from marlaas.errors import NotFound, SpecError
from marlaas.store import Store
from marlaas.store.blobs import tenant_part
from marlaas.store.tinker import TinkerStore, parse_path
from marlaas.types import AdapterRef

JOB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ALIAS = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
RESERVED = re.compile(r"^j[0-9]+$")  # job ids: an alias never shadows one
BEST = "best"


@dataclass(frozen=True)
class ModelName:
    """A parsed model name: kind "base" | "job" | "version" | "best" | "tinker"."""

    kind: str
    job: str | None = None
    version: int | None = None
    path: str | None = None
    """The tinker:// path of kind "tinker"."""


@dataclass(frozen=True)
class Target:
    """What a request samples: `model` (the name as answered), `ref` (None: the base model)."""

    model: str
    ref: AdapterRef | None


def not_found(name: str) -> NotFound:
    return NotFound(f"the model {name!r} does not exist or you do not have access to it")


def base_names(deployment: dict) -> tuple[str, ...]:
    """The names the deployment's base answers to: its served name, then its path ("" when none)."""
    base = deployment.get("base") or ""
    name = deployment.get("base_name") or (Path(base).name if base else "")
    return tuple(n for n in (name, base) if n)


def parse(name: str, base: tuple[str, ...]) -> ModelName:
    """The kind of model `name` is (NotFound for a name of no kind); `base`: the base's names."""
    if not isinstance(name, str) or not name:
        raise not_found(str(name))
    if name in base:
        return ModelName("base")
    if name.startswith("tinker://"):
        return ModelName("tinker", path=name)
    job, sep, tag = name.partition("@")
    if sep:
        if tag != BEST or not JOB_ID.match(job):
            raise not_found(name)
        return ModelName("best", job=job)
    job, sep, v = name.partition("/")
    if sep:
        if not JOB_ID.match(job) or not (v.isascii() and v.isdigit()):
            raise not_found(name)
        return ModelName("version", job=job, version=int(v))
    if not JOB_ID.match(name):
        raise not_found(name)
    return ModelName("job", job=name)


def _stored(store: Store, name: str, jid: str, v: int) -> AdapterRef | None:
    """Version v of a visible job as a ref (None: v = 0, the base); NotFound when no longer stored."""
    if v == 0:
        return None
    if not store.existing_adapters(jid, [v]):
        raise NotFound(f"the model {name!r}: version {v} of job {jid} is not stored (any more)")
    return AdapterRef(jid, v)


def check_alias(store: Store, ts: TinkerStore, tenant: str | None, alias: str, model: str) -> Target:
    """Whether `alias` may stand for `model` for this tenant (SpecError naming why); the target it
    resolves to now (NotFound when the model does not resolve)."""
    if not isinstance(alias, str) or not ALIAS.match(alias) or RESERVED.match(alias):
        raise SpecError(f"invalid alias {str(alias)[:80]!r}: a letter, then up to 63 letters, digits, '_', "
                        "'.' or '-', and not a job id (j + digits)")
    if alias in base_names(store.deployment()):
        raise SpecError(f"invalid alias {alias!r}: it is the base model's name")
    if store.alias(tenant_part(tenant), model) is not None:
        raise SpecError(f"the alias {alias!r} cannot stand for another alias ({model!r}): name its model")
    return resolve(store, ts, tenant, model, aliases=False)


def resolve(store: Store, ts: TinkerStore, tenant: str | None, name: str, aliases: bool = True) -> Target:
    """The adapter version `name` names for a caller of `tenant` (None: any tenant's); with `aliases`,
    the tenant's alias of that name first."""
    base = base_names(store.deployment())
    if not base:
        raise SpecError("this deployment has no base model registered yet (start a generate worker first)")
    m = parse(name, base)
    if aliases and m.kind == "job" and (target := store.alias(tenant_part(tenant), name)) is not None:
        return Target(name, resolve(store, ts, tenant, target, aliases=False).ref)
    if m.kind == "base":
        return Target(base[0], None)
    if m.kind == "tinker":
        mid, kind, ckpt = parse_path(m.path)
        if kind != "sampler_weights":
            raise SpecError(f"the model {name!r} is a training state: serve a sampler snapshot "
                            "(tinker://<model>/sampler_weights/<name>)")
        try:
            return Target(name, AdapterRef(mid, ts.sampler_version(tenant, mid, ckpt)))
        except NotFound:
            raise not_found(name) from None
    try:
        rec = access.job(store, tenant, m.job)
    except NotFound:
        raise not_found(name) from None
    if m.kind == "job":
        if rec.version < 1:
            raise NotFound(f"the model {name!r}: job {rec.id} has no trained version yet")
        return Target(name, _stored(store, name, rec.id, rec.version))
    if m.kind == "version":
        if m.version > rec.version:
            raise NotFound(f"the model {name!r}: job {rec.id} has versions 0..{rec.version}")
        return Target(name, _stored(store, name, rec.id, m.version))
    v = store.best_version(rec.id)
    if v is None:
        raise NotFound(f"the model {name!r}: job {rec.id} has no evaluated version yet")
    return Target(name, _stored(store, name, rec.id, v))


def listing(store: Store, tenant: str | None) -> list[dict]:
    """What the caller may call, as OpenAI model objects: the base, each of its jobs with a trained
    version (`JOB`), `JOB@best` where the job has one, and its aliases."""
    dep = store.deployment()
    base = base_names(dep)
    out = [{"id": base[0], "object": "model", "created": 0, "owned_by": "marlaas"}] if base else []
    for jid in access.job_ids(store, tenant):
        rec = store.job(jid)
        if rec.version < 1:
            continue
        out.append({"id": jid, "object": "model", "created": int(rec.created), "owned_by": rec.tenant})
        if store.best_version(jid) is not None:
            out.append({"id": f"{jid}@{BEST}", "object": "model", "created": int(rec.created),
                        "owned_by": rec.tenant})
    for alias in store.aliases(tenant_part(tenant)):
        out.append({"id": alias, "object": "model", "created": 0, "owned_by": tenant or "marlaas"})
    return out
