"""Generation and training engines: one resident base model, per-job LoRA adapters."""
