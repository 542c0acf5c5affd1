"""Job specifications: what a user submits, validated once at the boundary (pydantic v2).

A JobSpec that validates can run; one that does not raises `SpecError` with one clear line and
nothing is stored. Everything downstream (scheduler, engines) trusts a validated spec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from marlaas.errors import SpecError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class LoraSpec(BaseModel):
    """The job's LoRA adapter: the only weights the job trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(16, ge=1, le=256, description="LoRA rank r.")
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0, le=4096, description="LoRA alpha; the update is scaled by alpha / r.")
    """LoRA alpha; the update is scaled by alpha / r."""
    targets: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear' for every linear layer."
    )
    """Module names to adapt, or 'all-linear' for every linear layer but the output head."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout (0 keeps the train step exact).")
    """LoRA dropout; 0 keeps training exact and allows fused multi-tenant steps."""


class RLSpec(BaseModel):
    """The policy-gradient objective (formulas in `marlaas.rl`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: Literal["grpo", "drgrpo"] = "grpo"
    """'grpo': (r - mean) / (std + eps) per group; 'drgrpo': r - mean, no std (Dr. GRPO)."""
    aggregation: Literal["token", "sequence"] = "token"
    """'token': mean over all tokens of the batch; 'sequence': mean over sequences of per-sequence means."""
    clip_eps: float = Field(0.2, gt=0, le=10)
    """PPO clip range on pi_theta / pi_prox."""
    tis_cap: float = Field(2.0, ge=1, le=1000)
    """Cap C of the truncated importance weight min(pi_prox / pi_behav, C)."""
    kl_coef: float = Field(0.0, ge=0, le=100)
    """Coefficient of the KL penalty to the base model (adapter disabled); 0 = off."""
    drop_zero_advantage: bool = True
    """Skip groups whose rewards are all equal (they carry no signal)."""


class JobSpec(BaseModel):
    """One RL fine-tuning job of one tenant: data, verifier, sizes and optimisation settings."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field("default", description="Tenant name (letters, digits, _ . -).")
    """Tenant that owns the job (letters, digits, '_', '.', '-'; at most 64)."""
    task: str | None = None
    """A built-in task family (see `marlaas.families`), or None when `dataset` is given."""
    dataset: list[dict] | str | None = None
    """Training prompts: a list of {"prompt", "answer"} rows or a local JSONL path. Excludes `task`."""
    eval_dataset: list[dict] | str | None = None
    """Held-out prompts for evaluation (rows or JSONL path); default: 10% of `dataset` split off."""
    verifier: str | None = None
    """'exact', 'math', 'code' or 'package.module:function'; default: the task's own verifier."""
    steps: int = Field(40, ge=1, le=100_000)
    """Number of training steps; the job publishes adapter versions 1..steps."""
    group_size: int = Field(8, ge=2, le=256)
    """Completions sampled per prompt (G); advantages are relative within a group."""
    prompts_per_step: int = Field(8, ge=1, le=1024)
    """Prompts (groups) per training step (P)."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """The adapter's shape."""
    rl: RLSpec = Field(default_factory=RLSpec)
    """The loss."""
    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate."""
    max_staleness: int = Field(1, ge=0, le=64)
    """S: a rollout sampled with adapter version v is trained at version <= v + S (0 = synchronous)."""
    max_new_tokens: int = Field(8, ge=1, le=4096)
    """Longest completion in tokens."""
    temperature: float = Field(1.0, gt=0, le=5.0)
    """Sampling temperature; the policy trained is softmax(logits / temperature)."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed for prompt order, sampling and adapter initialisation."""
    weight: float = Field(1.0, gt=0, le=100)
    """Share of the trainer relative to other jobs (weighted round-robin)."""
    eval_size: int = Field(64, ge=1, le=100_000)
    """Held-out prompts evaluated (greedy) at version 0 and at the end."""
    base_model: str | None = None
    """Optional: the base the user expects; refused when the deployment serves another."""

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("tenant must be 1-64 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _dataset_rows(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("dataset is empty")
            for i, row in enumerate(v):
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                    raise ValueError(f"row {i} needs a non-empty string 'prompt'")
                if "answer" not in row and "tests" not in row:
                    raise ValueError(f"row {i} needs an 'answer' (or 'tests' for the code verifier)")
        elif isinstance(v, str) and not Path(v).is_file():
            raise ValueError(f"dataset file not found: {v}")
        return v

    @model_validator(mode="after")
    def _task_or_dataset(self) -> JobSpec:
        from marlaas import families
        from marlaas.rewards import check_verifier_name

        if (self.task is None) == (self.dataset is None):
            raise ValueError("give exactly one of 'task' (a built-in family) or 'dataset'")
        if self.task is not None and self.task not in families.FAMILIES:
            raise ValueError(f"unknown task {self.task!r}; built-in: {', '.join(sorted(families.FAMILIES))}")
        if self.verifier is not None:
            check_verifier_name(self.verifier)
        return self

    def verifier_name(self) -> str:
        """The verifier this job uses."""
        if self.verifier is not None:
            return self.verifier
        if self.task is not None:
            from marlaas import families

            return families.FAMILIES[self.task].verifier
        return "exact"


def parse_spec(data: dict | JobSpec) -> JobSpec:
    """Validate a spec; raise SpecError with one line naming the first problem."""
    if isinstance(data, JobSpec):
        data = data.model_dump()
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        raise SpecError(f"invalid job spec: {where + ': ' if where else ''}{msg}") from None
