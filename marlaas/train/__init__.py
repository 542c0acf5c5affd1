"""The train station: the training engine, the RL maths (pure), the fused multi-job step, one task."""
