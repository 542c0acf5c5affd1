"""Custom verifiers the end-to-end tests name by import path (workers import them from the checkout)."""


def always_raises(completion: str, row: dict) -> float:
    raise RuntimeError(f"this verifier always fails (saw {completion!r})")


# A python grader with partial credit: 1 for the exact answer, else half the share of matching characters.
PARTIAL = (
    "def grade(sample, item):\n"
    "    out, ans = sample['output_text'].strip(), item['answer']\n"
    "    if out == ans:\n        return 1.0\n"
    "    hits = sum(1 for a, b in zip(out, ans) if a == b)\n"
    "    return 0.5 * hits / max(len(ans), len(out), 1)\n"
)
