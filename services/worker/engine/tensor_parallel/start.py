"""Starting an engine's model runner: a plain `ModelRunner`, or for tensor parallelism the rank processes and
rank 0's `LeadRunner` over its shard (the engine's one way in)."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.model_runner import ModelRunner


def make_runner(adapter: Any, model: torch.nn.Module, config: EngineConfig) -> ModelRunner:
    """The engine's model runner: a `ModelRunner` at ``tensor_parallel_size`` 1; else the ranks started (each
    loading the model from ``adapter``'s folder), ``model`` cut to rank 0's shard in place and a `LeadRunner`
    over it. ValueError when the size cannot split this model (before anything starts); RankStartError naming
    the rank that could not start."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(adapter, model, config)
    from services.worker.engine.tensor_parallel.layers import shard_language_model
    from services.worker.engine.tensor_parallel.plan import ShardPlan
    from services.worker.engine.tensor_parallel.ranks import RankGroup, rank_device
    from services.worker.engine.tensor_parallel.runner import LeadRunner

    plan = ShardPlan.of_config(model.config, config.tensor_parallel_size)
    if getattr(adapter, "model_dir", None) is None:
        raise ValueError("tensor parallelism loads each rank's model from its folder; this adapter has none")
    ranks = RankGroup(str(adapter.model_dir), config)
    try:
        shard_language_model(model, plan, 0, ranks.group)
        model.to(rank_device(config.device, 0))
        runner = LeadRunner(adapter, model, config, ranks)
        ranks.ready()
    except BaseException:
        ranks.stop()
        raise
    return runner
