"""Held-out evaluation maths: exact, mean reward and the unbiased sampled pass@k (pure, no I/O).

Each evaluated adapter version v of a job is scored on its held-out prompts i = 1..N. Every figure
is named for what it counts:

- `exact`: the share of prompts whose ONE greedy completion gets full reward (reward >= `FULL`,
  i.e. 1 - 1e-9; a grader with a `pass_threshold` already answers 1.0 or 0.0, so that is its pass);
  exact = (1/N) #{i : reward_i >= FULL}. Partial credit never counts here.
- `mean_reward`: the mean greedy reward, (1/N) sum_i reward_i; with 0/1 verifiers it equals
  `exact`, with partial-credit graders (text_similarity without a threshold, a python grader
  returning 0.5) it is the larger one and says nothing about answers being right.
- sampled pass@k, counted on full-reward completions: n = `eval_k` completions per prompt at the
  evaluation temperature, c_i of them with full reward, and the unbiased estimator of Chen et al.
  2021 ("Evaluating Large Language Models Trained on Code", eq. 1):

      pass@k = (1/N) sum_i [ 1 - C(n - c_i, k) / C(n, k) ]        (1 <= k <= n)

  i.e. the probability that at least one of k completions drawn without replacement from the n
  gets full reward; when n - c_i < k every k-subset holds one and the term is 1. For k = 1 it is
  the mean of c_i / n (`pass1_sampled`). We report it for k = 1, 2, 4, ... up to n, and n itself
  (`pass_at`; the headline `pass_at_k`, k = n).
- `grader_errors`: held-out rows whose greedy completion the grader could not score (scored 0.0,
  counted, never silent).
- `acc`: a deprecated alias of `exact` (the same number), kept for readers of old records.

The product form below avoids big binomials: C(n-c, k) / C(n, k) = prod_{j=n-c+1}^{n} (1 - k / j)
(the numerically stable form of the reference implementation).
"""

from __future__ import annotations

FULL = 1.0 - 1e-9
"""A completion has full reward (it counts for `exact` and pass@k) when its reward is at least this."""
CORRECT_AT = FULL
"""The same threshold under its older name."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples, c of them correct: 1 - C(n-c, k) / C(n, k)."""
    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for j in range(n - c + 1, n + 1):
        miss *= 1.0 - k / j
    return 1.0 - miss


def mean_pass_at_k(n: int, correct: list[int], k: int) -> float:
    """The estimator averaged over prompts: (1/N) sum_i pass@k(n, c_i, k)."""
    if not correct:
        raise ValueError("pass@k over no prompts")
    return sum(pass_at_k(n, c, k) for c in correct) / len(correct)


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two below n, then n itself."""
    if n < 1:
        return []
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def summarize(greedy_rewards: list[float], sample_rewards: list[list[float]] | None,
              errors: int = 0) -> dict:
    """The stored evaluation of one version, from rewards.

    greedy_rewards: one reward per held-out prompt (greedy completion).
    sample_rewards: per prompt, the rewards of its n sampled completions (None or [] = greedy only;
    every prompt must have the same n >= 1).
    errors: held-out rows whose greedy completion the grader could not score (they are in
    greedy_rewards as 0.0).

    Returns {"exact", "mean_reward", "acc", "n", "k", "pass1_sampled", "pass_at_k", "pass_at",
    "grader_errors"}: exact = share of prompts with full greedy reward; mean_reward = mean greedy
    reward; acc = exact (deprecated alias); n = prompts; k = samples per prompt (0 when greedy only,
    then the sampled fields are None); pass_at = {str(k'): pass@k'} for k' in ks_for(k), counted on
    full-reward completions; pass_at_k = pass@k (k' = k).
    """
    n_prompts = len(greedy_rewards)
    exact = sum(1 for r in greedy_rewards if r >= FULL) / max(n_prompts, 1)
    out: dict = {"exact": exact, "mean_reward": sum(greedy_rewards) / max(n_prompts, 1), "acc": exact,
                 "n": n_prompts, "k": 0, "pass1_sampled": None, "pass_at_k": None, "pass_at": {},
                 "grader_errors": errors}
    if not sample_rewards:
        return out
    if len(sample_rewards) != n_prompts:
        raise ValueError(f"{len(sample_rewards)} sampled groups for {n_prompts} prompts")
    sizes = {len(s) for s in sample_rewards}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"every prompt needs the same number (>= 1) of samples, got sizes {sorted(sizes)}")
    k = sizes.pop()
    correct = [sum(1 for r in s if r >= FULL) for s in sample_rewards]
    pass_at = {str(kk): mean_pass_at_k(k, correct, kk) for kk in ks_for(k)}
    out.update(k=k, pass1_sampled=pass_at["1"], pass_at_k=pass_at[str(k)], pass_at=pass_at)
    return out


def figures(ev: dict) -> tuple[float | None, float | None]:
    """(exact, mean_reward) of a stored evaluation. Evaluations stored before `exact` existed held
    only `acc`, which was the mean greedy reward: they read as exact None, mean_reward = that acc."""
    if "exact" in ev:
        return ev.get("exact"), ev.get("mean_reward")
    return None, ev.get("acc")


def train_rewards(steps: list[dict]) -> dict[int, float]:
    """The training reward curve: {version: mean reward of the rollouts trained on to publish it}
    from a job's per-step metrics."""
    return {int(m["step"]): m["reward_mean"] for m in steps
            if m.get("step") is not None and m.get("reward_mean") is not None}


def table_row(version: int, ev: dict, train_reward: float | None = None) -> dict:
    """One line of `marlaas eval` / `Job.evals()`: a stored evaluation without its outputs, with the
    training reward of that version next to it (`train_reward`, None for version 0 or unknown).

    Evaluations stored before sampled pass@k existed have only acc and n; they read as k = 0."""
    exact, mean_reward = figures(ev)
    return {
        "version": version,
        "exact": exact,
        "mean_reward": mean_reward,
        "pass1_sampled": ev.get("pass1_sampled"),
        "pass_at_k": ev.get("pass_at_k"),
        "k": ev.get("k", 0),
        "n": ev.get("n"),
        "pass_at": ev.get("pass_at", {}),
        "grader_errors": ev.get("grader_errors", 0),
        "train_reward": train_reward,
        "acc": exact,
        "at": ev.get("at"),
    }


def table(evals: dict[int, dict], steps: list[dict] | None = None) -> list[dict]:
    """Every evaluated version's `table_row`, ascending, with the training reward curve beside it."""
    curve = train_rewards(steps or [])
    return [table_row(v, e, curve.get(v)) for v, e in sorted(evals.items())]
