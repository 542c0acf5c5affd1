"""Per-pool worker bootstrap: load the engine once per process, announce the worker in the store."""
