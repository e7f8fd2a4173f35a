"""``asymptote prepare-model``: the model directory a local run trains, made ready in a process of its own.

The local stack runs it before the services start: it builds and warm-starts
the embedded recipe's tiny model for the run's task (cached by every setting
that shapes it, services/embedded/warmstart.py), or checks a user's model
directory as the learner will load it, names and shapes against the stored
tensors. Its request is one JSON object; a malformed one is refused in one
line that names ``--request``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from asymptote.cli_args import ArgumentParser, validation_problems, writable_dir
from asymptote.errors import ConfigError

REQUEST_KEYS = ("cache_dir", "task", "model", "warmstart", "model_dir")
"""What a ``prepare-model --request`` object may hold."""


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


def main(argv: list[str]) -> int:
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
    from services.embedded.warmstart import prepare_model, tiny_model_settings

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
