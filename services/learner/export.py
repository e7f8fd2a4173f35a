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
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from asymptote.best_round import best_round, read_eval_rows
from asymptote.codec import PICKLE_SUFFIXES, read_signature
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, WeightsError
from services.learner import checkpoint
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
) -> Path:
    """Write checkpoint ``step`` (newest: None; ``best``: the best held-out round's, ``find_best``) of
    ``run_dir`` as a model directory ``to``; returns ``to``.

    ``model_dir``: where the config and tokenizer come from when the run
    kept no copy of them. Tensors go in safetensors shards of at most
    ``shard_bytes`` (one file when they fit). ConfigError for a destination
    that exists and is not empty, or a run without what export needs.
    """
    run_dir, to = run_dir.resolve(), to.resolve()
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise ConfigError(f"--to {to}: exists and is not an empty directory")
    source = model_dir if model_dir is not None else run_dir / MODEL_FILES
    flag = f"--model {source}" if model_dir is not None else str(source)
    if not (source / "config.json").is_file():
        raise ConfigError(f"{source}: no config.json; name the model directory the run started from with --model")
    try:
        signature = _signature(source)
    except (WeightsError, OSError) as exc:
        raise ConfigError(f"{flag}: its weights cannot be read: {exc}") from exc
    path = find_best(run_dir).path if best else find_checkpoint(run_dir, step)
    check_fits(signature, checkpoint.weight_names(path), path, flag)
    started = time.perf_counter()
    tmp = to.parent / f".{to.name}.export-tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--to {to}: cannot write there: {exc.strerror or exc}") from exc
    shards = _plan_shards(signature, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = checkpoint.read_weights(path, names)
        out = {n: tensors[n].to(TORCH_DTYPES[signature[n][0]]).contiguous() for n in names}
        save_file(out, str(tmp / file), metadata={"format": "pt"})
        # safetensors writes its files 0600: give them the mode the folder's other files get.
        (tmp / file).chmod(0o666 & ~_umask())
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(names, file))
        log.info("export: %s (%d of %d shards)", file, i + 1, len(shards))
        del tensors, out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != SIGNATURE and not f.name.endswith(_WEIGHT_FILES) and f.name != INDEX:
            shutil.copy2(f, tmp / f.name)
    meta = json.loads((path / checkpoint.META).read_text()) if (path / checkpoint.META).exists() else {}
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
