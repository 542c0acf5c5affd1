"""Flower's password never sits in a command line, and `marlaas up` names the port Flower runs on."""

from pathlib import Path

import pytest

from marlaas.ops import embedded

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_procfile_hands_flower_its_password_through_the_environment():
    line = next(ln for ln in (ROOT / "Procfile").read_text().splitlines() if ln.startswith("flower:"))
    assert "--basic-auth" not in line  # argv is visible to every user in `ps`
    assert 'FLOWER_BASIC_AUTH="${FLOWER_BASIC_AUTH:-${MARLAAS_FLOWER_AUTH:?' in line and "exec celery" in line
    assert '--port="${MARLAAS_FLOWER_PORT:-5555}"' in line


def test_flower_url_follows_the_port_setting(monkeypatch):
    monkeypatch.delenv("MARLAAS_FLOWER_PORT", raising=False)
    assert embedded.flower_url() == "http://127.0.0.1:5555"
    monkeypatch.setenv("MARLAAS_FLOWER_PORT", "5601")
    assert embedded.flower_url() == "http://127.0.0.1:5601"


def test_the_stack_environment_carries_flowers_credential(monkeypatch):
    monkeypatch.setenv("MARLAAS_FLOWER_AUTH", "marlaas:s3cret")
    env = embedded.stack_env("redis://:pw@127.0.0.1:1/0")
    assert env["FLOWER_BASIC_AUTH"] == "marlaas:s3cret"


def test_the_stack_runs_flowers_line_as_written_and_others_under_exec():
    """`exec VAR=... prog` would look for a program named `VAR=...`: a line that execs itself runs as
    written (Flower's), every other line under `exec`."""
    lines = embedded.procfile_lines()
    assert embedded.shell_line(lines["flower"]) == lines["flower"]
    assert embedded.shell_line(lines["control"]) == "exec " + lines["control"]
    line = "celery -A tasks.app worker --executor x"  # "exec" inside a word is no exec
    assert embedded.shell_line(line) == "exec " + line
