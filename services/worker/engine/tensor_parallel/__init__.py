"""Tensor parallelism: one worker's language model sharded over 2-8 ranks (processes, one per device), rank 0
the engine's (`start.make_runner` is the engine's one way in)."""
