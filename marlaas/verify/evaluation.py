"""Held-out evaluation maths: greedy pass@1 and the unbiased sampled pass@k (pure, no I/O).

Each evaluated adapter version v of a job is scored on its held-out prompts i = 1..N:

- greedy pass@1 (`acc`): one greedy completion per prompt; acc = (1/N) sum_i reward_i (for the
  built-in 0/1 verifiers this is the fraction solved);
- sampled pass@k: n = `eval_k` completions per prompt at the evaluation temperature, c_i of them
  correct, and the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1):

      pass@k = (1/N) sum_i [ 1 - C(n - c_i, k) / C(n, k) ]        (1 <= k <= n)

  i.e. the probability that at least one of k completions drawn without replacement from the n
  is correct; when n - c_i < k every k-subset holds a correct one and the term is 1. For k = 1 it
  is the mean of c_i / n (`pass1_sampled`). We report it for k = 1, 2, 4, ... up to n, and n itself
  (the headline `pass_at_k`, k = n). A completion counts as correct when its reward is >= 1.0
  (full credit): built-in verifiers give exactly 0.0 or 1.0; a custom verifier's partial credit is
  not a pass.

The product form below avoids big binomials: C(n-c, k) / C(n, k) = prod_{j=n-c+1}^{n} (1 - k / j)
(the numerically stable form of the reference implementation).
"""

from __future__ import annotations

CORRECT_AT = 1.0
"""A sampled completion is correct (for pass@k) when its reward is at least this."""


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


def summarize(greedy_rewards: list[float], sample_rewards: list[list[float]] | None) -> dict:
    """The stored evaluation of one version, from rewards.

    greedy_rewards: one reward per held-out prompt (greedy completion).
    sample_rewards: per prompt, the rewards of its n sampled completions (None or [] = greedy only;
    every prompt must have the same n >= 1).

    Returns {"acc", "n", "k", "pass1_sampled", "pass_at_k", "pass_at"}: acc = mean greedy reward;
    n = prompts; k = samples per prompt (0 when greedy only, then the sampled fields are None);
    pass_at = {str(k'): pass@k'} for k' in ks_for(k); pass_at_k = pass@k (k' = k).
    """
    n_prompts = len(greedy_rewards)
    out: dict = {"acc": sum(greedy_rewards) / max(n_prompts, 1), "n": n_prompts, "k": 0,
                 "pass1_sampled": None, "pass_at_k": None, "pass_at": {}}
    if not sample_rewards:
        return out
    if len(sample_rewards) != n_prompts:
        raise ValueError(f"{len(sample_rewards)} sampled groups for {n_prompts} prompts")
    sizes = {len(s) for s in sample_rewards}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"every prompt needs the same number (>= 1) of samples, got sizes {sorted(sizes)}")
    k = sizes.pop()
    correct = [sum(1 for r in s if r >= CORRECT_AT) for s in sample_rewards]
    pass_at = {str(kk): mean_pass_at_k(k, correct, kk) for kk in ks_for(k)}
    out.update(k=k, pass1_sampled=pass_at["1"], pass_at_k=pass_at[str(k)], pass_at=pass_at)
    return out


def table_row(version: int, ev: dict) -> dict:
    """One line of `marlaas eval` / `Job.evals()`: a stored evaluation without its outputs.

    Evaluations stored before sampled pass@k existed have only acc and n; they read as k = 0."""
    return {
        "version": version,
        "acc": ev.get("acc"),
        "pass1_sampled": ev.get("pass1_sampled"),
        "pass_at_k": ev.get("pass_at_k"),
        "k": ev.get("k", 0),
        "n": ev.get("n"),
        "pass_at": ev.get("pass_at", {}),
        "at": ev.get("at"),
    }
