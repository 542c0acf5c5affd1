"""The generate station: the engine interface, its two engines (hf, vllm) and what one task does."""
