"""Tool episodes: the episode text format (pure), the multi-turn loop, the calculator service."""
