"""Durable learner checkpoints, sharded and written while training goes on.

Owns writing and finding checkpoints. A checkpoint is a folder
``ckpt-<version>``:

- ``state/``: the model's parameters (with a LoRA, the adapter's only) and AdamW's state in
  ``torch.distributed.checkpoint`` (DCP) format. Every rank writes its own
  shards (FSDP2) or its share of the replicated tensors (DDP, one process),
  keyed by parameter name, so any number of ranks in either layout resumes it
  (DCP reshards on load) and no rank ever gathers the whole model;
- ``trainer.json``: the policy version, the step, the counters, the ids of
  the groups trained into the weights, the learning-rate scheduler's state
  and, for a LoRA, its settings and its base (model directory and digest);
- ``rng.pt``: rank 0's random-number generator states;
- ``DONE``: the marker that makes it count.

A save is asynchronous (``dcp.async_save``): each rank copies its state to
host memory (the staging copy, the only pause the training loop sees) and a
background thread writes and fsyncs the files, over a process group of its
own so that its collectives never interleave with training's. When DCP's
metadata is written every rank has written its part; rank 0 then writes
``trainer.json``, fsyncs, marks the folder ``DONE`` and renames it into
place. A crash at any moment leaves the previous checkpoints as they were:
only ``ckpt-*`` folders with ``DONE`` count. Batches are acked to the broker
only once the checkpoint that holds them is ``DONE`` (``loop``).

Pruning keeps the newest ``keep`` checkpoints and, when the run keeps its
best (``keep_best_checkpoint``), the one of the best held-out eval round the
fitter published (``asymptote.best_round``): the checkpoint at that round's
version, else the newest before it (the weights the round's version started
from, e.g. after a restart moved versions ahead of steps). That one holds a
``BEST`` file naming the round, which ``asymptote export --best`` reads; the
previous best's goes at the next commit once a better round supersedes it.
Until the learner has read the fitter's entry (at start, NATS unreachable)
nothing is pruned, so a restart never deletes the best. A round scored after
its checkpoint left the newest ``keep`` (a fitter that far behind) has none.

On several nodes every rank must see the same checkpoint folder (a shared
volume), as DCP writes each rank's files into it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ModelError
from asymptote.faults import failpoint

log = logging.getLogger(__name__)
# One process without a process group reads and writes checkpoints on its own, as meant (DCP warns,
# from its writer thread too).
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

STATE = "state"
"""The DCP folder inside a checkpoint."""
META = "trainer.json"
RNG = "rng.pt"
BEST = "BEST"
"""In the checkpoint kept for the best held-out round: the round's version, pass rate and rounds scored (JSON)."""
LEGACY_WEIGHTS = "model.safetensors"
"""The whole-model file of the consolidated format written before checkpoints were sharded."""


@dataclass(frozen=True)
class Restored:
    version: int
    samples_trained: int
    path: Path
    trained_group_ids: tuple[str, ...] = ()
    """The newest group ids trained into these weights (redelivered copies are skipped)."""
    step: int = 0
    """Optimizer steps taken (the version can run ahead of it after a restart)."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The learning-rate scheduler's state dict."""
    stepped: bool = True
    """Whether the optimizer has state (False: saved before its first step; a fresh optimizer then)."""
    lora: dict[str, Any] | None = None
    """The LoRA settings of an adapter checkpoint (it holds the adapter and its AdamW state only); None: whole weights."""
    base: dict[str, str] | None = None
    """An adapter checkpoint's base: its ``model_dir`` and ``digest`` (``adapter.base_digest``)."""

    @property
    def legacy(self) -> bool:
        """Written in the consolidated format (one ``model.safetensors`` and ``trainer.pt``)."""
        return (self.path / LEGACY_WEIGHTS).exists()


@dataclass(frozen=True)
class Meta:
    """What ``trainer.json`` holds."""

    version: int
    step: int
    samples_trained: int
    trained_group_ids: list[str]
    scheduler: dict[str, Any]
    stepped: bool
    world_size: int
    layout: str
    lora: dict[str, Any] | None = None
    base: dict[str, str] | None = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def final_path(root: Path, version: int) -> Path:
    return root / f"ckpt-{version:08d}"


def tmp_path(root: Path, version: int) -> Path:
    return root / f".ckpt-{version:08d}.tmp"


@dataclass
class _Pending:
    version: int
    tmp: Path
    future: Future[Any]
    meta: Meta | None
    """Rank 0's: what ``trainer.json`` gets once every rank's shards are written."""


class Checkpointer:
    """Each rank's side of the checkpoints in ``root``: at most one save in flight.

    Every rank calls ``begin`` with the same version (a collective); rank 0
    alone calls ``finish`` (or ``poll``) to commit it once the shards are
    durable. Create on every rank in the same order (it makes a process
    group for the writes when there are several ranks).
    """

    def __init__(
        self,
        root: Path,
        keep: int,
        *,
        distributed: bool,
        rank: int,
        pin_staging: bool = False,
        keep_best: bool = False,
    ) -> None:
        self.root = root
        self.keep = keep
        self.rank = rank
        self.keep_best = keep_best
        self.best: rollout_pb2.BestRound | None = None
        """The best held-out round the fitter published, whose checkpoint pruning keeps (``keep_best``)."""
        self.best_known = not keep_best
        """Whether ``best`` was read: until then nothing is pruned (it may be any checkpoint)."""
        # The writer's collectives (gathering plans and results) run in a background thread: on a
        # group of their own (gloo on the CPU) they cannot cross the training loop's.
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._pin_staging = pin_staging
        self._pending: _Pending | None = None

    @property
    def in_flight(self) -> int | None:
        """The version being written, if any."""
        return None if self._pending is None else self._pending.version

    def begin(self, version: int, state: dict[str, Any], meta: Meta | None = None) -> None:
        """Start writing ``state`` (``Trainer.state_dict``) as checkpoint ``version``; every rank calls it.

        Waits for the previous save first (rank 0 commits it). Returns once this rank's state is
        staged in host memory; the files are written in the background.
        ``meta``: rank 0's ``trainer.json`` (ignored on the other ranks).
        """
        if self.rank == 0:
            self.finish()  # the previous one committed first (the learner does so itself before it acks)
        else:
            self.wait_written()
        tmp = tmp_path(self.root, version)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        if self._group is not None:
            dist.barrier(group=self._group)  # the folder exists before any rank writes into it
        writer = FileSystemWriter(tmp / STATE, sync_files=True, cache_staged_state_dict=self._pin_staging)
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group, no_dist=self._group is None)
        assert isinstance(future, Future), "a thread-based async_save returns a Future"
        self._pending = _Pending(version, tmp, future, meta if self.rank == 0 else None)
        # The shards are being written now, in the background: a crash here leaves a folder without DONE.
        failpoint("learner.checkpoint.writing", version if meta is None else meta.step)

    def wait_written(self) -> None:
        """Block until this rank's part of the save in flight is written (raises what the writer raised)."""
        if self._pending is not None:
            self._pending.future.result()
            if self.rank != 0:
                self._pending = None

    def ready(self) -> bool:
        """Rank 0: the save in flight is written by every rank and can be committed without waiting."""
        return self._pending is not None and self._pending.future.done()

    def set_best(self, best: rollout_pb2.BestRound | None) -> None:
        """The best round as the fitter published it (None: none yet); pruning keeps its checkpoint from now."""
        self.best, self.best_known = best, True

    def finish(self) -> Path | None:
        """Rank 0: wait for the save in flight, commit it (``DONE``, renamed into place) and prune old ones.

        Returns the committed checkpoint, or None when nothing was in flight.
        """
        pending = self._pending
        if pending is None:
            return None
        pending.future.result()  # DCP writes its metadata after every rank's files are written
        self._pending = None
        assert pending.meta is not None, "rank 0 commits"
        final = commit(self.root, pending.version, pending.tmp, pending.meta)
        if self.best_known:
            prune(self.root, self.keep, self.best if self.keep_best else None)
        else:
            log.info("nothing pruned after %s: the run's best held-out round is not known yet", final.name)
        return final

    def close(self) -> None:
        """Finish what is in flight (rank 0 commits it) and leave the writers' process group."""
        if self.rank == 0:
            self.finish()
        else:
            self.wait_written()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            self._group = None


def commit(root: Path, version: int, tmp: Path, meta: Meta) -> Path:
    """Write ``trainer.json`` and the RNG states into ``tmp``, fsync, mark it DONE, rename it into place."""
    (tmp / META).write_text(json.dumps(asdict(meta)))
    torch.save({"torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp / RNG)
    failpoint("learner.checkpoint.written", meta.step)
    for f in (tmp / META, tmp / RNG):
        _fsync_file(f)
    _fsync_dir(tmp / STATE)
    (tmp / "DONE").touch()
    _fsync_dir(tmp)
    final = final_path(root, version)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    return final


def kept_versions(versions: list[int], keep: int, best_version: int | None) -> set[int]:
    """The checkpoint versions pruning keeps: the newest ``keep``, and the best round's (``best_version``'s own,
    else the newest before it; None: no best to keep)."""
    ordered = sorted(versions)
    kept = set(ordered[-keep:])
    before = [v for v in ordered if best_version is not None and v <= best_version]
    if before:
        kept.add(before[-1])
    return kept


def version_of(path: Path) -> int:
    """The version a ``ckpt-<version>`` folder holds."""
    return int(path.name.removeprefix("ckpt-"))


def committed(root: Path) -> list[Path]:
    """The checkpoints in ``root`` that count (marked DONE), oldest first."""
    return sorted(p for p in root.glob("ckpt-*") if (p / "DONE").exists())


def prune(root: Path, keep: int, best: rollout_pb2.BestRound | None) -> None:
    """Delete the checkpoints ``kept_versions`` does not keep; mark the best round's with ``BEST`` first, and
    take the mark off one that no longer is."""
    done = {version_of(p): p for p in committed(root)}
    best_version = int(best.policy_version) if best is not None else None
    kept = kept_versions(list(done), keep, best_version)
    stand_in = max((v for v in kept if best_version is not None and v <= best_version), default=None)
    if best is not None and stand_in is not None:
        mark = {"policy_version": best_version, "pass_rate": best.pass_rate, "num_rounds": best.num_rounds}
        path = done[stand_in] / BEST
        if not path.exists() or json.loads(path.read_text()) != mark:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(mark))
            _fsync_file(tmp)
            tmp.replace(path)
            _fsync_dir(done[stand_in])
            log.info(
                "%s kept for the best held-out round, version %d (pass rate %.3f)",
                done[stand_in].name,
                best_version,
                best.pass_rate,
            )
    for version, path in done.items():
        if version not in kept:
            shutil.rmtree(path, ignore_errors=True)
        elif version != stand_in:
            (path / BEST).unlink(missing_ok=True)


def best_mark(path: Path) -> dict[str, Any] | None:
    """What the ``BEST`` file of checkpoint ``path`` says, or None without one."""
    mark = path / BEST
    return json.loads(mark.read_text()) if mark.exists() else None


def latest(root: Path) -> Path | None:
    done = committed(root)
    return done[-1] if done else None


def read(path: Path) -> Restored:
    """The counters of the checkpoint in ``path``, and this process's RNG state from it.

    Reads the sharded format and the consolidated one before it; ModelError
    when the folder holds neither.
    """
    if (path / META).exists():
        meta = json.loads((path / META).read_text())
        rng = torch.load(path / RNG, weights_only=False)  # our own file, written by commit
    elif (path / LEGACY_WEIGHTS).exists():
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        meta = json.loads((path / "meta.json").read_text())
        meta["scheduler"] = trainer["scheduler"]
        meta["stepped"] = bool(trainer["optimizer"].get("state"))
        rng = trainer
    else:
        raise ModelError(f"{path}: marked DONE but holds neither {META} nor {LEGACY_WEIGHTS}")
    torch.set_rng_state(rng["torch_rng"])
    random.setstate(rng["python_rng"])
    return Restored(
        version=int(meta["version"]),
        samples_trained=int(meta["samples_trained"]),
        path=path,
        trained_group_ids=tuple(meta.get("trained_group_ids", ())),
        step=int(meta.get("step", meta["version"])),
        scheduler=dict(meta["scheduler"]),
        stepped=bool(meta["stepped"]),
        lora=meta.get("lora"),
        base=meta.get("base"),
    )


def load_state(path: Path, state: dict[str, Any]) -> None:
    """Fill ``state`` (``Trainer.state_dict``'s layout, allocated where it lives) from checkpoint ``path``.

    Each rank reads only what its own tensors hold (its shards under FSDP2).
    A collective when the process group is up. ModelError naming what does
    not fit when the checkpoint is another model's.
    """
    try:
        dcp.load(state, checkpoint_id=path / STATE, no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, ValueError) as exc:
        raise ModelError(f"checkpoint {path} does not fit the model: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):  # each rank's failure, wrapped with its traceback
        exc = next((inner for inner, _ in exc.failures.values()), exc)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def weight_names(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model tensors a checkpoint holds: name -> (shape, dtype), from its metadata alone."""
    metadata = FileSystemReader(path / STATE).read_metadata()
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            out[key.removeprefix("model.")] = (tuple(md.size), md.properties.dtype)
    return out


def read_weights(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole model tensors of the checkpoint in ``path`` (all, or ``names``), on the CPU, in one process.

    Reads only the tensors asked for, whatever the number of ranks that wrote
    them: a tool (``asymptote export``, a test) reads a big model a group of
    tensors at a time.
    """
    stored = weight_names(path)
    wanted = list(stored) if names is None else names
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise ModelError(f"checkpoint {path} holds no weights named {missing[:5]}")
    tensors = {n: torch.empty(stored[n][0], dtype=stored[n][1]) for n in wanted}
    dcp.load({"model": tensors}, checkpoint_id=path / STATE, no_dist=True)
    return tensors


def load_legacy(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The consolidated format's whole weights and optimizer state (keyed by parameter name)."""
    from safetensors.torch import load_file

    trainer = torch.load(path / "trainer.pt", weights_only=False)
    return load_file(str(path / LEGACY_WEIGHTS)), trainer["optimizer"]
