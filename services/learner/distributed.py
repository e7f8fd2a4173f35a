"""Data parallelism for the learner on torch.distributed, launched by torchrun.

``torchrun --nproc-per-node N -m services.cli learner ...`` starts N ranks.
Rank 0 is the learner service: it alone talks to the broker, checkpoints,
serves weights and announces versions. Every step it broadcasts the batch
to the other ranks; each rank scores its own share of the prompts, and
DistributedDataParallel averages the gradients, so every rank takes the same
optimizer step and holds the same weights. Ranks > 0 run ``follow``: receive
a batch, step, repeat, until rank 0 releases them.

What makes N ranks equal one process (``tests/learner/test_distributed.py``):
advantages, the zero-variance mask and the aggregation's denominators are
computed on the whole batch on every rank (they are cheap and need every
prompt), each rank sums its rows' weighted token losses, and the loss is
scaled by N because DDP averages gradients where the batch's loss adds its
shards. gloo on CPU, NCCL on GPUs. DDP is one of two layouts: ``sharding``
puts a model under FSDP2 instead when ``parallelism`` asks for it.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the learner's ranks (one rank: no collectives at all)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, backend: Backend = "auto", timeout_s: float = 1800.0) -> DataParallel:
        """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, MASTER_ADDR...)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            chosen = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
            if chosen == "nccl":  # one GPU per rank, before NCCL creates its communicators
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=chosen, timeout=timedelta(seconds=timeout_s))
            log.info("rank %d of %d joined the process group (%s)", dist.get_rank(), world, chosen)
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def prompt_range(self, num_prompts: int) -> tuple[int, int]:
        """This rank's contiguous share of the batch's prompts (sizes differ by at most one)."""
        base, extra = divmod(num_prompts, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """DDP around the module whose forward the trainer calls (parameters broadcast from rank 0)."""
        if not self.distributed:
            return module
        return torch.nn.parallel.DistributedDataParallel(module)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for batches and state dicts, not weights streams)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks (a CPU tensor in, a CPU tensor out)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """``values``' elementwise maximum over ranks (a CPU tensor in, a CPU tensor out)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if not self.distributed:
            return values
        if dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            on_gpu = values.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=op)
            return on_gpu.cpu()
        dist.all_reduce(values, op=op)
        return values

    def close(self) -> None:
        """Leave the process group (after every DDP module is dropped: ``Trainer.close``)."""
        if self.distributed and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
