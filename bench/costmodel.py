"""Station cost model: how long one generate, verify or train task takes, with named parameters.

    .venv/bin/python bench/costmodel.py          # prints the cpu and h200 parameter sets

Formulas (all times in seconds; `rows` = completions sampled in one generate task, `d` = distinct
adapters in it, `T` = new tokens per completion, `new_versions` = adapter versions this generate
worker has not loaded before):

    generate(rows, prompts, d, new_versions) =
        gen_task_s + adapter_load_s * new_versions + prefill_token_s * prompts * prompt_tokens
        + (L_max(rows) * decode_step_s + decode_row_s * rows * T) * lora_factor * (1 + mix_slope * log2(d))

    L_max(rows) = min(max_new_tokens, T * exp(sigma * z - sigma^2 / 2)),  z = Phi^-1(1 - 1/(rows + 1))
    (completion lengths lognormal with mean T and spread `length_sigma`: one batch decodes until its
    longest completion ends, L_max steps of the batch-independent cost, while the growing part is
    paid per token actually produced; sigma = 0 is fixed length, L_max = T, the CPU workload's case)
    verify(groups_rows)  = verify_task_s + verify_row_s * rows
    train(step)          = train_task_s + train_token_s * P * group_size * (prompt_tokens + T)

`decode_step_s` is the batch-independent part of one decode step (reading the weights: what makes a
GPU decode a large batch nearly as fast as a small one); `decode_row_s` the part that grows with the
batch. `dispatch_s` is the delay from a scheduler decision to the task starting (broker round trip
plus the tick), `submit_gap_s` the delay between one sequential job ending and the next starting.

Parameter sets:
- `cpu_params(throughput_json, n)`: fitted from this repo's CPU benchmark (results/throughput.json),
  with the arithmetic written out in `fit_notes` (see `fit_cpu`).
- `h200_params()`: from published figures, each cited where it is set; replaced field by field by
  results/gpu_check.json (key "costmodel" or top-level keys named like the fields) when it exists.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import NormalDist

RESULTS = Path(__file__).resolve().parent.parent / "results"


@dataclass(frozen=True)
class Workload:
    """One tenant's job, as the scheduler sees it (all tenants of a run are alike)."""

    steps: int = 8
    groups_per_step: int = 8
    group_size: int = 8
    prompt_tokens: int = 16
    new_tokens: int = 8
    eval_rows: int = 32
    staleness: int = 2
    length_sigma: float = 0.0  # lognormal spread of completion lengths (0: every completion new_tokens long)
    max_new_tokens: int = 0  # the length cap (0: new_tokens)

    @property
    def train_tokens(self) -> int:
        return self.groups_per_step * self.group_size * (self.prompt_tokens + self.new_tokens)

    def longest(self, rows: int) -> float:
        """Expected decode steps of a batch of `rows` completions: its longest one (L_max above)."""
        cap = self.max_new_tokens or self.new_tokens
        if self.length_sigma <= 0 or rows <= 1:
            return float(min(cap, self.new_tokens))
        z = NormalDist().inv_cdf(1.0 - 1.0 / (rows + 1))
        s = self.length_sigma
        return min(float(cap), self.new_tokens * math.exp(s * z - s * s / 2))


@dataclass(frozen=True)
class CostParams:
    """Named cost parameters of every station (seconds)."""

    name: str
    gen_task_s: float = 0.0
    decode_step_s: float = 0.0
    decode_row_s: float = 0.0
    prefill_token_s: float = 0.0
    adapter_load_s: float = 0.0
    lora_factor: float = 1.0
    mix_slope: float = 0.0
    verify_task_s: float = 0.0
    verify_row_s: float = 0.0
    train_task_s: float = 0.0
    train_token_s: float = 0.0
    dispatch_s: float = 0.0
    submit_gap_s: float = 0.0
    fit_notes: tuple[str, ...] = field(default=(), compare=False)

    def generate_s(self, w: Workload, rows: int, prompts: int, distinct: int, new_versions: int) -> float:
        mix = 1.0 + self.mix_slope * math.log2(max(distinct, 1))
        decode = (w.longest(rows) * self.decode_step_s + self.decode_row_s * rows * w.new_tokens) \
            * self.lora_factor * mix
        return (self.gen_task_s + self.adapter_load_s * new_versions
                + self.prefill_token_s * prompts * w.prompt_tokens + decode)

    def verify_s(self, rows: int) -> float:
        return self.verify_task_s + self.verify_row_s * rows

    def train_s(self, w: Workload) -> float:
        return self.train_task_s + self.train_token_s * w.train_tokens

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fit_notes"] = list(self.fit_notes)
        return d


# ---- CPU: fitted from results/throughput.json --------------------------------------------------

CPU_TASKS_PER_STEP_CHAIN = 3  # generate -> verify -> train: three dispatches on a synchronous step


def cpu_workload(throughput: dict, steps: int | None = None) -> Workload:
    wl = throughput["workload"]
    return Workload(steps=steps or _steps_of(throughput), groups_per_step=wl["prompts_per_step"],
                    group_size=wl["group_size"], new_tokens=wl["max_new_tokens"], eval_rows=wl["eval_size"],
                    staleness=int(throughput["command"].split("--staleness")[1].split()[0]))


def _steps_of(throughput: dict) -> int:
    return int(throughput["command"].split("--steps")[1].split()[0])


def cpu_adapter_load_s() -> float:
    """Handing a new adapter version to the hf engine, measured in isolation (bench/adapter_load.py:
    the slot of the job's previous version, or the least recently used one, overwritten in place)."""
    path = RESULTS / "adapter_load.json"
    if path.exists():
        return float(json.loads(path.read_text())["after"]["load_s_median_full_cache"])
    return 0.0024


def cpu_mix_slope() -> float:
    """Cost of mixing adapters in one batch, measured in isolation (bench/generation_engines.py, hf
    engine, same rows): tokens/s with 1 adapter / with 32 = 1 + slope * log2(32)."""
    path = RESULTS / "generation_engines.json"
    if not path.exists():
        return 0.0
    cases = json.loads(path.read_text())["engines"]["hf"]["cases"]
    return max(0.0, (cases["1"]["tokens_per_s"] / cases["32"]["tokens_per_s"] - 1) / math.log2(32))


SUBMIT_GAP_S = 0.01  # Job.wait blocks on the job's end (Store.wait_end); the next job wakes the scheduler


def compute_rows(throughput: dict) -> list[dict]:
    """The compute-only workload's rows of a bench/throughput.py JSON (older files: top-level rows)."""
    return throughput["rows"] if "rows" in throughput else throughput["workloads"]["compute"]


def fit_cpu(throughput: dict, n: int | None = None, submit_gap_s: float = SUBMIT_GAP_S,
            adapter_load_s: float | None = None, mix_slope: float | None = None) -> CostParams:
    """Fit the CPU parameters from the *sequential* runs of bench/throughput.py (row `n`, or all rows
    pooled) and two isolated measurements; the marlaas runs are what the calibration then predicts.
    The arithmetic:

    - per job: rows sampled = steps*P*G + 2*eval_rows (evaluation of version 0 and of the last);
      generate tasks = steps + 1 (the version-0 evaluation rides in the first batch).
    - adapter_load_s: measured separately (cpu_adapter_load_s); a sequential job loads versions
      1..steps once each.
    - decode_row_s = (busy_generate - jobs*steps*adapter_load_s) / (jobs * rows * T)  (CPU compute grows
      linearly with rows, measured here; decode_step_s = 0, gen_task_s = 0: inside the per-row figure).
    - verify_row_s = busy_verify / (jobs * (steps*P*G + 2*eval_rows)).
    - train_task_s = busy_train / (jobs * steps)  (tokens per step are fixed in this workload).
    - gaps: sequential has no overlap, so makespan - sum(busy) is pure overhead; per job it is
      submit_gap_s (the client, blocked on the job's end, submits the next, which wakes the scheduler:
      milliseconds; the simulator adds it after each job, the last one included) + dispatch_s * (3*steps + 2)
      dispatches.
    - mix_slope: measured separately (cpu_mix_slope: 1 against 32 adapters in one batch).
    """
    adapter_load_s = cpu_adapter_load_s() if adapter_load_s is None else adapter_load_s
    mix_slope = cpu_mix_slope() if mix_slope is None else mix_slope
    rows = [r for r in compute_rows(throughput) if n is None or r["tenants"] == n]
    if not rows:
        raise ValueError(f"no row with {n} tenants in throughput.json")
    w = cpu_workload(throughput)
    jobs = sum(r["tenants"] for r in rows)
    gen_rows = w.steps * w.groups_per_step * w.group_size + 2 * w.eval_rows
    busy = {k: sum(r["sequential"]["busy_s"][k] for r in rows) for k in ("generate", "verify", "train")}
    makespan = sum(r["sequential"]["makespan_s"] for r in rows)
    loads = jobs * w.steps  # versions 1..steps each loaded once by the generate worker (0 is the base)
    decode_row_s = (busy["generate"] - loads * adapter_load_s) / (jobs * gen_rows * w.new_tokens)
    verify_row_s = busy["verify"] / (jobs * gen_rows)
    train_task_s = busy["train"] / (jobs * w.steps)
    gap = makespan - sum(busy.values())
    dispatches = CPU_TASKS_PER_STEP_CHAIN * w.steps + 2
    dispatch_s = max(0.0, (gap / jobs - submit_gap_s) / dispatches)
    tag = "all rows pooled" if n is None else f"{n} tenants"
    notes = (
        f"source: results/throughput.json sequential run ({tag}), {jobs} jobs x {w.steps} steps",
        f"rows per job = {w.steps}*{w.groups_per_step}*{w.group_size} + 2*{w.eval_rows} = {gen_rows}",
        f"decode_row_s = ({busy['generate']:.2f} - {loads}*{adapter_load_s}) / ({jobs}*{gen_rows}*{w.new_tokens})"
        f" = {decode_row_s:.3e}",
        f"verify_row_s = {busy['verify']:.2f} / ({jobs}*{gen_rows}) = {verify_row_s:.3e}",
        f"train_task_s = {busy['train']:.2f} / ({jobs}*{w.steps}) = {train_task_s:.4f}",
        f"overhead = makespan - sum(busy) = {makespan:.2f} - {sum(busy.values()):.2f} = {gap:.2f} s;"
        f" dispatch_s = ({gap:.2f}/{jobs} - {submit_gap_s}) / {dispatches} = {dispatch_s:.4f}",
        f"adapter_load_s = {adapter_load_s} (results/adapter_load.json); mix_slope = {mix_slope:.4f}"
        " (results/generation_engines.json, hf: tokens/s 1 adapter / 32 = 1 + 5 * slope)",
    )
    return CostParams(name=f"cpu[{tag}]", decode_row_s=decode_row_s, adapter_load_s=adapter_load_s,
                      verify_row_s=verify_row_s,
                      train_task_s=train_task_s, dispatch_s=dispatch_s, submit_gap_s=submit_gap_s,
                      mix_slope=mix_slope, fit_notes=notes)


def load_throughput(path: Path | None = None) -> dict:
    return json.loads((path or RESULTS / "throughput.json").read_text())


# ---- H200: published figures --------------------------------------------------------------------

H200_MODEL = "7-8B dense decoder (Qwen2.5-7B / Llama-3-8B class), bf16, LoRA r=16 on all linear layers"


def h200_workload(steps: int = 20) -> Workload:
    """A GRPO math-style step: 8 prompts x 8 samples, 256 prompt tokens, 512 new tokens."""
    return Workload(steps=steps, groups_per_step=8, group_size=8, prompt_tokens=256, new_tokens=512,
                    eval_rows=64, staleness=2)


def h200_params() -> CostParams:
    """Published-figure parameters for one H200 (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense bf16:
    NVIDIA H200 Tensor Core GPU datasheet, 2024). Approximate by construction: replace with
    results/gpu_check.json when a GPU run exists."""
    weights_gb = 15.2  # 7.6e9 params x 2 bytes
    p = CostParams(
        name="h200[published]",
        # Weights read once per decode step: 15.2 GB / 4.8 TB/s = 3.2 ms; vLLM reaches ~60-70% of peak
        # bandwidth at small batch (vLLM v0.6 performance blog, Sep 2024) -> ~5 ms; 6 ms with
        # scheduling/sampling overhead. This fixed part is why "a GPU decodes a batch of 2,048 nearly
        # as fast as a batch of 64" holds for short contexts (the paper).
        decode_step_s=0.006,
        # Growing part per row and step: 2 x 7.6 GFLOP per token at ~50% of 989 TFLOPS = 31 us, plus the
        # KV read (~57 KB/token x ~500 tokens = 29 MB -> 6 us): ~40 us. Check: batch 2,048 ->
        # 2048/(6 ms + 82 ms) = 23k tokens/s, in line with published 8B vLLM throughputs on H100/H200.
        decode_row_s=40e-6,
        # Prefill is compute-bound: 15.2 GFLOP per prompt token at ~50% of peak = 31 us (prefix
        # caching shares a group's prompt, so it is charged per prompt, not per row).
        prefill_token_s=31e-6,
        # Multi-LoRA decode with SGMV/BGMV kernels: Punica (Chen et al., arXiv:2310.18547) adds about
        # 2 ms per token step (~+15-25% on an 8B model); S-LoRA (Sheng et al., arXiv:2311.03285) serves
        # thousands of adapters with throughput falling slowly as adapters grow: ~2-3% per doubling.
        lora_factor=1.2,
        mix_slope=0.025,
        # A new adapter version into the engine: ~80 MB (r=16, all linear, bf16) fetched and copied to
        # the GPU; vLLM add_lora on CPU measured 11 ms + 37-45 ms first use (measured here) for a tiny adapter;
        # 80 MB at ~1-2 GB/s from the store dominates: ~0.08 s.
        adapter_load_s=0.08,
        gen_task_s=0.02,
        # Verifying math answers: ~1-2 ms of CPU per completion (rule-based checker), on a host pool.
        verify_task_s=0.01,
        verify_row_s=0.002,
        # LoRA step: forward 2N + backward activations 2N + the proximal-policy forward 2N = 6N FLOPs
        # per token = 46 GFLOP; at ~45% MFU of 989 TFLOPS -> ~103 us per token (~9.7k tokens/s;
        # published LoRA fine-tuning rates for 8B models on one H100 are 3-10k tokens/s).
        train_token_s=103e-6,
        # Adapter + AdamW state load/save per step and publish (~240 MB at ~1-2 GB/s): ~0.3 s.
        train_task_s=0.3,
        dispatch_s=0.03,  # Celery round trip 9 ms median + tick (results/tick.json order of ms)
        submit_gap_s=SUBMIT_GAP_S,
        fit_notes=(f"model: {H200_MODEL}; weights {weights_gb} GB", "sources cited in bench/costmodel.py"),
    )
    return apply_gpu_check(p)


def apply_gpu_check(p: CostParams, path: Path | None = None) -> CostParams:
    """Override fields with measured values from results/gpu_check.json when it exists."""
    path = path or RESULTS / "gpu_check.json"
    if not path.exists():
        return p
    data = json.loads(path.read_text())
    src = data.get("costmodel", data)
    names = set(CostParams.__dataclass_fields__) - {"name", "fit_notes"}
    over = {k: float(v) for k, v in src.items() if k in names and isinstance(v, (int, float))}
    if not over:
        return p
    return replace(p, name="h200[gpu_check.json]", **over,
                   fit_notes=p.fit_notes + (f"overridden from gpu_check.json: {sorted(over)}",))


if __name__ == "__main__":
    tp = load_throughput()
    for params in (fit_cpu(tp), h200_params()):
        print(json.dumps(params.as_dict(), indent=2))
