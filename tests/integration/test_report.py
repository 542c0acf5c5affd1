"""Run reports: one PNG and one self-contained HTML page, written from a real store."""

import base64
import json
import re
import time

import pytest

from marlaas.errors import MarlaasError
from marlaas.ops import report
from marlaas.spec import JobSpec
from marlaas.store import Store
from marlaas.types import AdapterBlob

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def build_jobs(st: Store) -> dict[str, str]:
    """Three tenants' jobs as the stations leave them; returns tenant -> job id."""
    now = time.time()
    rows = [{"prompt": f"sort:{i}=", "answer": str(i)} for i in range(6)]
    ids = {}
    for k, tenant in enumerate(("alice", "bob", "carol")):
        steps = 3 + k
        spec = JobSpec(tenant=tenant, task="sort", steps=steps, prompts_per_step=2, group_size=4,
                       max_staleness=k, eval_size=2)
        jid = st.create_job(spec, rows, rows[:2])
        st.put_eval_result(jid, 0, {"exact": 0.25, "mean_reward": 0.25, "acc": 0.25, "n": 4, "at": now})
        for t in range(steps):
            m = {"loss": 0.5, "step": t + 1, "reward_mean": 0.1 * t + 0.05 * k, "staleness": [min(t, k), 0],
                 "train_s": 0.2, "at": now + t}
            assert st.publish(jid, t, AdapterBlob(config={"r": 1}, weights=b"w"), b"o", m, "tok", [], steps)
            if t == 1:
                st.put_eval_result(jid, 2, {"exact": 0.5, "mean_reward": 0.5, "acc": 0.5, "n": 4, "at": now + t})
        if tenant != "carol":
            st.put_eval_result(jid, steps, {"exact": 0.75, "mean_reward": 0.75, "acc": 0.75, "n": 4, "at": now + steps})
            st.set_status(jid, "done")
        ids[tenant] = jid
    st.incr_field(ids["bob"], "regenerated", 4)
    for i in range(6):
        st.record_event("generate", now + i, now + i + 0.6, list(ids.values()), "g1")
        st.record_event("verify", now + i + 0.6, now + i + 0.8, [ids["alice"]], "v1")
        st.record_event("train", now + i + 0.8, now + i + 1.0, [ids["bob"]], "t1")
    return ids


@pytest.mark.integration
def test_write_report_writes_png_and_self_contained_html(st, tmp_path):
    ids = build_jobs(st)
    png, page = report.write_report(st, list(ids.values()), tmp_path / "out")
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    text = page.read_text(encoding="utf-8")
    for tenant, jid in ids.items():
        assert f"tenant {tenant}</h2>" in text and f"<td>{jid}</td>" in text
    m = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert m and base64.b64decode(m.group(1)) == data  # the page embeds the very same figure
    assert "src=\"http" not in text and "<link" not in text  # nothing to fetch
    # bob: steps 4/4, base exact 0.25, final 0.75 (mean reward the same), 4 regenerated; carol still
    # evaluating: no final figures
    assert re.search(r"<td>4/4</td><td>0.25</td><td>0.75</td><td>0.25</td><td>0.75</td><td>4</td><td>0 / 0</td>",
                     text)
    assert re.search(r"<td>5/5</td><td>0.25</td><td>–</td><td>0.25</td><td>–</td><td>0</td>", text)


@pytest.mark.integration
def test_gather_numbers_behind_the_figure(st):
    ids = build_jobs(st)
    data = report.gather(st, list(ids.values()))
    # staleness lists per step: alice (S=0) [0,0]x3; bob (S=1) [0,0],[1,0]x3; carol (S=2) [0,0],[1,0],[2,0]x3
    assert report.staleness_counts(data["jobs"]) == {"alice": {0: 6}, "bob": {0: 5, 1: 3}, "carol": {0: 6, 1: 1, 2: 3}}
    assert data["jobs"][0]["evals"] == {0: 0.25, 2: 0.5, 3: 0.75}
    assert len(data["events"]) == 18
    assert data["busy"]["generate"] > data["busy"]["verify"] > 0
    with pytest.raises(MarlaasError):
        report.gather(st, [])


@pytest.mark.unit
def test_html_page_escapes_and_groups_by_tenant():
    job = {"job": "j1", "tenant": "a<b>", "task": "x&y", "status": "running", "version": 1, "steps_total": 2,
           "evals": {0: 0.5}, "regenerated": 0, "verify_errors": 0, "metrics": []}
    data = {"generated": 0.0, "jobs": [job, {**job, "job": "j2"}], "t0": 0.0, "t1": 1.0, "events": [],
            "busy": {"generate": 0.0}}
    text = report.html_page(data, PNG_MAGIC)
    assert "tenant a&lt;b&gt;</h2>" in text and text.count("<h2>") == 1 and "x&amp;y" in text
    assert "<b>" not in text


@pytest.mark.integration
def test_cli_report_all_json(st, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from marlaas.cli import app
    from marlaas.settings import get_settings

    ids = build_jobs(st)
    monkeypatch.setenv("MARLAAS_REDIS_URL", st.url)
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(app, ["report", ids["alice"], "--out", str(tmp_path), "--json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout)
        assert out["png"].endswith(f"report-{ids['alice']}.png") and out["html"].endswith(".html")
        res = CliRunner().invoke(app, ["report", "--all", "--out", str(tmp_path), "--json"])
        assert res.exit_code == 0, res.output
        page = open(json.loads(res.stdout)["html"], encoding="utf-8").read()
        assert all(t in page for t in ids)
        res = CliRunner().invoke(app, ["report", "--out", str(tmp_path)])  # neither ids nor --all
        assert isinstance(res.exception, MarlaasError)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
