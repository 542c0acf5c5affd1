"""One access policy through every door (the direct Client, the HTTP API, the Tinker routes), against
a real Redis: another tenant's job or listing is not found (404), and the largest LoRA rank comes from
one setting (the deployment record, else MARLAAS_MAX_LORA_RANK)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from marlaas.api import access
from marlaas.api.app import create_app
from marlaas.api.client import Client
from marlaas.api.settings import ApiSettings
from marlaas.api.tenancy import add_tenant
from marlaas.errors import NotFound, SpecError
from marlaas.settings import Settings

pytestmark = pytest.mark.integration

SPEC = {"task": "sort", "steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_size": 2}


@pytest.fixture()
def doors(scratch_url, st, tmp_path):
    """Tenants alice and bob, one job of alice's, a model of alice's over the Tinker door:
    (alice's direct Client, bob's direct Client, {name: HTTP client}, alice's job id, alice's model id)."""
    st.set_deployment(base=str(tmp_path / "no-base-here"), base_name="tiny")
    tokens = {"alice": add_tenant(st, "alice"), "bob": add_tenant(st, "bob")}
    app = create_app(scratch_url, tmp_path / "home", settings=ApiSettings(rate=1000.0, burst=1000))
    with TestClient(app) as http:
        clients = {n: TestClient(app, headers={"Authorization": f"Bearer {t}"}) for n, t in tokens.items()}
        tinker = {n: TestClient(app, headers={"X-API-Key": f"tml-{t}"}) for n, t in tokens.items()}
        alice, bob = Client(scratch_url, token=tokens["alice"]), Client(scratch_url, token=tokens["bob"])
        job = alice.submit(SPEC).id
        sid = tinker["alice"].post("/api/v1/create_session", json={}).json()["session_id"]
        r = tinker["alice"].post("/api/v1/create_model", json={"session_id": sid, "base_model": "tiny",
                                                               "lora_config": {"rank": 4}})
        assert r.status_code == 200, r.text
        yield alice, bob, {**clients, "tinker_" + "alice": tinker["alice"], "tinker_bob": tinker["bob"],
                           "anon": http}, job, r.json()["model_id"]


def not_found(r) -> str:
    assert r.status_code == 404, (r.status_code, r.text)
    assert r.json()["error"]["type"] == "NotFound", r.text
    return r.json()["error"]["message"]


def test_another_tenants_job_is_not_found_through_every_door(doors):
    alice, bob, http, job, model = doors
    # the direct client
    with pytest.raises(NotFound, match=f"no job '{job}'"):
        bob.job(job)
    with pytest.raises(NotFound, match="no tenant 'alice'"):
        bob.jobs(tenant="alice")
    assert [j.id for j in bob.jobs()] == [] and [j.id for j in alice.jobs()] == [job]
    # the HTTP API: get, every per-job route, and the listing, answered as a missing job / tenant
    assert not_found(http["bob"].get(f"/v1/jobs/{job}")) == f"no job '{job}'"  # as a missing id
    assert not_found(http["bob"].get("/v1/jobs/j999999")) == "no job 'j999999'"
    for path in ("/events?after=0", "/metrics", "/evals", "/checkpoints", "/checkpoints/latest/adapter"):
        not_found(http["bob"].get(f"/v1/jobs/{job}{path}", headers={"Accept": "application/json"}))
    not_found(http["bob"].post(f"/v1/jobs/{job}/cancel"))
    assert not_found(http["bob"].get("/v1/jobs", params={"tenant": "alice"})) == "no tenant 'alice'"
    assert http["bob"].get("/v1/jobs").json() == {"jobs": []}
    assert [j["id"] for j in http["alice"].get("/v1/jobs").json()["jobs"]] == [job]
    assert alice.job(job).status()["status"] == "running"  # bob's cancel changed nothing
    # the Tinker door: bob's key cannot see alice's model
    assert http["tinker_alice"].get(f"/api/v1/training_runs/{model}").status_code == 200
    not_found(http["tinker_bob"].get(f"/api/v1/training_runs/{model}"))
    not_found(http["tinker_bob"].post("/api/v1/get_info", json={"model_id": model}))


def test_the_largest_lora_rank_comes_from_one_setting(doors, st):
    alice, _, http, _, _ = doors
    default = Settings.model_fields["max_lora_rank"].default
    assert access.max_lora_rank(st) == default  # no record yet: the setting
    over = {**SPEC, "lora": {"rank": default * 2}}
    sid = http["tinker_alice"].post("/api/v1/create_session", json={}).json()["session_id"]
    tinker_over = {"session_id": sid, "base_model": "tiny", "lora_config": {"rank": default * 2}}

    def refused_everywhere(top: int) -> None:
        with pytest.raises(SpecError, match=f"exceeds the maximum {top}"):
            alice.submit(over)
        for r in (http["alice"].post("/v1/jobs", json=over), http["tinker_alice"].post("/api/v1/create_model",
                                                                                         json=tinker_over)):
            assert r.status_code == 422, r.text
            assert f"maximum {top}" in r.json()["error"]["message"], r.text

    refused_everywhere(default)
    st.set_deployment(max_lora_rank=default // 2)  # the workers record the setting they run with
    assert access.max_lora_rank(st, fallback=256) == default // 2
    over = {**SPEC, "lora": {"rank": default}}
    tinker_over = {"session_id": sid, "base_model": "tiny", "lora_config": {"rank": default}}
    refused_everywhere(default // 2)
