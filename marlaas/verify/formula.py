"""The safe formula language of `multi` graders: a weighted combination of named sub-grader scores.

Grammar (checked on the parsed Python AST, never `eval`ed): numbers, names of sub-graders, the binary
operators `+ - * /`, unary `+ -`, parentheses, and calls of exactly `min(...)`, `max(...)` (at least one
argument) and `abs(x)`. Everything else is refused at validation with one line: attribute access,
subscripts, any other call, `**` (no huge exponents), comparisons, boolean operators, lambdas,
comprehensions, strings. A formula is at most `MAX_CHARS` characters and `MAX_NODES` AST nodes, and
numeric literals are at most `MAX_LITERAL` in magnitude, so evaluating one is a few hundred float
operations at most.

Evaluation is plain float arithmetic over the checked tree: division by zero and a non-finite result
raise `FormulaError` (the grader counts it as an error for that completion).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping

MAX_CHARS = 1000
MAX_NODES = 200
MAX_LITERAL = 1e6
FUNCTIONS = {"min": min, "max": max, "abs": abs}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class FormulaError(ValueError):
    """A formula that is not in the language, or that cannot be evaluated on these values."""


def parse_formula(text: str, names: set[str] | frozenset[str]) -> ast.Expression:
    """The checked AST of `text`; FormulaError (one line) unless it is in the language and every name
    it uses is in `names`."""
    if not isinstance(text, str) or not text.strip():
        raise FormulaError("the formula is empty")
    if len(text) > MAX_CHARS:
        raise FormulaError(f"the formula has {len(text)} characters (at most {MAX_CHARS})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise FormulaError(f"the formula does not parse: {e.msg}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"the formula is too long (over {MAX_NODES} terms)")
    callees = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    for node in nodes:
        _check_node(node, names, callees)
    return tree


def _check_node(node: ast.AST, names: set[str] | frozenset[str], callees: set[int]) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.UAdd, ast.USub)):
        return
    if isinstance(node, ast.BinOp):
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            raise FormulaError(f"operator {type(node.op).__name__} is not allowed: use + - * / only")
        return
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.UAdd, ast.USub)):
            raise FormulaError(f"operator {type(node.op).__name__} is not allowed: use + - * / only")
        return
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise FormulaError(f"only numbers are allowed as constants, not {node.value!r}")
        if not math.isfinite(node.value) or abs(node.value) > MAX_LITERAL:
            raise FormulaError(f"the number {node.value!r} is out of range (at most {MAX_LITERAL:g})")
        return
    if isinstance(node, ast.Name):
        if id(node) in callees and node.id in FUNCTIONS:
            return
        if node.id not in names:
            raise FormulaError(f"unknown name {node.id!r}: the formula may use the sub-graders "
                               f"{', '.join(sorted(names)) or '(none)'} and min, max, abs")
        return
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise FormulaError("only min(...), max(...) and abs(...) may be called")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise FormulaError(f"{node.func.id}() takes plain arguments only")
        if not node.args or (node.func.id == "abs" and len(node.args) != 1):
            raise FormulaError(f"{node.func.id}() needs {'one argument' if node.func.id == 'abs' else 'arguments'}")
        return
    if isinstance(node, ast.Attribute):
        raise FormulaError("attribute access is not allowed in a formula")
    raise FormulaError(f"{type(node).__name__} is not allowed in a formula")


def evaluate(tree: ast.Expression, values: Mapping[str, float]) -> float:
    """The formula's value with these sub-grader scores; FormulaError on division by zero or a
    non-finite result."""
    result = _eval(tree.body, values)
    if not math.isfinite(result):
        raise FormulaError(f"the formula evaluated to {result}")
    return result


def _eval(node: ast.AST, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, values)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, values), _eval(node.right, values)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise FormulaError("division by zero in the formula")
            return a / b
        return _BINOPS[type(node.op)](a, b)
    if isinstance(node, ast.Call):
        return float(FUNCTIONS[node.func.id](*(_eval(a, values) for a in node.args)))
    raise FormulaError(f"{type(node).__name__} is not allowed in a formula")  # parse_formula refuses it first
