"""``asymptote up``'s command line: the StackConfig a run's flags and files describe, and the run.

Owns reading ``--config`` with the flags over it (and the workload under
both), the dataset flags, ``--resume`` of a recorded run, and the size
preset of a user's own model; then hands the checked config to
``LocalStack``. A user's mistake is a ConfigError that names the flag or the
file, which the command line prints in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from asymptote.cli_args import ArgumentParser, validation_problems, writable_dir
from asymptote.codec import count_stored_parameters
from asymptote.config import load_config
from asymptote.errors import ConfigError, WeightsError
from asymptote.lora import LORA_LR_FACTOR
from asymptote.tasks import DatasetSettings, TaskSettingsValue
from asymptote.tasks.readers import read_rows
from asymptote.tasks.words import SOLUTION_FIELD
from services.local.config import StackConfig
from services.local.presets import apply_preset, describe
from services.local.workloads import WORKLOADS_DIR, workload_names

UP_FLAGS = {
    "run_dir": "--run-dir",
    "model_dir": "--model",
    "max_steps": "--max-steps",
    "max_tokens": "--max-tokens",
    "num_generators": "--generators",
    "learner_ranks": "--learner-ranks",
    "gpus": "--gpus",
    "tensor_parallel_size": "--tensor-parallel",
    "learner_gpus": "--learner-gpus",
    "lr": "--lr",
    "batch_prompts": "--batch-prompts",
    "group_size": "--group-size",
    "seed": "--seed",
    "report_to": "--report-to",
}
"""StackConfig fields that ``asymptote up`` sets from flags, and their flags."""
DATASET_FLAGS = {
    "path": "--dataset",
    "eval_path": "--eval-dataset",
    "holdout_fraction": "--holdout-fraction",
    "preset": "--preset",
}
"""DatasetSettings fields that ``asymptote up`` sets from flags, and their flags."""


def _first_row(path: Path, flag: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The first readable row of the dataset at ``path``; ConfigError naming ``flag`` when there is none."""

    try:
        for _, row in read_rows(path, settings.get("format", "auto"), settings.get("split", "train")):
            if isinstance(row, dict):
                return row
    except ValueError as exc:  # DatasetError: missing, unknown format, unreadable
        raise ConfigError(f"{flag} {path}: {exc}") from exc
    raise ConfigError(f"{flag} {path}: no readable row")


def dataset_task(task: TaskSettingsValue | None, args: argparse.Namespace) -> DatasetSettings | None:
    """The dataset task the ``up`` flags describe (over a dataset task of ``--config``), or None without them.

    Without ``--preset`` (and no field mapping in the config) a file whose
    rows have GSM8K's ``question`` and ``answer`` (with its ``#### `` line)
    is read with the gsm8k preset. ConfigError names the flag at fault.
    """

    given = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in DATASET_FLAGS.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if not given:
        return None
    if "path" not in given:
        raise ConfigError(f"{', '.join(DATASET_FLAGS[f] for f in given)}: needs --dataset FILE")
    for field in ("path", "eval_path"):
        if field in given:
            if not given[field].exists():
                raise ConfigError(f"{DATASET_FLAGS[field]} {given[field]}: no such file or directory")
            given[field] = given[field].resolve()  # the services may run elsewhere
    base = task.model_dump() if isinstance(task, DatasetSettings) else {}
    if "eval_path" in given and "holdout_fraction" not in given:
        base.pop("holdout_fraction", None)
    if "holdout_fraction" in given and "eval_path" not in given:
        base.pop("eval_path", None)
    if "eval_path" not in given and "holdout_fraction" not in given and not isinstance(task, DatasetSettings):
        raise ConfigError(
            "--dataset: needs --eval-dataset FILE or --holdout-fraction F (e.g. 0.05) for the held-out split"
        )
    merged = {**base, **given, "name": "dataset"}
    first = _first_row(given["path"], "--dataset", merged)
    if "preset" not in given and not base.get("fields") and base.get("preset", "none") == "none":
        if "prompt" not in first and "question" in first and "####" in str(first.get("answer", "")):
            merged["preset"] = "gsm8k"
            print("--dataset: rows have question and answer fields: reading them as GSM8K (--preset gsm8k)")
    try:
        settings = DatasetSettings.model_validate(merged)
    except ValidationError as exc:
        flags = ", ".join(DATASET_FLAGS[f] for f in given)
        raise ConfigError(
            validation_problems(exc, lambda loc: DATASET_FLAGS.get(str(loc[0]) if loc else "") or flags)
        ) from exc
    names = settings.field_names
    missing = [n for n in (names.prompt, names.answer) if n not in first]
    if missing:
        raise ConfigError(
            f"--dataset {given['path']}: rows have fields {', '.join(map(str, first)) or 'none'}, not "
            f"{' and '.join(missing)}; --preset gsm8k reads question/answer, task.fields in --config maps others"
        )
    return settings


def up_config(argv: list[str]) -> StackConfig:
    """The stack config ``asymptote up argv`` runs: ``--config`` with the flags over it, checked."""

    parser = ArgumentParser(prog="asymptote up", description="Run the embedded default end to end.")
    parser.add_argument("--config", type=Path, help="YAML stack config (env overrides: ASY_UP__...)")
    parser.add_argument(
        DRY_RUN, action="store_true", help="print the preset, the placement, the memory plan and the config; exit"
    )
    parser.add_argument("--run-dir", type=Path, help="run directory (default runs/<timestamp>)")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR with the config it recorded (its checkpoints, ledger, curve); "
        "flags such as --max-steps change it",
    )
    parser.add_argument("--model", type=Path, help="Hugging Face model directory to train (default: the tiny model)")
    parser.add_argument("--max-steps", type=int, help="learner steps")
    parser.add_argument(
        "--workload",
        choices=workload_names(),
        metavar="WORKLOAD",
        help=f"the embedded workload, a file of {WORKLOADS_DIR.relative_to(WORKLOADS_DIR.parents[1])}/ "
        f"(default: words): {', '.join(workload_names())}",
    )
    parser.add_argument("--max-tokens", type=int, help="completion length cap (with --model: the size preset's)")
    parser.add_argument("--lr", type=float, help="learner peak learning rate (with --model: the size preset's)")
    parser.add_argument("--batch-prompts", type=int, help="prompt groups per step (with --model: the size preset's)")
    parser.add_argument("--group-size", type=int, help="completions per prompt (with --model: the size preset's)")
    parser.add_argument("--seed", type=int, help="the run's seed: prompt order, learner and sampling (default 0)")
    parser.add_argument(
        "--report-to",
        type=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
        help="mirror the run's metrics to tensorboard, wandb, or both (comma-separated)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        help="train a LoRA adapter of this rank in place of every weight (lr: 10x the full fine-tuning one)",
    )
    parser.add_argument("--generators", type=int, help="generator processes")
    parser.add_argument("--learner-ranks", type=int, help="data-parallel learner ranks on the CPU (torchrun)")
    parser.add_argument(
        "--gpus",
        type=int,
        help="GPUs to place the services on (default: every visible GPU; 0: the CPU build even where GPUs are)",
    )
    parser.add_argument("--tensor-parallel", type=int, help="on GPUs: GPUs per generator engine (default 1)")
    parser.add_argument("--learner-gpus", type=int, help="on GPUs: the learner's ranks, one GPU each (default: half)")
    parser.add_argument(
        "--dataset", type=Path, help="train on this file (jsonl, parquet, csv, or a save_to_disk folder); needs --model"
    )
    parser.add_argument("--eval-dataset", type=Path, help="held-out file in the same layout as --dataset")
    parser.add_argument("--holdout-fraction", type=float, help="hold out this fraction of --dataset instead")
    parser.add_argument(
        "--preset", choices=["none", "gsm8k"], help="a known layout (default: gsm8k for question/answer rows)"
    )
    args = parser.parse_args(argv)
    if args.resume is not None:
        return resumed_config(args)
    config = load_config(StackConfig, args.config, "ASY_UP")
    if args.workload is not None:
        # Over the fields the config gives, not its defaults: the workload fills the ones it does not.
        config = StackConfig.model_validate(
            {**config.model_dump(include=config.model_fields_set), "workload": args.workload}
        )
    given = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in UP_FLAGS.items()}
    overrides = {field: value for field, value in given.items() if value is not None}
    user_set = set(config.model_fields_set) | set(overrides)  # what a preset for --model must not change
    # A dataset task the config names is the base the flags edit; the default word problems are not.
    task = dataset_task(config.task if "task" in config.model_fields_set else None, args)
    if task is not None and config.model_dir is None and args.model is None:
        raise ConfigError(
            "--dataset: needs --model DIR (the built tiny model is warm-started only on the embedded word problems)"
        )
    if overrides:

        def name(loc: tuple[int | str, ...]) -> str:
            # A check across fields (empty loc) can only have failed through the flags given.
            return UP_FLAGS.get(str(loc[0]) if loc else "") or ", ".join(UP_FLAGS[f] for f in overrides)

        try:
            config = StackConfig.model_validate({**config.model_dump(), **overrides})
        except ValidationError as exc:
            raise ConfigError(validation_problems(exc, name)) from exc
    if task is not None:
        config = config.model_copy(update={"task": task})
    if isinstance(config.task, DatasetSettings) and config.model_dir is None:
        # The tiny model is built for it: a BPE tokenizer and a warm start on its rows' worked solutions.
        first = _first_row(config.task.path, "--config task.path", config.task.model_dump())
        if SOLUTION_FIELD not in first:
            raise ConfigError(
                f"--config task: a dataset task needs model_dir (or --model DIR), or rows with a worked "
                f"'{SOLUTION_FIELD}' to warm-start the built tiny model on (the rows of {config.task.path} have "
                f"{', '.join(map(str, first))})"
            )
    if config.run_dir is not None:
        writable_dir(config.run_dir, "--run-dir" if args.run_dir is not None else "--config run_dir")
    if config.model_dir is not None and not (config.model_dir / "config.json").is_file():
        flag = "--model" if args.model is not None else "--config model_dir"
        raise ConfigError(f"{flag} {config.model_dir}: no config.json here (not a Hugging Face model directory)")
    if args.lora_rank is not None:
        lora = {**(config.lora.model_dump() if config.lora else {}), "rank": args.lora_rank}
        try:
            config = StackConfig.model_validate({**config.model_dump(), "lora": lora})
        except ValidationError as exc:
            raise ConfigError(validation_problems(exc, lambda loc: "--lora-rank")) from exc
        user_set.add("lora")
    if config.model_dir is not None:
        config = with_preset(config, user_set, "--model" if args.model is not None else "--config model_dir")
    return with_lora_lr(config, user_set)


def with_lora_lr(config: StackConfig, user_set: set[str]) -> StackConfig:
    """A LoRA's learning rate where the config and the flags set none: LORA_LR_FACTOR x the one the stack
    (or the model's size preset) picks for full fine-tuning, the rule of "LoRA Without Regret" (asymptote.lora)."""
    if config.lora is None or "lr" in user_set:
        return config
    return config.model_copy(update={"lr": LORA_LR_FACTOR * config.lr})


def resumed_config(args: argparse.Namespace) -> StackConfig:
    """The config a run recorded in ``stack.json``, in its own directory, with the flags given over it.

    ConfigError for a directory that holds no run, or flags that would make
    another run of it (a model, a dataset, another run directory, a config file).
    """

    run_dir: Path = args.resume.resolve()
    recorded = run_dir / "stack.json"
    if not recorded.is_file():
        raise ConfigError(f"--resume {run_dir}: no stack.json here (not a run directory asymptote up wrote)")
    clashing = [
        flag
        for flag, value in (
            ("--config", args.config),
            ("--run-dir", args.run_dir),
            ("--model", args.model),
            ("--dataset", args.dataset),
            ("--eval-dataset", args.eval_dataset),
            ("--workload", args.workload),
            ("--holdout-fraction", args.holdout_fraction),
            ("--preset", args.preset),
        )
        if value is not None
    ]
    if clashing:
        raise ConfigError(f"--resume: {', '.join(clashing)} would start another run; the run keeps its own")
    overrides = {
        field: getattr(args, flag[2:].replace("-", "_"))
        for field, flag in UP_FLAGS.items()
        if field not in ("run_dir", "model_dir") and getattr(args, flag[2:].replace("-", "_")) is not None
    }
    try:
        data = json.loads(recorded.read_text())
        return StackConfig.model_validate({**data, **overrides, "run_dir": run_dir})
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--resume {recorded}: not valid JSON ({exc})") from exc
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(exc, lambda loc: UP_FLAGS.get(str(loc[0]) if loc else "") or f"--resume {recorded}")
        ) from exc


def with_preset(config: StackConfig, user_set: set[str], flag: str) -> StackConfig:
    """``config`` with the size preset of its own model in the fields ``user_set`` leaves (printed, with any
    warning). A directory whose weights cannot be read is left to the model check at start, which names
    what is wrong."""

    assert config.model_dir is not None
    try:
        num_parameters = count_stored_parameters(config.model_dir)
    except (OSError, WeightsError):
        # No readable weights (a config.json to plan with, say): the size its config describes.
        from services.learner.activations import ModelShape

        try:
            num_parameters = ModelShape.read(config.model_dir).num_parameters
        except (OSError, ValueError):
            return config
    try:
        config, preset, warnings = apply_preset(config, user_set, num_parameters)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, lambda loc: ".".join(map(str, loc)) or flag)) from exc
    print(describe(config, preset, num_parameters), flush=True)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return config


def main(argv: list[str]) -> int:
    """``asymptote up ARGV``: the run the flags describe, end to end. (``--dry-run`` is the planner's:
    services/ops/plan.py ``up_dry_run``, which the command line calls instead.)"""
    assert DRY_RUN not in argv, "the command line hands a dry run to services.ops.plan.up_dry_run"
    config = up_config(argv)
    from services.local.stack import LocalStack

    return LocalStack(config).run()


DRY_RUN = "--dry-run"
