"""A Tinker-style RL loop with the unmodified SDK against marlaas: sample, reward on the client,
an importance_sampling step, new sampler weights; the mean reward per iteration.

    .venv/bin/python bench/tinker_rl.py --out results/tinker_rl.json                 # tiny test base, sort
    .venv/bin/python bench/tinker_rl.py --base DIR --task reasoning_gym:basic_arithmetic \\
        --iterations 4 --out results/tinker_rl_smollm2.json                            # a real base, read only

Starts a private stack on 127.0.0.1 (Redis, the API, the stations) on the base (default: the tiny
test base, built here); the client samples `--samples` completions for each of `--prompts` prompts
per iteration, rewards them itself (the task's own check), centres the rewards per prompt
(GRPO-style advantages), and sends one forward_backward (importance_sampling, with the sampler's
logprobs) and one optim_step. Reports the mean reward of every iteration. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path


def rows_and_reward(task: str, n: int, seed: int, tokenizer):
    """(prompts as text, reward(completion, i)) for a built-in family or a reasoning-gym task."""
    if task.startswith("reasoning_gym:"):
        from marlaas.api.datasets_io import render_chat
        from marlaas.verify import reasoning_gym

        name, config = reasoning_gym.parse_task(task, {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                       "max_digits": 2, "operators": ["+", "-"],
                                                       "allow_parentheses": False, "allow_negation": False}
                                                if task.endswith("basic_arithmetic") else None)
        rows = reasoning_gym.make_rows(name, config, seed, n)
        rows = render_chat(rows, tokenizer, "dataset")
        return [r["prompt"] for r in rows], lambda text, i: reasoning_gym.score(text, rows[i])
    from marlaas import families

    rows = families.rows(task, "train", n, seed)
    return [r["prompt"] for r in rows], lambda text, i: float(text.strip() == str(rows[i]["answer"]).strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=None, help="a base model directory (read only)")
    ap.add_argument("--task", default="max")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/tinker_rl.json"))
    a = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    home = Path(tempfile.mkdtemp(prefix="marlaas-bench-tinker-rl-"))
    os.environ["MARLAAS_HOME"] = str(home)
    os.environ.pop("MARLAAS_REDIS_URL", None)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    import tinker
    from tinker import types

    from marlaas.api.tenancy import add_tenant
    from marlaas.base.pretrain import ensure_base
    from marlaas.base.tiny import load_tokenizer
    from marlaas.ops.embedded import Stack, free_port, wait_for_api, wait_for_workers
    from marlaas.store import Store

    base = a.base or ensure_base(home / "base-test", preset="test", seed=0, progress=False, threads=1)
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    stack = Stack(log_dir=home / "logs", env={"MARLAAS_BASE": str(base), "MARLAAS_ENGINE": "hf", "MARLAAS_THREADS": "1",
                                              "MARLAAS_API_PORT": str(api_port), "MARLAAS_API_RATE": "0"})
    rng = random.Random(a.seed)
    tok = load_tokenizer(base)
    prompts, reward = rows_and_reward(a.task, 256, a.seed, tok)
    curve = []
    t0 = time.time()
    try:
        stack.start("redis", "api", "control", "generate", "verify", "train", "beat")
        store = Store(stack.url)
        wait_for_workers(store, timeout=300)
        wait_for_api(api)
        sc = tinker.ServiceClient(base_url=api, api_key="tml-" + add_tenant(store, "tinker-rl"))
        model = sc.get_server_capabilities().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=model, rank=8, seed=a.seed).result()
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0)
        for it in range(a.iterations):
            sampler = tc.save_weights_and_get_sampling_client(f"it{it}")
            picks = rng.sample(range(len(prompts)), a.prompts)
            futures = [(i, sampler.sample(prompt=types.ModelInput.from_ints(tok(prompts[i])["input_ids"]),
                                          num_samples=a.samples, sampling_params=params)) for i in picks]
            data, rewards = [], []
            for i, fut in futures:
                seqs = fut.result().sequences
                r = [reward(tok.decode(s.tokens, skip_special_tokens=True), i) for s in seqs]
                rewards += r
                mean = sum(r) / len(r)
                ids = tok(prompts[i])["input_ids"]
                for s, ri in zip(seqs, r):
                    if ri == mean or not s.tokens:
                        continue  # no signal in this sample
                    full, pad = ids + list(s.tokens), len(ids) - 1
                    data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                        "target_tokens": types.TensorData(data=full[1:], dtype="int64", shape=[len(full) - 1]),
                        "logprobs": types.TensorData(data=[0.0] * pad + list(s.logprobs), dtype="float32",
                                                     shape=[len(full) - 1]),
                        "advantages": types.TensorData(data=[0.0] * pad + [ri - mean] * len(s.tokens),
                                                       dtype="float32", shape=[len(full) - 1])}))
            curve.append(round(sum(rewards) / len(rewards), 4))
            print(f"iteration {it}: mean reward {curve[-1]:.3f} ({len(data)} samples with signal)", flush=True)
            if data:
                tc.forward_backward(data, "importance_sampling").result()
                tc.optim_step(types.AdamParams(learning_rate=a.lr)).result()
        k = max(1, len(curve) // 4)
        out = {"command": "bench/tinker_rl.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
               "base": base.name if a.base else "tiny test base", "task": a.task,
               "sizes": {"iterations": a.iterations, "prompts": a.prompts, "samples": a.samples,
                         "max_tokens": a.max_tokens, "lr": a.lr},
               "mean_reward": curve, "first": round(sum(curve[:k]) / k, 4), "last": round(sum(curve[-k:]) / k, 4),
               "wall_s": round(time.time() - t0, 1)}
        out["rises"] = out["last"] > out["first"]
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps(out), f"\nwrote {a.out}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
