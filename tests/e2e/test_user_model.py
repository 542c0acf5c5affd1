"""A user's own model: `marlaas up` on it, a job through the HTTP API, `marlaas down`, as a user would.

The base is a real-architecture model the test makes (a random-weight Llama with a byte-level BPE
tokenizer, a chat template and EOS <|im_end|>), in a directory of the "user's". It must come out
byte for byte unchanged (the bug this guards against: `up` deleted such a directory and pretrained
the tiny model in its place), and the job must run end to end on it with its chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from marlaas import Client, JobSpec
from marlaas.ops.embedded import free_port
from marlaas.store import Store
from tests.helpers_models import make_tiny_llama, tree_hashes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_up_a_job_and_down_on_a_users_llama_leave_it_untouched(tmp_path):
    src = make_tiny_llama(tmp_path / "users-models" / "tiny-llama")
    before = tree_hashes(src)
    home = tmp_path / "home"
    api_port, tool_port = free_port(), free_port()
    env = {**os.environ, "MARLAAS_HOME": str(home), "MARLAAS_BASE": str(src), "MARLAAS_THREADS": "1",
           "MARLAAS_API_PORT": str(api_port), "MARLAAS_API_URL": f"http://127.0.0.1:{api_port}",
           "MARLAAS_FLOWER_PORT": str(free_port()), "MARLAAS_METRICS_PORT": str(free_port()),
           "MARLAAS_TOOL_PORT": str(tool_port), "MARLAAS_TOOL_URL": f"http://127.0.0.1:{tool_port}"}
    for var in ("MARLAAS_REDIS_URL", "MARLAAS_TOKEN", "MARLAAS_FLOWER_AUTH"):
        env.pop(var, None)
    cli = [sys.executable, "-m", "marlaas.cli"]
    up = subprocess.run(cli + ["up", "--json"], env=env, capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        info = json.loads(up.stdout)
        assert info["api"] == env["MARLAAS_API_URL"] and ":***@" in info["redis"]  # the password never printed
        rows = [{"prompt": f"Say {w}.", "answer": w} for w in ("yes", "no", "fox", "dog", "sum", "word")]
        job = Client(info["api"]).submit(JobSpec(tenant="user", dataset=rows, steps=2, prompts_per_step=2,
                                                 group_size=2, max_new_tokens=6, eval_size=2, lora={"rank": 4}))
        st = job.wait(timeout=420)
        assert st["status"] == "done", st
        assert st["version"] == 2 and set(job.metrics()["evals"]) == {0, 2}
        url = (home / "embedded" / "redis.url").read_text().strip()
        assert oct((home / "embedded" / "redis.url").stat().st_mode & 0o777) == "0o600"
        rec = Store(url).job(job.id)
        assert rec.extra["chat_template"] == "applied"
        assert Store(url).deployment()["base"] == str(src)
        out = job.download_adapter(tmp_path / "adapter")
        cfg = json.loads((out / "adapter_config.json").read_text())
        leaves = {m.rsplit(".", 1)[-1] for m in cfg["target_modules"]}
        assert {"q_proj", "v_proj", "gate_proj", "down_proj"} <= leaves  # all-linear: the MLP too
    finally:
        down = subprocess.run(cli + ["down"], env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
    assert tree_hashes(src) == before
    assert not (src.parent / ".tiny-llama.building").exists()
    assert sorted(p.name for p in src.parent.iterdir()) == ["tiny-llama"]
