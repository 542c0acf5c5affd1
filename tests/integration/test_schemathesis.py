"""schemathesis over the API's own /openapi.json against a real uvicorn server on a real Redis, with a
tenant's token: no documented operation answers 5xx (57 operations, ~1,500 cases here).

Bounded: a few examples per operation (`MAX_EXAMPLES`), so the run takes well under 3 minutes.
Not yet asserted: schemathesis's conformance checks (`--checks all`: documented status codes, response
schemas, negative data accepted) still report failures on the route declarations; once those are fixed,
CHECKS becomes "all" and the run must still pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marlaas.api.app import create_app
from marlaas.api.settings import ApiSettings
from marlaas.api.tenancy import add_tenant
from tests.integration.test_api import Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
MAX_EXAMPLES = 5
SERVER_ERROR = "not_a_server_error"
CHECKS = SERVER_ERROR  # "all" (conformance) still finds failures: see the module docstring


def _failures(ndjson: Path) -> dict[str, int]:
    """{check name: failures} from schemathesis's NDJSON event stream."""
    out: dict[str, int] = {}
    for line in ndjson.read_text().splitlines():
        for check in _checks(json.loads(line)):
            if check.get("status") in ("FAILURE", "failure"):
                out[check["name"]] = out.get(check["name"], 0) + 1
    return out


def _checks(node) -> list[dict]:
    if isinstance(node, dict):
        if "name" in node and "status" in node and isinstance(node.get("name"), str):
            return [node]
        return [c for v in node.values() for c in _checks(v)]
    if isinstance(node, list):
        return [c for v in node for c in _checks(v)]
    return []


def test_schemathesis_finds_no_server_error(scratch_url, st, tmp_path):
    srv = Server(create_app(scratch_url, tmp_path / "home", settings=ApiSettings(rate=0, burst=1)))
    token = add_tenant(st, "alice")
    report = tmp_path / "events.ndjson"
    try:
        run = subprocess.run(
            [str(Path(sys.executable).with_name("st")), "run", f"{srv.url}/openapi.json",
             "-H", f"Authorization: Bearer {token}", "--checks", CHECKS, "-n", str(MAX_EXAMPLES),
             "--phases", "examples,coverage,fuzzing", "--request-timeout", "20", "--report", "ndjson",
             "--report-ndjson-path", str(report), "--no-color"],
            capture_output=True, text=True, timeout=360, cwd=tmp_path)  # its cache dir stays out of the repo
    finally:
        srv.stop()
    failures = _failures(report) if report.exists() else {}
    assert failures.get(SERVER_ERROR, 0) == 0, (failures, run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:]
