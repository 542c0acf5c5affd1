"""GPU check: decode, train-step and fused multi-adapter timings on a ~100M-parameter model.

Run through `bench/gpu_check.sh` (which states what the machine needs). Everything is built from
a config with random weights: no download, no network, no tokenizer. Three measurements, each
under its share of one wall-clock budget (`--budget-s`; a measurement that would start after its
share is spent is recorded as {"skipped": "budget"}; an out-of-memory one as {"oom": true}):

1. decode: ms per decode step of `generate` (greedy, KV cache, EOS off) for batch B in
   {1, 8, 64, 256, 1024, 2048} with D in {1, 8, 32} distinct LoRA adapters (r 16, all linear
   layers, random non-zero B) spread over the rows through PEFT's per-row `adapter_names` (the
   mixed-adapter path of the project's HF engine; vLLM wheels cannot be carried there).
   decode_ms_per_step = (t(N new tokens) - t(1 new token)) / (N - 1); tokens_per_s = B N / t(N).
2. train: ms per training step of one adapter (forward, policy-gradient loss on the last
   `completion` positions as `TrainingEngine` computes it, backward, clip, AdamW) against the
   tokens per step (batch x sequence length).
3. fused: J jobs (own adapter, own AdamW, R sequences each) trained one after another (set_adapter
   per job) against one fused forward/backward with per-row adapter routing
   (`marlaas/train/routing.py`, loaded by file path so the project's other dependencies are not
   needed), then each job's own clip + AdamW step. fused_speedup = sequential_s / fused_s.

Figures are medians of `--reps` timed runs after one warm-up; CUDA is synchronised around each.

    python bench/gpu_check.py [--out results/gpu_check.json] [--device cuda|cpu] [--small] [--budget-s 420]

`--small` (the CPU smoke mode) uses a ~0.1M-parameter model and small sizes so the whole script
runs in well under a minute on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

FULL = dict(
    model=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
               intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096),
    decode_batches=[1, 8, 64, 256, 1024, 2048], decode_adapters=[1, 8, 32], prompt_len=64, new_tokens=32,
    train_seq=512, train_tokens=[2048, 8192, 32768, 65536], completion=128,
    fused_jobs=[2, 8, 32], fused_rows=16, fused_seq=256, rank=16,
)  # fmt: skip
SMALL = dict(
    model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=512, max_position_embeddings=256),
    decode_batches=[1, 8], decode_adapters=[1, 8], prompt_len=8, new_tokens=4,
    train_seq=32, train_tokens=[64, 256], completion=8,
    fused_jobs=[2, 4], fused_rows=4, fused_seq=32, rank=4,
)  # fmt: skip
SHARES = {"decode": 0.5, "train": 0.2, "fused": 0.3}  # of the budget, cumulative in this order


def load_routing():
    """`marlaas/train/routing.py` by path (it imports only torch and peft)."""
    spec = importlib.util.spec_from_file_location("marlaas_routing", ROOT / "marlaas" / "train" / "routing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.routed


class Clock:
    def __init__(self, torch, device: str):
        self.torch, self.device = torch, device

    def sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def time(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def build(torch, cfg: dict, device: str, dtype, n_adapters: int):
    """Random Qwen2 model + `n_adapters` LoRA adapters a0..a{n-1} (random non-zero B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**cfg["model"], tie_word_embeddings=True, use_cache=True)
    model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    lcfg = LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"], target_modules=TARGETS, lora_dropout=0.0)
    pm = get_peft_model(model, lcfg, adapter_name="a0")
    for i in range(1, n_adapters):
        pm.add_adapter(f"a{i}", lcfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01)
    pm.to(device=device, dtype=dtype)
    pm.requires_grad_(False)
    return pm, n_params


class Budget:
    def __init__(self, total_s: float):
        self.t0, self.total = time.perf_counter(), total_s
        self.deadline = self.t0

    def phase(self, name: str):
        self.deadline += SHARES[name] * self.total

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def spent(self) -> float:
        return time.perf_counter() - self.t0


def guarded(torch, budget: Budget, fn) -> dict:
    if budget.left() <= 0:
        return {"skipped": "budget"}
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}


def decode_phase(torch, pm, cfg, clock, budget, device, reps) -> list[dict]:
    rows = []
    pm.eval()
    for D in cfg["decode_adapters"]:
        for B in cfg["decode_batches"]:

            def one(D=D, B=B):
                g = torch.Generator().manual_seed(B)
                ids = torch.randint(1, cfg["model"]["vocab_size"], (B, cfg["prompt_len"]), generator=g).to(device)
                names = [f"a{i % D}" for i in range(B)]
                N = cfg["new_tokens"]

                def gen(n):
                    with torch.no_grad():
                        pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False)  # fmt: skip

                gen(2)  # warm-up (kernels, allocator)
                t1 = statistics.median(clock.time(lambda: gen(1)) for _ in range(reps))
                tn = statistics.median(clock.time(lambda: gen(N)) for _ in range(reps))
                return {"decode_ms_per_step": round(1000 * (tn - t1) / (N - 1), 3),
                        "tokens_per_s": round(B * N / tn, 1), "generate_s": round(tn, 4)}  # fmt: skip

            row = {"batch": B, "adapters": D, **guarded(torch, budget, one)}
            rows.append(row)
            print(json.dumps({"decode": row}), flush=True)
    return rows


def _pg_loss(torch, logits_B_T_V, targets_B_T, adv_B):
    """The policy-gradient surrogate of one on-policy step: -mean_t(A_i * logp_it) over tokens."""
    logp = torch.log_softmax(logits_B_T_V.float(), dim=-1).gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    return -(logp * adv_B.unsqueeze(1)).mean()


def _forward_loss(torch, pm, ids, adv, completion):
    out = pm(input_ids=ids, logits_to_keep=completion + 1)
    return _pg_loss(torch, out.logits[:, :-1, :], ids[:, -completion:], adv)


_PARAMS: dict = {}


def _params(pm, name):
    """Adapter `name`'s LoRA parameters (cached: the lookup is not part of what is timed)."""
    if name not in _PARAMS:
        _PARAMS[name] = [p for n, p in pm.named_parameters() if f".{name}." in n and "lora_" in n]
    return _PARAMS[name]


def _trainable(pm, names):
    """Exactly the LoRA parameters of `names` require grad (set_adapter resets requires_grad)."""
    for a in _PARAMS:
        for p in _PARAMS[a]:
            p.requires_grad_(False)
    for a in names:
        for p in _params(pm, a):
            p.requires_grad_(True)


def train_phase(torch, pm, cfg, clock, budget, device, reps) -> list[dict]:
    rows = []
    pm.train()
    pm.set_adapter("a0")
    _trainable(pm, ["a0"])
    params = _params(pm, "a0")
    opt = torch.optim.AdamW(params, lr=1e-4)
    S = cfg["train_seq"]
    for tokens in cfg["train_tokens"]:

        def one(tokens=tokens):
            B = max(1, tokens // S)
            ids = torch.randint(1, cfg["model"]["vocab_size"], (B, S)).to(device)
            adv = torch.randn(B, device=device)

            def step():
                loss = _forward_loss(torch, pm, ids, adv, cfg["completion"])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()
            t = statistics.median(clock.time(step) for _ in range(reps))
            return {"batch": B, "seq": S, "step_ms": round(1000 * t, 2), "tokens_per_s": round(B * S / t, 1)}

        row = {"tokens": tokens, **guarded(torch, budget, one)}
        rows.append(row)
        print(json.dumps({"train": row}), flush=True)
    return rows


def fused_phase(torch, pm, cfg, clock, budget, device, reps, routed) -> list[dict]:
    rows = []
    pm.train()
    R, S, C = cfg["fused_rows"], cfg["fused_seq"], cfg["completion"]
    for J in cfg["fused_jobs"]:

        def one(J=J):
            names = [f"a{i}" for i in range(J)]
            params = {a: _params(pm, a) for a in names}
            opts = {a: torch.optim.AdamW(params[a], lr=1e-4) for a in names}
            ids = {a: torch.randint(1, cfg["model"]["vocab_size"], (R, S)).to(device) for a in names}
            adv = {a: torch.randn(R, device=device) for a in names}

            def finish(a):
                torch.nn.utils.clip_grad_norm_(params[a], 1.0)
                opts[a].step()
                opts[a].zero_grad(set_to_none=True)

            def sequential():
                for a in names:
                    pm.set_adapter(a)
                    _trainable(pm, [a])
                    _forward_loss(torch, pm, ids[a], adv[a], C).backward()
                    finish(a)

            def fused():
                _trainable(pm, names)
                all_ids = torch.cat([ids[a] for a in names])
                with routed(pm, names, [R] * J):
                    logits = pm(input_ids=all_ids, logits_to_keep=C + 1).logits[:, :-1, :]
                losses = [
                    _pg_loss(torch, logits[i * R : (i + 1) * R], ids[a][:, -C:], adv[a]) for i, a in enumerate(names)
                ]
                torch.stack(losses).sum().backward()
                for a in names:
                    finish(a)

            sequential()
            fused()
            seq, fus = [], []
            for _ in range(reps):
                seq.append(clock.time(sequential))
                fus.append(clock.time(fused))
            s, f = statistics.median(seq), statistics.median(fus)
            return {
                "sequential_ms": round(1000 * s, 2),
                "fused_ms": round(1000 * f, 2),
                "fused_speedup": round(s / f, 3),
            }

        row = {"jobs": J, "rows_per_job": R, "seq": S, **guarded(torch, budget, one)}
        rows.append(row)
        print(json.dumps({"fused": row}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_check.json"))
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--small", action="store_true", help="tiny model and sizes (CPU smoke test)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the measurements")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda but torch sees no CUDA device")
    cfg = SMALL if args.small else FULL
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    routed = load_routing()
    clock = Clock(torch, device)
    budget = Budget(args.budget_s)
    t_build = time.perf_counter()
    n_adapters = max(cfg["decode_adapters"] + cfg["fused_jobs"])
    pm, n_params = build(torch, cfg, device, dtype, n_adapters)
    result = {
        "benchmark": "gpu_check",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "mode": "small" if args.small else "full",
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            **{m: __import__(m).__version__ for m in ("transformers", "peft")},
        },  # fmt: skip
        "model": {
            **cfg["model"],
            "params": n_params,
            "lora_rank": cfg["rank"],
            "lora_targets": TARGETS,
            "adapters_built": n_adapters,
            "build_s": round(time.perf_counter() - t_build, 2),
        },  # fmt: skip
        "budget_s": args.budget_s,
        "reps": args.reps,
    }
    print(json.dumps({"model": result["model"]}), flush=True)
    budget.phase("decode")
    result["decode"] = decode_phase(torch, pm, cfg, clock, budget, device, args.reps)
    budget.phase("train")
    result["train"] = train_phase(torch, pm, cfg, clock, budget, device, args.reps)
    budget.phase("fused")
    result["fused"] = fused_phase(torch, pm, cfg, clock, budget, device, args.reps, routed)
    result["total_s"] = round(budget.spent(), 2)
    if device.startswith("cuda"):
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
