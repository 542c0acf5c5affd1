"""Built-in task families: small verifiable tasks the tiny base model is pretrained on and RL tunes.

Each family maps an *input* (a tuple) to a prompt, a reference answer and, for pretraining, a
plausible deterministic WRONG answer (`marlaas.base.pretrain` labels most of its examples with it, so the
base model knows both behaviours and RL has something to choose between (an undertrained base
gave small or no RL gains).

Rows are plain dicts: {"prompt", "answer"} plus "tests" for the code family. `rows()` is
deterministic for (family, split, n, seed); the "train" and "eval" splits never share a prompt
(each prompt is assigned to one split by a hash of its text). Prompts only use
`basemodel.CHARSET`; answers are at most `MAX_ANSWER_TOKENS` characters (= tokens).

Families (prompt -> answer):

- reverse  "rev:3817=" -> "7183"            exact   (wrong: copies the input)
- sort     "sort:3817=" -> "1378"            exact   (wrong: sorts descending)
- max      "max:38172=" -> "8"               exact   (wrong: the minimum)
- min      "min:38172=" -> "1"               exact   (wrong: the maximum)
- add      "add:47+5=" -> "52"               math    (wrong: off by one, a+b+1)
- code     "code:417>" -> any Python expression equal to 417, e.g. "410+7"; code verifier
           (wrong: an expression off by one, "417+1")
- calc     "calc:47*38=" -> "1786"           tool    a multi-turn tool task (`marlaas.tools.episodes`): the
           model may call a calculator, "[47*38]", generation stops at "]", the tool's result is
           appended as "=1786;" and the model goes on; the reward is an exact match of the text
           after the last tool result. Right label "[47*38]=1786;1786" (uses the tool and copies
           its result); wrong label: answers directly with the product of the tens digits,
           "1200" (a plausible estimate; +10 when it happens to be exact). Two-digit operands
           are too hard for the tiny model to multiply alone: RL has to learn to call the tool.

max/min inputs are drawn so that every answer digit is equally likely: no single answer is right
more often than 1/8, below the base model's accuracy (a family where always giving the majority
answer beats the base is a trap for RL).
"""

from __future__ import annotations

import ast
import hashlib
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from marlaas.tools.episodes import final_answer

MAX_ANSWER_TOKENS = 8
EVAL_PERCENT = 20  # share of each family's input space held out for the "eval" split
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Family:
    """One built-in task family.

    `sample(rng)` draws an input; `prompt`, `answer` and `wrong` map it to text; `parse` maps a prompt
    back to its input. `label(x)` is the correct completion used for pretraining (defaults to the
    answer; the code family's answer is a value while its completions are expressions).
    """

    name: str
    verifier: str  # "exact" | "math" | "code"
    description: str
    sample: Callable[[random.Random], tuple] = field(repr=False)
    prompt: Callable[[tuple], str] = field(repr=False)
    answer: Callable[[tuple], str] = field(repr=False)
    wrong: Callable[[tuple], str] = field(repr=False)
    parse: Callable[[str], tuple] = field(repr=False)
    label: Callable[[tuple], str] | None = field(default=None, repr=False)
    tests: Callable[[tuple], list[str]] | None = field(default=None, repr=False)
    tool: str | None = None  # a tool the episode may call (multi-turn, `marlaas.tools.episodes`)

    def correct_label(self, x: tuple) -> str:
        """The completion pretraining teaches as right for input x."""
        return self.label(x) if self.label is not None else self.answer(x)

    def row(self, x: tuple) -> dict:
        r = {"prompt": self.prompt(x), "answer": self.answer(x)}
        if self.tests is not None:
            r["tests"] = self.tests(x)
        return r


def _body(prefix: str, suffix: str) -> Callable[[str], str]:
    def get(prompt: str) -> str:
        if not (prompt.startswith(prefix) and prompt.endswith(suffix)):
            raise ValueError(f"not a {prefix[:-1]} prompt: {prompt!r}")
        return prompt[len(prefix) : len(prompt) - len(suffix)]

    return get


# ---- reverse ---------------------------------------------------------------------------------


def _reverse_sample(rng: random.Random) -> tuple:
    while True:
        s = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
        if s != s[::-1]:  # a palindrome's wrong answer would be right
            return (s,)


_reverse_body = _body("rev:", "=")

# ---- sort ------------------------------------------------------------------------------------


def _sort_sample(rng: random.Random) -> tuple:
    while True:
        s = "".join(rng.choice(string.digits) for _ in range(rng.randint(4, 5)))
        if len(set(s)) > 1:
            return (s,)


_sort_body = _body("sort:", "=")

# ---- max / min -------------------------------------------------------------------------------


def _extreme_sample(kind: str) -> Callable[[random.Random], tuple]:
    """Digit strings whose max (or min) is uniform over 8 values and differs from the min (max)."""

    def sample(rng: random.Random) -> tuple:
        n = rng.randint(4, 5)
        if kind == "max":
            m = rng.randint(2, 9)
            digits = [m] + [rng.randint(0, m) for _ in range(n - 1)]
        else:
            m = rng.randint(0, 7)
            digits = [m] + [rng.randint(m, 9) for _ in range(n - 1)]
        if len(set(digits)) == 1:
            digits[-1] = m - 1 if kind == "max" else m + 1
        rng.shuffle(digits)
        return ("".join(map(str, digits)),)

    return sample


_max_body = _body("max:", "=")
_min_body = _body("min:", "=")

# ---- add -------------------------------------------------------------------------------------


def _add_sample(rng: random.Random) -> tuple:
    return (rng.randint(10, 99), rng.randint(1, 9))


_add_body = _body("add:", "=")


def _add_parse(prompt: str) -> tuple:
    a, b = _add_body(prompt).split("+")
    return (int(a), int(b))


# ---- code ------------------------------------------------------------------------------------


def _code_sample(rng: random.Random) -> tuple:
    return (rng.randint(10, 999),)


_code_body = _body("code:", ">")


def _code_label(x: tuple) -> str:
    n = x[0]
    return f"{n - n % 10}+{n % 10}"  # 417 -> "410+7"


# ---- calc (multi-turn, with a calculator tool) -------------------------------------------------


def _calc_sample(rng: random.Random) -> tuple:
    return (rng.randint(10, 99), rng.randint(10, 99))


_calc_body = _body("calc:", "=")


def _calc_parse(prompt: str) -> tuple:
    a, b = _calc_body(prompt).split("*")
    return (int(a), int(b))


def _calc_wrong(x: tuple) -> str:
    est = (x[0] // 10) * (x[1] // 10) * 100  # product of the tens digits: a plausible estimate
    return str(est + 10 if est == x[0] * x[1] else est)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "reverse",
            "exact",
            "Reverse a string of 3-5 digits.",
            sample=_reverse_sample,
            prompt=lambda x: f"rev:{x[0]}=",
            answer=lambda x: x[0][::-1],
            wrong=lambda x: x[0],
            parse=lambda p: (_reverse_body(p),),
        ),
        Family(
            "sort",
            "exact",
            "Sort 4-5 digits ascending.",
            sample=_sort_sample,
            prompt=lambda x: f"sort:{x[0]}=",
            answer=lambda x: "".join(sorted(x[0])),
            wrong=lambda x: "".join(sorted(x[0], reverse=True)),
            parse=lambda p: (_sort_body(p),),
        ),
        Family(
            "max",
            "exact",
            "The largest of 4-5 digits.",
            sample=_extreme_sample("max"),
            prompt=lambda x: f"max:{x[0]}=",
            answer=lambda x: max(x[0]),
            wrong=lambda x: min(x[0]),
            parse=lambda p: (_max_body(p),),
        ),
        Family(
            "min",
            "exact",
            "The smallest of 4-5 digits.",
            sample=_extreme_sample("min"),
            prompt=lambda x: f"min:{x[0]}=",
            answer=lambda x: min(x[0]),
            wrong=lambda x: max(x[0]),
            parse=lambda p: (_min_body(p),),
        ),
        Family(
            "add",
            "math",
            "Add a digit (1-9) to a two-digit number (10-99).",
            sample=_add_sample,
            prompt=lambda x: f"add:{x[0]}+{x[1]}=",
            answer=lambda x: str(x[0] + x[1]),
            wrong=lambda x: str(x[0] + x[1] + 1),
            parse=_add_parse,
        ),
        Family(
            "code",
            "code",
            "Write a Python expression whose value is the number (10-999).",
            sample=_code_sample,
            prompt=lambda x: f"code:{x[0]}>",
            answer=lambda x: str(x[0]),
            wrong=lambda x: f"{x[0]}+1",
            parse=lambda p: (int(_code_body(p)),),
            label=_code_label,
            tests=lambda x: [f"assert result == {x[0]}"],
        ),
        Family(
            "calc",
            "tool",
            "Multiply two two-digit numbers; a calculator tool may be called as [expr].",
            sample=_calc_sample,
            prompt=lambda x: f"calc:{x[0]}*{x[1]}=",
            answer=lambda x: str(x[0] * x[1]),
            wrong=_calc_wrong,
            parse=_calc_parse,
            label=lambda x: f"[{x[0]}*{x[1]}]={x[0] * x[1]};{x[0] * x[1]}",
            tool="calc",
        ),
    ]
}


def get(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown task family {name!r}; built-in: {', '.join(sorted(FAMILIES))}") from None


def bucket(prompt: str, salt: str) -> int:
    """A stable hash of a prompt into 0..99 (independent for each salt)."""
    h = hashlib.sha256(f"{salt}\x00{prompt}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 100


def split_of(prompt: str) -> str:
    """The split ("train" or "eval") a prompt belongs to, whatever seed drew it."""
    return "eval" if bucket(prompt, "split") < EVAL_PERCENT else "train"


def rows(name: str, split: str, n: int, seed: int = 0) -> list[dict]:
    """`n` deterministic rows of family `name` from `split` ("train" or "eval").

    Distinct prompts as long as the split has enough of them (every family has hundreds at least);
    after that prompts repeat.
    """
    fam = get(name)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(f"marlaas-rows:{name}:{split}:{seed}")
    out: list[dict] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        x = fam.sample(rng)
        p = fam.prompt(x)
        if split_of(p) != split:
            continue
        if p in seen and misses < 200 * n + 1000:
            misses += 1
            continue
        seen.add(p)
        out.append(fam.row(x))
    return out


# ---- reference checking ----------------------------------------------------------------------

_ALLOWED_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div, ast.Mod)
_ALLOWED_UNARY = (ast.UAdd, ast.USub)


def safe_eval(expr: str, max_abs: float = 1e12):
    """Evaluate a small arithmetic Python expression (numbers, + - * / // %, parentheses).

    Anything else (names, calls, powers, ...) raises ValueError. A pure-Python stand-in for the
    sandboxed code verifier, for tests and pretraining evaluation.
    """
    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expr!r}") from e

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, _ALLOWED_UNARY):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, _ALLOWED_BINOPS):
            a, b = ev(node.left), ev(node.right)
            op = node.op
            if isinstance(op, ast.Add):
                v = a + b
            elif isinstance(op, ast.Sub):
                v = a - b
            elif isinstance(op, ast.Mult):
                v = a * b
            elif isinstance(op, ast.Div):
                v = a / b
            elif isinstance(op, ast.FloorDiv):
                v = a // b
            else:
                v = a % b
            if abs(v) > max_abs:
                raise ValueError("value too large")
            return v
        raise ValueError(f"unsupported syntax in {expr!r}")

    try:
        return ev(tree)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e


def run_tests(expr: str, tests: list[str]) -> bool:
    """True when `expr` evaluates (safely) and every assert in `tests` holds with `result` bound."""
    try:
        result = safe_eval(expr)
    except ValueError:
        return False
    for t in tests:
        try:
            exec(compile(t, "<test>", "exec"), {"__builtins__": {}}, {"result": result})
        except Exception:
            return False
    return True


def _number(text: str) -> float | None:
    t = text.strip()
    try:
        return float(int(t))
    except ValueError:
        try:
            return float(t)
        except ValueError:
            return None


def tool_of(spec) -> str | None:
    """The tool a job's episodes may call (its built-in family's), or None (single-turn)."""
    fam = FAMILIES.get(getattr(spec, "task", None) or "")
    return fam.tool if fam is not None else None


def correct(name: str, prompt: str, completion: str) -> bool:
    """Reference check: is `completion` a right answer to `prompt` of family `name`?"""
    fam = get(name)
    x = fam.parse(prompt)
    if fam.tool is not None:
        completion = final_answer(completion)
    if fam.verifier == "code":
        return run_tests(completion, fam.tests(x) if fam.tests else [])
    if fam.verifier == "math":
        got = _number(completion)
        return got is not None and got == float(fam.answer(x))
    return completion.strip() == fam.answer(x)


__all__ = [
    "FAMILIES",
    "Family",
    "MAX_ANSWER_TOKENS",
    "correct",
    "get",
    "rows",
    "run_tests",
    "safe_eval",
    "split_of",
    "tool_of",
]
