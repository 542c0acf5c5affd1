"""The python grader's calls: the sandbox program of one call, its outcome, one sandbox batch for all.

`python_program(g, sample, item)` embeds a `PythonGrader`'s source (`marlaas.verify.graders`) in a
program that prints only a marker line with the number `grade(sample, item)` returned;
`python_outcome` reads it back (a number in [0, 1], else one error line); `run_python` runs every
queued call in ONE sandbox batch under the strictest limits of the graders queued.
Invariant: tenant source runs only in the sandbox (`marlaas.verify.sandbox`), never here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from marlaas.errors import one_line

MARK = "__marlaas_grade__="
RANGE_EPS = 1e-9
Outcome = tuple[float, str | None]


def in_range(value: object, what: str) -> float:
    """`value` as a float in [0, 1] (a bool as 0/1; within RANGE_EPS clamped); TypeError/ValueError otherwise."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"{what} returned {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} returned {value}")
    if not -RANGE_EPS <= value <= 1 + RANGE_EPS:
        raise ValueError(f"{what} returned {value}, outside [0, 1]")
    return min(1.0, max(0.0, value))


def python_program(g, sample: dict, item: Mapping) -> str:
    """The sandbox program of one call: the tenant's source in its own namespace, grade(sample, item)
    on JSON copies, its prints discarded, the number printed after a marker."""
    return (
        "import json as _j, sys as _s\n"
        "class _Sink:\n"
        "    def write(self, t):\n        return len(t)\n"
        "    def flush(self):\n        pass\n"
        "_out = _s.stdout\n"
        "_s.stdout = _s.stderr = _Sink()\n"
        f"_sample = _j.loads({json.dumps(sample)!r})\n"
        f"_item = _j.loads({json.dumps(dict(item))!r})\n"
        "_ns = {'__name__': '__grader__'}\n"
        f"exec(compile({g.source!r}, '<grader>', 'exec'), _ns)\n"
        "_v = _ns['grade'](_sample, _item)\n"
        "if not isinstance(_v, (bool, int, float)):\n"
        "    raise TypeError(f'grade returned {type(_v).__name__}, not a number')\n"
        f"_out.write('\\n{MARK}' + repr(float(_v)) + '\\n')\n"
        "_out.flush()\n"
    )


def python_outcome(result) -> Outcome:
    """(reward, None) from a sandbox result of `python_program`, or (0.0, one line)."""
    if not result.ok:
        return 0.0, one_line(f"python grader: {result.error or result.status}")
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(MARK)), None)
    if line is None:
        return 0.0, "python grader: no result (output lost)"
    try:
        return in_range(float(line[len(MARK):]), "grade"), None
    except ValueError as e:
        return 0.0, one_line(f"python grader: {e}")


def run_python(queued: list) -> list:
    """Run every queued python call in ONE sandbox batch (limits: the strictest of the graders
    queued); SandboxError when the sandbox itself fails."""
    from marlaas.verify.sandbox import Limits, run_batch

    if not queued:
        return []
    timeout = min(g.timeout_s for _, g in queued)
    limits = Limits(cpu_s=max(1, math.ceil(timeout)), wall_s=timeout, memory_mb=min(g.memory_mb for _, g in queued))
    return run_batch([p for p, _ in queued], limits)
