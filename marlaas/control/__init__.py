"""The control process: the scheduling policy (pure) and the tick that carries it out (dispatch)."""
