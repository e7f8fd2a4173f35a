"""The ``asymptote`` command: one subcommand per service, plus the local
stack (``up``), offline curve fitting (``fit``), benchmarks (``bench``) and
operating a deployed run (``kube``).

This module sits above everything it dispatches to: the services, the
local stack, the operator tools (``services/ops/``) and ``benchmarks/``
(which runs from a checkout: it is not installed with the package). It imports each of them lazily,
inside the subcommand that needs it, so ``asymptote broker`` never loads
torch or vLLM, a service image without ``benchmarks/`` still runs, and no
module below imports back up into the command line.

A user's mistake is answered in one line on stderr that names the flag (or
the file) and what is accepted, with exit status 2; a traceback is for bugs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from asymptote.cli_args import ArgumentParser, validation_problems
from asymptote.errors import ConfigError

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
  sweep        recipes compared by their projected asymptote: plan SPEC (the arms, runs, budget, looks)
  export       a run's checkpoint as a Hugging Face model directory (transformers, vLLM)
  bench        every performance figure against its baseline, side by side (bench.json, bench.md)
  plan         GPU, host and disk memory of a run before it starts (learner, generators, checkpoints)
  kube         a deployed run: status, scale generators, fetch results, gRPC health
  sandbox      the code sandbox: selftest (which backend, each check), exec FILE (one program's verdict)
"""


def _up(argv: list[str]) -> int:
    if "--dry-run" in argv:  # the planner's: it prints what up would run, and starts nothing
        from services.ops.plan import up_dry_run

        return up_dry_run(argv)
    from services.local.up import main as up_main

    return up_main(argv)


def _prepare_model(argv: list[str]) -> int:
    from services.local.prepare import main as prepare_main

    return prepare_main(argv)


def _export(argv: list[str]) -> int:
    import logging

    parser = ArgumentParser(
        prog="asymptote export",
        description="Write a learner checkpoint as a Hugging Face model directory (config, tokenizer, chat "
        "template, safetensors in the served dtype) that transformers and vLLM load.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (its checkpoints/)")
    parser.add_argument("--to", type=Path, required=True, help="the model directory to write (new or empty)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint holding this step (default: the newest)")
    which.add_argument("--best", action="store_true", help="the checkpoint of the best held-out eval round")
    parser.add_argument("--model", type=Path, help="the model directory the run started from (default: the run's copy)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: the base with the adapter merged in (float32, then the base's dtype), not the adapter",
    )
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {args.run_dir}: not a directory")
    logging.basicConfig(level="INFO", format="%(asctime)s export %(levelname)s: %(message)s")
    from asymptote.errors import ModelError
    from services.learner.export import export, find_best

    try:
        chosen = find_best(args.run_dir.resolve()) if args.best else None
        to = export(args.run_dir, args.to, args.step, args.model, best=args.best, merge=args.merge)
        print(chosen.said(to) if chosen is not None else to)
    except ModelError as exc:
        raise ConfigError(str(exc)) from exc
    return 0


def _plan(argv: list[str]) -> int:
    from services.ops.plan import main as plan_main

    return plan_main(argv)


def _fit(argv: list[str]) -> int:
    from services.fitter.offline import main as fit_main

    return fit_main(argv)


def _sweep(argv: list[str]) -> int:
    from services.sweep.cli import main as sweep_main

    return sweep_main(argv)


def _bench(argv: list[str]) -> int:
    try:
        from benchmarks.run import main as bench_main
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks":
            raise
        raise ConfigError(
            "the benchmarks run from a checkout of the repository (benchmarks/ is not installed with the package)"
        ) from exc
    return bench_main(argv)


def _kube(argv: list[str]) -> int:
    from services.ops.kube import main as kube_main

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
    "sweep": _sweep,
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
