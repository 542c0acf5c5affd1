"""Custom verifiers the end-to-end tests name by import path (workers import them from the checkout)."""


def always_raises(completion: str, row: dict) -> float:
    raise RuntimeError(f"this verifier always fails (saw {completion!r})")
