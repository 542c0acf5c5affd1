"""The layout's rules, checked on the source: no celery in the library, pure modules stay pure, no
import cycle between the project's files (lazy imports inside functions included), files stay small."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("marlaas", "tasks", "workers")

# Pure modules: policy and maths over plain data. They import no redis, store, Celery or tasks.
PURE = (
    "marlaas.types",
    "marlaas.control.scheduler",
    "marlaas.train.rl",
    "marlaas.train.losses",
    "marlaas.train.schedule",
    "marlaas.tools.episodes",
    "marlaas.verify.evaluation",
    "marlaas.verify.preflight",
    "marlaas.families",
)
IMPURE_ROOTS = ("redis", "celery", "kombu", "tasks", "workers", "marlaas.store")


def _modules() -> dict[str, Path]:
    mods = {}
    for top in PACKAGES:
        for f in (ROOT / top).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module `mod` imports, at the top or inside functions. `from pkg import sub` counts as an
    import of the submodule `pkg.sub` (not of the package, whose __init__ is executed anyway)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(base)
    out.discard(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    mods = _modules()
    graph = {m: {d for d in _imports(m, f, mods) if d in mods} for m, f in mods.items()}
    assert _cycles(graph) == []


def test_pure_modules_import_no_store_redis_or_tasks():
    mods = _modules()
    offenders = {}
    for m in PURE:
        bad = sorted(d for d in _imports(m, mods[m], mods)
                     if any(d == r or d.startswith(r + ".") for r in IMPURE_ROOTS))
        if bad:
            offenders[m] = bad
    assert offenders == {}


def test_no_celery_import_in_library():
    mods = _modules()
    offenders = [m for m, f in mods.items() if m.split(".")[0] == "marlaas"
                 and any(d.split(".")[0] in ("celery", "kombu") for d in _imports(m, f, mods))]
    assert offenders == []


def test_files_stay_small_and_the_top_level_is_short():
    big = {str(f.relative_to(ROOT)): n for f in _modules().values()
           if f.name != "_sandbox_runner.py" and (n := len(f.read_text().splitlines())) > 450}
    assert big == {}
    assert len(list((ROOT / "marlaas").glob("*.py"))) <= 12


def test_importing_the_library_loads_no_celery():
    code = (
        "import sys, marlaas, marlaas.api.client, marlaas.cli, marlaas.control.dispatch, "
        "marlaas.generate.station, marlaas.verify.station, marlaas.train.station, marlaas.store, "
        "marlaas.control.scheduler, marlaas.ops.embedded, marlaas.ops.demo; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# Underscore names of third-party libraries that marlaas has to reach (each with its reason). A
# project module reaching another project module's underscore name is never allowed.
THIRD_PARTY_PRIVATE = {
    "_replace": "namedtuple's public API (urllib's ParseResult)",
    "_exit": "os._exit in the sandbox's forked children",
    "_C": "torch._C thread and flag settings",
    "_disable_adapters": "peft LoRA layers' disable flag (the stacked multi-LoRA layer mirrors it)",
    "_forward_pre_hooks": "torch hooks left by a failed peft generate (removed to recover)",
    "_forward_pre_hooks_with_kwargs": "torch hooks left by a failed peft generate (removed to recover)",
}


def private_reads(path: Path) -> list[str]:
    """`X._name` where X is not self/cls, and `from M import _name`, in one file."""
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr not in THIRD_PARTY_PRIVATE:
                found.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in PACKAGES:
            found += [f"{n.lineno}: from {n.module} import {a.name}" for a in n.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_private_read_finder_finds_them(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from marlaas.x import _y\nself._ok\nengine._jobs\nu._replace()\nobj.__class__\n")
    assert private_reads(f) == ["1: from marlaas.x import _y", "3: engine._jobs"]


def test_no_module_reads_another_modules_underscore_names():
    offenders = {str(f.relative_to(ROOT)): bad for f in _modules().values() if (bad := private_reads(f))}
    assert offenders == {}


# Arrows point down: the records and the store know nothing of the doors or the scheduler.
FORBIDDEN_IMPORTS = {
    ("marlaas.spec", "marlaas.types", "marlaas.store"): ("marlaas.api", "marlaas.control"),
    ("marlaas.control",): ("marlaas.api",),
}


def test_imports_point_down():
    mods = _modules()
    offenders = {}
    for sources, targets in FORBIDDEN_IMPORTS.items():
        for m, f in mods.items():
            if not any(m == s or m.startswith(s + ".") for s in sources):
                continue
            bad = sorted(d for d in _imports(m, f, mods) if any(d == t or d.startswith(t + ".") for t in targets))
            if bad:
                offenders[m] = bad
    assert offenders == {}
