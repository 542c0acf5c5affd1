"""Rewards: verifiers (exact, math, code, custom `package.module:function`) and the code sandbox.

`check_verifier_name` is cheap for built-ins (nothing heavy is imported here; math_verify is imported
on first use). `score_group` scores one group of completions of a row and never raises for a known
verifier. See `verifiers` for the contract and `sandbox` for what the code sandbox contains.
"""

from marlaas.rewards.verifiers import (
    BUILTIN,
    GroupScore,
    Verifier,
    check_verifier_name,
    code_verifier,
    exact_verifier,
    math_verifier,
    resolve_verifier,
    score_group,
    score_groups,
)

__all__ = [
    "BUILTIN",
    "GroupScore",
    "Verifier",
    "check_verifier_name",
    "code_verifier",
    "exact_verifier",
    "math_verifier",
    "resolve_verifier",
    "score_group",
    "score_groups",
]
