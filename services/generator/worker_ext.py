"""Code that runs inside vLLM's worker process (``worker_extension_cls``).

Owns splitting a weight swap in two so that the engine pauses only for the
part that must be atomic, and keeping tied LM heads tied across reloads:
``stage_weights`` reads a verified safetensors checkpoint into the worker's
memory on a thread while generation continues, and
``apply_staged_weights`` (called with the scheduler paused) loads those
tensors through vLLM's in-place layerwise reload, which repacks CPU
kernels' weights the way loading from disk does. Safetensors only: no
pickle ever reaches the worker.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


def _read(files: list[Path]) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))
    return tensors


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
        """Start reading ``weights_path``/*.safetensors into memory; returns the bytes it holds.

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
        runner.reload_weights(weights_iterator=iter(staged.items()), is_checkpoint_format=True)
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
        model = runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        if head.weight is not embed.weight:
            head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
