"""``asymptote plan``: what a run holds in GPU, host and disk memory, before it starts.

Reads the model directory's ``config.json`` and the run's settings, plans
them with ``services.learner.memory`` and prints the figures as tables: one
learner rank, one generator GPU, a learner pod's host memory, the
checkpoints. ``--config`` is a Helm values file, read over the chart's own
values.yaml (when this checkout has it) as ``helm install`` merges them (the learner's settings from
``learner.config``, its GPUs from ``learner.gpusPerNode`` and ``nodes``, the
completion cap from ``broker.config.sampling.max_tokens``, the engine from
``generator.config.engine``), or a learner config file (LearnerConfig's
fields) in place of the chart's ``learner.config``. Exit 0 when a learner
rank fits; a user's mistake, or a rank that does not fit, is one line on
stderr naming the setting, and exit 2 (the table is printed first). This
module knows the chart's value names, not how the figures are computed.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from asymptote.cli_args import ArgumentParser
from asymptote.errors import ConfigError
from asymptote.lora import LoraSettings
from services.generator.config import EngineSettings
from services.learner.activations import ModelShape
from services.learner.config import LearnerConfig
from services.learner.memory import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_PROMPT_TOKENS,
    GENERATOR_RESERVE_BYTES,
    GIB,
    USABLE_FRACTION,
    GeneratorSettings,
    RunPlan,
    check_generator,
    check_learner,
    plan_run,
)
from services.ops.cost import ACCELERATORS, DECODE_BANDWIDTH_EFFICIENCY, TRAIN_MFU, StepCost, step_cost

CHART_VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "asymptote" / "values.yaml"
"""The chart's defaults: a values file given to ``asymptote plan`` is read over them, as ``helm install`` does."""
HELM_SECTIONS = ("run", "model", "generator", "generatorPools", "learner", "broker", "fitter")
"""Top-level keys that make a ``--config`` file a Helm values file rather than a learner config."""


@dataclass(frozen=True)
class PlanInputs:
    """What ``asymptote plan`` plans, resolved from its flags, ``--config`` and the chart's defaults."""

    shape: ModelShape
    learner: LearnerConfig
    engine: GeneratorSettings
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float
    prompt_tokens: int
    max_tokens: int
    max_tokens_from: str
    """Where max_tokens was read: the flag, or the values key and file."""
    group_size: int
    batch_prompts: int
    generator_gpus: int
    generator_gpus_from: str
    """Where generator_gpus was read: the flag, or the values keys."""
    accelerator: str
    mean_completion_tokens: int
    learner_key: str
    """Where the learner's settings live in --config: "learner.config." in a values file, "" in a learner config."""
    placement: str | None = None
    """An up config's split of the machine's GPUs (``Placement.describe``); None for a values or learner file."""

    def plan(self) -> RunPlan:
        """The run's plan: every learner rank, every generator GPU, each learner pod's host and disk."""
        return plan_run(
            self.shape,
            self.learner,
            self.engine,
            gpus_per_node=self.gpus_per_node,
            nodes=self.nodes,
            gpu_memory_gib=self.gpu_memory_gib,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            group_size=self.group_size,
        )


def _merge_values(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's merge of a values file over defaults: maps key by key, a null deletes, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge_values(out[key], value)
        else:
            out[key] = value
    return out


def _dig(tree: Mapping[str, Any], *keys: str) -> Any:
    """``tree[k1][k2]...``, or None where a key is missing."""
    node: Any = tree
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _read_yaml(path: Path, flag: str) -> dict[str, Any]:
    """The mapping in a YAML file; ConfigError naming ``flag`` otherwise."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {path}: not valid YAML ({' '.join(str(exc).split())})") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{flag} {path}: must hold a mapping, got {type(loaded).__name__}")
    return loaded


def _problems(exc: ValidationError, prefix: str) -> str:
    """Every error of ``exc`` as ``<prefix><field>: <what was wrong>, got <input>``, on one line."""
    problems = []
    for err in exc.errors():
        what = str(err["msg"]).removeprefix("Value error, ")
        got = f", got {err['input']!r}" if err["type"] != "missing" and not isinstance(err["input"], Mapping) else ""
        problems.append(f"{prefix}{'.'.join(map(str, err['loc']))}: {what[:1].lower()}{what[1:]}{got}")
    return "; ".join(problems)


def plan_inputs(argv: list[str]) -> PlanInputs:
    """``asymptote plan argv`` resolved: the model's shape and every setting the plan reads, checked."""
    parser = ArgumentParser(
        prog="asymptote plan",
        description="GPU, host and disk memory of a run before it starts; exit 2 when a learner rank does not fit.",
    )
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory (reads config.json)")
    parser.add_argument("--gpus-per-node", type=int, help="learner GPUs per node (default: learner.gpusPerNode)")
    parser.add_argument("--nodes", type=int, help="learner nodes (default: learner.nodes, else 1)")
    parser.add_argument("--gpu-memory", type=float, help="GiB of one GPU (default: the --gpu card's)")
    parser.add_argument(
        "--config",
        type=Path,
        help="a Helm values file (read over the chart's values.yaml), an `asymptote up` config (planned as up "
        "places it on --gpus), or a learner config YAML",
    )
    parser.add_argument("--gpus", type=int, help="with an up config: the machine's GPUs, split as `asymptote up` does")
    parser.add_argument("--learner-gpus", type=int, help="with an up config: the learner's ranks (default: half)")
    parser.add_argument("--tensor-parallel", type=int, help="with an up config: GPUs per generator engine")
    parser.add_argument("--generators", type=int, help="with an up config: generator processes")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=DEFAULT_PROMPT_TOKENS,
        help=f"padded prompt length in tokens (default {DEFAULT_PROMPT_TOKENS})",
    )
    parser.add_argument("--max-tokens", type=int, help="completion cap (default: broker.config.sampling.max_tokens)")
    parser.add_argument(
        "--generator-gpus",
        type=int,
        help="GPUs generating, all generators together (default: generator.replicas x generator.gpus)",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(ACCELERATORS),
        default="h100",
        help="the GPU the time estimate assumes (its datasheet bandwidth and bf16 FLOPs)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help="train a LoRA of this rank (over learner.config.lora, else its defaults) in place of every weight",
    )
    parser.add_argument(
        "--mean-completion-tokens",
        type=int,
        help="mean completion length the time estimate assumes (default: half of max_tokens)",
    )
    args = parser.parse_args(argv)
    for flag, value in (
        ("--gpus-per-node", args.gpus_per_node),
        ("--nodes", args.nodes),
        ("--prompt-tokens", args.prompt_tokens),
        ("--max-tokens", args.max_tokens),
        ("--generator-gpus", args.generator_gpus),
        ("--mean-completion-tokens", args.mean_completion_tokens),
        ("--lora-rank", args.lora_rank),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    if args.gpu_memory is None:
        args.gpu_memory = ACCELERATORS[args.gpu].memory_gib
    if not args.gpu_memory > 0:
        raise ConfigError(f"--gpu-memory {args.gpu_memory:g}: must be more than 0 GiB")
    try:
        shape = ModelShape.read(args.model)
    except ConfigError as exc:
        raise ConfigError(f"--model {exc}") from exc

    chart = _read_yaml(CHART_VALUES, "the chart's") if CHART_VALUES.is_file() else {}
    given = _read_yaml(args.config, "--config") if args.config is not None else {}
    up_flags = {"--gpus": args.gpus, "--learner-gpus": args.learner_gpus, "--tensor-parallel": args.tensor_parallel}
    up_flags["--generators"] = args.generators
    if _is_up_config(given):
        return up_plan_inputs(args, shape, {flag: v for flag, v in up_flags.items() if v is not None})
    for flag, value in up_flags.items():
        if value is not None:
            raise ConfigError(f"{flag}: plans an `asymptote up` config (--config FILE of its fields) only")
    helm_file = args.config is None or any(key in given for key in HELM_SECTIONS)
    if helm_file:
        values = _merge_values(chart, given)
        learner_settings = dict(_dig(values, "learner", "config") or {})
        if _dig(values, "run", "batchPrompts") is not None:
            learner_settings["batch_prompts"] = values["run"]["batchPrompts"]  # the chart owns it
        learner_key = "learner.config."
    else:  # a learner config: the service's own file, in place of the chart's learner.config
        values = chart
        learner_settings, learner_key = dict(given), ""
    where = f"--config {args.config}" if args.config is not None else "the chart's values.yaml"
    try:
        learner = LearnerConfig.model_validate({**learner_settings, "model_dir": args.model})
    except ValidationError as exc:
        raise ConfigError(f"{where}: " + _problems(exc, learner_key)) from exc
    if args.lora_rank is not None:
        lora = {**(learner.lora.model_dump() if learner.lora else {}), "rank": args.lora_rank}
        try:
            learner = learner.model_copy(update={"lora": LoraSettings.model_validate(lora)})
        except ValidationError as exc:
            raise ConfigError(f"--lora-rank {args.lora_rank}: " + _problems(exc, "")) from exc

    def setting(*keys: str) -> tuple[Any, str]:
        """A value of the merged values, and which file it came from."""
        source = args.config if _dig(given, *keys) is not None and helm_file else "the chart's values.yaml"
        return _dig(values, *keys), f"{'.'.join(keys)} in {source}"

    def count(*keys: str, minimum: int = 1) -> int | None:
        """A whole number of the values (a count of GPUs, nodes, tokens); ConfigError naming it otherwise."""
        value, source = setting(*keys)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{source}: must be a whole number of at least {minimum}, got {value!r}")
        return value

    gpus_per_node = args.gpus_per_node or count("learner", "gpusPerNode")
    if gpus_per_node is None:
        raise ConfigError("--gpus-per-node: needed (the learner's GPUs per node; a learner config does not say)")
    nodes = args.nodes or count("learner", "nodes") or 1
    if args.max_tokens is not None:
        max_tokens, max_tokens_from = args.max_tokens, "--max-tokens"
    else:
        max_tokens, max_tokens_from = (
            count("broker", "config", "sampling", "max_tokens"),
            setting("broker", "config", "sampling", "max_tokens")[1],
        )
        if max_tokens is None:
            raise ConfigError("--max-tokens: needed (the completion cap, the broker's sampling.max_tokens)")
    sequence = args.prompt_tokens + max_tokens
    budget = learner.micro_batch_tokens
    if budget is not None and budget < sequence:
        raise ConfigError(
            f"{where}: {learner_key}micro_batch_tokens {budget} is below one sequence: prompt {args.prompt_tokens} "
            f"(--prompt-tokens) + max_tokens {max_tokens} ({max_tokens_from}) = {sequence} tokens; set at least {sequence}"
        )
    engine_values = dict(_dig(values, "generator", "config", "engine") or {})
    tp = count("generator", "tensorParallelSize") or count("generator", "gpus")
    engine = GeneratorSettings()
    if engine_values or tp:
        try:
            settings = EngineSettings.model_validate(
                {**engine_values, "model_dir": args.model, **({"tensor_parallel_size": tp} if tp else {})}
            )
        except ValidationError as exc:
            raise ConfigError(f"{where}: " + _problems(exc, "generator.config.engine.")) from exc
        engine = GeneratorSettings(
            dtype=settings.dtype,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_num_seqs=settings.max_num_seqs,
            fp32_lm_head=settings.fp32_lm_head,
        )
    if args.generator_gpus is not None:
        generator_gpus, generator_gpus_from = args.generator_gpus, "--generator-gpus"
    else:
        replicas, replicas_from = count("generator", "replicas", minimum=0), setting("generator", "replicas")[1]
        generator_gpus = (replicas or 1) * (tp or 1)
        generator_gpus_from = f"{replicas_from} x {tp or 1} GPUs each"
    return PlanInputs(
        shape=shape,
        learner=learner,
        engine=engine,
        gpus_per_node=int(gpus_per_node),
        nodes=int(nodes),
        gpu_memory_gib=args.gpu_memory,
        prompt_tokens=args.prompt_tokens,
        max_tokens=int(max_tokens),
        max_tokens_from=max_tokens_from,
        group_size=count("broker", "config", "sampling", "group_size") or DEFAULT_GROUP_SIZE,
        batch_prompts=learner.batch_prompts,
        generator_gpus=generator_gpus,
        generator_gpus_from=generator_gpus_from,
        accelerator=args.gpu,
        mean_completion_tokens=args.mean_completion_tokens or max(1, int(max_tokens) // 2),
        learner_key=learner_key,
    )


def _is_up_config(given: Mapping[str, Any]) -> bool:
    """Whether a ``--config`` file is an ``asymptote up`` config: only StackConfig's fields, one at least that
    neither a values file nor a learner config has."""
    from services.local.config import StackConfig

    keys = set(given)
    own = keys - set(LearnerConfig.model_fields) - set(HELM_SECTIONS)
    return bool(own) and keys <= set(StackConfig.model_fields)


def up_plan_inputs(args: Any, shape: ModelShape, flags: dict[str, int]) -> PlanInputs:
    """What ``asymptote up`` would run from ``args.config`` on ``args.model``: its config (the size preset
    included), split over ``--gpus`` cards of ``--gpu-memory`` as the stack splits GPUs, and the learner's
    settings on them as the stack derives them (services/local/planning.py)."""
    from services.local.planning import described_gpus
    from services.local.up import up_config

    if "--gpus" not in flags:
        raise ConfigError("--gpus: needed to plan an `asymptote up` config (the GPUs of the machine it runs on)")
    argv = ["--config", str(args.config), "--model", str(args.model)]
    for flag, value in flags.items():
        argv += [flag, str(value)]
    if args.max_tokens is not None:
        argv += ["--max-tokens", str(args.max_tokens)]
    config = up_config(argv)
    gpus = described_gpus(flags["--gpus"], args.gpu_memory, ACCELERATORS[args.gpu].name)
    return stack_plan_inputs(config, gpus, args.gpu, args.prompt_tokens)


def stack_plan_inputs(config: Any, gpus: list[Any], accelerator: str, prompt_tokens: int) -> PlanInputs:
    """The plan of the local stack ``config`` on ``gpus``, its placement and learner as the stack makes them."""
    from services.local.planning import placement_of, planned_completion_tokens, planned_engine, planned_learner

    assert config.model_dir is not None
    placement = placement_of(config, gpus)
    learner = planned_learner(config, config.model_dir, placement)
    tp = config.tensor_parallel_size
    engine = planned_engine(config, placement)
    return PlanInputs(
        shape=ModelShape.read(config.model_dir),
        learner=learner,
        engine=engine,
        gpus_per_node=len(placement.learner),
        nodes=1,
        gpu_memory_gib=placement.gpu_memory_bytes / 2**30,
        prompt_tokens=prompt_tokens,
        max_tokens=config.max_tokens,
        max_tokens_from="the up config's max_tokens",
        group_size=config.group_size,
        batch_prompts=config.batch_prompts,
        generator_gpus=len(placement.generators) * tp,
        generator_gpus_from=f"{len(placement.generators)} generators x {tp} GPUs each",
        accelerator=accelerator,
        mean_completion_tokens=planned_completion_tokens(config),
        learner_key="services.learner.",
        placement=placement.describe(),
    )


def main(argv: list[str]) -> int:
    """Plan, print, and refuse in one line (ConfigError) what does not fit."""
    return report(plan_inputs(argv))


def report(inputs: PlanInputs) -> int:
    """Print the plan of ``inputs``; ConfigError (one line) for a generator or learner rank that does not fit."""
    run = inputs.plan()
    print_plan(run, inputs)
    check_generator(run.generator)
    check_learner(
        inputs.shape,
        inputs.learner,
        gpus_per_node=inputs.gpus_per_node,
        nodes=inputs.nodes,
        gpu_memory_gib=inputs.gpu_memory_gib,
        sequence_tokens=inputs.prompt_tokens + inputs.max_tokens,
        group_size=inputs.group_size,
        settings_key=inputs.learner_key,
    )
    return 0


def print_plan(run: RunPlan, inputs: PlanInputs) -> None:
    """``run`` as tables: a learner rank, a generator GPU, a learner pod's host memory, the checkpoints."""
    console = Console(width=max(110, shutil.get_terminal_size().columns))
    shape, learner, generator, host = run.shape, run.learner, run.generator, run.host
    console.print(
        f"{inputs.learner.model_dir}: {shape.model_type}, {shape.num_parameters / 1e9:.2f}B parameters "
        f"({shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads and "
        f"{shape.num_kv_heads} KV heads of {shape.head_dim}, vocabulary {shape.vocab_size:,}, "
        f"{'tied' if shape.tie_word_embeddings else 'untied'} head)",
        highlight=False,
    )
    if inputs.placement is not None:
        console.print(f"placement ({inputs.gpu_memory_gib:g} GiB GPUs): {inputs.placement}", highlight=False)
    console.print(
        f"sequences: prompt {run.prompt_tokens} (--prompt-tokens) + max_tokens {run.max_tokens} "
        f"({inputs.max_tokens_from}) = {learner.sequence_tokens:,} tokens",
        highlight=False,
    )

    def gib(num_bytes: int) -> str:
        return f"{num_bytes / GIB:,.2f}"

    def table(title: str, *columns: str) -> Table:
        t = Table(title=title, title_justify="left", highlight=False)
        for column in columns:
            t.add_column(column, justify="right" if column == "GiB" else "left")
        return t

    layout = {"fsdp": "FSDP2", "ddp": "DDP", "single": "one rank"}[learner.layout]
    rank = table(
        f"Learner rank: 1 of {learner.world_size} ({inputs.nodes} x {inputs.gpus_per_node} GPUs, {layout}), "
        f"micro_batch_tokens {learner.micro_batch_tokens:,}, activation_checkpointing "
        f"{str(learner.activation_checkpointing).lower()}",
        "when",
        "",
        "GiB",
        "how it is counted",
    )
    for when, items in (("always", learner.held), ("forward, backward", learner.training), ("step", learner.stepping)):
        for item in items:
            rank.add_row(when, item.name, gib(item.num_bytes), item.note)
    spare = (learner.usable_bytes - learner.total_bytes) / GIB
    verdict = f"fits with {spare:,.1f} GiB to spare" if learner.fits else f"does NOT fit by {-spare:,.1f} GiB"
    rank.add_row(
        "",
        "total",
        gib(learner.total_bytes),
        f"always + the larger of forward-backward and step: {learner.fraction:.0%} of "
        f"{inputs.gpu_memory_gib:g} GiB, {verdict} (at most {USABLE_FRACTION:.0%})",
        style="bold",
    )
    console.print(rank)

    engine = inputs.engine
    gen = table(
        f"Generator GPU: {engine.dtype}, tensor parallel {engine.tensor_parallel_size}, KV cache by {generator.sized_by}",
        "",
        "GiB",
        "how it is counted",
    )
    head = ", and the LM head in float32 (fp32_lm_head)" if engine.fp32_lm_head else ""
    gen.add_row("weights", gib(generator.weights_bytes), f"the parameters in {engine.dtype}{head}")
    gen.add_row(
        "KV cache",
        gib(max(0, generator.kv_cache_bytes)),
        f"{generator.kv_tokens:,} tokens of {generator.kv_bytes_per_token:,} bytes: {generator.sequences:,} sequences "
        f"of {generator.sequence_tokens:,} at once (max_num_seqs {generator.max_num_seqs})",
    )
    gen.add_row("reserve", gib(GENERATOR_RESERVE_BYTES), "CUDA context, profiled activations, CUDA graphs")
    gen.add_row(
        "total",
        gib(generator.total_bytes),
        f"{generator.total_bytes / generator.gpu_memory_bytes:.0%} of the {inputs.gpu_memory_gib:g} GiB GPU",
        style="bold",
    )
    console.print(gen)

    pod = table(
        f"Learner pod host memory ({inputs.gpus_per_node} ranks), beside the processes' own",
        "",
        "GiB",
        "how it is counted",
    )
    pod.add_row("load", gib(host.load_bytes), "each rank one stored tensor at a time, in float32")
    pod.add_row(
        "served versions",
        gib(host.served_bytes),
        f"served_versions_kept + 1 (being copied out) x the model in {shape.stored_dtype}"
        if inputs.learner.lora is None
        else "served_versions_kept + 1 (being copied out) x the adapter in float32",
    )
    pod.add_row(
        "checkpoint staging", gib(host.staging_bytes), "the pod's ranks' shards of float32 weights and AdamW moments"
    )
    pod.add_row("total", gib(host.host_bytes), "load + served + staging", style="bold")
    console.print(pod)

    disk = table("Checkpoints", "", "GiB", "how it is counted")
    kept = "a parameter" if inputs.learner.lora is None else "an adapter parameter (the base is not saved)"
    disk.add_row("one checkpoint", gib(host.checkpoint_bytes), f"12 bytes {kept}: float32 weights, AdamW moments")
    disk.add_row(
        "on the volume",
        gib(host.disk_bytes),
        f"keep_checkpoints {inputs.learner.keep_checkpoints}"
        f"{' + the best round' if inputs.learner.keep_best_checkpoint else ''} + the one being written",
        style="bold",
    )
    console.print(disk)
    print_cost(console, run, inputs)


def print_cost(console: Console, run: RunPlan, inputs: PlanInputs) -> None:
    """The time and GPU-hours of 100 steps, at the split given and at the balanced one."""
    learner_gpus = inputs.gpus_per_node * inputs.nodes

    def at(generator_gpus: int, learner_gpus: int) -> StepCost:
        return step_cost(
            run.shape,
            run.generator,
            accelerator=ACCELERATORS[inputs.accelerator],
            generator_gpus=generator_gpus,
            learner_gpus=learner_gpus,
            batch_prompts=inputs.batch_prompts,
            group_size=inputs.group_size,
            prompt_tokens=inputs.prompt_tokens,
            mean_completion_tokens=inputs.mean_completion_tokens,
            activation_checkpointing=inputs.learner.activation_checkpointing,
        )

    given = at(inputs.generator_gpus, learner_gpus)
    t = Table(
        title=f"Time and GPUs (an estimate on {given.accelerator.name}: decoding at {DECODE_BANDWIDTH_EFFICIENCY:.0%} "
        f"of peak bandwidth, training at {TRAIN_MFU:.0%} MFU)",
        title_justify="left",
        highlight=False,
    )
    for column in ("", "value", "how it is counted"):
        t.add_column(column, justify="right" if column == "value" else "left")
    t.add_row(
        "a step",
        f"{given.completion_tokens:,} tokens",
        f"{inputs.batch_prompts} prompts x {inputs.group_size} completions of {inputs.mean_completion_tokens:,} "
        f"tokens on average (--mean-completion-tokens)",
    )
    t.add_row(
        "generating",
        f"{given.generate_tokens_per_s_per_gpu:,.0f} tokens/s",
        f"a GPU, {given.concurrent_sequences_per_gpu} sequences at once; "
        f"{given.generate_s:,.1f} s a step on {given.generator_gpus} GPUs ({inputs.generator_gpus_from})",
    )
    t.add_row(
        "training",
        f"{given.train_tokens_per_s_per_gpu:,.0f} tokens/s",
        f"a GPU, prompts included; {given.train_s:,.1f} s a step on {learner_gpus} GPUs",
    )
    t.add_row(
        "100 steps",
        f"{100 * given.step_s / 3600:,.2f} h",
        f"{given.gpu_hours_per_100_steps:,.1f} GPU-hours; generating and training overlap, the slower sets the pace",
        style="bold",
    )
    balanced = given.balanced_generator_gpus
    if balanced != given.generator_gpus:
        other = at(balanced, given.generator_gpus + learner_gpus - balanced)
        t.add_row(
            "balanced split",
            f"{balanced} + {other.learner_gpus} GPUs",
            f"generating + training, same GPUs in all: 100 steps in {100 * other.step_s / 3600:,.2f} h "
            f"({other.gpu_hours_per_100_steps:,.1f} GPU-hours), if the learner's ranks fit",
        )
    console.print(t)


DRY_RUN_CARD = "h100"
"""The card ``asymptote up --dry-run`` plans for when the GPUs it is given are not on this machine
(``asymptote plan --gpu`` plans for another)."""


def up_dry_run(argv: list[str]) -> int:
    """Print what ``asymptote up`` would run: the preset (printed by ``up_config``), where each process goes,
    the memory plan of a run on GPUs (``asymptote plan``'s, from the same functions) and the resolved config;
    exit 0, or ConfigError in one line for what does not fit."""
    from services.local.placement import visible_gpus
    from services.local.planning import described_gpus
    from services.local.up import DRY_RUN, up_config

    config = up_config([a for a in argv if a != DRY_RUN])
    found = [] if config.gpus == 0 else visible_gpus()
    if config.gpus == 0 or (config.gpus is None and not found):
        generators = config.num_generators or 1
        print(f"placement: the CPU: {generators} generator(s), {config.learner_ranks} learner rank(s) (gloo)")
    elif config.model_dir is None:
        print("placement: GPUs; the tiny model is built at start, so there is nothing to plan its memory by")
    else:
        wanted = config.gpus or len(found)
        if len(found) < wanted:
            card = ACCELERATORS[DRY_RUN_CARD]
            print(f"({len(found)} GPUs visible here: planned for {wanted} x {card.name}, {card.memory_gib:g} GiB each)")
            found = described_gpus(wanted, card.memory_gib, card.name)
        report(stack_plan_inputs(config, found[:wanted], DRY_RUN_CARD, DEFAULT_PROMPT_TOKENS))
    print("resolved config (asymptote up --config takes it as it is):")
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0
