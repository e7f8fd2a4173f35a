"""The ``asymptote`` command: one subcommand per service, plus the local
stack (``up``), offline curve fitting (``fit``), benchmarks (``bench``) and
operating a deployed run (``kube``).

This module sits above everything it dispatches to: the services, the
local stack, ``benchmarks/`` and ``ops/``. It imports each of them lazily,
inside the subcommand that needs it, so ``asymptote broker`` never loads
torch or vLLM, a service image without ``benchmarks/`` still runs, and no
module below imports back up into the command line.

A user's mistake is answered in one line on stderr that names the flag (or
the file) and what is accepted, with exit status 2; a traceback is for bugs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

from asymptote.cli_args import ArgumentParser
from asymptote.errors import ConfigError

if TYPE_CHECKING:
    import argparse

    from asymptote.tasks import DatasetSettings, TaskSettingsValue
    from services.local.config import StackConfig

USAGE = """asymptote <command> [options]   (asymptote <command> --help; asymptote --version)

services:
  broker       curriculum, admission, batching (JetStream + gRPC)
  generator    vLLM rollouts with in-flight weight swaps
  learner      CISPO learner serving weights over gRPC
  fitter       compute-performance curve fit and projections
  sandbox-pool runs model-written programs for the code verifier (gRPC)

local and offline:
  up           run nats-server and the four services on this machine
  fit          fit eval.jsonl files offline, print a table, write a plot
  export       a run's checkpoint as a Hugging Face model directory (transformers, vLLM)
  bench        every performance figure against its baseline, side by side (bench.json, bench.md)
  plan         GPU, host and disk memory of a run before it starts (learner, generators, checkpoints)
  kube         a deployed run: status, scale generators, fetch results, gRPC health
  sandbox      the code sandbox: selftest (which backend, each check), exec FILE (one program's verdict)
"""

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
REQUEST_KEYS = ("cache_dir", "task", "model", "warmstart", "model_dir")
"""What a ``prepare-model --request`` object may hold."""


def validation_problems(exc: ValidationError, name: Callable[[tuple[int | str, ...]], str]) -> str:
    """Every error of ``exc`` as ``<name of its location>: <what was wrong>, got <input>``, joined by "; "."""
    problems = []
    for err in exc.errors():
        what = str(err["msg"]).removeprefix("Value error, ")
        what = what[0].lower() + what[1:] if what else what
        got = f", got {err['input']!r}" if err["type"] != "missing" and not isinstance(err["input"], Mapping) else ""
        problems.append(f"{name(tuple(err['loc']))}: {what}{got}")
    return "; ".join(problems)


def writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` if missing; ConfigError naming ``flag`` when it cannot be created or written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create the directory: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: the directory is not writable")


def _first_row(path: Path, flag: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The first readable row of the dataset at ``path``; ConfigError naming ``flag`` when there is none."""
    from asymptote.tasks.readers import read_rows

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
    from asymptote.tasks import DatasetSettings

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


def _up(argv: list[str]) -> int:
    config = up_config(argv)
    from services.local.stack import LocalStack

    return LocalStack(config).run()


def up_config(argv: list[str]) -> StackConfig:
    """The stack config ``asymptote up argv`` runs: ``--config`` with the flags over it, checked."""
    from asymptote.config import load_config
    from asymptote.tasks import DatasetSettings
    from asymptote.tasks.words import SOLUTION_FIELD
    from services.local.config import StackConfig, Workload

    parser = ArgumentParser(prog="asymptote up", description="Run the embedded default end to end.")
    parser.add_argument("--config", type=Path, help="YAML stack config (env overrides: ASY_UP__...)")
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
        choices=get_args(Workload),
        metavar="WORKLOAD",
        help="the embedded task: words (default: word problems, thinking, math-verify, length control), "
        "arithmetic (four-token answers, for the quickest smoke runs), words-code (the word problems answered "
        "by a Python program run in the sandbox), words+code (both in one run, a curve and fit each) or "
        "words-tools (multi-turn: a calculator tool called in one turn, its answer boxed in the next)",
    )
    parser.add_argument("--max-tokens", type=int, help="completion length cap (with --model: the size preset's)")
    parser.add_argument("--lr", type=float, help="learner peak learning rate (with --model: the size preset's)")
    parser.add_argument("--batch-prompts", type=int, help="prompt groups per step (with --model: the size preset's)")
    parser.add_argument("--group-size", type=int, help="completions per prompt (with --model: the size preset's)")
    parser.add_argument(
        "--report-to",
        type=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
        help="mirror the run's metrics to tensorboard, wandb, or both (comma-separated)",
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
    if config.model_dir is not None:
        config = with_preset(config, user_set, "--model" if args.model is not None else "--config model_dir")
    return config


def resumed_config(args: argparse.Namespace) -> StackConfig:
    """The config a run recorded in ``stack.json``, in its own directory, with the flags given over it.

    ConfigError for a directory that holds no run, or flags that would make
    another run of it (a model, a dataset, another run directory, a config file).
    """
    from services.local.config import StackConfig

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
    from asymptote.codec import count_stored_parameters
    from asymptote.errors import WeightsError
    from services.local.presets import apply_preset, describe

    assert config.model_dir is not None
    try:
        num_parameters = count_stored_parameters(config.model_dir)
    except (OSError, WeightsError):
        return config
    try:
        config, preset, warnings = apply_preset(config, user_set, num_parameters)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc, lambda loc: ".".join(map(str, loc)) or flag)) from exc
    print(describe(config, preset, num_parameters), flush=True)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return config


def prepare_request(text: str) -> dict[str, Any]:
    """The ``--request`` JSON object, its keys checked; ConfigError naming ``--request`` otherwise."""
    try:
        request = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--request: not valid JSON ({exc})") from exc
    if not isinstance(request, dict):
        raise ConfigError(f"--request: must be a JSON object with {', '.join(REQUEST_KEYS)}, got {text!r}")
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise ConfigError(f"--request: unknown keys {unknown}; accepted: {', '.join(REQUEST_KEYS)}")
    if not isinstance(request.get("cache_dir"), str) or not request["cache_dir"]:
        raise ConfigError(f"--request: cache_dir must be a directory path, got {request.get('cache_dir')!r}")
    for key in ("task", "model", "warmstart"):
        if not isinstance(request.get(key) or {}, dict):
            raise ConfigError(f"--request: {key} must be a JSON object, got {request[key]!r}")
    if request.get("model_dir") is not None and not isinstance(request["model_dir"], str):
        raise ConfigError(f"--request: model_dir must be a directory path, got {request['model_dir']!r}")
    return request


def _check_model_dir(model_dir: Path) -> Path:
    """A user's model directory, built as the learner builds it (on the meta device, checked against the
    stored tensors' names and shapes); ConfigError saying what does not fit."""
    from asymptote.errors import ModelError
    from services.learner.model import count_parameters, empty_model, load_tokenizer

    if not model_dir.is_dir():
        raise ConfigError(f"--request model_dir {model_dir}: not a directory")
    try:
        tokenizer = load_tokenizer(model_dir)
        model = empty_model(model_dir)  # on the meta device: names and shapes checked, nothing allocated
    except ModelError as exc:
        raise ConfigError(f"--request model_dir: {exc}") from exc
    except (OSError, ValueError) as exc:  # transformers' answer to a directory it cannot read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--request model_dir {model_dir}: cannot be loaded ({first})") from exc
    print(
        f"model: {model_dir} ({type(model).__name__}, {count_parameters(model):,} parameters, "
        f"vocabulary {len(tokenizer):,})",
        file=sys.stderr,
        flush=True,
    )
    return model_dir


def _prepare_model(argv: list[str]) -> int:
    import logging

    parser = ArgumentParser(prog="asymptote prepare-model")
    parser.add_argument("--request", required=True, help="JSON: cache_dir, task, model, warmstart, model_dir")
    args = parser.parse_args(argv)
    req = prepare_request(args.request)
    writable_dir(Path(req["cache_dir"]), "--request cache_dir")
    logging.basicConfig(level="INFO", format="%(asctime)s prepare-model %(levelname)s: %(message)s")
    # Imports torch: only after the request is known to be well formed.
    import torch

    from asymptote.tasks import parse_task_settings
    from services.learner.warmstart import prepare_model, tiny_model_settings

    try:
        task = parse_task_settings(req.get("task") or {})
        model, warmstart = tiny_model_settings(task, req.get("model"), req.get("warmstart"))
    except ValidationError as exc:
        section = {"ModelSpec": "model", "WarmstartSettings": "warmstart"}.get(exc.title, "task")
        raise ConfigError(
            validation_problems(exc, lambda loc: "--request " + ".".join(str(p) for p in (section, *loc)))
        ) from exc
    torch.set_num_threads(1)
    if req.get("model_dir") is not None:
        print(_check_model_dir(Path(req["model_dir"]).resolve()))
        return 0
    print(prepare_model(Path(req["cache_dir"]), model, task, warmstart))
    return 0


def _export(argv: list[str]) -> int:
    import logging

    parser = ArgumentParser(
        prog="asymptote export",
        description="Write a learner checkpoint as a Hugging Face model directory (config, tokenizer, chat "
        "template, safetensors in the served dtype) that transformers and vLLM load.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (its checkpoints/)")
    parser.add_argument("--to", type=Path, required=True, help="the model directory to write (new or empty)")
    parser.add_argument("--step", type=int, help="the checkpoint holding this step (default: the newest)")
    parser.add_argument("--model", type=Path, help="the model directory the run started from (default: the run's copy)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {args.run_dir}: not a directory")
    logging.basicConfig(level="INFO", format="%(asctime)s export %(levelname)s: %(message)s")
    from asymptote.errors import ModelError
    from services.learner.export import export

    try:
        print(export(args.run_dir, args.to, args.step, args.model))
    except ModelError as exc:
        raise ConfigError(str(exc)) from exc
    return 0


def _plan(argv: list[str]) -> int:
    from ops.plan import main as plan_main

    return plan_main(argv)


def _fit(argv: list[str]) -> int:
    from services.fitter.offline import main as fit_main

    return fit_main(argv)


def _bench(argv: list[str]) -> int:
    from benchmarks.run import main as bench_main

    return bench_main(argv)


def _kube(argv: list[str]) -> int:
    from ops.kube import main as kube_main

    return kube_main(argv)


def _sandbox(argv: list[str]) -> int:
    """``asymptote sandbox selftest`` and ``asymptote sandbox exec FILE``: both print JSON."""
    parser = ArgumentParser(
        prog="asymptote sandbox", description="The sandbox code tasks run in: which backend, and one program in it."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    test = sub.add_parser("selftest", help="choose a backend as a code task would; print it and each check")
    run = sub.add_parser("exec", help="run one Python program as a code task would; print its verdict")
    run.add_argument("file", type=Path, metavar="FILE", help="the Python program")
    run.add_argument("--stdin", type=Path, help="file fed to its standard input")
    run.add_argument("--timeout", type=float, default=10.0, help="wall-clock deadline in seconds")
    run.add_argument("--memory", type=int, default=1024, help="address space in MiB")
    for p in (test, run):
        p.add_argument("--backend", choices=("auto", "bubblewrap", "landlock"), default="auto", help="backend to use")
        p.add_argument("--python", type=Path, help="interpreter programs run with (default: this one's)")
    args = parser.parse_args(argv)
    from asymptote.sandbox import Limits, SandboxSettings, SandboxUnavailable, select_sandbox

    program = stdin = None
    if args.action == "exec":
        program = _read_text(args.file, "FILE")
        stdin = _read_text(args.stdin, "--stdin").encode() if args.stdin is not None else b""
    try:
        settings = SandboxSettings(backend=args.backend, python=args.python)
        limits = Limits(timeout_s=args.timeout, memory_mib=args.memory) if args.action == "exec" else None
    except ValidationError as exc:
        flags = {"timeout_s": "--timeout", "memory_mib": "--memory", "python": "--python"}
        raise ConfigError(validation_problems(exc, lambda loc: flags.get(str(loc[-1]), str(loc[-1])))) from exc
    try:
        selection = select_sandbox(settings)
    except SandboxUnavailable as exc:
        if args.action == "selftest":
            print(json.dumps({"backend": None, "error": str(exc)}, indent=2))
            return 1
        raise ConfigError(str(exc)) from exc
    if args.action == "selftest":
        print(json.dumps(selection.as_json(), indent=2))
        return 0
    assert program is not None and stdin is not None
    print(json.dumps(selection.sandbox.run(program, stdin, limits).as_json(), indent=2))
    return 0


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read it as UTF-8 text: {exc}") from exc


def _service(name: str) -> Callable[[list[str]], int]:
    """The ``main`` of a service, imported when its command runs."""

    def run(argv: list[str]) -> int:
        if name == "broker":
            from services.broker.main import main
        elif name == "generator":
            from services.generator.main import main
        elif name == "learner":
            from services.learner.main import main
        elif name == "sandbox-pool":
            from services.sandbox_pool.main import main
        else:
            from services.fitter.main import main
        return main(argv)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    **{name: _service(name) for name in ("broker", "generator", "learner", "fitter", "sandbox-pool")},
    "up": _up,
    "fit": _fit,
    "export": _export,
    "bench": _bench,
    "prepare-model": _prepare_model,
    "plan": _plan,
    "kube": _kube,
    "sandbox": _sandbox,
}


def _config_flag(argv: list[str]) -> str | None:
    """The value given to ``--config`` in ``argv``, if any."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def one_line(exc: ConfigError, argv: list[str]) -> str:
    """``exc`` on one line, with ``--config`` in front when it is about the file given there."""
    message = " ".join(str(exc).split())
    config = _config_flag(argv)
    if config is not None and str(Path(config)) in message and not message.startswith("--config"):
        message = f"--config: {message}"
    return message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        from asymptote import __version__

        print(f"asymptote {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    run = COMMANDS.get(command)
    if run is None:
        print(f"asymptote: unknown command {command!r}; accepted: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return run(rest)
    except ConfigError as exc:
        print(f"asymptote {command}: {one_line(exc, rest)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
