"""``asymptote export``: a learner checkpoint as a Hugging Face model directory.

The learner keeps a copy of its model directory's small files (config,
tokenizer, chat template, generation config) and of its tensors' names,
dtypes and shapes in ``<run>/model/`` (``keep_model_files``). Export reads a
checkpoint's weights a group of tensors at a time (``checkpoint.read_weights``:
whatever the number of ranks that wrote it), casts each to the dtype the
model directory stored it in (the dtype generators serve), and writes
safetensors shards with their index beside those files: a folder that
transformers' ``from_pretrained`` and vLLM load as they loaded the original.
The folder is written beside its destination and renamed into place, so an
interrupted export leaves nothing that looks complete.

``--best`` takes the checkpoint of the run's best held-out eval round, read
from the run directory alone: the round from ``eval.jsonl``
(``asymptote.best_round``), its checkpoint the one at its version, else the
one the learner kept for it and marked ``BEST`` (the newest before it).

A LoRA run's checkpoint holds the adapter only: export writes it as peft's
adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``
in float32, under peft's names), which peft and vLLM load over the base; with
``merge`` it writes a whole model directory instead, each adapted weight
``W + scaling * B @ A`` computed in float32 from the base's stored tensor and
then cast to the base's dtype (the base read from the directory the
checkpoint names, checked against its digest, or ``model_dir``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from asymptote.best_round import best_round, read_eval_rows
from asymptote.codec import PICKLE_SUFFIXES, read_signature, safetensors_files
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, WeightsError
from asymptote.lora import ADAPTER_WEIGHTS, LoraSettings
from services.learner import adapter, checkpoint
from services.learner.model import TORCH_DTYPES

log = logging.getLogger(__name__)

MODEL_FILES = "model"
"""The run directory's copy of the model directory's small files."""
SIGNATURE = "signature.json"
"""Tensor name -> [dtype, shape] of the model directory's stored tensors."""
SHARD_BYTES = 5 * 1024**3
"""Largest safetensors shard written (Hugging Face's default for save_pretrained)."""
INDEX = "model.safetensors.index.json"
_WEIGHT_FILES = (".safetensors", *PICKLE_SUFFIXES)


def keep_model_files(model_dir: Path, run_dir: Path) -> Path:
    """Copy ``model_dir``'s files other than weights, and its tensors' signature, into ``run_dir/model``.

    Idempotent: a run resumed keeps the copy it made first.
    """
    out = run_dir / MODEL_FILES
    if (out / SIGNATURE).exists():
        return out
    tmp = run_dir / f".{MODEL_FILES}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name != INDEX:
            shutil.copy2(f, tmp / f.name)
    signature = {name: [dtype, list(shape)] for name, (dtype, shape) in read_signature(model_dir).items()}
    (tmp / SIGNATURE).write_text(json.dumps(signature))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@dataclass(frozen=True)
class BestCheckpoint:
    """The checkpoint of a run's best held-out round."""

    path: Path
    round: rollout_pb2.BestRound

    @property
    def version(self) -> int:
        return checkpoint.version_of(self.path)

    def said(self, to: Path) -> str:
        """The line ``asymptote export --best`` answers with."""
        v, score = self.round.policy_version, f"held-out pass rate {self.round.pass_rate:.3f}"
        of = f"the best of {self.round.num_rounds} eval rounds"
        if self.version == v:
            return f"exported version {v} ({score}, {of}) to {to}"
        return f"exported version {self.version}, the newest checkpoint before the best round's version {v} ({score}, {of}), to {to}"


def find_best(run_dir: Path) -> BestCheckpoint:
    """The checkpoint of the run's best held-out round (``eval.jsonl``); ConfigError saying why there is none."""
    evals = run_dir / "eval.jsonl"
    best = best_round(read_eval_rows(evals))
    if best is None:
        raise ConfigError(f"--best: {evals} holds no eval round")
    done = {checkpoint.version_of(p): p for p in checkpoint.committed(run_dir / "checkpoints")}
    v = int(best.policy_version)
    if v in done:
        return BestCheckpoint(done[v], best)
    for path in done.values():
        mark = checkpoint.best_mark(path)
        if mark is not None and mark.get("policy_version") == v:
            return BestCheckpoint(path, best)
    why = (
        "version 0 is the model the run started from"
        if v == 0
        else "it left the newest ones before the round was scored, or the run kept no best (keep_best_checkpoint)"
    )
    raise ConfigError(
        f"--best: the best held-out round, version {v} (pass rate {best.pass_rate:.3f}), has no checkpoint: {why}; "
        f"the run's checkpoints hold versions {sorted(done)}"
    )


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The run's newest committed checkpoint, or the one holding ``step``; ConfigError saying what there is."""
    root = run_dir / "checkpoints"
    done = checkpoint.committed(root)
    if not done:
        raise ConfigError(f"{run_dir}: no committed checkpoint in {root}")
    if step is None:
        return done[-1]
    steps = {}
    for path in done:
        meta = json.loads((path / checkpoint.META).read_text()) if (path / checkpoint.META).exists() else {}
        steps[int(meta.get("step", -1))] = path
    if step not in steps:
        raise ConfigError(f"--step {step}: the run's checkpoints hold steps {sorted(steps)}")
    return steps[step]


def export(
    run_dir: Path,
    to: Path,
    step: int | None = None,
    model_dir: Path | None = None,
    shard_bytes: int = SHARD_BYTES,
    best: bool = False,
    merge: bool = False,
) -> Path:
    """Write checkpoint ``step`` (newest: None; ``best``: the best held-out round's, ``find_best``) of
    ``run_dir`` as a model directory ``to``; returns ``to``.

    ``model_dir``: where the config and tokenizer come from when the run
    kept no copy of them (a LoRA's base, for ``merge``). Tensors go in
    safetensors shards of at most ``shard_bytes`` (one file when they fit).
    A LoRA run's checkpoint is written as peft's adapter directory, or with
    ``merge`` as the merged model. ConfigError for a destination that exists
    and is not empty, or a run without what export needs.
    """
    run_dir, to = run_dir.resolve(), to.resolve()
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"--to {to}: exists and is not an empty directory")
    path = find_best(run_dir).path if best else find_checkpoint(run_dir, step)
    meta = json.loads((path / checkpoint.META).read_text()) if (path / checkpoint.META).exists() else {}
    if meta.get("lora") is not None:
        return _export_lora(run_dir, to, path, meta, model_dir, shard_bytes, merge)
    if merge:
        raise ConfigError(f"--merge: checkpoint {path.name} holds whole weights (the run trained no LoRA)")
    source = model_dir if model_dir is not None else run_dir / MODEL_FILES
    flag = f"--model {source}" if model_dir is not None else str(source)
    if not (source / "config.json").is_file():
        raise ConfigError(f"{source}: no config.json; name the model directory the run started from with --model")
    try:
        signature = _signature(source)
    except (WeightsError, OSError) as exc:
        raise ConfigError(f"{flag}: its weights cannot be read: {exc}") from exc
    check_fits(signature, checkpoint.weight_names(path), path, flag)
    started = time.perf_counter()
    tmp = _staging(to)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = checkpoint.read_weights(path, names)
        return {n: tensors[n].to(TORCH_DTYPES[signature[n][0]]) for n in names}

    total = _write_shards(tmp, signature, shard_bytes, read)
    _copy_small_files(source, tmp)
    return _finish(tmp, to, run_dir, path, meta, total, started)


def _export_lora(
    run_dir: Path,
    to: Path,
    path: Path,
    meta: dict[str, Any],
    model_dir: Path | None,
    shard_bytes: int,
    merge: bool,
) -> Path:
    """A LoRA checkpoint as peft's adapter directory, or with ``merge`` as the merged model directory."""
    settings = LoraSettings.model_validate(meta["lora"])
    base = meta.get("base") or {}
    base_dir = model_dir if model_dir is not None else Path(base["model_dir"]) if base else None
    flag = f"--model {base_dir}" if model_dir is not None else f"the base {base_dir} (checkpoint {path.name})"
    started = time.perf_counter()
    stored = checkpoint.read_weights(path)
    tensors = {adapter.file_name(name): t.to(torch.float32).contiguous() for name, t in stored.items()}
    if not merge:
        tmp = _staging(to)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_WEIGHTS).chmod(0o666 & ~_umask())
        adapter.write_config(settings, str(base_dir or ""), tensors, tmp)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return _finish(tmp, to, run_dir, path, meta, total, started)
    if base_dir is None or not (base_dir / "config.json").is_file():
        raise ConfigError(f"--merge: {flag} is no model directory; name the base with --model")
    try:
        signature = read_signature(base_dir)
        digest = adapter.base_digest(base_dir)
    except (WeightsError, OSError) as exc:
        raise ConfigError(f"--merge: {flag}: its weights cannot be read: {exc}") from exc
    if base and digest != base["digest"]:
        raise ConfigError(
            f"--merge: {flag} is not the base checkpoint {path.name} trained over (digest {digest[:12]}, "
            f"the checkpoint's {base['digest'][:12]})"
        )
    targets = adapter.base_layer_names(tensors)
    unknown = sorted(set(targets) - set(signature))
    if unknown:
        raise ConfigError(f"--merge: {flag} has no weight {unknown[0]} the adapter changes: not this run's base")
    tmp = _staging(to)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out = _read_stored(base_dir, names)
        for name in names:
            if name in targets:
                a, b = targets[name]
                out[name] = adapter.merged(out[name], tensors[a], tensors[b], settings.scaling, out[name].dtype)
        return out

    total = _write_shards(tmp, signature, shard_bytes, read)
    _copy_small_files(run_dir / MODEL_FILES if (run_dir / MODEL_FILES).is_dir() else base_dir, tmp)
    return _finish(tmp, to, run_dir, path, meta, total, started)


def _read_stored(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The stored tensors ``names`` of ``model_dir``, in their stored dtypes."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    wanted = set(names)
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in wanted.intersection(f.keys()):
                out[name] = f.get_tensor(name)
    return out


def _staging(to: Path) -> Path:
    """The folder an export is written in, beside ``to`` (renamed into place by ``_finish``)."""
    tmp = to.parent / f".{to.name}.export-tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--to {to}: cannot write there: {exc.strerror or exc}") from exc
    return tmp


def _write_shards(
    tmp: Path,
    signature: dict[str, tuple[str, tuple[int, ...]]],
    shard_bytes: int,
    read: Callable[[list[str]], dict[str, torch.Tensor]],
) -> int:
    """Write the tensors ``read`` gives, a shard of names at a time, as safetensors shards with their index;
    returns their bytes."""
    shards = _plan_shards(signature, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {n: t.contiguous() for n, t in read(names).items()}
        save_file(out, str(tmp / file), metadata={"format": "pt"})
        # safetensors writes its files 0600: give them the mode the folder's other files get.
        (tmp / file).chmod(0o666 & ~_umask())
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(names, file))
        log.info("export: %s (%d of %d shards)", file, i + 1, len(shards))
        del out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    return total


def _copy_small_files(source: Path, tmp: Path) -> None:
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != SIGNATURE and not f.name.endswith(_WEIGHT_FILES) and f.name != INDEX:
            shutil.copy2(f, tmp / f.name)


def _finish(tmp: Path, to: Path, run_dir: Path, path: Path, meta: dict[str, Any], total: int, started: float) -> Path:
    """Write the export's provenance into ``tmp`` and rename it into place as ``to``."""
    provenance = {
        "run_dir": str(run_dir),
        "checkpoint": path.name,
        "step": meta.get("step"),
        "policy_version": meta.get("version"),
        "bytes": total,
    }
    (tmp / "asymptote-export.json").write_text(json.dumps(provenance, indent=2))
    if to.exists():
        to.rmdir()
    tmp.rename(to)
    log.info("exported %s (%.2f GB) to %s in %.1fs", path.name, total / 1e9, to, time.perf_counter() - started)
    return to


def check_fits(
    signature: dict[str, tuple[str, tuple[int, ...]]],
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]],
    path: Path,
    flag: str,
) -> None:
    """Refuse, before anything is written, a model directory whose tensors the checkpoint does not hold with
    the same shapes (an export with another model's config over this run's weights would not load)."""
    missing = sorted(set(signature) - set(stored))
    if missing:
        raise ConfigError(
            f"{flag}: checkpoint {path.name} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): not the model this run trained"
        )
    reshaped = sorted(name for name, (_, shape) in signature.items() if tuple(stored[name][0]) != tuple(shape))
    if reshaped:
        name = reshaped[0]
        raise ConfigError(
            f"{flag}: {len(reshaped)} tensors differ in shape from checkpoint {path.name} ({name}: the model "
            f"{list(signature[name][1])}, the checkpoint {list(stored[name][0])}): not the model this run trained"
        )


def _signature(source: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    kept = source / SIGNATURE
    if kept.exists():
        return {name: (dtype, tuple(shape)) for name, (dtype, shape) in json.loads(kept.read_text()).items()}
    return read_signature(source)


def _plan_shards(signature: dict[str, tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[str]]:
    """Tensor names in shards of at most ``shard_bytes`` in the served dtype (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in signature.items():
        nbytes = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size() * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
