"""The row fields a grader needs, found without running it (pure: no I/O, nothing executed).

`required_fields(grader)` is checked at submit against every training and held-out row, so a row a
grader cannot read is refused with one line naming the row, instead of erring in every group later:

- `string_check` / `text_similarity`: each `{{item.FIELD}}` of `input` and `reference`;
- `python`: its source is parsed with `ast` (never run); in `grade(sample, item)` (whatever the
  second parameter is called) each `item["FIELD"]` read with a constant string is required.
  Not required: `item.get("FIELD")` and `item.get("FIELD", default)` (a `get` says the grader copes
  with absence), a field the source tests with `"FIELD" in item` / `not in`, and a subscript inside
  a `try` whose handlers catch KeyError, LookupError, Exception, BaseException or everything;
- `multi`: the union of its sub-graders'; `builtin`: none here (the built-in verifiers' own
  fields, e.g. `answer` for exact and math, are checked where the rows are read).

`ROW_REF` is the key under which a job's stored row keeps its label for the tenant ("dataset
data.jsonl line 5", "eval_dataset row 3": the user's own file name and row, numbered from 1). It
is not a column: `strip_ref` removes it before any grader or verifier sees the row.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

ROW_REF = "_marlaas_row"
"""The stored row's label for the tenant (never shown to graders; see `strip_ref`)."""

_ITEM_TEMPLATE = re.compile(r"\{\{\s*item\.([A-Za-z_][A-Za-z0-9_]{0,63})\s*\}\}")
_CATCHES_KEY = {"KeyError", "LookupError", "Exception", "BaseException"}


def strip_ref(row: Mapping) -> dict:
    """The row as a grader sees it: every column, without the label."""
    return {k: v for k, v in row.items() if k != ROW_REF}


def ref_of(row: Mapping, fallback: str) -> str:
    """The tenant's label of a stored row, else `fallback` (rows of built-in tasks have none)."""
    ref = row.get(ROW_REF)
    return ref if isinstance(ref, str) and ref else fallback


def template_fields(text: str) -> set[str]:
    """The FIELDs of the `{{item.FIELD}}` placeholders of a template."""
    return set(_ITEM_TEMPLATE.findall(text))


def python_fields(source: str) -> set[str]:
    """The fields `grade(sample, item)` reads with `item["FIELD"]` and needs (see the module
    docstring); an empty set when the source does not parse or has no such function."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    grade = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grade"]
    if not grade:
        return set()
    params = [*grade[-1].args.posonlyargs, *grade[-1].args.args]
    if len(params) < 2:
        return set()
    item = params[1].arg
    needed: set[str] = set()
    tested: set[str] = set()
    _walk(grade[-1], item, needed, tested, guarded=False)
    return needed - tested


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _catches_missing(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in _CATCHES_KEY for n in names)


def _walk(node: ast.AST, item: str, needed: set[str], tested: set[str], guarded: bool) -> None:
    if isinstance(node, ast.Try | getattr(ast, "TryStar", ast.Try)):
        body_guarded = guarded or any(_catches_missing(h) for h in node.handlers)
        for child in node.body:
            _walk(child, item, needed, tested, body_guarded)
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            _walk(child, item, needed, tested, guarded)
        return
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == item \
            and isinstance(node.ctx, ast.Load) and (key := _key(node.slice)) is not None and not guarded:
        needed.add(key)
    if isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Name) and s.id == item for s in sides):
            tested.update(k for s in sides if (k := _key(s)) is not None)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue  # a nested function may never run: what it reads is not required
        _walk(child, item, needed, tested, guarded)


def required_fields(grader) -> set[str]:
    """The row fields `grader` (a parsed `marlaas.verify.graders.Grader`) needs in every row."""
    kind = getattr(grader, "type", None)
    if kind in ("string_check", "text_similarity"):
        return template_fields(grader.input) | template_fields(grader.reference)
    if kind == "python":
        return python_fields(grader.source)
    if kind == "multi":
        return set().union(*(required_fields(g) for g in grader.graders.values()))
    return set()


def missing_fields(grader, row: Mapping) -> list[str]:
    """The fields `grader` needs that `row` lacks, sorted."""
    return sorted(required_fields(grader) - set(row))
