"""Conformance with tinker-cookbook itself: its own training entry points, unmodified, against marlaas.

`python -m tinker_cookbook.recipes.chat_sl.train` (supervised.train on a local JSONL of conversations)
and `python -m tinker_cookbook.recipes.math_rl.train` (rl.train on the arithmetic environment, with the
recipe's default loss, stable_reinforce, and default LoRA rank, 32) run as subprocesses of this
interpreter on SmolLM2-135M-Instruct (`smollm2_base`: a real Llama with a ChatML chat template),
served by its own worker stack and API. The SDK finds the server through TINKER_BASE_URL and
TINKER_API_KEY ('tml-' + a tenant token); `model_name` is the base directory, so the cookbook's
tokenizer loads from it (HF_HUB_OFFLINE=1: no hub). Each recipe runs a few steps, then runs again
with the same log_path and resumes from its own checkpoints.jsonl
(`create_training_client_from_state_with_optimizer`): every run exits 0 and each resume continues
from the saved step, not from 0. The two recipes run side by side (the server serves them in turn).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
pytest.importorskip("tinker_cookbook")

SL = "tinker_cookbook.recipes.chat_sl.train"
RL = "tinker_cookbook.recipes.math_rl.train"
# ChatML without a think block: SmolLM2's chat template, less its default system turn.
RENDERER = "qwen3_instruct"
CONVERSATIONS = [("What is 2+3?", "5"), ("Name a primary colour.", "Red"),
                 ("What is the capital of France?", "Paris"), ("Say hello.", "Hello!")]


@pytest.fixture(scope="module")
def cookbook_env(smollm2_base, home) -> dict[str, str]:
    """SmolLM2's own stack (Redis, API, control, generate, train, beat) and a tenant: the environment
    a cookbook process needs to reach it."""
    from marlaas.api import tenancy
    from marlaas.ops.embedded import Stack, free_port, wait_for_api, wait_for_workers
    from marlaas.store import Store

    own_home = home / "cookbook"
    own_home.mkdir(exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"MARLAAS_HOME": str(own_home), "MARLAAS_BASE": str(smollm2_base), "MARLAAS_ENGINE": "hf",
           "MARLAAS_THREADS": "1", "MARLAAS_LEASE_S": "120", "MARLAAS_API_PORT": str(port),
           "MARLAAS_API_URL": url}
    stack = Stack(env=env, log_dir=own_home / "logs")
    t0 = time.time()
    try:
        stack.start("redis", "api", "control", "generate", "train", "beat")
        wait_for_workers(Store(stack.url), stations=("generate", "train", "control"), timeout=300)
        wait_for_api(url)
        key = "tml-" + tenancy.add_tenant(Store(stack.url), "cookbook")
        print(f"cookbook stack up in {time.time() - t0:.0f} s")
        yield {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0",
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    finally:
        stack.stop()


def run_together(env: dict[str, str], runs: dict[str, tuple[str, list[str]]], out_dir: Path,
                 timeout: float = 600) -> dict[str, tuple[int, str]]:
    """Run `python -m module args...` for each named run at once; their exit codes and outputs."""
    procs = {}
    for name, (module, args) in runs.items():
        log = open(out_dir / f"{name}.out", "wb")
        procs[name] = (subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log)
    deadline = time.time() + timeout
    results = {}
    for name, (p, log) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        log.close()
        results[name] = (rc, (out_dir / f"{name}.out").read_text(errors="replace"))
    return results


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def recipe_runs(cookbook_env, smollm2_base, tmp_path_factory) -> dict:
    """Both recipes for a few steps, then both again on the same log directories (the resumes)."""
    root = tmp_path_factory.mktemp("cookbook")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    common = [f"model_name={smollm2_base}", f"renderer_name={RENDERER}", "behavior_if_log_dir_exists=resume"]
    sl = [*common, f"log_path={root / 'sl'}", f"dataset={data}", "batch_size=2", "max_length=128"]
    rl = [*common, f"log_path={root / 'rl'}", "env=arithmetic", "group_size=2", "groups_per_batch=2",
          "max_tokens=5"]
    t0 = time.time()
    first = run_together(cookbook_env, {"sl1": (SL, [*sl, "num_epochs=1"]), "rl1": (RL, [*rl, "max_steps=2"])},
                         root)
    t1 = time.time()
    snap = {"sl_ck": jsonl(root / "sl" / "checkpoints.jsonl") if (root / "sl" / "checkpoints.jsonl").exists() else [],
            "rl_ck": jsonl(root / "rl" / "checkpoints.jsonl") if (root / "rl" / "checkpoints.jsonl").exists() else []}
    second = {}
    if all(rc == 0 for rc, _ in first.values()):
        second = run_together(cookbook_env, {"sl2": (SL, [*sl, "num_epochs=2"]), "rl2": (RL, [*rl, "max_steps=3"])},
                              root)
    print(f"cookbook runs: first {t1 - t0:.0f} s, resumes {time.time() - t1:.0f} s")
    return {"root": root, **first, **second, **snap}


def tail(out: str, n: int = 3000) -> str:
    return out[-n:]


def test_supervised_train_runs_and_resumes_from_its_checkpoint(recipe_runs):
    rc, out = recipe_runs["sl1"]
    assert rc == 0, tail(out)
    log = recipe_runs["root"] / "sl"
    first = recipe_runs["sl_ck"]
    assert first[-1]["epoch"] == 1 and first[-1]["batch"] == 0, first  # one epoch of 2 batches, then final
    state = first[-1]["state_path"]
    assert state.startswith("tinker://") and "/weights/" in state

    rc, out = recipe_runs["sl2"]
    assert rc == 0, tail(out)
    assert f"Resumed training from {state}" in out
    assert f"Renderer metadata matches for checkpoint {state}: {RENDERER}" in out  # the run's user_metadata
    assert "Starting epoch 1" in out and "Starting epoch 0" not in out
    ck = jsonl(log / "checkpoints.jsonl")
    assert len(ck) == len(first) + 1 and ck[-1]["epoch"] == 2
    assert ck[-1]["state_path"] != state  # a new model, created from the saved state
    rows = jsonl(log / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the resume logged steps 2 and 3, never 0 again
    # the resumed weights are the trained ones: the second pass over the same data fits it better
    nll = [r["train_mean_nll"] for r in rows]
    assert (nll[2] + nll[3]) / 2 < (nll[0] + nll[1]) / 2, nll


def test_rl_train_with_its_default_loss_runs_and_resumes(recipe_runs):
    rc, out = recipe_runs["rl1"]
    assert rc == 0, tail(out)
    log = recipe_runs["root"] / "rl"
    assert json.loads((log / "config.json").read_text())["loss_fn"] == "stable_reinforce"  # the default
    first = recipe_runs["rl_ck"]
    assert first[-1]["batch"] == 2, first
    state = first[-1]["state_path"]

    rc, out = recipe_runs["rl2"]
    assert rc == 0, tail(out)
    assert f"Resumed training from {state}" in out
    assert f"Renderer metadata matches for checkpoint {state}: {RENDERER}" in out
    ck = jsonl(log / "checkpoints.jsonl")
    assert ck[-1]["batch"] == 3 and ck[-1]["state_path"] != state
    steps = [r for r in jsonl(log / "metrics.jsonl") if "env/all/reward/total" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]  # the resume ran step 2 only
    for r in steps:  # every step trained, on samples of the current sampler weights
        assert r["tokens/trained"] > 0
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3, r
