"""The library never imports celery: only tasks/ and workers/ do."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def test_no_celery_import_in_source():
    offenders = []
    for f in (ROOT / "marlaas").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "celery" or n.startswith("celery.") or n == "kombu" for n in names):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_importing_the_library_loads_no_celery():
    code = (
        "import sys, marlaas, marlaas.client, marlaas.cli, marlaas.dispatch, marlaas.stations, "
        "marlaas.store, marlaas.scheduler, marlaas.embedded, marlaas.demo; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
