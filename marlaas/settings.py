"""Deployment settings, read from environment variables (pydantic-settings).

| variable | meaning | default |
|---|---|---|
| MARLAAS_HOME | where the embedded Redis, the built base model and caches live | ~/.marlaas |
| MARLAAS_REDIS_URL | the Redis every process shares; unset = the embedded one started by `marlaas up` | embedded |
| MARLAAS_BASE | the base model directory (any local HF causal LM) | $MARLAAS_HOME/base |
| MARLAAS_BASE_PRESET | size of the tiny base built when MARLAAS_BASE is missing ('default', 'test') | default |
| MARLAAS_ENGINE | generation engine: 'hf' (transformers+PEFT) or 'vllm' | hf |
| MARLAAS_THREADS | torch/OMP threads per engine process | 1 |
| MARLAAS_DEVICE / MARLAAS_DTYPE | trainer and hf engine device ('auto': a GPU if any) / base dtype | auto / auto |
| MARLAAS_GEN_BATCH_ROWS | most completions one generate task samples | 256 |
| MARLAAS_GEN_MIN_FILL | batches of groups not needed yet wait until this full (one shared device) | 0 |
| MARLAAS_LEASE_S | seconds before unfinished work is re-dispatched | 120 |
| MARLAAS_MAX_LORA_RANK | largest LoRA rank of a job or Tinker model (vLLM: one of its ranks) | 64 hf, 16 vllm |
| MARLAAS_VLLM_ARGS | extra vLLM engine arguments, a JSON object (GPU hosts; docs/deployment.md) | {} |
| MARLAAS_TOOL_URL | the calculator tool service of tool tasks (`marlaas tool-server`) | http://127.0.0.1:9110 |
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256)
"""The max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks, up to this setting's bound)."""
VLLM_DEFAULT_LORA_RANK = 16


class Settings(BaseSettings):
    """All knobs of a deployment; every process of one deployment must see the same values."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".marlaas")
    """Directory for the embedded Redis data, the built base model and local caches."""
    redis_url: str | None = None
    """Redis URL shared by every process; None means the embedded server of `marlaas up`."""
    base: Path | None = None
    """Base model directory; None means `<home>/base` (built on demand)."""
    base_preset: Literal["default", "test"] = "default"
    """Size of the tiny base model built when none exists."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: 'hf' (transformers + PEFT, the CPU default; docs/performance.md says why) or 'vllm'."""
    threads: int = Field(1, ge=1, le=256)
    """Torch / OpenMP threads per engine process (several processes share the cores)."""
    device: str = "auto"
    """Torch device of the trainer and of the hf generation engine: 'auto' (cuda:0 when torch sees a
    GPU, else cpu), 'cpu', 'cuda' or 'cuda:N' (marlaas.devices). vLLM places itself."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the base weights in those engines: 'auto' is bfloat16 on a GPU, float32 on the CPU
    (LoRA weights stay float32: PEFT's default)."""
    gen_batch_rows: int = Field(256, ge=1, le=65536)
    """Most completions (rows) one generate task samples, across jobs."""
    gen_min_fill: float = Field(0.0, ge=0.0, le=1.0)
    """For generate and train sharing one accelerator: a generate batch holding only groups that no
    train step waits on yet (groups ahead, within the staleness bound) is sent only once it has
    gen_min_fill * gen_batch_rows rows, so the shared device decodes a few large batches instead of
    many small ones (decode cost hardly grows with the batch on a GPU). Batches with lost work, an
    evaluation or a group the trainer waits on go at once. 0: every batch at once (separate devices,
    or CPU cores, where early generation costs the trainer nothing)."""
    gen_jit_jobs: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """From this many jobs training on, generation is just in time: only the groups a job's next train
    step needs (and evaluations) are generated, never groups for its later steps, so every sample
    trains at the version it was sampled with (staleness 0) while the trainer takes the other jobs'
    steps. 'auto' (the default): the scheduler chooses from what it measures (marlaas.control.jit):
    just in time from 2 jobs training on, except where neither the generate station nor the trainer
    is busy most of the time (averaged over ~10 trainer steps: the busier under 60% switches groups
    ahead on, 85% or more switches them off again), since groups ahead then fill idle gaps instead of
    only aging samples. A number overrides it: 0 always generates
    ahead as far as each job's staleness bound allows (most overlap, oldest samples). Not with
    gen_min_fill (one device for generate and train): that one needs the groups ahead to fill its
    large batches (bench/jit.py: just in time costs ~30% there, gains up to ~13% on the CPU), so a
    number is refused with it and 'auto' never turns just in time on."""
    max_lora_rank: int = Field(64, ge=1, le=256)
    """Largest LoRA rank a job or Tinker model may use, recorded in the deployment record by the workers
    (`tasks.common.register_base`) and read by the API (`marlaas.api.access.max_lora_rank`). The hf engine
    serves any rank: 64 by default. The vLLM engine is started with exactly this max_lora_rank, which
    must be one of vLLM's ranks (VLLM_LORA_RANKS); its default there is 16, since vLLM's CPU LoRA cost
    follows the engine's max_lora_rank, not the adapter's (docs/performance.md)."""
    artifacts: str | None = None
    """Where adapters, optimizer states, checkpoints and base files live (marlaas.store.artifacts):
    `file:///DIR` or `s3://BUCKET/PREFIX` (endpoint and credentials from boto3's environment:
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). None: `<home>/artifacts`, which serves
    the processes of one host; several hosts need S3 (or one shared filesystem)."""
    artifact_cache_mb: int = Field(2048, ge=0)
    """Each host's on-disk read cache of S3 objects (`<home>/cache/artifacts`, least recently used
    evicted past this size; 0: none). Unused with a local directory."""
    artifact_grace_s: float = Field(3600.0, gt=0)
    """An object no reference names is deleted by the sweep once it is this old: longer than any write
    takes to be published (a trainer killed between the write and its publish leaves such an orphan)."""
    lease_s: float = Field(120.0, gt=0)
    """Seconds after which dispatched work that has not finished is dispatched again."""
    tool_url: str = "http://127.0.0.1:9110"
    """The calculator tool service (`marlaas tool-server`, Procfile line `tool`) tool tasks call."""
    serve_share: float = Field(0.5, ge=0.0, le=1.0)
    """MARLAAS_SERVE_SHARE: the most a generate call's rows that sample and serving requests (which go
    first) may take while training work waits (docs/serving.md); the rest wait for the next call."""
    redis_maxmemory_mb: int = Field(4096, ge=64)
    """The embedded Redis's memory cap (noeviction: it refuses writes past it, never drops keys)."""
    admission_memory_fraction: float = Field(0.8, gt=0, le=1)
    """Admission refuses new jobs once the store uses this share of its memory cap (running jobs keep
    the rest), with a clear error instead of a store that fails mid-job."""
    retention_s: float = Field(7 * 86400.0, ge=0)
    """How long a finished, failed or cancelled job's bulk data (rows, rollouts, optimizer state,
    adapters other than the final and evaluated ones) stays; its record, metrics and evaluations stay.
    Sooner when a submit finds the store over `admission_memory_fraction` (oldest ended first)."""
    stall_s: float = Field(1800.0, gt=0)
    """The watchdog: a job whose version and dispatched groups have not moved for this long, while
    its turn on the trainer has come (its pass is not past the lane's virtual time), is failed with
    the reason. A job waiting behind other tenants is not stalled, however long it waits."""
    train_lease_s: float = Field(300.0, gt=0)
    """Seconds after which a train task that has not published is considered lost."""
    train_checkpointing: bool = False
    """Gradient checkpointing in the trainer: each layer's activations recomputed during the backward
    pass instead of kept. Measured on SmolLM2-135M (16 rows in one pass, bench/memory.py): the
    trainer's peak 3.5 -> 2.1 GB, a step 1.4x slower; for a trainer host short of memory."""
    train_activation_mb: float | None = Field(None, ge=0)
    """MARLAAS_TRAIN_ACTIVATION_MB: the activations one trainer pass may hold; a step's rows run in
    micro-batches within it and their gradients add up (the same step, bounded memory); a micro-batch of
    one row over it recomputes the activations of just enough of its first layers in the backward to
    fit. Unset: a quarter of the base's weight bytes on the CPU, one pass on a GPU; 0: one pass always."""
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    """Extra vLLM engine arguments (MARLAAS_VLLM_ARGS, a JSON object) for GPU hosts: max_loras,
    max_adapters (= vLLM's max_cpu_loras), max_num_seqs, max_model_len, kv_cache_memory_bytes, or any
    `vllm.LLM` argument (dtype, gpu_memory_utilization, tensor_parallel_size, ...); see docs/deployment.md."""

    @property
    def base_path(self) -> Path:
        return self.base if self.base is not None else self.home / "base"

    @property
    def artifacts_url(self) -> str:
        return self.artifacts or f"file://{self.home / 'artifacts'}"

    @property
    def embedded_dir(self) -> Path:
        return self.home / "embedded"

    @model_validator(mode="after")
    def _lora_rank_of_the_engine(self) -> Settings:
        if self.engine == "vllm":
            if "max_lora_rank" not in self.model_fields_set:
                self.max_lora_rank = VLLM_DEFAULT_LORA_RANK
            elif self.max_lora_rank not in VLLM_LORA_RANKS:
                raise ValueError(f"MARLAAS_MAX_LORA_RANK={self.max_lora_rank} is not a rank vLLM serves "
                                 f"(one of {', '.join(map(str, VLLM_LORA_RANKS))})")
        return self

    @model_validator(mode="after")
    def _jit_or_min_fill(self) -> Settings:
        if self.gen_jit_jobs != "auto" and self.gen_jit_jobs and self.gen_min_fill:
            raise ValueError("MARLAAS_GEN_JIT_JOBS and MARLAAS_GEN_MIN_FILL exclude each other: a batch that waits "
                             "to be filled by groups ahead gets none when generation is just in time")
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
