"""Code that runs inside vLLM's worker process (``worker_extension_cls``).

Owns splitting a weight swap in two so that the engine pauses only for the
part that must be atomic, and keeping tied LM heads tied across reloads:
``stage_weights`` maps a verified safetensors checkpoint into the worker's
memory on a thread while generation continues (no copy: on tmpfs the
pages are the ones the generator wrote), and
``apply_staged_weights`` (called with the scheduler paused) loads those
tensors through vLLM's in-place layerwise reload, which repacks CPU
kernels' weights the way loading from disk does. Safetensors only: no
pickle ever reaches the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _read(files: list[Path]) -> dict[str, Any]:
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


_PAGE_BYTES = 4096
_TRIM_EVERY_S = 0.01


@contextmanager
def _returning_freed_memory() -> Iterator[None]:
    """While the body runs, hand the heap's free pages back to the kernel every 10 ms.

    vLLM's layerwise reload materialises each layer anew, loads and repacks
    it, copies it into the live parameters and frees the new tensors. glibc
    keeps such frees inside the heap, fragmented, and over a reload they add
    up (measured on a 100M-parameter model: the worker grew by 127 MB,
    about a third of the model, before the reload ended). Trimming as it
    goes holds the growth to the layers under way (under 30 MB there), for
    about 20% more reload time. Does nothing on a C library other than glibc.
    """
    import ctypes
    import platform
    import threading

    if platform.libc_ver()[0] != "glibc":
        yield
        return
    trim = ctypes.CDLL(None).malloc_trim
    done = threading.Event()

    def run() -> None:
        while not done.wait(_TRIM_EVERY_S):
            trim(0)

    trimmer = threading.Thread(target=run, name="trim-heap", daemon=True)
    trimmer.start()
    try:
        yield
    finally:
        done.set()
        trimmer.join()
        trim(0)


class StagedWeightsExtension:
    """Mixed into vLLM's worker; methods are reached through ``collective_rpc``.

    A worker answers one RPC at a time and the engine core waits for each
    answer before its next step, so ``stage_weights`` only starts the read (on
    a thread of the worker's own) and returns: the engine keeps stepping while
    the checkpoint is read, and ``staged`` says when it is in memory.
    """

    _staging: tuple[str, Future[dict[str, Any]]] | None = None
    _reader: ThreadPoolExecutor | None = None

    def stage_weights(self, weights_path: str) -> int:
        """Start mapping ``weights_path``/*.safetensors into memory; returns the bytes it holds.

        WeightsError at once if the folder holds no safetensors checkpoint
        (pickle-only folders included).
        """
        from asymptote.codec import safetensors_files

        files = safetensors_files(Path(weights_path))
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-weights")
        self._staging = (weights_path, self._reader.submit(_read, files))
        return sum(f.stat().st_size for f in files)

    def staged(self, weights_path: str) -> bool:
        """Whether the read of ``weights_path`` has ended (a failed read too: applying raises it)."""
        if self._staging is None or self._staging[0] != weights_path:
            raise RuntimeError(f"weights from {weights_path} are not being staged in this worker")
        return self._staging[1].done()

    def apply_staged_weights(self, weights_path: str) -> None:
        """Load the tensors staged from ``weights_path`` into the running model."""
        if self._staging is None or self._staging[0] != weights_path:
            raise RuntimeError(f"weights from {weights_path} were not staged in this worker")
        staged, self._staging = self._staging[1].result(), None
        runner = self.model_runner  # type: ignore[attr-defined]
        with _returning_freed_memory():
            runner.reload_weights(weights_iterator=iter(staged.items()), is_checkpoint_format=True)
            del staged
            self._retie_lm_head(runner)

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
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = runner.get_model()
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
        embeds = [
            m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        ]
        if len(heads) != 1 or len(embeds) != 1:
            raise RuntimeError(
                f"a tied LM head needs one embedding and one head to retie; "
                f"{type(model).__name__} has {len(embeds)} embeddings and {len(heads)} heads"
            )
        head, embed = heads[0], embeds[0]
        if head.weight is not embed.weight:
            head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
