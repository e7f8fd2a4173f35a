"""The ``asymptote`` command: one subcommand per service, plus the local
stack (``up``), offline curve fitting (``fit``) and benchmarks (``bench``).

Each subcommand imports its service lazily, so ``asymptote broker`` never
loads torch or vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asymptote.errors import ConfigError

USAGE = """asymptote <command> [options]

services:
  broker       curriculum, admission, batching (JetStream + gRPC)
  generator    vLLM rollouts with in-flight weight swaps
  learner      CISPO learner serving weights over gRPC
  fitter       compute-performance curve fit and projections

local and offline:
  up           run nats-server and the four services on this machine
  fit          fit eval.jsonl files offline, print a table, write a plot
  bench        every performance figure as a ratio, side by side (bench.json, bench.md)
  prepare-model  build and warm-start the tiny local model (cached)
  kube         a deployed run: status, scale generators, gRPC health
"""


def _up(argv: list[str]) -> int:
    from asymptote.config import load_config
    from services.local.config import StackConfig
    from services.local.stack import LocalStack

    parser = argparse.ArgumentParser(prog="asymptote up", description="Run the embedded default end to end.")
    parser.add_argument("--config", type=Path, help="YAML stack config (env overrides: ASY_UP__...)")
    parser.add_argument("--run-dir", type=Path, help="run directory (default runs/<timestamp>)")
    parser.add_argument("--max-steps", type=int, help="learner steps")
    parser.add_argument("--generators", type=int, help="generator processes")
    parser.add_argument("--learner-ranks", type=int, help="data-parallel learner ranks (torchrun)")
    args = parser.parse_args(argv)
    config = load_config(StackConfig, args.config, "ASY_UP")
    overrides = {
        k: v
        for k, v in {
            "run_dir": args.run_dir,
            "max_steps": args.max_steps,
            "num_generators": args.generators,
            "learner_ranks": args.learner_ranks,
        }.items()
        if v is not None
    }
    if overrides:
        config = StackConfig.model_validate({**config.model_dump(), **overrides})
    return LocalStack(config).run()


def _prepare_model(argv: list[str]) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="asymptote prepare-model")
    parser.add_argument("--request", required=True, help="JSON: cache_dir, task, model, warmstart")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s prepare-model %(levelname)s: %(message)s")
    req = json.loads(args.request)
    import torch

    from asymptote.tasks import TaskSettings
    from services.learner.model import ModelSpec
    from services.learner.warmstart import WarmstartSettings, prepare_model

    torch.set_num_threads(1)
    path = prepare_model(
        Path(req["cache_dir"]),
        ModelSpec.model_validate(req.get("model") or {}),
        TaskSettings.model_validate(req.get("task") or {}),
        WarmstartSettings.model_validate(req.get("warmstart") or {}),
    )
    print(path)
    return 0


def _fit(argv: list[str]) -> int:
    from services.fitter.offline import main as fit_main

    return fit_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "broker":
            from services.broker.main import main as run
        elif command == "generator":
            from services.generator.main import main as run
        elif command == "learner":
            from services.learner.main import main as run
        elif command == "fitter":
            from services.fitter.main import main as run
        elif command == "up":
            run = _up
        elif command == "fit":
            run = _fit
        elif command == "bench":
            from services.bench import main as run
        elif command == "kube":
            from services.kube import main as run
        elif command == "prepare-model":
            run = _prepare_model
        else:
            print(f"asymptote: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
            return 2
        return run(rest)
    except ConfigError as exc:
        print(f"asymptote {command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
