"""Code that runs inside vLLM's worker process (``worker_extension_cls``).

Owns splitting a weight swap in two so that the engine pauses only for the
part that must be atomic, and keeping tied LM heads tied across reloads: ``stage_weights`` reads a verified safetensors
checkpoint into the worker's memory while generation continues, and
``apply_staged_weights`` (called with the scheduler paused) loads those
tensors through vLLM's in-place layerwise reload, which repacks CPU
kernels' weights the way loading from disk does. Safetensors only: no
pickle ever reaches the worker.
"""

from __future__ import annotations

from typing import Any


class StagedWeightsExtension:
    """Mixed into vLLM's worker; methods are reached through ``collective_rpc``."""

    _staged: dict[str, Any] | None = None
    _staged_path: str | None = None

    def stage_weights(self, weights_path: str) -> int:
        """Read ``weights_path``/*.safetensors into memory; returns bytes staged."""
        from pathlib import Path

        from safetensors.torch import load_file

        from asymptote.codec import safetensors_files

        tensors: dict[str, Any] = {}
        for file in safetensors_files(Path(weights_path)):
            tensors.update(load_file(str(file), device="cpu"))
        self._staged, self._staged_path = tensors, weights_path
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def apply_staged_weights(self, weights_path: str) -> None:
        """Load the tensors staged from ``weights_path`` into the running model."""
        if self._staged is None or self._staged_path != weights_path:
            raise RuntimeError(f"weights from {weights_path} were not staged in this worker")
        staged, self._staged, self._staged_path = self._staged, None, None
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
