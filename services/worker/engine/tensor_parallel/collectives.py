"""The collectives of one tensor-parallel group (gloo on the CPU, NCCL on CUDA), bounded by a timeout: the
all-reduce after row-parallel layers, the gather of LM-head shards, the broadcast of a step's media rows."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


class Collectives:
    """One process group's calls on this rank (a group object of its own: never torch's default group, which
    the embedding transport may hold). Every call waits for its result; a peer gone or silent past the group's
    timeout raises RuntimeError."""

    def __init__(self, group: Any, rank: int, size: int, device: torch.device) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.device = device  # where its tensors live (NCCL: this rank's GPU)

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> Collectives:
        """Join the group of ``size`` ranks meeting at ``store`` (blocks until all have joined)."""
        timeout = datetime.timedelta(seconds=max(timeout_s, 0.001))
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)
            return cls(dist.ProcessGroupNCCL(store, rank, size, options), rank, size, device)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return cls(dist.ProcessGroupGloo(store, rank, size, options), rank, size, torch.device("cpu"))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def all_reduce_min(self, value: int, timeout_s: float | None = None) -> int:
        """The smallest of every rank's ``value`` (within ``timeout_s`` when given, else the group's timeout:
        the start-up's agreement waits for ranks still loading)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        if timeout_s is not None:
            options.timeout = datetime.timedelta(seconds=timeout_s)
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def all_gather_last(self, tensor: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``tensor`` (this rank's is ``widths[rank]`` wide in its last dim) concatenated along the
        last dim: shards padded to the widest, gathered, cut back."""
        widest = max(widths)
        local = tensor
        if tensor.shape[-1] < widest:
            local = torch.nn.functional.pad(tensor, (0, widest - tensor.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        return torch.cat([part[..., :width] for part, width in zip(parts, widths, strict=True)], dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (the others pass one of its shape and dtype to fill), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor
