"""Code that runs inside vLLM's worker process (``worker_extension_cls``).

Owns splitting a weight swap in two so that the engine pauses only for the
part that must be atomic, and keeping tied LM heads tied across reloads:
``stage_weights`` brings a verified safetensors checkpoint to where the load
reads it from, on a thread while generation continues, and
``apply_staged_weights`` (called with the scheduler paused) loads those
tensors through vLLM's in-place layerwise reload, which repacks CPU
kernels' weights the way loading from disk does (MoE experts but for the
packing ``services.generator.prepack.repack_experts`` adds after it). On
the CPU that repacking is most of the load, so a CPU engine
(``EngineSettings.swap_prepack``) runs the reload while staging, into a
twin of the model (``services.generator.prepack``), and the pause only
hands it over.
Safetensors only: no pickle ever reaches the worker.

Where a version waits (``EngineSettings.swap_staging``):

- mapped: the tmpfs pages the generator wrote, mapped, every page touched
  (no copy). The CPU build: the engine's memory is those pages' memory.
- pinned: page-locked host buffers, allocated at the first swap and kept
  (a GPU copies from them at the bus's speed; from pageable memory it goes
  through a bounce buffer at a fraction of it).
- device: spare GPU memory; the paused load is then a device-to-device copy.

On a GPU the copy into pinned or device buffers runs on a stream of its own
while the engine generates, so the pause holds only the final copy into the
model's parameters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.generator.prepack import Prepared, prepare, repack_experts, tied_head

PLACEMENTS = ("mapped", "pinned", "device")
"""Where a staged version can wait; see the module docstring."""
DEVICE_RESERVE_BYTES = 1 << 30
"""GPU memory ``auto`` leaves free beside a version staged on the device (the engine's own allocations)."""


def _mapped(files: list[Path]) -> dict[str, Any]:
    """Map the checkpoint's tensors (no copy: they view the files' pages) and fault their pages in.

    On tmpfs the pages are the ones the generator wrote the version into, so
    the worker holds no second copy. Touching one byte per page here, while
    the engine keeps stepping, maps every page now rather than during the
    pause, where the load copies from them.
    """
    import torch
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    for tensor in tensors.values():
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor
        flat[::_PAGE_BYTES].sum()
    return tensors


def choose_placement(requested: str, device: Any, num_bytes: int) -> str:
    """The placement for a version of ``num_bytes`` on ``device`` (a torch device), ``requested`` being
    one of ``auto`` or PLACEMENTS.

    auto: mapped on the CPU; on a GPU the device when the version fits beside
    DEVICE_RESERVE_BYTES in what is free (what the caching allocator holds
    unused counts as free), else pinned host memory. mapped is the only
    placement on the CPU: its memory is the one the engine computes from.
    """
    if requested not in ("auto", *PLACEMENTS):
        raise ValueError(f"swap staging {requested!r}: expected auto, {', '.join(PLACEMENTS)}")
    if device.type == "cpu":
        return "mapped"
    if requested != "auto":
        return requested
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return "device" if free - num_bytes >= DEVICE_RESERVE_BYTES else "pinned"


def _staged_copy(source: dict[str, Any], placement: str, device: Any, keep: dict[str, Any]) -> dict[str, Any]:
    """``source`` copied into pinned host buffers (reusing those in ``keep``, by name, when shape and dtype
    match) or onto ``device``, on a CUDA stream of its own so the engine's kernels run on beside it."""
    import torch

    stream = torch.cuda.Stream(device)
    out: dict[str, Any] = {}
    with torch.cuda.stream(stream):
        for name, tensor in source.items():
            if placement == "pinned":
                buffer = keep.get(name)
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = keep[name] = torch.empty_like(tensor, device="cpu").pin_memory()
                out[name] = buffer.copy_(tensor)
            else:
                out[name] = tensor.to(device, non_blocking=True)
    stream.synchronize()
    return out


_PAGE_BYTES = 4096
_TRIM_EVERY_S = 0.01
TRIM_FROM_BYTES = 64 << 20
"""Versions from this size on are loaded with the heap trimmed as the load goes (see
``_returning_freed_memory``); below it the growth is a few MB and the trimming would cost more pause
than it saves memory (on the embedded default's 1.3 MB model: 12.0 ms against 9.7 ms a reload)."""


@contextmanager
def _returning_freed_memory(num_bytes: int) -> Iterator[None]:
    """For a version of ``num_bytes`` from TRIM_FROM_BYTES on: while the body runs, hand the heap's free
    pages back to the kernel every 10 ms. The last trim runs after the body, on the trimming thread, so
    whoever waits for the body does not wait for it.

    vLLM's layerwise reload materialises each layer anew, loads and repacks
    it, copies it into the live parameters and frees the new tensors. glibc
    keeps such frees inside the heap, fragmented, and over a reload they add
    up. Measured on a 100M-parameter model (396 MB), one reload in the
    worker: no trimming, 210-260 ms and the worker grew by 165-183 MB;
    trimming every 40 ms, 257-277 ms and 43-89 MB; every 10 ms, 360-404 ms
    and 6-51 MB; glibc's mmap threshold at 1 MiB instead, 229-244 ms and
    107-164 MB. Memory is what a generator runs out of, so 10 ms it is.
    Does nothing on a C library other than glibc.
    """
    import ctypes
    import platform
    import threading

    if num_bytes < TRIM_FROM_BYTES or platform.libc_ver()[0] != "glibc":
        yield
        return
    trim = ctypes.CDLL(None).malloc_trim
    done = threading.Event()

    def run() -> None:
        while not done.wait(_TRIM_EVERY_S):
            trim(0)
        trim(0)

    threading.Thread(target=run, name="trim-heap", daemon=True).start()
    try:
        yield
    finally:
        done.set()


@dataclass
class _Staged:
    """A version staged in the worker: where it waits, its tensors, and the twin they were loaded into."""

    placement: str
    tensors: dict[str, Any]
    prepared: Prepared | None = None
    prepare_s: float = 0.0
    """Building ``prepared`` (on the staging thread, while the engine generated)."""


class StagedWeightsExtension:
    """Mixed into vLLM's worker; methods are reached through ``collective_rpc``.

    A worker answers one RPC at a time and the engine core waits for each
    answer before its next step, so ``stage_weights`` only starts the read (on
    a thread of the worker's own) and returns: the engine keeps stepping while
    the checkpoint is read, and ``staged`` says when it is in memory.
    """

    _staging: tuple[str, Future[_Staged]] | None = None
    _reader: ThreadPoolExecutor | None = None
    _pinned: dict[str, Any] | None = None
    _routing: Any = None
    """The MoE routing capture (``install_routing_capture``), if installed."""
    """Page-locked buffers of the pinned placement, by tensor name, kept from one swap to the next."""

    def stage_weights(self, weights_path: str, placement: str = "auto", prepack: bool = False) -> int:
        """Start staging ``weights_path``/*.safetensors where ``placement`` (auto or one of PLACEMENTS)
        puts it; returns the bytes it holds. ``prepack``: on a CPU engine serving an unquantized model,
        also load and pack the version into a twin of the model (see ``services.generator.prepack``).

        WeightsError at once if the folder holds no safetensors checkpoint
        (pickle-only folders included).
        """
        from asymptote.codec import safetensors_files

        files = safetensors_files(Path(weights_path))
        num_bytes = sum(f.stat().st_size for f in files)
        chosen = choose_placement(placement, self._device(), num_bytes)
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-weights")
        self._staging = (weights_path, self._reader.submit(self._stage, files, chosen, prepack, num_bytes))
        return num_bytes

    def _stage(self, files: list[Path], placement: str, prepack: bool, num_bytes: int) -> _Staged:
        tensors = _mapped(files)
        if placement != "mapped":
            if placement == "pinned" and self._pinned is None:
                self._pinned = {}
            return _Staged(placement, _staged_copy(tensors, placement, self._device(), self._pinned or {}))
        runner = getattr(self, "model_runner", None)
        # Only the CPU build packs weights: a GPU engine's reload is a copy, which the pause holds anyway.
        cpu = self._device().type == "cpu"
        if not prepack or runner is None or not cpu or runner.model_config.quantization is not None:
            return _Staged(placement, tensors)
        started = time.perf_counter()
        with _returning_freed_memory(num_bytes):
            prepared = prepare(runner.get_model(), runner.model_config, iter(tensors.items()))
        return _Staged(placement, {}, prepared, time.perf_counter() - started)  # the twin holds the version now

    def _device(self) -> Any:
        """The device the model computes on (the CPU in a worker with no model, e.g. a bare extension)."""
        import torch

        runner = getattr(self, "model_runner", None)
        return torch.device(runner.device) if runner is not None else torch.device("cpu")

    def staged(self, weights_path: str) -> bool:
        """Whether the read of ``weights_path`` has ended (a failed read too: applying raises it)."""
        if self._staging is None or self._staging[0] != weights_path:
            raise RuntimeError(f"weights from {weights_path} are not being staged in this worker")
        return self._staging[1].done()

    def apply_staged_weights(self, weights_path: str) -> dict[str, Any]:
        """Load the tensors staged from ``weights_path`` into the running model; where they were
        staged and the seconds the load took in this worker."""
        if self._staging is None or self._staging[0] != weights_path:
            raise RuntimeError(f"weights from {weights_path} were not staged in this worker")
        staged, self._staging = self._staging[1].result(), None
        runner = self.model_runner  # type: ignore[attr-defined]
        report = {
            "placement": staged.placement,
            "prepacked": staged.prepared is not None,
            "prepare_s": staged.prepare_s,
        }
        started = time.perf_counter()
        if staged.prepared is not None:
            staged.prepared.apply()
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload does
                getattr(runner, reset, lambda: None)()
            return {**report, "load_s": time.perf_counter() - started}
        tensors = staged.tensors
        del staged
        with _returning_freed_memory(sum(t.numel() * t.element_size() for t in tensors.values())):
            runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
            del tensors
            for module in runner.get_model().modules():
                repack_experts(module)
            self._retie_lm_head(runner)
        return {**report, "load_s": time.perf_counter() - started}

    def install_routing_capture(self) -> dict[str, Any]:
        """Record every MoE layer's routing (``services.generator.capture``); returns what it found: the MoE
        layers, top-k and experts."""
        from services.generator.capture import RoutingCapture

        capture = self._routing = RoutingCapture(self.model_runner)  # type: ignore[attr-defined]
        return {"moe_layers": capture.moe_layers, "top_k": capture.top_k, "num_experts": capture.num_experts}

    def take_routing(self, request_id: str) -> dict[int, bytes]:
        """The recorded rows of the requests the driver submitted as ``request_id``, by sample index."""
        return self._routing.take(request_id)

    @staticmethod
    def _retie_lm_head(runner: Any) -> None:
        """Make a tied LM head score with the reloaded embedding.

        The layerwise reload skips the head (no checkpoint tensor names it):
        if the reload gave the embedding a new parameter the head must point at
        it again, and on CPU the head's GEMM, prepacked from the old weight at
        start-up, must be rebuilt either way, or a tied head keeps scoring with
        version 0's embedding.
        """
        if not getattr(runner.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        head, embed = tied_head(runner.get_model())
        if head.weight is not embed.weight:
            head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
