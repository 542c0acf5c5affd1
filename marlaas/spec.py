"""Job specifications: what a user submits, validated once at the boundary (pydantic v2).

A JobSpec that validates can run; one that does not raises `SpecError` with one clear line and
nothing is stored. Everything downstream (scheduler, engines) trusts a validated spec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from marlaas.errors import SpecError
from marlaas.verify.graders import Grader

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# The data files a spec may name, by suffix (marlaas.api.datasets_io reads them).
DATA_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def format_error(path: str | Path, what: str = "dataset") -> str | None:
    """Why a path cannot be a data source (one line), or None when its kind is known."""
    if not str(path).strip():
        return f"{what} path is empty"
    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return None
        return (f"{what} {p.name or path}: a directory, but not one written by datasets' save_to_disk "
                "(no state.json or dataset_dict.json)")
    if not p.is_file():
        return f"{what} file not found: {str(path)!r}"
    if p.suffix.lower() not in DATA_SUFFIXES:
        return (f"{what} {p.name}: unknown format {p.suffix or '(no extension)'!r}; give a .jsonl or "
                ".parquet file or a directory written by datasets' save_to_disk")
    return None


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


class DecoupledPPOLoss(BaseModel):
    """Decoupled PPO (AReaL): clip on pi_theta / pi_prox, importance weight on pi_prox / pi_behav."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["decoupled_ppo"] = "decoupled_ppo"
    """Selects this loss."""
    prox: Literal["recompute", "a3po"] = "recompute"
    """The proximal policy: 'recompute' (the trainer's weights at the step start) or 'a3po'
    (log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav), no extra forward pass)."""
    alpha: float | None = Field(None, ge=0.0, le=1.0)
    """A-3PO interpolation weight on pi_theta in [0, 1] (only with prox = 'a3po'; default 0.5)."""

    @model_validator(mode="after")
    def _alpha_for_a3po(self) -> DecoupledPPOLoss:
        if self.prox == "a3po" and self.alpha is None:
            object.__setattr__(self, "alpha", 0.5)
        elif self.prox != "a3po" and self.alpha is not None:
            raise ValueError("alpha applies only to prox = 'a3po'")
        return self


class CoupledPPOLoss(BaseModel):
    """Coupled PPO / GRPO: pi_prox = pi_behav, so the clip on pi_theta / pi_behav is the only correction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["ppo"] = "ppo"
    """Selects this loss."""


class TruncateIS(BaseModel):
    """Truncated importance weight w = min(r, cap) (TIS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["truncate"] = "truncate"
    """Selects this weighting."""
    level: Literal["token", "sequence"] = "token"
    """'token': r per token; 'sequence': the geometric mean of the sequence's token ratios."""
    cap: float = Field(2.0, ge=1, le=1000)
    """C >= 1: weights above it are cut to it."""


class MaskIS(BaseModel):
    """Masked importance weight w = r if 1/cap <= r <= cap else 0 (the token or sequence is dropped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["mask"] = "mask"
    """Selects this weighting."""
    level: Literal["token", "sequence"] = "token"
    """'token': drop single tokens; 'sequence': drop whole sequences by their geometric-mean ratio."""
    cap: float = Field(2.0, ge=1, le=1000)
    """C >= 1: the band [1/C, C] a ratio must stay in."""


class NoIS(BaseModel):
    """No importance correction: w = 1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["none"] = "none"
    """Selects this weighting."""


LossSpec = Annotated[DecoupledPPOLoss | CoupledPPOLoss, Field(discriminator="kind")]
ImportanceSpec = Annotated[TruncateIS | MaskIS | NoIS, Field(discriminator="kind")]


class RLSpec(BaseModel):
    """The policy-gradient objective (formulas in `marlaas.train.rl` and `marlaas.train.losses`).

    `loss` and `importance` are tagged unions keyed by `kind`, e.g. in TOML
    `rl = {advantage = "drgrpo", aggregation = "constant", loss = {kind = "decoupled_ppo",
    prox = "a3po", alpha = 0.5}, importance = {kind = "mask", level = "sequence", cap = 2.0}}`.
    The legacy `tis_cap = C` still parses, as `importance = {kind = "truncate", level = "token", cap = C}`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: Literal["grpo", "drgrpo"] = "grpo"
    """'grpo': (r - mean) / (std + eps) per group; 'drgrpo': r - mean, no std (Dr. GRPO)."""
    aggregation: Literal["token", "sequence", "constant"] = "token"
    """'token': mean over all tokens of the batch; 'sequence': mean over sequences of per-sequence
    means; 'constant': token sum / (max_new_tokens x sequences), Dr. GRPO's normaliser."""
    loss: LossSpec = Field(default_factory=DecoupledPPOLoss)
    """The surrogate: {kind = 'decoupled_ppo', prox, alpha} or {kind = 'ppo'}."""
    importance: ImportanceSpec = Field(default_factory=TruncateIS)
    """Importance weight on pi_prox / pi_behav: {kind = 'truncate'|'mask', level, cap} or {kind = 'none'}."""
    clip_eps: float = Field(0.2, gt=0, le=10)
    """PPO clip range on pi_theta / pi_prox."""
    kl_coef: float = Field(0.0, ge=0, le=100)
    """Coefficient of the KL penalty to the base model (adapter disabled); 0 = off."""
    drop_zero_advantage: bool = False
    """Drop the rows of groups whose rewards are all equal from the loss's normaliser too. Such rows are
    never run through the model (they carry no policy gradient); off, they still count in the
    normaliser, so a step with few informative groups takes a smaller step (TRL's and DAPO's batch
    normaliser). On, every step has the full size whatever its share of signal, so a step
    from one informative group moves the adapter as far as one from many (noisier runs)."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_legacy(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "tis_cap" in data:
            if "importance" in data:
                raise ValueError("give either tis_cap (legacy) or importance, not both")
            data["importance"] = {"kind": "truncate", "level": "token", "cap": data.pop("tis_cap")}
        # A union member written without its tag means the default kind.
        for key, kind in (("loss", "decoupled_ppo"), ("importance", "truncate")):
            if isinstance(data.get(key), dict) and "kind" not in data[key]:
                data[key] = {"kind": kind, **data[key]}
        return data


class JobSpec(BaseModel):
    """One RL fine-tuning job of one tenant: data, verifier, sizes and optimisation settings."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field("default", description="Tenant name (letters, digits, _ . -).")
    """Tenant that owns the job (letters, digits, '_', '.', '-'; at most 64)."""
    task: str | None = None
    """A built-in task family (see `marlaas.families`), or `reasoning_gym:NAME` (a task of the
    reasoning-gym package, scored by its own scorer; see `task_config`), or None when `dataset` is given."""
    task_config: dict | None = None
    """Only with a `reasoning_gym:NAME` task: the task's config (e.g. {"min_terms": 2, "max_terms": 2});
    None uses the task's defaults."""
    dataset: list[dict] | str | None = None
    """Training prompts: a list of {"prompt", "answer"} rows, or a local .jsonl / .parquet file or
    directory written by `datasets`' save_to_disk (see `marlaas.api.datasets_io`). Excludes `task`."""
    eval_dataset: list[dict] | str | None = None
    """Held-out prompts, in the same forms; default: the "test"/"validation" split of a DatasetDict
    `dataset`, else 10% of `dataset` split off."""
    prompt_field: str = Field("prompt", min_length=1, max_length=200)
    """The column (key) of the user's data that holds the prompt."""
    answer_field: str = Field("answer", min_length=1, max_length=200)
    """The column that holds the reference answer (exact / math verifiers)."""
    tests_field: str = Field("tests", min_length=1, max_length=200)
    """The column that holds the list of assert statements (code verifier)."""
    dataset_split: str | None = Field(None, min_length=1, max_length=200)
    """Split of a DatasetDict directory `dataset` to train on; None = "train"."""
    eval_dataset_split: str | None = Field(None, min_length=1, max_length=200)
    """Split of a DatasetDict `eval_dataset` (or, without one, of `dataset`) to evaluate on;
    None = the first of "test", "validation" it has."""
    chat_template: bool | None = None
    """Render each prompt with the base model's chat template (one user message plus the generation
    prompt) at submit: None = when the base has one, False = never, True = required."""
    verifier: str | None = None
    """'exact', 'math', 'code', a name the operator registered (`marlaas.verify.registry`), or (operator
    only) 'package.module:function'; default: the task's own verifier. Excludes `grader`."""
    grader: Grader | None = None
    """A grader uploaded with the job (`marlaas.verify.graders`: string_check, text_similarity, python,
    multi, builtin); excludes `verifier`. Rows then need only a prompt (the grader reads their fields)."""
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
    """AdamW learning rate (the peak of `lr_schedule`)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How the rate moves over the steps after warm-up (formulas in `marlaas.train.schedule`):
    'constant', or decaying to `min_lr_ratio` x `learning_rate` ('linear', 'cosine')."""
    warmup_steps: int = Field(0, ge=0, le=100_000)
    """Steps of linear warm-up to `learning_rate` (fewer than `steps`)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where a decaying schedule ends, as a fraction of `learning_rate`."""
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
    """Held-out prompts evaluated at version 0, every `eval_every` versions and at the end."""
    eval_every: int = Field(0, ge=0, le=100_000)
    """K: also evaluate every K-th published version (K, 2K, ...); 0 = only at version 0 and the end."""
    eval_k: int = Field(8, ge=0, le=256)
    """Completions sampled per held-out prompt for the unbiased pass@k on full-reward samples (k = 1,
    2, 4, ..., eval_k); 0 = the greedy figures only (exact, mean_reward). Each evaluation generates
    eval_size x (1 + eval_k) completions: keep it small on a CPU."""
    eval_temperature: float | None = Field(None, gt=0, le=5.0)
    """Sampling temperature of the pass@k completions; None = the job's `temperature`."""
    base_model: str | None = None
    """Optional: the base the user expects; refused when the deployment serves another."""
    max_grader_error_share: float = Field(0.5, ge=0.0, le=1.0)
    """The job fails when its grader errs on more than this share of an evaluation's held-out rows
    (any errored row is also a warning event); 1.0 = never fail for that."""
    max_grader_error_groups: int = Field(20, ge=1, le=100_000)
    """The job fails when its grader errs on every completion of this many training groups in a
    row (a warning event at half of it); a group with one scored completion resets the count."""
    reward_hacking_drop: float = Field(0.1, ge=0.0, le=1.0)
    """The reward-hacking alarm (`marlaas.verify.alarm`): a warning event when, from one held-out
    evaluation to the next, held-out `exact` falls by more than this while the mean training reward of
    the interval rises by more than `reward_hacking_rise`; 1.0 = never."""
    reward_hacking_rise: float = Field(0.0, ge=0.0, le=100.0)
    """How much the mean training reward must rise over the evaluation interval (its last steps against
    its first ones) for the alarm; 0 = any rise."""
    pause_on_reward_hacking: bool = False
    """Pause the job (resumable) when the reward-hacking alarm fires while it is still training (the
    alarm's event says whether it paused)."""
    preflight: bool = False
    """A learnability check instead of training: sample the base (version 0) on `preflight_prompts`
    training prompts with `group_size` completions each, score them with the job's verifier or grader,
    and end with a summary (exact, mean reward, share of groups with signal, a verdict); nothing is
    trained or evaluated (`marlaas.verify.preflight`)."""
    preflight_prompts: int = Field(32, ge=1, le=256)
    """Prompts a preflight samples (at most the training rows there are)."""
    no_signal_steps: int = Field(5, ge=0, le=100_000)
    """K: a job whose first K steps have no group with differing rewards (GRPO learns nothing from
    them) gets a warning event; 0 = never checked."""
    stop_without_signal: bool = False
    """Fail the job (with the warning as its reason) when its first `no_signal_steps` steps had no signal."""

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("tenant must be 1-64 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _dataset_source(cls, v, info: ValidationInfo):
        if isinstance(v, list) and not v:
            raise ValueError(f"{info.field_name} is empty")
        if isinstance(v, str) and (err := format_error(v, info.field_name)):
            raise ValueError(err)
        return v

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> JobSpec:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be fewer than steps ({self.steps})")
        return self

    @model_validator(mode="after")
    def _dataset_rows(self) -> JobSpec:
        # List rows are checked here, where the field names are known; files are read at submit.
        for what, rows in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset)):
            if not isinstance(rows, list):
                continue
            for i, row in enumerate(rows, start=1):
                if not isinstance(row, dict) or not isinstance(row.get(self.prompt_field), str) \
                        or not row[self.prompt_field]:
                    raise ValueError(f"{what} row {i} needs a non-empty string {self.prompt_field!r}")
                if self.grader is None and self.answer_field not in row and self.tests_field not in row:
                    raise ValueError(f"{what} row {i} needs an {self.answer_field!r} "
                                     f"(or {self.tests_field!r} for the code verifier)")
        if self.prompt_field in (self.answer_field, self.tests_field) or self.answer_field == self.tests_field:
            raise ValueError("prompt_field, answer_field and tests_field must be different columns")
        return self

    @model_validator(mode="after")
    def _task_or_dataset(self) -> JobSpec:
        from marlaas import families
        from marlaas.verify import reasoning_gym
        from marlaas.verify.boundary import check_spec_verifier

        if (self.task is None) == (self.dataset is None):
            raise ValueError("give exactly one of 'task' (a built-in family) or 'dataset'")
        if reasoning_gym.is_task(self.task):
            reasoning_gym.parse_task(self.task, self.task_config)  # the name and the config, checked now
        elif self.task is not None and self.task not in families.FAMILIES:
            raise ValueError(f"unknown task {self.task!r}; built-in: {', '.join(sorted(families.FAMILIES))}, "
                             "or 'reasoning_gym:NAME'")
        if self.task_config is not None and not reasoning_gym.is_task(self.task):
            raise ValueError("task_config is only for a 'reasoning_gym:NAME' task")
        if self.verifier is not None and self.grader is not None:
            raise ValueError("give either 'verifier' or 'grader', not both")
        if self.verifier is not None:
            check_spec_verifier(self.verifier)
        if self.eval_every > self.steps:
            raise ValueError(f"eval_every ({self.eval_every}) is more than steps ({self.steps}); "
                             "0 evaluates only at version 0 and the end")
        return self

    def verifier_name(self) -> str:
        """The verifier this job uses ('grader' for a job with a non-builtin grader)."""
        if self.grader is not None:
            return self.grader.verifier if self.grader.type == "builtin" else "grader"
        if self.verifier is not None:
            return self.verifier
        if self.task is not None:
            from marlaas import families
            from marlaas.verify import reasoning_gym

            if reasoning_gym.is_task(self.task):
                return "reasoning_gym"
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
        line = " ".join(f"invalid job spec: {where + ': ' if where else ''}{msg}".split())  # one line, always
        raise SpecError(line if len(line) <= 300 else line[:297] + "...") from None
