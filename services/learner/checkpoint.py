"""Durable learner checkpoints.

Owns writing and finding checkpoints: model weights (safetensors), the
optimizer and scheduler state, RNG state, the policy version, counters and
the ids of the groups trained into the weights.
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    version: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
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
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    # Tied parameters share storage; safetensors refuses shared tensors.
    seen: dict[int, str] = {}
    unique = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        if ptr in seen:
            continue
        seen[ptr] = k
        unique[k] = v
    save_file(unique, str(tmp / "model.safetensors"))
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
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


def restore(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Restored:
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied weights appear under one name only; anything else missing is fatal.
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")
    trainer = torch.load(path / "trainer.pt", weights_only=False)  # our own file, written above
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["torch_rng"])
    random.setstate(trainer["python_rng"])
    meta = json.loads((path / "meta.json").read_text())
    return Restored(
        int(meta["version"]),
        int(meta["samples_trained"]),
        path,
        tuple(meta.get("trained_group_ids", ())),
        int(meta.get("step", meta["version"])),
    )
