"""What a tenant may ask of reasoning-gym, and at what cost: the boundary of the reasoning-gym task source.

A `reasoning_gym:NAME` job hands a tenant's config to a third-party library, and the model's text
to that library's scorer. Three guards keep that inside the service's rules (tenant-written and
model-written text never runs as code outside the sandbox; every cost a tenant causes is bounded):

1. Tasks whose code can run text as Python are refused (`refusal`). The source of each task's
   module and of every reasoning_gym module it imports (transitively, inside the package) is
   scanned once with `ast`: a call of the builtins eval / exec / compile / __import__, of
   sympify / parse_expr / parse_latex / S, of pickle / marshal / dill / yaml loaders, or any import
   of sympy (whose functions turn string arguments into code) refuses the task with one line naming
   the place. Several scorers eval the model's answer (string_insertion, spiral_matrix, ...), and
   config strings reach eval in some generators. One task is allowed after reading its code
   (`AUDITED`): basic_arithmetic evals only expressions it builds from integers and operators its
   config's validate() restricts to + - * /. The verify station runs the remaining scorers in its
   own process, under the verify task's time limits. `composite` is refused as well (`REFUSED`): it
   builds other tasks by name from its config. Third-party libraries a task imports are not scanned.
2. Config values that name files are refused unless they name one of the package's own data files
   (`check_config_values`): reasoning-gym joins a `data_file` onto its data directory, so an
   absolute path would read any file the service can read (the store's credentials) into prompts.
   Every other string that looks like a path is refused too.
3. Rows are generated in a child process (`_rg_rows.py`) with a CPU, memory and wall-clock limit
   (`make_split_bounded`: CPU_S of CPU per submit): generators are lazy and some constructors
   precompute tables sized by the config (count_primes sieves up to max_n: max_n=3e7 cost 42 s per
   submit), so a config can ask for unbounded work; the service's processes never run a tenant's
   config unbounded. Where the cost follows from one config field (`COSTLY`: count_primes' max_n,
   game_of_life's grid and steps, tower_of_hanoi's disks, ...), a value past its bound is refused
   before any child starts, with one line naming the field (`check_config_cost`). A config whose
   dataset grows the child by more than `DATASET_MB` is refused as well: the verify station
   re-creates the same dataset to score (cached per worker), so that bound is the verify worker's
   memory per job too.

Invariant: `refusal(name)` is None only for tasks whose code (as installed) has no path from text
to Python execution, or that are in AUDITED; `make_split_bounded` either returns rows made within
the limits or raises TaskSourceError with one line.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from marlaas.errors import TaskSourceError

# Read and allowed: the eval is on an expression the generator builds itself (see module docstring).
AUDITED = {"basic_arithmetic"}
# Read and refused: composite builds other tasks by name from its config (refused ones included) and
# reads YAML files; a tenant submits one job per task instead.
REFUSED = {"composite": "reasoning-gym task 'composite' is not offered: it builds other tasks by name from its "
                        "config, past these checks; submit one job per task"}
_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint"}
_TEXT_TO_CODE = {"sympify", "parse_expr", "parse_latex", "S"}
_LOADERS = {("pickle", "loads"), ("pickle", "load"), ("marshal", "loads"), ("dill", "loads"),
            ("yaml", "load"), ("yaml", "unsafe_load")}
_CODE_MODULES = ("sympy",)

CPU_S = 10
WALL_S = 30.0
MEMORY_MB = 2048  # address space of the child: interpreter, numpy & co. and the dataset
DATASET_MB = 256  # what the dataset and its rows may add to the child's resident memory
COSTLY: dict[str, dict[str, tuple[int, str]]] = {
    "count_primes": {"max_n": (100_000, "it sieves up to max_n and lists every prime of a row's interval")},
    "game_of_life": {"grid_size_x": (100, "each row simulates the whole grid"),
                     "grid_size_y": (100, "each row simulates the whole grid"),
                     "simulation_steps": (100, "each row simulates every step")},
    "tower_of_hanoi": {"max_disks": (12, "a solution has 2**disks moves")},
    "rubiks_cube": {"cube_size": (7, "each row renders and scrambles the whole cube"),
                    "max_scramble_steps": (100, "each row applies every scramble step")},
    "maze": {"max_grid_size": (100, "each row searches the whole grid")},
}
"""Config fields whose value predicts a row-making cost past CPU_S: {task: {field: (largest, why)}}."""
_CHILDREN = threading.BoundedSemaphore(2)  # row-making children at once per process (memory: 2 x MEMORY_MB)


def _package_root() -> Path:
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None or spec.origin is None:
        raise TaskSourceError("reasoning-gym is not installed (pip install reasoning-gym)")
    return Path(spec.origin).parent


def _imported_modules(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [mod] + [f"{mod}.{a.name}" for a in node.names]


def _call_name(func: ast.AST) -> tuple[str | None, str | None]:
    """(object name or None, called name) of a call's function."""
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else None
        return owner, func.attr
    return None, None


def scan_source(text: str, where: str = "<source>") -> list[str]:
    """Places in `text` where text could become code (module docstring's list): 'where:line: what'."""
    hits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            owner, name = _call_name(node.func)
            if (owner is None and name in _BUILTINS) or name in _TEXT_TO_CODE or (owner, name) in _LOADERS:
                hits.append(f"{where}:{node.lineno}: {name}()")
        elif isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            top = {m.split(".")[0] for m in mods} & set(_CODE_MODULES)
            if top:
                hits.append(f"{where}:{node.lineno}: imports {min(top)}")
    return hits


def _scan_module(path: Path, root: Path, seen: set[Path]) -> list[str]:
    if path in seen:
        return []
    seen.add(path)
    rel = path.relative_to(root.parent)
    package = ".".join(rel.parts[:-1])
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    hits = scan_source(text, str(path.relative_to(root)))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for mod in _imported_modules(node, package):
            if not mod.startswith("reasoning_gym.") or mod == "reasoning_gym.factory":
                continue
            try:
                spec = importlib.util.find_spec(mod)
            except (ImportError, ValueError, AttributeError):
                continue  # `from .x import name`: the name is not a module
            origin = Path(spec.origin) if spec is not None and spec.origin else None
            inside = origin is not None and origin.suffix == ".py" and root in origin.parents
            if inside and origin.name != "__init__.py":
                hits += _scan_module(origin, root, seen)
    return hits


@functools.lru_cache(maxsize=256)
def refusal(name: str) -> str | None:
    """Why task `name` is refused (one line), or None when it may run. `name` must be registered."""
    if name in AUDITED:
        return None
    if name in REFUSED:
        return REFUSED[name]
    import inspect

    from reasoning_gym.factory import DATASETS

    root = _package_root()
    hits = _scan_module(Path(inspect.getfile(DATASETS[name][0])), root, set())
    if not hits:
        return None
    more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
    return (f"reasoning-gym task {name!r} is not offered: its code can run text as Python ({hits[0]}{more}), "
            f"and marlaas runs model- and tenant-written code only in the sandbox; use a dataset with a python grader")


@functools.lru_cache(maxsize=1)
def _data_files() -> frozenset[str]:
    data = _package_root() / "data"
    return frozenset(p.name for p in data.iterdir() if p.is_file()) if data.is_dir() else frozenset()


def _strings(value) -> list[str]:
    """Every string in a JSON value (keys included); iterative, whatever the nesting."""
    out, todo = [], [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
    return out


def check_config_values(name: str, config: dict) -> None:
    """Refuse config values that name files other than the package's data files (module docstring, 2)."""
    for key, value in config.items():
        if key.endswith(("file", "path", "dir", "directory", "filename")):
            if not isinstance(value, str) or value not in _data_files():
                raise TaskSourceError(f"reasoning-gym config {key!r} of {name!r} must name one of the package's "
                                      f"data files, e.g. {sorted(_data_files())[:3]}; got {value!r}")
        for s in _strings(value):
            if len(s) > 1 and ("/" in s or "\\" in s or s.startswith((".", "~"))):
                raise TaskSourceError(f"reasoning-gym config {key!r} of {name!r}: {s[:60]!r} looks like a path; "
                                      f"paths are not accepted")


def check_config_cost(name: str, config: dict) -> None:
    """Refuse a config whose cost `COSTLY` predicts as too large, naming the field (module docstring, 3)."""
    for key, (largest, why) in COSTLY.get(name, {}).items():
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > largest:
            raise TaskSourceError(f"reasoning-gym config {key!r} of {name!r} is {value:g}, at most {largest}: "
                                  f"{why}, past the {CPU_S} s of CPU a submit may spend making rows")


def make_split_bounded(name: str, config: dict, seed: int, n_train: int, n_held: int,
                       cpu_s: int = CPU_S) -> tuple[list[dict], list[dict]]:
    """`reasoning_gym.make_split` in a child process under `cpu_s` seconds of CPU, MEMORY_MB, WALL_S and
    DATASET_MB (at most two such children per process; a third caller waits for one to end)."""
    request = json.dumps({"name": name, "config": config, "seed": seed, "n_train": n_train, "n_held": n_held,
                          "cpu_s": cpu_s})
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    what = f"reasoning-gym task {name!r} with this config"
    try:
        with _CHILDREN:
            proc = subprocess.run([sys.executable, "-m", "marlaas.verify._rg_rows"], input=request, capture_output=True,
                                  text=True, timeout=WALL_S, env=env, cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        raise TaskSourceError(f"{what} takes more than {WALL_S:.0f} s to make its rows: make it smaller") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if proc.returncode in (-9, -24) or "MemoryError" in tail or "Cannot allocate" in tail:
            raise TaskSourceError(f"{what} needs more than {cpu_s} s of CPU or {MEMORY_MB} MB to make its rows: "
                                  f"make it smaller")
        raise TaskSourceError(f"{what} could not make its rows: {tail[:200]}")
    out = json.loads(proc.stdout)
    if "error" in out:
        raise TaskSourceError(out["error"])
    return out["train"], out["held"]
