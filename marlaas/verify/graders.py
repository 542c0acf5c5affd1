"""Graders: reward functions a tenant uploads with the job, as JSON in the style of reinforcement
fine-tuning graders, validated at the boundary and run without trusting them.

Types (`Grader`, a union keyed by `type`):

- `string_check`: `input` and `reference` are templates; `operation` eq (equal), ne (not equal), like
  (input contains reference) or ilike (the same, ignoring case): 1.0 or 0.0.
- `text_similarity`: `evaluation_metric` over the rendered `input` and `reference`
  (`marlaas.verify.similarity`: fuzzy_match, bleu, gleu, rouge_1..rouge_5, rouge_l), a float in
  [0, 1]; with `pass_threshold`, 1.0 when the metric reaches it, else 0.0. Token metrics compare
  the first 4,096 tokens of each text, rouge_l the first 512 (its cost is quadratic).
- `python`: `source` (at most `MAX_SOURCE` bytes) defines `grade(sample, item) -> float`; it runs
  ONLY in the sandbox (`marlaas.verify.sandbox`: no network, empty environment, no credentials, read-
  only mounts), one sandbox program per call with the grader's `timeout_s` as CPU and wall-clock limit
  and `memory_mb` as address-space limit; all the calls of a `grade_groups` call go in ONE sandbox
  batch, itself bounded by the sandbox's batch budget. Standard library only. `sample` is
  {"output_text": completion}, `item` the dataset row (every column). Whatever the grader prints is
  discarded. Its result must be a number (a bool counts as 0/1), finite and in [0, 1] (values within
  1e-9 of the range are clamped): anything else is an error, never silently clamped.
- `multi`: named sub-`graders` (at most `MAX_SUBGRADERS` in the whole tree, nesting at most
  `MAX_DEPTH`) and `calculate_output`, a formula over their names (`marlaas.verify.formula`: numbers,
  + - * /, min, max, abs; nothing else); the result must be finite and in [0, 1] like a python
  grader's. A completion whose sub-grader errs is an error of the multi grader.
- `builtin`: `verifier` names a built-in verifier (exact, math, code, tool, reasoning_gym) or one the
  operator registered (`marlaas.verify.registry`); registered names are resolved by the caller.

Templates: `{{item.FIELD}}` (a column of the row; a non-string value is written as JSON) and
`{{sample.output_text}}` (the completion); any other `{{...}}` is refused at validation. A rendered
string is cut to `MAX_TEXT` characters, so in-process graders are pure and bounded.

Costs: every in-process grader is bounded by its inputs (MAX_TEXT characters, the token caps
above); `dry_run` grades one sample (a `multi`'s sub-graders once each) for the API, which runs it
in a child process under a memory and time limit (`marlaas.api.dryruns`).

Invariants: `grade_groups` never raises for a grader that loaded: a completion a grader cannot score
gets 0.0 and is counted in `GroupScore.errors`, first message kept (one line). `GraderLoadError` (a
registered name that no longer resolves) means no completion can ever be scored: the verify station
fails the job at once.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from marlaas.errors import GraderLoadError, MarlaasError, SpecError, VerifierError, one_line  # noqa: F401  (GraderLoadError re-exported)
from marlaas.verify import formula, similarity
from marlaas.verify.grader_python import in_range, python_outcome, python_program, run_python
from marlaas.verify.verifiers import BUILTIN, GroupScore

MAX_SOURCE = 256 * 1024
MAX_TEMPLATE = 4096
MAX_TEXT = 20_000
MAX_SUBGRADERS = 16
MAX_DEPTH = 3
_TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.S)
_FIELD = re.compile(r"^\s*(?:item\.([A-Za-z_][A-Za-z0-9_]{0,63})|sample\.(output_text))\s*$")
_SUBNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def check_template(text: str) -> str:
    """`text` unless it uses a placeholder other than {{item.FIELD}} and {{sample.output_text}}."""
    for m in _TEMPLATE.finditer(text):
        if not _FIELD.match(m.group(1)):
            raise ValueError(f"template placeholder {m.group(0)[:80]!r} is not allowed: use {{{{item.FIELD}}}} "
                             "or {{sample.output_text}}")
    return text


def render(template: str, item: Mapping, output_text: str) -> str:
    """The template with its placeholders filled, cut to MAX_TEXT characters; KeyError-free: a missing
    item field raises ValueError (an error of that completion)."""
    def fill(m: re.Match) -> str:
        field, sample_field = _FIELD.match(m.group(1)).groups()
        if sample_field:
            return output_text
        if field not in item:
            raise ValueError(f"the row has no field {field!r} (template {m.group(0)!r})")
        value = item[field]
        return value if isinstance(value, str) else json.dumps(value)

    return _TEMPLATE.sub(fill, template)[:MAX_TEXT]


# ---------------------------------------------------------------- the grader models
class _GraderBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("grader", min_length=1, max_length=64)
    """A label for the tenant (shown in errors); sub-graders of a `multi` are named by their key."""


class StringCheckGrader(_GraderBase):
    """Compare two rendered templates: 1.0 when the check holds, else 0.0."""

    type: Literal["string_check"]
    """Selects this grader."""
    input: str = Field(max_length=MAX_TEMPLATE)
    """The text checked, a template (usually '{{sample.output_text}}')."""
    reference: str = Field(max_length=MAX_TEMPLATE)
    """The text checked against, a template (usually '{{item.answer}}')."""
    operation: Literal["eq", "ne", "like", "ilike"]
    """eq: equal; ne: not equal; like: input contains reference; ilike: the same ignoring case."""

    @field_validator("input", "reference")
    @classmethod
    def _templates(cls, v: str) -> str:
        return check_template(v)


class TextSimilarityGrader(_GraderBase):
    """A similarity metric of the rendered input to the rendered reference, in [0, 1]."""

    type: Literal["text_similarity"]
    """Selects this grader."""
    input: str = Field(max_length=MAX_TEMPLATE)
    """The text graded, a template."""
    reference: str = Field(max_length=MAX_TEMPLATE)
    """The text graded against, a template."""
    evaluation_metric: str
    """fuzzy_match, bleu, gleu, rouge_1..rouge_5 or rouge_l (these compare the first 4,096 tokens of each
    text, rouge_l the first 512)."""
    pass_threshold: float | None = Field(None, ge=0.0, le=1.0)
    """When set, the reward is 1.0 if the metric reaches it, else 0.0; None: the metric itself."""

    @field_validator("input", "reference")
    @classmethod
    def _templates(cls, v: str) -> str:
        return check_template(v)

    @field_validator("evaluation_metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v in similarity.UNAVAILABLE:
            raise ValueError(f"evaluation_metric {v!r} is not available: it {similarity.UNAVAILABLE[v]}")
        if v not in similarity.METRICS:
            raise ValueError(f"unknown evaluation_metric {v!r}: use one of {', '.join(similarity.METRICS)}")
        return v


class PythonGrader(_GraderBase):
    """`def grade(sample, item) -> float`, run in the sandbox, one call per completion."""

    type: Literal["python"]
    """Selects this grader."""
    source: str
    """Python source (at most 256 kB, standard library only) defining grade(sample, item)."""
    timeout_s: float = Field(2.0, ge=0.1, le=10.0)
    """CPU and wall-clock limit of one call in seconds (a call over it is an error)."""
    memory_mb: int = Field(256, ge=64, le=1024)
    """Address-space limit of one call in MiB."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        n = len(v.encode("utf-8", "surrogatepass"))
        if n > MAX_SOURCE:
            raise ValueError(f"source is {n} bytes (at most {MAX_SOURCE})")
        try:
            tree = ast.parse(v, "<grader>")  # parsing runs nothing
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise ValueError(f"source does not parse: {one_line(e, typed=True)}") from None
        grade = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grade"]
        if not grade:
            raise ValueError("source must define a top-level function grade(sample, item)")
        args = grade[-1].args
        if len(args.posonlyargs) + len(args.args) < 2 and args.vararg is None:
            raise ValueError("grade must accept two arguments: grade(sample, item)")
        return v


class BuiltinGrader(_GraderBase):
    """A built-in verifier or one the operator registered, by name."""

    type: Literal["builtin"]
    """Selects this grader."""
    verifier: str = Field(min_length=1, max_length=64)
    """exact, math, code, tool, reasoning_gym, or a registered name (never an import path)."""

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, v: str) -> str:
        from marlaas.verify.registry import NAME

        if v not in BUILTIN and not NAME.fullmatch(v):
            raise ValueError(f"verifier {v!r}: use a built-in ({', '.join(BUILTIN)}) or a name the operator "
                             "registered (import paths are not accepted)")
        return v


class MultiGrader(_GraderBase):
    """Named sub-graders combined by a formula."""

    type: Literal["multi"]
    """Selects this grader."""
    graders: dict[str, Grader]
    """The sub-graders by name (letters, digits, '_'; the names the formula uses)."""
    calculate_output: str = Field(min_length=1, max_length=formula.MAX_CHARS)
    """The formula, e.g. '0.7 * correct + 0.3 * fmt' (numbers, names, + - * /, min, max, abs)."""

    @model_validator(mode="after")
    def _check(self) -> MultiGrader:
        if not self.graders:
            raise ValueError("a multi grader needs at least one sub-grader")
        for key in self.graders:
            if not _SUBNAME.match(key) or key in formula.FUNCTIONS:
                raise ValueError(f"sub-grader name {key!r}: use letters, digits and '_' (not min, max, abs)")
        try:
            formula.parse_formula(self.calculate_output, frozenset(self.graders))
        except formula.FormulaError as e:
            raise ValueError(f"calculate_output: {e}") from None
        n, depth = _size(self)
        if n > MAX_SUBGRADERS:
            raise ValueError(f"{n} graders in all (at most {MAX_SUBGRADERS})")
        if depth > MAX_DEPTH:
            raise ValueError(f"multi graders nested {depth} deep (at most {MAX_DEPTH})")
        return self


Grader = Annotated[StringCheckGrader | TextSimilarityGrader | PythonGrader | MultiGrader | BuiltinGrader,
                   Field(discriminator="type")]
MultiGrader.model_rebuild()


class _Holder(BaseModel):
    grader: Grader


def _size(g) -> tuple[int, int]:
    """(graders in the tree, multi nesting depth)."""
    if not isinstance(g, MultiGrader):
        return 1, 0
    subs = [_size(s) for s in g.graders.values()]
    return 1 + sum(n for n, _ in subs), 1 + max(d for _, d in subs)


def parse_grader(data: object) -> Grader:
    """A validated grader; SpecError with one line naming the first problem."""
    if isinstance(data, BaseModel) and not isinstance(data, _Holder):
        data = data.model_dump()
    try:
        g = _Holder.model_validate({"grader": data}).grader
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())[1:])
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        raise SpecError(f"invalid grader: {where + ': ' if where else ''}{msg}") from None
    if sum(len(p.source.encode()) for p in _pythons(g)) > 4 * MAX_SOURCE:
        raise SpecError(f"invalid grader: the python sources add up to over {4 * MAX_SOURCE} bytes")
    return g


def _pythons(g) -> list[PythonGrader]:
    if isinstance(g, PythonGrader):
        return [g]
    if isinstance(g, MultiGrader):
        return [p for s in g.graders.values() for p in _pythons(s)]
    return []


def builtin_names(g) -> set[str]:
    """The verifier names the grader's `builtin` nodes use (for the registration check at submit)."""
    if isinstance(g, BuiltinGrader):
        return {g.verifier}
    if isinstance(g, MultiGrader):
        return set().union(*(builtin_names(s) for s in g.graders.values()))
    return set()


# ---------------------------------------------------------------- grading
Outcome = tuple[float, str | None]
"""(reward, None) or (0.0, one-line error) for one completion."""
Finish = Callable[[list], list[Outcome]]


def _each(completions: list[str], fn: Callable[[str], float]) -> list[Outcome]:
    out: list[Outcome] = []
    for c in completions:
        try:
            out.append((float(fn(c)), None))
        except Exception as e:  # noqa: BLE001 - a completion the grader cannot score is counted, by contract
            out.append((0.0, one_line(e, typed=True)))
    return out


def _string_check(g: StringCheckGrader, item: Mapping, c: str) -> float:
    a, b = render(g.input, item, c), render(g.reference, item, c)
    ok = {"eq": a == b, "ne": a != b, "like": b in a, "ilike": b.lower() in a.lower()}[g.operation]
    return 1.0 if ok else 0.0


def _text_similarity(g: TextSimilarityGrader, item: Mapping, c: str) -> float:
    value = similarity.similarity(g.evaluation_metric, render(g.input, item, c), render(g.reference, item, c))
    if g.pass_threshold is not None:
        return 1.0 if value >= g.pass_threshold else 0.0
    return value


def _prepare(g, item: Mapping, comps: list[str], programs: list, registered: Mapping[str, str]) -> Finish:
    """Score what runs in-process now; queue python calls in `programs` (with their limits); return
    the function that, given the sandbox results of the whole batch, yields this node's outcomes."""
    if isinstance(g, StringCheckGrader):
        out = _each(comps, lambda c: _string_check(g, item, c))
        return lambda results: out
    if isinstance(g, TextSimilarityGrader):
        out = _each(comps, lambda c: _text_similarity(g, item, c))
        return lambda results: out
    if isinstance(g, BuiltinGrader):
        out = _builtin(g, item, comps, registered)
        return lambda results: out
    if isinstance(g, PythonGrader):
        start = len(programs)
        programs.extend((python_program(g, {"output_text": c}, item), g) for c in comps)
        return lambda results: [python_outcome(r) for r in results[start:start + len(comps)]]
    if isinstance(g, MultiGrader):
        subs = {k: _prepare(s, item, comps, programs, registered) for k, s in g.graders.items()}
        return lambda results: _combine(g, {k: f(results) for k, f in subs.items()}, len(comps))
    raise GraderLoadError(f"unknown grader type {type(g).__name__}")


def _combine(g: MultiGrader, by_name: dict[str, list[Outcome]], n: int) -> list[Outcome]:
    """A multi grader's outcomes from its sub-graders' (an erring sub-grader makes the completion err)."""
    tree = formula.parse_formula(g.calculate_output, frozenset(g.graders))
    out: list[Outcome] = []
    for i in range(n):
        err = next((f"{k}: {by_name[k][i][1]}" for k in by_name if by_name[k][i][1]), None)
        if err:
            out.append((0.0, one_line(err)))
            continue
        try:
            out.append((in_range(formula.evaluate(tree, {k: by_name[k][i][0] for k in by_name}),
                                  "calculate_output"), None))
        except (formula.FormulaError, ValueError, TypeError) as e:
            out.append((0.0, one_line(e, typed=True)))
    return out


def _builtin(g: BuiltinGrader, item: Mapping, comps: list[str], registered: Mapping[str, str]) -> list[Outcome]:
    from marlaas.verify.verifiers import resolve_verifier, score_group

    if g.verifier == "code":
        gs = score_group("code", dict(item), comps)
        return [(r, gs.error if gs.errors else None) for r in gs.rewards]
    path = g.verifier if g.verifier in BUILTIN else registered.get(g.verifier)
    if path is None:
        raise GraderLoadError(f"verifier {g.verifier!r} is not registered")
    try:
        fn = resolve_verifier(path)
    except VerifierError as e:
        raise GraderLoadError(str(e)) from None
    return _each(comps, lambda c: _builtin_value(fn(c, dict(item))))


def _builtin_value(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"verifier returned {value!r}, not a finite number")
    return float(value)


def grade_groups(grader, items: list[tuple[Mapping, list[str]]],
                 registered: Mapping[str, str] | None = None) -> list[GroupScore]:
    """Score several groups (row, completions): in-process graders now, every python call of every
    group in ONE sandbox batch. `registered`: registered verifier names -> import paths (from the
    store). Never raises for a grader that loads; GraderLoadError when it cannot load at all."""
    from marlaas.verify.sandbox import SandboxError

    programs: list = []
    finishes = [_prepare(grader, item, list(comps), programs, registered or {}) for item, comps in items]
    try:
        results = run_python(programs)
    except SandboxError as e:
        err = one_line(e, typed=True)
        return [GroupScore(rewards=[0.0] * len(comps), errors=len(comps), error=err) for _, comps in items]
    out = []
    for finish in finishes:
        outcomes = finish(results)
        errors = [e for _, e in outcomes if e]
        out.append(GroupScore(rewards=[r for r, _ in outcomes], errors=len(errors),
                              error=errors[0] if errors else None))
    return out


def grade_group(grader, item: Mapping, completions: list[str],
                registered: Mapping[str, str] | None = None) -> GroupScore:
    """Score one group of completions of one row (see grade_groups)."""
    return grade_groups(grader, [(item, completions)], registered)[0]


def dry_run(grader, item: Mapping, output_text: str, registered: Mapping[str, str] | None = None) -> dict:
    """One sample graded once: {"reward", "error", "sub_rewards"} (a `multi`'s sub-graders' rewards, None
    where one erred, from the same run as its reward). GraderLoadError when the grader cannot load."""
    from marlaas.verify.sandbox import SandboxError

    programs: list = []
    is_multi = isinstance(grader, MultiGrader)
    parts = grader.graders if is_multi else {"": grader}
    finishes = {k: _prepare(s, item, [output_text], programs, registered or {}) for k, s in parts.items()}
    try:
        results = run_python(programs)
    except SandboxError as e:
        return {"reward": 0.0, "error": one_line(e, typed=True), "sub_rewards": {}}
    by_name = {k: f(results) for k, f in finishes.items()}
    reward, error = _combine(grader, by_name, 1)[0] if is_multi else by_name[""][0]
    subs = {k: None if o[0][1] else o[0][0] for k, o in by_name.items()} if is_multi else {}
    return {"reward": reward, "error": error, "sub_rewards": subs}
