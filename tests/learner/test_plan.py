"""The memory planner against what the learner's own forward and backward hold, and ``asymptote plan``.

Activations are measured on the CPU in two ways, both counting tensor
bytes rather than an allocator's: autograd's saved tensors (with
``torch.autograd.graph.saved_tensors_hooks``, plus the layer inputs that
activation checkpoints hold), which is what survives from the forward to
the backward; and the peak of every live tensor over the forward and the
backward (a ``TorchDispatchMode`` that sees each op's outputs and drops them
when their storage dies), parameters and their gradients aside. Models of
each family with over 50M parameters run through ``PolicyForward`` as the
learner runs them: the CPU learner's configuration (eager attention,
float32), and the GPU learner's numerics (SDPA, bf16, FSDP2's mixed
precision over a one-rank gloo group). The planner's figures come from
``services.learner.memory``, the same functions ``asymptote plan`` and the
learner use.
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from asymptote.errors import ConfigError
from services.cli import main
from services.learner.activations import ModelShape, activation_bytes
from services.learner.config import LearnerConfig
from services.learner.layers import decoder_layers
from services.learner.memory import (
    GIB,
    USABLE_FRACTION,
    GeneratorPlan,
    GeneratorSettings,
    check_learner,
    learner_fits,
    plan_generator,
    plan_run,
    suggest_micro_batch_tokens,
)
from services.learner.model import PackedBatch, PolicyForward, Precision, count_parameters, pack
from services.learner.sharding import checkpoint_activations, shard
from services.ops.plan import plan_inputs
from tests.helpers.badinput import BAD_INPUTS
from tests.helpers.families import QWEN3_8B, config_only

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "helm" / "qwen3-gsm8k-values.yaml"
TOLERANCE = 0.2
"""Predicted within 20% of measured (the brief's bound; the saved tensors match to the byte)."""

# Wide enough for over 50M parameters, with few layers and short rows so that each run takes seconds.
COMMON: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
FAMILIES: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**COMMON, vocab_size=16384, tie_word_embeddings=False),
    "qwen2": Qwen2Config(**COMMON, vocab_size=32768, tie_word_embeddings=True),  # q/k/v biases, tied head
    "qwen3": Qwen3Config(
        **{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 2}, head_dim=128, vocab_size=16384
    ),
}


NARROW: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, vocab_size=4096)
"""For the bf16 runs: this machine's CPU torch computes a bf16 product whose right operand is row-major
(most of a backward) at under 1 GFLOP/s, so the FSDP2 bf16 runs take a model a tenth the size (the
saved bytes per token still match to 0.1%)."""


def narrowed(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with NARROW's widths (its layers, heads' shape and head tying kept)."""
    return type(config)(**{**config.to_dict(), **NARROW})


def random_model(config: PretrainedConfig, attention: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(
        config, attn_implementation=attention, dtype=torch.float32
    )
    return model.train()


def ragged_batch() -> PackedBatch:
    """Two rows of different prompt and completion lengths: left and right padding, as the learner packs."""
    return pack([[5] * 20, [7] * 36], [[9] * 90, [11] * 70], pad_id=0)


# -- measuring ----------------------------------------------------------------------------------------------


class LiveTensors(TorchDispatchMode):
    """Every storage an op creates, from its creation to its death: the bytes of live tensors over time."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore
        self.clock = 0
        self.live: dict[int, list[Any]] = {}
        self.records: list[list[Any]] = []  # [data_ptr, bytes, born, StorageWeakRef, died, shape]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.clock += 1
        for key in [k for k, r in self.live.items() if r[3].expired()]:
            self.live.pop(key)[4] = self.clock
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.ignore:
                    record = [key, storage.nbytes(), self.clock, StorageWeakRef(storage), None, tuple(t.shape)]
                    self.live[key] = record
                    self.records.append(record)
        return out

    def peak(self, after: int, gradient_shapes: set[tuple[int, ...]]) -> int:
        """The most bytes alive at once, leaving out what is born after ``after`` (the forward's end) in a
        parameter's shape: the parameters' gradients, and their sums where a tied weight gets two."""
        events = []
        for _, size, born, _, died, shape in self.records:
            if born > after and shape in gradient_shapes:
                continue
            events += [(born, size), (died if died is not None else self.clock + 1, -size)]
        current = best = 0
        for _, change in sorted(events):
            current += change
            best = max(best, current)
        return best


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or autocast's cast copy of one."""
    base = t._base if t._base is not None else t
    if isinstance(base, torch.nn.Parameter):
        return True
    fn = base.grad_fn
    return (
        fn is not None and fn.name() == "ToCopyBackward0" and type(fn.next_functions[0][0]).__name__ == "AccumulateGrad"
    )


@dataclass
class Measured:
    kept_bytes: int
    """Saved for the backward (and held by checkpoints), each storage once."""
    peak_bytes: int | None
    """Most bytes of live tensors at once over the forward and backward, parameters and gradients aside."""


def measure(
    policy: PolicyForward, layers: list[torch.nn.Module], batch: PackedBatch, checkpointing: bool, live: bool
) -> Measured:
    """One forward and backward of ``policy``, set up as the learner sets it; ``layers``: its decoder layers."""
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if not _is_weight(t):
            kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    def held_by_checkpoint(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                keep(t)

    hooks = []
    if checkpointing:  # a checkpointed layer keeps its inputs to recompute from, outside autograd's saved tensors
        hooks = [layer.register_forward_pre_hook(held_by_checkpoint, with_kwargs=True) for layer in layers]
    mode: LiveTensors | contextlib.nullcontext[None] = contextlib.nullcontext()
    if live:
        mode = LiveTensors({p.untyped_storage().data_ptr() for p in policy.parameters()})
    temperature = torch.ones(batch.input_ids.shape[0])
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp, _ = policy(batch, temperature)
            forward_end = mode.clock if isinstance(mode, LiveTensors) else 0
            (logp * batch.completion_mask).sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    peak = None
    if isinstance(mode, LiveTensors):
        shapes = {tuple(p.shape) for p in policy.parameters()} | {tuple(p.shape)[::-1] for p in policy.parameters()}
        peak = mode.peak(forward_end, shapes)
    return Measured(sum(kept.values()), peak)


def predicted(config: PretrainedConfig, batch: PackedBatch, **numerics: Any) -> Any:
    rows, width = batch.input_ids.shape
    return activation_bytes(
        ModelShape.from_config(config.to_dict()),
        tokens=rows * width,
        width_tokens=width,
        completion_positions=int(batch.completion_mask.sum()),  # the head takes the real completion tokens only
        **numerics,
    )


def report(label: str, tokens: int, measured: float, predicted_bytes: float) -> str:
    return (
        f"{label}: measured {measured / tokens:,.0f} B/token, predicted {predicted_bytes / tokens:,.0f} B/token "
        f"({predicted_bytes / measured - 1:+.1%})"
    )


# -- the CPU learner's configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_bytes_per_token_match_the_cpu_learner(family: str, checkpointing: bool) -> None:
    config = FAMILIES[family]
    model = random_model(config, "eager")
    shape = ModelShape.from_config(config.to_dict())
    assert shape.num_parameters == count_parameters(model) >= 50_000_000
    if checkpointing:
        checkpoint_activations(model)
    batch = ragged_batch()
    tokens = batch.input_ids.numel()
    policy = PolicyForward(model, Precision(torch.device("cpu"), torch.float32))
    got = measure(policy, decoder_layers(model), batch, checkpointing, live=True)
    want = predicted(config, batch, compute_bytes=4, attention="eager", fsdp=False, checkpointing=checkpointing)
    # What survives from the forward to the backward, the head's targets and temperatures included.
    kept = want.kept + want.head_saved
    print(report(f"{family} eager float32 {'checkpointed' if checkpointing else 'kept'}", tokens, got.kept_bytes, kept))
    assert kept == pytest.approx(got.kept_bytes, rel=TOLERANCE)
    # The whole forward and backward: the kept tensors plus the head's three [chunk, vocab] float32 tensors
    # (or a recomputed layer, whichever is larger), against the live tensors' measured peak.
    assert got.peak_bytes is not None
    print(report("  peak", tokens, got.peak_bytes, want.peak))
    assert want.peak == pytest.approx(got.peak_bytes, rel=TOLERANCE)
    assert want.head > want.recomputed  # these shapes' peak is the head's: the test below covers the other case


def test_the_recomputed_layer_is_the_peak_with_a_small_vocabulary() -> None:
    """With activation checkpointing and a head too small to matter, the peak is one layer rebuilt in the backward."""
    config = LlamaConfig(**COMMON, vocab_size=512, tie_word_embeddings=False)
    model = random_model(config, "eager")
    checkpoint_activations(model)
    batch = ragged_batch()
    policy = PolicyForward(model, Precision(torch.device("cpu"), torch.float32))
    got = measure(policy, decoder_layers(model), batch, checkpointing=True, live=True)
    want = predicted(config, batch, compute_bytes=4, attention="eager", fsdp=False, checkpointing=True)
    assert want.recomputed > 4 * want.head
    assert got.peak_bytes is not None
    print(report("llama small vocabulary, checkpointed, peak", batch.input_ids.numel(), got.peak_bytes, want.peak))
    assert want.peak == pytest.approx(got.peak_bytes, rel=TOLERANCE)
    # The eager attention's probabilities are quadratic in the row's width: a layer's bytes grow with it.
    shape = ModelShape.from_config(config.to_dict())
    wide = predicted(
        config, pack([[5] * 20], [[9] * 490], 0), compute_bytes=4, attention="eager", fsdp=False, checkpointing=True
    )
    assert wide.recomputed / 510 - want.recomputed / batch.input_ids.numel() == pytest.approx(
        shape.num_heads * (510 - batch.input_ids.shape[1]) * 4
    )


# -- the GPU learner's numerics, on the CPU ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo process group, so FSDP2 shards (trivially) and casts as it does on GPUs."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saved_activations_match_under_fsdp2_bf16_sdpa(family: str, checkpointing: bool, one_rank_group: None) -> None:
    """The GPU path's numerics: FSDP2 casts each layer's weights and inputs to bf16, SDPA attention,
    the root (embeddings, head) in float32; set up in the trainer's order (checkpointing, then sharding)."""
    config = narrowed(FAMILIES[family])
    model = random_model(config, "sdpa")
    precision = Precision(torch.device("cpu"), torch.bfloat16)
    if checkpointing:
        checkpoint_activations(model)
    policy = PolicyForward(model, precision)
    layers = decoder_layers(model)
    shard(policy, model, precision)
    batch = ragged_batch()
    got = measure(policy, layers, batch, checkpointing, live=False)
    want = predicted(config, batch, compute_bytes=2, attention="sdpa", fsdp=True, checkpointing=checkpointing)
    kept = want.kept + want.head_saved
    label = f"{family} sdpa bf16 FSDP2 {'checkpointed' if checkpointing else 'kept'}"
    print(report(label, batch.input_ids.numel(), got.kept_bytes, kept))
    assert kept == pytest.approx(got.kept_bytes, rel=TOLERANCE)


# -- Qwen3-8B on 8 x H100-80GB with the shipped preset ------------------------------------------------------


@pytest.fixture
def qwen3_8b(tmp_path: Path) -> Path:
    return config_only(tmp_path / "Qwen3-8B", QWEN3_8B)


def test_qwen3_8b_shape() -> None:
    shape = ModelShape.from_config(QWEN3_8B)
    # Qwen3-8B's model card: 8.2B parameters, 6.95B without the embeddings (which its untied head doubles).
    assert shape.num_parameters == 8_190_735_360
    assert shape.num_parameters - 2 * shape.vocab_size * shape.hidden_size == pytest.approx(6.95e9, rel=1e-3)
    assert shape.layer_parameters == 192_946_432
    assert shape.largest_tensor_elements == 151936 * 4096


def test_the_8b_preset_fits_a_node_of_eight_h100s(qwen3_8b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The example values over the chart's defaults, as helm merges them, as ``asymptote plan`` reads them."""
    inputs = plan_inputs(["--model", str(qwen3_8b), "--config", str(EXAMPLE)])
    assert (inputs.gpus_per_node, inputs.nodes, inputs.gpu_memory_gib) == (8, 1, 80.0)
    assert inputs.learner.activation_checkpointing and inputs.learner.micro_batch_tokens == 32768
    assert (inputs.max_tokens, inputs.prompt_tokens, inputs.group_size) == (8192, 512, 16)
    assert inputs.max_tokens_from == f"broker.config.sampling.max_tokens in {EXAMPLE}"
    assert inputs.engine.kv_cache_memory_bytes is None and inputs.engine.gpu_memory_utilization == 0.9
    run = plan_run(
        inputs.shape,
        inputs.learner,
        inputs.engine,
        gpus_per_node=8,
        prompt_tokens=inputs.prompt_tokens,
        max_tokens=inputs.max_tokens,
    )
    rank, p = run.learner, inputs.shape.num_parameters
    assert rank.layout == "fsdp" and rank.world_size == 8
    held = {item.name: item.num_bytes for item in rank.held}
    assert held["weights"] + held["gradients"] + held["AdamW moments"] == 16 * p // 8  # whole model, 8 shards
    assert rank.total_bytes <= 0.9 * 80 * GIB
    assert rank.total_bytes == pytest.approx(47.9 * GIB, abs=0.05 * GIB)
    # A generator GPU: bf16 KV of 36 layers x 8 heads x 128 x (K, V) per token, by memory fraction.
    assert run.generator.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    assert run.generator.sequences == run.generator.kv_tokens // 8704 >= 32
    # The fixed 16 GiB the chart used to ship held a third of that (GPU-READINESS.md: about 116k tokens).
    fixed = plan_generator(
        inputs.shape, GeneratorSettings(kv_cache_memory_bytes=16 * GIB), gpu_memory_gib=80, sequence_tokens=8704
    )
    assert fixed.kv_tokens == 116_508 < run.generator.kv_tokens / 3
    # Host memory of the pod and the checkpoints: 12 bytes a parameter, staged over the pod's 8 ranks.
    assert run.host.staging_bytes == 12 * p
    assert run.host.load_bytes == 8 * 4 * 151936 * 4096
    assert run.host.served_bytes == (2 + 1) * 2 * p  # two kept, one being copied out; bf16
    # The newest two, the best held-out round's and the one being written.
    assert run.host.disk_bytes == 4 * run.host.checkpoint_bytes >= 4 * 12 * p
    # The command prints it and says it fits.
    assert main(["plan", "--model", str(qwen3_8b), "--config", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "47.90" in out and "fits" in out and "155.85" in out and "366.40" in out


def test_a_micro_batch_too_large_is_refused_with_one_that_fits(qwen3_8b: Path) -> None:
    config = LearnerConfig(model_dir=qwen3_8b, micro_batch_tokens=131072, activation_checkpointing=True)
    gib80 = 80 * GIB
    with pytest.raises(ConfigError) as refused:
        learner_fits(qwen3_8b, config, world_size=8, local_world_size=8, gpu_memory_bytes=gib80, sequence_tokens=8704)
    message = str(refused.value)
    assert "\n" not in message and "micro_batch_tokens 131072" in message
    assert "set micro_batch_tokens: 65536" in message
    shape = ModelShape.from_config(QWEN3_8B)
    where: dict[str, Any] = dict(gpus_per_node=8, gpu_memory_gib=80.0, sequence_tokens=8704)
    assert suggest_micro_batch_tokens(shape, config, **where) == 65536
    # 65536 fits, and the next power of two does not.
    fitting = check_learner(shape, config.model_copy(update={"micro_batch_tokens": 65536}), **where)
    assert fitting.total_bytes <= USABLE_FRACTION * gib80
    with pytest.raises(ConfigError):
        check_learner(shape, config.model_copy(update={"micro_batch_tokens": 131072}), **where)
    # Without activation checkpointing not one sequence fits: the message names that setting first.
    with pytest.raises(ConfigError, match="set activation_checkpointing: true and micro_batch_tokens: 65536"):
        check_learner(shape, config.model_copy(update={"activation_checkpointing": False}), **where)
    # DDP keeps 16 bytes a parameter on every GPU: only sharding fits.
    with pytest.raises(ConfigError, match="set parallelism: fsdp, activation_checkpointing: true and"):
        check_learner(shape, config.model_copy(update={"parallelism": "ddp"}), **where)
    # The learner at start does not know max_tokens: rows are planned as wide as the micro-batch, so the
    # quadratic mask costs a little more and the largest round number that fits is a multiple of 1024.
    preset = config.model_copy(update={"micro_batch_tokens": 32768})
    assert learner_fits(qwen3_8b, preset, world_size=8, local_world_size=8, gpu_memory_bytes=gib80).fits
    with pytest.raises(ConfigError, match=r"set micro_batch_tokens: 59392 \(71.4 GiB\)"):
        learner_fits(qwen3_8b, config, world_size=8, local_world_size=8, gpu_memory_bytes=gib80)
    # Two GPUs cannot hold the 8B model's states at all.
    with pytest.raises(ConfigError, match="not even one sequence of 8704 tokens fits"):
        check_learner(shape, config, **{**where, "gpus_per_node": 2})


# -- the command line -----------------------------------------------------------------------------------------

RUN_CLI = (
    "import sys\n"
    "from services.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as exit:\n"
    "    code = exit.code\n"
    "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))\n"
    "sys.exit(code)\n"
)


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, *argv],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"},
        capture_output=True,
        text=True,
        timeout=60,
    )


REFUSALS = {
    "no-gpus": "--gpus-per-node 0: must be at least 1",
    "no-config-json": "no config.json",
    "below-one-sequence": "micro_batch_tokens 4096 is below one sequence: prompt 512 (--prompt-tokens) + "
    "max_tokens 8192 (--max-tokens) = 8704 tokens",
    "below-one-sequence-values": "learner.config.micro_batch_tokens 4096 is below one sequence",
    "does-not-fit": "learner.config.micro_batch_tokens 131072: a learner rank needs",
    "not-a-count": "learner.gpusPerNode in {config}: must be a whole number of at least 1, got 'eight'",
}
"""Each case and what its one line must say."""


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_plan_answers_in_one_line(case: str, qwen3_8b: Path, tmp_path: Path) -> None:
    named = REFUSALS[case]
    learner_yaml = tmp_path / "learner.yaml"
    learner_yaml.write_text("micro_batch_tokens: 4096\nactivation_checkpointing: true\n")
    small = tmp_path / "small.yaml"
    small.write_text("learner:\n  config:\n    micro_batch_tokens: 4096\n")
    large = tmp_path / "large.yaml"
    large.write_text("learner:\n  config:\n    micro_batch_tokens: 131072\n")
    words = tmp_path / "words.yaml"
    words.write_text("learner:\n  gpusPerNode: eight\n")
    named = named.format(config=words)
    argv = {
        "no-gpus": ["--model", str(qwen3_8b), "--gpus-per-node", "0"],
        "no-config-json": ["--model", str(tmp_path), "--gpus-per-node", "8"],
        "below-one-sequence": [
            "--model",
            str(qwen3_8b),
            "--gpus-per-node",
            "8",
            "--max-tokens",
            "8192",
            "--config",
            str(learner_yaml),
        ],
        "below-one-sequence-values": ["--model", str(qwen3_8b), "--config", str(small)],
        "does-not-fit": ["--model", str(qwen3_8b), "--config", str(large)],
        "not-a-count": ["--model", str(qwen3_8b), "--config", str(words)],
    }[case]
    proc = run_cli("plan", *argv)
    BAD_INPUTS.record("command line", f"plan {case}", crashed="Traceback" in proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("asymptote plan: ") and named in line, line
    if case == "no-config-json":
        assert line.startswith(f"asymptote plan: --model {tmp_path}")
    if case == "does-not-fit":
        assert "set learner.config.micro_batch_tokens: 65536" in line
        assert "does NOT fit" in proc.stdout  # the plan is printed before the refusal
    # Pure arithmetic: neither torch nor transformers was imported.
    assert ast.literal_eval(proc.stdout.splitlines()[-1]) == []


def test_the_learner_refuses_at_start_what_does_not_fit(
    qwen3_8b: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asymptote learner`` on a GPU runs the planner's check before it allocates (no GPU here: the
    device and its memory are faked, the check and the command line are the learner's own)."""
    import services.learner.model as model_module
    from services.cli import main as cli

    gpu = Precision(torch.device("cuda", 0), torch.bfloat16)
    monkeypatch.setattr(model_module.Precision, "resolve", classmethod(lambda cls, *a, **k: gpu))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    config = tmp_path / "learner.yaml"
    config.write_text(f"model_dir: {qwen3_8b}\nmicro_batch_tokens: 131072\nactivation_checkpointing: true\n")
    assert cli(["learner", "--config", str(config)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the learner's log of its config
    assert last.startswith("asymptote learner: micro_batch_tokens 131072") and "set micro_batch_tokens: 59392" in last


# -- what 100 steps cost ------------------------------------------------------------------------------------


def test_a_step_s_cost_follows_bandwidth_and_flops_by_hand() -> None:
    from services.ops.cost import ACCELERATORS, step_cost

    shape = ModelShape.from_config(QWEN3_8B)
    gpu = GeneratorPlan(
        gpu_memory_bytes=80 * GIB,
        weights_bytes=16_000_000_000,
        kv_cache_bytes=147_456 * 1_000_000,
        kv_bytes_per_token=147_456,
        sequence_tokens=8704,
        max_num_seqs=256,
        sized_by="memory fraction",
    )
    cost = step_cost(
        shape,
        gpu,
        accelerator=ACCELERATORS["h100"],
        generator_gpus=4,
        learner_gpus=8,
        batch_prompts=48,
        group_size=16,
        prompt_tokens=512,
        mean_completion_tokens=4096,
        activation_checkpointing=True,
    )
    # Decoding half-way: 512 + 2048 tokens of context; 1M KV tokens hold 390 such sequences, max_num_seqs 256.
    assert cost.concurrent_sequences_per_gpu == 256
    step_bytes = 16_000_000_000 + 256 * 2560 * 147_456
    assert cost.generate_tokens_per_s_per_gpu == pytest.approx(256 * 3.35e12 * 0.5 / step_bytes)  # about 3,807
    # Training: 4 passes (checkpointed) x (2N + 2 x 36 layers x 32 heads x 128 x 2,304 tokens of context).
    flops = 4 * (2 * 8_190_735_360 + 2 * 36 * 32 * 128 * 2304)
    assert cost.train_tokens_per_s_per_gpu == pytest.approx(989e12 * 0.35 / flops)  # about 5,072
    assert (cost.completion_tokens, cost.trained_tokens) == (768 * 4096, 768 * 4608)
    assert cost.generate_s == pytest.approx(768 * 4096 / (4 * cost.generate_tokens_per_s_per_gpu))
    assert cost.step_s == cost.generate_s > cost.train_s  # four generator GPUs are the bottleneck
    assert cost.gpu_hours_per_100_steps == pytest.approx(100 * cost.generate_s * 12 / 3600)
    # The balanced split of the same 12 GPUs: the shortest step of all eleven.
    steps = {
        g: step_cost(
            shape,
            gpu,
            accelerator=ACCELERATORS["h100"],
            generator_gpus=g,
            learner_gpus=12 - g,
            batch_prompts=48,
            group_size=16,
            prompt_tokens=512,
            mean_completion_tokens=4096,
            activation_checkpointing=True,
        ).step_s
        for g in range(1, 12)
    }
    assert cost.balanced_generator_gpus == min(steps, key=steps.__getitem__) == 6  # 137.7 s; 7 would take 139.5
    with pytest.raises(ValueError, match="at least 1 each"):
        step_cost(shape, gpu, accelerator=ACCELERATORS["h100"], generator_gpus=0, learner_gpus=8, batch_prompts=1,
                  group_size=2, prompt_tokens=1, mean_completion_tokens=1, activation_checkpointing=False)  # fmt: skip


def test_plan_prints_the_time_of_100_steps_and_the_balanced_split(
    qwen3_8b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", "--model", str(qwen3_8b), "--config", str(EXAMPLE), "--generator-gpus", "4", "--gpu", "h200"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    inputs = plan_inputs(["--model", str(qwen3_8b), "--config", str(EXAMPLE), "--generator-gpus", "4"])
    assert (inputs.generator_gpus, inputs.generator_gpus_from, inputs.mean_completion_tokens) == (
        4,
        "--generator-gpus",
        4096,
    )
    assert "an estimate on H200 SXM" in out and "48 prompts x 16 completions of 4,096 tokens" in out
    assert "100 steps" in out and "GPU-hours" in out and "balanced split" in out
    defaults = plan_inputs(["--model", str(qwen3_8b), "--config", str(EXAMPLE)])
    assert defaults.generator_gpus >= 1 and "generator.replicas" in defaults.generator_gpus_from
