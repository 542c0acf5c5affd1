"""Bad input through the API and the CLI: one clear line, a non-zero exit, nothing stored."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marlaas.api.client import Client
from marlaas.errors import MarlaasError
from marlaas.spec import JobSpec, parse_spec
from marlaas.store import Store
from tests.conftest import api_server

FIELDS = {
    "tenant": st.one_of(st.text(max_size=80), st.integers()),
    "task": st.one_of(st.none(), st.sampled_from(["sort", "code", "max", "nope", ""]), st.integers()),
    "dataset": st.one_of(st.none(), st.lists(st.dictionaries(st.sampled_from(["prompt", "answer", "x"]),
                                                             st.one_of(st.text(max_size=5), st.integers())),
                                             max_size=3), st.text(max_size=10)),
    "steps": st.one_of(st.integers(-5, 200_000), st.floats(allow_nan=True), st.text(max_size=3)),
    "group_size": st.integers(-2, 300),
    "prompts_per_step": st.integers(-2, 2000),
    "learning_rate": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-1, 2)),
    "max_staleness": st.integers(-3, 100),
    "temperature": st.floats(allow_nan=True, allow_infinity=True),
    "lora": st.one_of(st.just({}), st.dictionaries(st.sampled_from(["rank", "alpha", "bogus"]),
                                                   st.integers(-5, 5000))),
    "weight": st.floats(allow_nan=True, allow_infinity=True),
    "verifier": st.one_of(st.none(), st.sampled_from(["exact", "math", "code", "nope", "os:system", "a.b:c"])),
}


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_any_spec_is_valid_or_one_clear_error(data):
    try:
        spec = parse_spec(data)
    except MarlaasError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 400
        return
    assert isinstance(spec, JobSpec)
    assert spec.steps >= 1 and spec.group_size >= 2 and spec.learning_rate > 0
    assert (spec.task is None) != (spec.dataset is None)


@pytest.fixture()
def url(scratch_url):
    return scratch_url


def _nothing_stored(url):
    return not Store(url).job_ids()


@pytest.mark.integration
def test_api_refusals_store_nothing(url, tiny_base):
    store = Store(url)
    store.set_deployment(base=str(tiny_base), base_name="tiny", max_lora_rank=16)
    c = Client(url)
    bad = [
        ({"task": "sort", "base_model": "someone-elses-model"}, "serves base 'tiny'"),
        ({"task": "sort", "lora": {"rank": 64}}, "lora.rank: 64 exceeds the maximum 16"),
        ({"dataset": [{"prompt": "x" * 100, "answer": "1"}] * 3}, "exceeds the base model's context of 64"),
        ({"dataset": [{"prompt": "q", "answer": "1"}], "verifier": "code"}, "needs 'tests'"),
        ({"task": "sort", "steps": 10**9}, "steps"),
    ]
    for spec, words in bad:
        with pytest.raises(MarlaasError) as e:
            c.submit(spec)
        assert words in str(e.value) and "\n" not in str(e.value)
    assert _nothing_stored(url)


@pytest.mark.integration
def test_cli_bad_input_exits_non_zero_with_one_line(url, tmp_path):
    cli = [sys.executable, "-m", "marlaas.cli"]
    with api_server(url) as env:  # the tenant commands go through the API
        cases = {
            "broken.toml": ("task = ", "not valid TOML"),
            "bad.toml": ('task = "sort"\nsteps = -1\n', "steps"),
            "unknown.toml": ('task = "juggling"\n', "unknown task 'juggling'"),
            "latin1.toml": (b'task = "sort"\ntenant = "\xe9"\n', "not valid TOML"),
        }
        for name, (content, words) in cases.items():
            f = tmp_path / name
            f.write_bytes(content if isinstance(content, bytes) else content.encode())
            out = subprocess.run(cli + ["submit", str(f)], env=env, capture_output=True, text=True)
            assert out.returncode != 0, (name, out.stdout)
            assert words in out.stderr and out.stderr.strip().count("\n") == 0, (name, out.stderr)
        missing = subprocess.run(cli + ["status", "j999", "--json"], env=env, capture_output=True, text=True)
        assert missing.returncode == 2 and "no job 'j999'" in missing.stderr
        assert _nothing_stored(url)
        ok = tmp_path / "ok.toml"
        ok.write_text('task = "sort"\nsteps = 2\n')
        out = subprocess.run(cli + ["submit", str(ok), "--json"], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and json.loads(out.stdout)["status"] == "running"
