"""The verify station: verifiers, the code sandbox, held-out evaluation scoring, what one task does."""
