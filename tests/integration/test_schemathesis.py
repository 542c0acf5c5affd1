"""schemathesis over the API's own /openapi.json against a real uvicorn server on a real Redis, with a
tenant's token: every check (`--checks all`) passes on every documented operation (57 operations,
~3,000 cases, ~20 s here): no 5xx, only documented status codes, bodies and headers as declared, schema-valid
requests accepted and schema-violating ones refused, 405 with a right `Allow` for undeclared methods.

Bounded: a few examples per operation (`MAX_EXAMPLES`), so the run takes well under 3 minutes.
One check is narrowed, per operation: positive data acceptance may also meet the one refusal named in
`REFUSED_VALID`, where the test's deployment or JSON Schema itself cannot make a valid request acceptable
(the reasons are beside each entry). Any other status to a schema-valid request still fails.
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
CHECKS = "all"
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]
"""schemathesis's own statuses that accept a schema-valid request (positive_data_acceptance)."""
TINKER = ["/api/v1/create_session", "/api/v1/session_heartbeat", "/api/v1/sessions/{sid}/finish",
          "/api/v1/get_info", "/api/v1/forward", "/api/v1/forward_backward", "/api/v1/optim_step",
          "/api/v1/save_weights", "/api/v1/save_weights_for_sampler", "/api/v1/load_weights",
          "/api/v1/retrieve_future", "/api/v1/cancel_future"]
REFUSED_VALID: dict[str, list[int]] = {
    # No base model: this test runs no worker, so nothing registers the deployment's base, and serving
    # and Tinker training refuse a well-formed request until one does (400 on the OpenAI door, 422 on
    # the Tinker door); the completion bodies also take free-form objects (metadata, ...): see below.
    "GET /v1/models/{model}": [400],
    "POST /v1/chat/completions": [400, 422],
    "POST /v1/completions": [400, 422],
    "POST /api/v1/create_model": [422],
    "POST /api/v1/create_sampling_session": [422],
    "POST /api/v1/asample": [422],
    "PUT /v1/aliases/{name}": [422],  # the alias's model is resolved when it is set; also its name's rules
    # Checked beyond what JSON Schema says: a job spec's rules across its fields, a file's bytes that must
    # be a JSONL or parquet dataset, a grader's templates and program.
    "POST /v1/jobs": [422],
    "POST /v1/files": [422],
    "POST /v1/graders/validate": [422],
    "POST /v1/graders/run": [422],
    # Tinker bodies ignore unknown fields (a newer SDK may send them), so their schemas let any extra value
    # through, and JSON Schema cannot bound the integers nested in free-form values: the API's JSON body
    # check refuses one past 64 bits (422) before any route (declared fields are bounded in the schema).
    **{f"POST {path}": [422] for path in TINKER},
    "PUT /api/v1/training_runs/{mid}/checkpoints/{kind}/{name}/ttl": [422],
}


def _config() -> str:
    """schemathesis.toml: positive data acceptance per operation of `REFUSED_VALID` (TOML takes JSON arrays)."""
    return "".join(f"[[operations]]\ninclude-name = {json.dumps(name)}\n"
                   f"checks.positive_data_acceptance.expected-statuses = "
                   f"{json.dumps(ACCEPTED + [str(c) for c in codes])}\n\n" for name, codes in REFUSED_VALID.items())


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


def test_schemathesis_all_checks_pass(scratch_url, st, tmp_path):
    srv = Server(create_app(scratch_url, tmp_path / "home", settings=ApiSettings(rate=0, burst=1)))
    token = add_tenant(st, "alice")
    report, config = tmp_path / "events.ndjson", tmp_path / "schemathesis.toml"
    config.write_text(_config())
    try:
        run = subprocess.run(
            [str(Path(sys.executable).with_name("st")), "--config-file", str(config), "run", f"{srv.url}/openapi.json",
             "-H", f"Authorization: Bearer {token}", "--checks", CHECKS, "-n", str(MAX_EXAMPLES),
             "--phases", "examples,coverage,fuzzing", "--request-timeout", "20", "--report", "ndjson",
             "--report-ndjson-path", str(report), "--no-color"],
            capture_output=True, text=True, timeout=360, cwd=tmp_path)  # its cache dir stays out of the repo
    finally:
        srv.stop()
    failures = _failures(report) if report.exists() else {}
    assert failures.get(SERVER_ERROR, 0) == 0, f"{failures}\n{_failed_cases(run.stdout)}"
    assert not failures, f"{failures}\n{_failed_cases(run.stdout)}"
    assert run.returncode == 0, _failed_cases(run.stdout)


def _failed_cases(stdout: str) -> str:
    """schemathesis's FAILURES section (each failing operation, what failed and a curl to reproduce it) as
    a plain string, so pytest shows it whole: a fuzzer's find is rare and must be readable from CI's log."""
    start = stdout.find("FAILURES")
    end = stdout.find("WARNINGS", start)
    return stdout[start:end if end > 0 else None][:12000] if start >= 0 else stdout[-3000:]
