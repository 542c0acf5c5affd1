"""What a tenant sees is true: rows a grader cannot read are refused at submit naming the tenant's own
file and row (numbered from 1), the HTTP client's grader calls, and the HTTP e2e checks that exact
is apart from mean reward and that every grader error reaches the tenant.

Through a real uvicorn server and a real Redis (the e2e test: the real worker stack and tiny base).
"""

from __future__ import annotations

import json

import pytest

from marlaas.api.app import create_app
from marlaas.api.http_client import Client
from marlaas.api.settings import ApiSettings
from marlaas.errors import SpecError
from tests.integration.test_api import Server, err, serve, two  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

READS_ANSWER = {"type": "python", "source": "def grade(sample, item):\n    return float(sample['output_text'] == "
                                             "item['answer'])\n"}
ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(6)]


def test_a_row_the_grader_cannot_read_is_refused_naming_it(two, tmp_path):  # noqa: F811
    url, c, _ = two
    rows = [dict(r) for r in ROWS]
    del rows[3]["answer"]
    body = {"dataset": rows, "grader": READS_ANSWER, "steps": 1, "prompts_per_step": 1, "group_size": 2}
    msg = err(c["alice"].post("/v1/jobs", json=body), 422, "SpecError")
    assert msg.startswith("dataset row 4: the grader reads item['answer']"), msg  # numbered from 1
    # held-out rows too, and a template field
    template = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.gold}}",
                "operation": "eq"}
    held = [{"prompt": "h1", "gold": "1"}, {"prompt": "h2"}]
    body = {"dataset": [{**r, "gold": "x"} for r in ROWS], "eval_dataset": held, "grader": template, "steps": 1,
            "prompts_per_step": 1, "group_size": 2}
    assert err(c["alice"].post("/v1/jobs", json=body), 422, "SpecError").startswith(
        "eval_dataset row 2: the grader reads item['gold']")
    # item.get(...) is the tenant's way to say a field is optional: accepted
    optional = {"type": "python", "source": "def grade(sample, item):\n    return float(item.get('answer') == 1)\n"}
    assert c["alice"].post("/v1/jobs", json={**body, "grader": optional}).status_code == 201
    # an uploaded file is named as the tenant named it, with its line, never the server's file id
    (tmp_path / "my rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with Client(url, token=c["tokens"]["alice"]) as alice:
        with pytest.raises(SpecError, match=r"^dataset my rows\.jsonl line 4: the grader reads item\['answer'\]") as e:
            alice.submit({"dataset": str(tmp_path / "my rows.jsonl"), "grader": READS_ANSWER, "steps": 1,
                          "prompts_per_step": 1, "group_size": 2})
        assert "file-" not in str(e.value)
    bad = c["alice"].post("/v1/files", params={"filename": "/home/me/mine.jsonl"}, content=b'{"prompt": "a"}\nnope\n')
    assert err(bad, 422, "SpecError") == "file mine.jsonl line 2: not valid JSON (Expecting value)"


def test_the_http_client_validates_and_runs_graders(two):  # noqa: F811
    url, c, _ = two
    with Client(url, token=c["tokens"]["alice"]) as alice:
        assert alice.validate_grader(READS_ANSWER)["timeout_s"] == 2.0
        with pytest.raises(SpecError, match="invalid grader"):
            alice.validate_grader({"type": "python", "source": "x = 1"})
        run = alice.run_grader({"type": "text_similarity", "input": "{{sample.output_text}}",
                                "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"},
                               "abcd", {"answer": "abce"})
        assert 0.0 < run["reward"] < 1.0 and run["error"] is None
        assert alice.run_grader(READS_ANSWER, "1", {})["error"].startswith("python grader: KeyError")
        job = alice.submit({"task": "sort", "steps": 1, "prompts_per_step": 1, "group_size": 2})
        st = job.status()
        assert st["id"] == job.id and st["job"] == job.id  # `job`: the deprecated alias
        assert st["grader_errors"] == {"train": 0, "eval": 0} and st["base_exact"] is None


# ---------------------------------------------------------------- through the workers
HALF = {"type": "python", "source": "def grade(sample, item):\n    return 0.5\n"}
# reads `gold` with get (so submit accepts rows without it), then fails on a row that lacks it
GOLD = {"type": "python", "source": "def grade(sample, item):\n    return float(item.get('gold').strip() == "
                                    "sample['output_text'].strip())\n"}
BROKEN = {"type": "python", "source": "def grade(sample, item):\n    raise ValueError('broken grader')\n"}


@pytest.mark.e2e
def test_what_the_tenant_sees_over_http(worker_stack, tmp_path):
    srv = Server(create_app(worker_stack.url, tmp_path / "home", open=True,
                            settings=ApiSettings(rate=1000.0, burst=1000)))
    small = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "eval_k": 2, "max_new_tokens": 4, "seed": 1}
    rows = [{"prompt": f"max:{i}{i + 1}{i + 2}=", "answer": str(i + 2), "gold": str(i + 2)} for i in range(6)]
    try:
        with Client(srv.url) as client:
            partial = client.submit({"tenant": "truth", "dataset": rows, "grader": HALF, **small, "eval_size": 3})
            eval_err = client.submit({"tenant": "truth", "dataset": rows, "grader": GOLD, **small,
                                      "eval_dataset": [{"prompt": "max:123=", "gold": "3"}, {"prompt": "max:234="}]})
            broken = client.submit({"tenant": "truth", "dataset": rows, "grader": BROKEN, **small, "steps": 6,
                                    "max_grader_error_groups": 2, "max_grader_error_share": 1.0})
            # 1. partial credit is mean reward, never exact; pass@k counts full-reward samples only
            st = partial.wait(timeout=600)
            assert st["status"] == "done", st
            assert (st["base_exact"], st["final_exact"]) == (0.0, 0.0) and st["base_acc"] == 0.0
            assert (st["base_mean_reward"], st["final_mean_reward"]) == (0.5, 0.5)
            evs = partial.evals()
            assert [(e["version"], e["exact"], e["mean_reward"], e["pass_at_k"]) for e in evs] == [
                (0, 0.0, 0.5, 0.0), (2, 0.0, 0.5, 0.0)]
            assert evs[-1]["train_reward"] == 0.5
            # the downloaded adapter names the base, not the server's path to it
            cfg = partial.download_adapter(tmp_path / "a") / "adapter_config.json"
            base = json.loads(cfg.read_text())["base_model_name_or_path"]
            assert "/" not in base and base, base
            # 2. a held-out row the grader errs on is counted, and shown with the tenant's row number
            st = eval_err.wait(timeout=600)
            assert st["status"] == "done", st  # 1 of 2 rows: not more than max_grader_error_share 0.5
            assert st["grader_errors"]["eval"] > 0 and st["grader_errors"]["train"] == 0, st
            page = eval_err.events()
            notices = [e for e in page["events"] if e["type"] == "grader_error"]
            assert notices and all(n["data"]["row"] == "eval_dataset row 2" and n["data"]["phase"] == "eval"
                                   for n in notices), notices
            assert "AttributeError" in notices[0]["data"]["error"] and "/" not in notices[0]["data"]["error"]
            assert any(e["type"] == "warning" and "1 of 2 held-out rows" in e["data"]["message"]
                       for e in page["events"])
            assert all(e["grader_errors"] == 1 for e in eval_err.evals())
            # 3. a grader failing on every group fails the job with a one-line reason
            st = broken.wait(timeout=600)
            assert st["status"] == "failed", st
            assert "groups in a row (max_grader_error_groups 2): python grader: ValueError: broken grader" \
                in st["error"] and "\n" not in st["error"], st["error"]
            assert st["grader_errors"]["train"] >= 4
            kinds = {e["type"] for e in broken.events()["events"]}
            assert {"grader_error", "warning"} <= kinds
    finally:
        srv.stop()
