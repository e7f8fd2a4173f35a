"""Durable learner checkpoints.

Owns writing and finding checkpoints: model weights (safetensors), the
optimizer and scheduler state, RNG state, the policy version, counters and
the ids of the groups trained into the weights. A checkpoint holds the
whole (consolidated) state, the optimizer's keyed by parameter name, so it
resumes on any number of ranks in either layout (``sharding``).
A checkpoint is written into a temporary folder, fsynced, then renamed, so
a crash mid-write never leaves a checkpoint that looks complete. Only
``ckpt-*`` folders with a ``DONE`` marker count.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from asymptote.faults import failpoint


@dataclass(frozen=True)
class Restored:
    version: int
    samples_trained: int
    path: Path
    trained_group_ids: tuple[str, ...] = ()
    """The newest group ids trained into these weights (redelivered copies are skipped)."""
    step: int = 0
    """Optimizer steps taken (the version can run ahead of it after a restart)."""


@dataclass(frozen=True)
class TrainingState:
    """The whole state a step needs, as ``sharding.full_state`` gathers it onto rank 0."""

    weights: dict[str, torch.Tensor]
    """Parameters and buffers by state-dict name, a tied weight under its first name only."""
    optimizer: dict[str, Any]
    """The optimizer's state dict, keyed by parameter name."""
    scheduler: dict[str, Any]
    """The learning-rate scheduler's state dict."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    version: int,
    state: TrainingState,
    samples_trained: int,
    keep: int,
    trained_group_ids: Sequence[str] = (),
    step: int | None = None,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{version:08d}"
    tmp = root / f".ckpt-{version:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in state.weights.items()}, str(tmp / "model.safetensors"))
    torch.save(
        {
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        },
        tmp / "trainer.pt",
    )
    steps_done = version if step is None else step
    meta = {
        "version": version,
        "step": steps_done,
        "samples_trained": samples_trained,
        "trained_group_ids": list(trained_group_ids),
    }
    (tmp / "meta.json").write_text(json.dumps(meta))
    failpoint("learner.checkpoint.written", steps_done)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / "DONE").touch()
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("ckpt-*") if (p / "DONE").exists())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("ckpt-*") if (p / "DONE").exists())
    return done[-1] if done else None


def load(path: Path) -> tuple[Restored, TrainingState]:
    """The checkpoint in ``path``: its counters and its training state (and this process's RNG state from it)."""
    trainer = torch.load(path / "trainer.pt", weights_only=False)  # our own file, written above
    torch.set_rng_state(trainer["torch_rng"])
    random.setstate(trainer["python_rng"])
    meta = json.loads((path / "meta.json").read_text())
    restored = Restored(
        int(meta["version"]),
        int(meta["samples_trained"]),
        path,
        tuple(meta.get("trained_group_ids", ())),
        int(meta.get("step", meta["version"])),
    )
    return restored, TrainingState(
        load_file(str(path / "model.safetensors")), trainer["optimizer"], trainer["scheduler"]
    )
