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

import contextlib
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Backend = Literal["auto", "gloo", "nccl"]


def choose_backend(backend: Backend, device: str, cuda_available: bool) -> Literal["gloo", "nccl"]:
    """``backend`` unless ``auto``: NCCL when the learner trains on GPUs (``device`` cuda, or auto with
    CUDA available), else gloo, so a CPU learner on a GPU machine never gets NCCL."""
    if backend != "auto":
        return backend
    on_gpu = device == "cuda" or (device == "auto" and cuda_available)
    return "nccl" if on_gpu else "gloo"


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the learner's ranks (one rank: no collectives at all)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, backend: Backend = "auto", timeout_s: float = 600.0, device: str = "auto") -> DataParallel:
        """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, MASTER_ADDR...).

        ``auto`` backend: NCCL when the learner trains on GPUs (``device`` cuda,
        or auto with CUDA visible), else gloo.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            chosen = choose_backend(backend, device, torch.cuda.is_available())
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


DRAINING_KEY = "asymptote/rank0-draining"
"""Set in torchrun's store by rank 0 when it starts draining after SIGTERM or SIGINT."""
DRAIN_WAIT_S = 15.0
"""How long a rank that got SIGTERM waits to see rank 0 draining before it takes rank 0 for dead."""


def _store() -> dist.Store | None:
    """The process group's store (torchrun's, which outlives any rank), if there is one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def mark_draining(dp: DataParallel) -> None:
    """Rank 0: tell the other ranks that it drains (they keep following until it releases them)."""
    if dp.distributed and (store := _store()) is not None:
        store.set(DRAINING_KEY, "1")


def exit_now(why: str, code: int = 1) -> NoReturn:
    """End this process at once, logging the exception being handled.

    A rank whose training failed must not enter another collective, and a
    normal exit would wait for threads that may sit in one (a checkpoint's
    writer): ``os._exit`` ends it, torchrun sees it and stops the group.
    """
    log.exception("%s: ending this process so that torchrun stops every rank and restarts the group", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


@contextlib.contextmanager
def failing_fast(dp: DataParallel, who: str) -> Iterator[None]:
    """Around a rank's work: an exception ends the process at once (``exit_now``) when there are several
    ranks, so that no rank waits in a collective its peers never enter; one process raises it as usual."""
    try:
        yield
    except Exception:
        if dp.distributed:
            exit_now(f"{who} failed")
        raise


class DrainWatch:
    """A follower's SIGTERM/SIGINT handler: keep following while rank 0 drains, else exit.

    torchrun sends SIGTERM to every rank both when the pod is stopped (rank 0
    then drains, checkpoints and releases the others) and when a rank failed
    (rank 0 may be the one that died). The handler waits up to
    ``DRAIN_WAIT_S`` for rank 0's mark in the store; without it the rank exits.
    """

    def __init__(self, dp: DataParallel, wait_s: float = DRAIN_WAIT_S) -> None:
        self.dp = dp
        self.wait_s = wait_s
        self._watching = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._watching:
            return
        self._watching = True
        threading.Thread(target=self._watch, args=(signum,), name="drain-watch", daemon=True).start()

    def _watch(self, signum: int) -> None:
        store = _store()
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if store is not None and store.check([DRAINING_KEY]):
                log.info("rank %d: rank 0 drains; following until it releases this rank", self.dp.rank)
                return
            time.sleep(0.2)
        log.error("rank %d: signal %d and rank 0 is not draining (it failed): exiting", self.dp.rank, signum)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(128 + signum)


@dataclass
class NodeHealth:
    """``/healthz`` and ``/readyz`` of a learner node whose ranks serve nothing else (pods after the first).

    Live while the process runs (a failed rank ends it: ``exit_now``); ready
    once the rank has its weights and follows rank 0.
    """

    server: ThreadingHTTPServer
    ready: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def start(cls, host: str, port: int) -> NodeHealth:
        box: list[NodeHealth] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                health = box[0]
                if self.path == "/healthz":
                    code, body = 200, b"ok"
                elif self.path == "/readyz":
                    code = 200 if health.ready else 503
                    body = json.dumps({"service": "learner-node", "ready": health.ready}).encode()
                else:
                    code, body = 404, b"not found"
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
                return

        health = cls(ThreadingHTTPServer((host, port), Handler))
        box.append(health)
        health.thread = threading.Thread(target=health.server.serve_forever, name="node-health", daemon=True)
        health.thread.start()
        return health

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
