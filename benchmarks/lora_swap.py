"""A LoRA run's versions against whole-weight versions: bytes on the wire and the swap's pause.

Owns the LoRA swap benchmark. On the 100M-parameter test model (the swap
benchmark's Llama, float32), one invocation runs ``benchmarks.swap.measure``
three times, one engine after the other, with the same engine settings and
the same generation load: whole-weight versions with the CPU engine's
default (``swap_prepack``: packed while generating), whole-weight versions
loaded in the pause (the path GPU engines take), and a LoRA run's versions
(every version an adapter the learner's ``Trainer`` serves, pulled, checked
and staged by the ``Swapper``, loaded in place into the engine's one LoRA
slot). A full-weight engine and a LoRA engine are different engines (the
LoRA one has ``enable_lora``), so "the same engine" is the same model and
settings, not one process. The figures:

  bytes of an adapter version (measured, 100M, rank 32)   <= its tensors by arithmetic (``adapter_signature``)
  bytes of an adapter version / a whole version, Qwen3-8B rank 32, by arithmetic   <= 0.025
      (about 1% of the parameters, each sent in float32 against the base's bf16: twice the bytes)
  median pause of an adapter swap / a whole-weight swap's, prepacked   <= 1
  median pause of an adapter swap / a whole-weight swap's, loaded in the pause   <= 1

Every pause is taken with sequences in flight (nothing aborted, KV kept).

    python -m benchmarks.lora_swap --output DIR [--rank 32] [--swaps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from asymptote.codec import Signature, read_signature, signature_num_bytes
from asymptote.lora import SERVED_DTYPE, LoraSettings, adapter_signature
from benchmarks.figure import Figure, Target, write_and_print
from benchmarks.qwen3_8b import QWEN3_8B
from services.learner.activations import DTYPE_BYTES, ModelShape
from services.learner.memory import adapter_parameters

BENCH_FILE_NAME = "lora_swap_bench.json"
RANK = 32
QWEN3_8B_BYTES_TARGET = 0.025
PAUSE_TARGET = 1.0


def version_bytes(shape: ModelShape, lora: LoraSettings | None) -> int:
    """Bytes of one version as the learner serves it: the whole model in its stored dtype, or the
    adapter ``lora`` puts over it in float32."""
    if lora is None:
        return shape.num_parameters * DTYPE_BYTES[shape.stored_dtype]
    return adapter_parameters(shape, lora) * DTYPE_BYTES[SERVED_DTYPE]


def bytes_figures(full_bytes: int, adapter_bytes: int, base: Signature, lora: LoraSettings) -> list[Figure]:
    """The measured 100M figure (``full_bytes``, ``adapter_bytes``: one version each as served, over the
    base of signature ``base``) and the Qwen3-8B one by arithmetic."""
    predicted = signature_num_bytes(adapter_signature(base, lora))
    qwen = ModelShape.from_config(QWEN3_8B)
    qwen_full, qwen_adapter = version_bytes(qwen, None), version_bytes(qwen, lora)
    qwen_share = adapter_parameters(qwen, lora) / qwen.num_parameters
    return [
        Figure(
            name=f"lora_version_bytes_vs_full_100m_r{lora.rank}",
            value=adapter_bytes,
            unit="B",
            ratio=adapter_bytes / full_bytes,
            baseline=f"a whole version of the 100M model {full_bytes / 1e6:.1f} MB",
            measured=(
                f"an adapter version (rank {lora.rank}, every decoder linear layer) {adapter_bytes / 1e6:.2f} MB as "
                f"served, {adapter_bytes / full_bytes:.2%} of a whole one (by arithmetic {predicted / 1e6:.2f} MB)"
            ),
            targets=(Target(of="value", direction="at most", bound=predicted, rule="the adapter's float32 tensors"),),
            details={"full_bytes": full_bytes, "adapter_bytes": adapter_bytes, "predicted_bytes": predicted},
        ),
        Figure(
            name=f"lora_version_bytes_vs_full_qwen3_8b_r{lora.rank}",
            value=qwen_adapter,
            unit="B",
            ratio=qwen_adapter / qwen_full,
            baseline=f"a whole Qwen3-8B version in bf16 {qwen_full / 1e9:.2f} GB",
            measured=(
                f"by arithmetic: {adapter_parameters(qwen, lora) / 1e6:.1f}M adapter parameters "
                f"({qwen_share:.2%} of {qwen.num_parameters / 1e9:.2f}B) in float32, {qwen_adapter / 1e6:.0f} MB"
            ),
            targets=(
                Target(
                    of="ratio",
                    direction="at most",
                    bound=QWEN3_8B_BYTES_TARGET,
                    rule="about 1% of the parameters, float32 against bf16",
                ),
            ),
            details={
                "full_bytes": qwen_full,
                "adapter_bytes": qwen_adapter,
                "adapter_parameters": adapter_parameters(qwen, lora),
                "num_parameters": qwen.num_parameters,
                "parameter_share": qwen_share,
            },
        ),
    ]


def pause_figure(adapter: dict[str, Any], full: dict[str, Any], rank: int, how: str, key: str) -> Figure:
    """An adapter swap's median pause against a whole-weight swap's (``measure``'s records), ``how`` the
    whole-weight swaps were loaded."""
    ours, theirs = statistics.median(adapter["pause_s"]), statistics.median(full["pause_s"])
    return Figure(
        name=f"lora_swap_pause_vs_full_{key}_100m_r{rank}",
        value=ours,
        unit="s",
        ratio=ours / theirs,
        baseline=(
            f"whole-weight swap, {how}: median pause {theirs * 1e3:.1f} ms over {len(full['pause_s'])} "
            f"({full['version_bytes'] / 1e6:.1f} MB a version)"
        ),
        measured=(
            f"adapter swap, loaded in place: median pause {ours * 1e3:.1f} ms over {len(adapter['pause_s'])} "
            f"({adapter['version_bytes'] / 1e6:.2f} MB a version; {min(adapter['carried'])}-"
            f"{max(adapter['carried'])} sequences in flight)"
        ),
        targets=(Target(of="ratio", direction="at most", bound=PAUSE_TARGET),),
        details={"adapter_pause_s": adapter["pause_s"], "full_pause_s": full["pause_s"]},
    )


def bench_lora_swap(rank: int = RANK, swaps: int = 4, workdir: Path | None = None) -> list[Figure]:
    """The figures of the module docstring, measured in one invocation."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="lora-swap-bench-") as tmp:
            return bench_lora_swap(rank, swaps, Path(tmp))
    from asymptote.tasks import ALPHABET
    from benchmarks.swap import _tmpfs_root, measure
    from benchmarks.transfer import SPEC_100M
    from services.embedded.build import create_model_dir

    lora = LoraSettings(rank=rank)
    model_dir = create_model_dir(SPEC_100M, ALPHABET, workdir / "model")
    runs: dict[str, dict[str, Any]] = {}
    for name, prepack, adapter in (("prepacked", True, None), ("loaded", False, None), ("adapter", True, lora)):
        with tempfile.TemporaryDirectory(prefix="lora-swap-bench-", dir=_tmpfs_root()) as staging_root:
            runs[name] = asyncio.run(measure(model_dir, Path(staging_root), swaps, prepack, adapter))
    if runs["adapter"]["adapter_versions_loaded"] != swaps + 1:
        raise RuntimeError(
            f"the LoRA engine loaded {runs['adapter']['adapter_versions_loaded']} adapters, not {swaps + 1}"
        )
    base = read_signature(model_dir)
    return [
        *bytes_figures(runs["prepacked"]["version_bytes"], runs["adapter"]["version_bytes"], base, lora),
        pause_figure(runs["adapter"], runs["prepacked"], rank, "prepacked while generating", "prepacked"),
        pause_figure(runs["adapter"], runs["loaded"], rank, "loaded in the pause", "loaded"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--rank", type=int, default=RANK, help="the adapter's rank")
    parser.add_argument("--swaps", type=int, default=4, help="measured swaps of each kind")
    args = parser.parse_args(argv)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    write_and_print(bench_lora_swap(args.rank, args.swaps), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
