"""Which GPUs each process of the local stack sees, on one machine with GPUs.

Owns finding the machine's GPUs (``nvidia-smi``, within the caller's
``CUDA_VISIBLE_DEVICES``) and splitting them: each generator gets
``tensor_parallel_size`` GPUs of its own, the learner's torchrun ranks one
GPU each on the rest, and nats-server, the broker and the fitter none. The
split is given to each process as its ``CUDA_VISIBLE_DEVICES``, so vLLM and
torch see only their own GPUs, numbered from 0, exactly as a pod sees the
GPUs it was granted. Imports nothing heavy: the placement is decided before
anything starts.

One GPU is shared: the generator's engine takes ``SHARED_GPU_FRACTION`` of
its memory (weights and KV cache) and the learner the rest, which suits
models of a few hundred million parameters (``asymptote plan`` says whether
one fits).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from asymptote.errors import ConfigError

SHARED_GPU_FRACTION = 0.4
"""Of a GPU that the generator and the learner share: what vLLM may take (weights and KV cache)."""
GPU_FRACTION = 0.9
"""Of a generator's own GPU: what vLLM may take (vLLM's default)."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as the caller sees it."""

    id: str
    """Its name for CUDA_VISIBLE_DEVICES (an index, or a UUID when the caller's variable uses them)."""
    memory_bytes: int
    name: str = ""
    """The card's product name as ``nvidia-smi`` gives it ("NVIDIA H100 80GB HBM3"); empty when unknown."""


def visible_gpus(env: dict[str, str] | None = None) -> list[Gpu]:
    """The GPUs this process may use: ``nvidia-smi``'s list, narrowed by ``CUDA_VISIBLE_DEVICES`` when set.

    No ``nvidia-smi`` (a machine without NVIDIA's driver) or an empty
    ``CUDA_VISIBLE_DEVICES``: none.
    """
    env = dict(os.environ) if env is None else env
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid,memory.total,name", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return narrow(parse_smi(out), env.get("CUDA_VISIBLE_DEVICES"))


def parse_smi(out: str) -> list[tuple[str, str, int, str]]:
    """``nvidia-smi --query-gpu=index,uuid,memory.total,name --format=csv,noheader,nounits`` as (index, uuid,
    bytes, name)."""
    rows = []
    for line in out.strip().splitlines():
        index, uuid, mib, name = (part.strip() for part in line.split(",", 3))
        rows.append((index, uuid, int(float(mib)) * 1024 * 1024, name))
    return rows


def narrow(rows: list[tuple[str, str, int, str]], visible: str | None) -> list[Gpu]:
    """The GPUs of ``rows`` that ``CUDA_VISIBLE_DEVICES`` (None: unset) lets through, in its order."""
    if visible is None:
        return [Gpu(index, memory, name) for index, _, memory, name in rows]
    chosen = []
    for want in (v.strip() for v in visible.split(",") if v.strip()):
        match = next((r for r in rows if want in (r[0], r[1])), None)
        if match is None:
            break  # CUDA stops at the first entry it cannot find
        chosen.append(Gpu(want, match[2], match[3]))
    return chosen


@dataclass(frozen=True)
class Placement:
    """The GPUs of each generator and of the learner's ranks."""

    generators: tuple[tuple[Gpu, ...], ...]
    """Generator i's GPUs (``tensor_parallel_size`` of them)."""
    learner: tuple[Gpu, ...]
    """One GPU per learner rank."""
    why: str = ""
    """How the split was chosen, when not by the settings or the half-and-half default."""

    @property
    def shared(self) -> bool:
        """The generator and the learner share one GPU."""
        return any(g in self.learner for gpus in self.generators for g in gpus)

    @property
    def gpu_memory_bytes(self) -> int:
        """The smallest of the learner's GPUs (what the memory planner sizes a rank for)."""
        return min(g.memory_bytes for g in self.learner)

    @property
    def generator_fraction(self) -> float:
        """What each engine's vLLM may take of its GPUs."""
        return SHARED_GPU_FRACTION if self.shared else GPU_FRACTION

    def visible_devices(self, name: str) -> str:
        """``CUDA_VISIBLE_DEVICES`` of process ``name`` (generator-<i>, learner, or any other: none)."""
        if name.startswith("generator-"):
            gpus = self.generators[int(name.removeprefix("generator-"))]
        elif name == "learner":
            gpus = self.learner
        else:
            gpus = ()
        return ",".join(g.id for g in gpus)

    def describe(self) -> str:
        gens = "; ".join(
            f"generator-{i}: GPU {self.visible_devices(f'generator-{i}')}" for i in range(len(self.generators))
        )
        how = "sharing" if self.shared else "on"
        why = f" ({self.why})" if self.why else ""
        return f"{gens}; learner ({len(self.learner)} ranks) {how} GPU {self.visible_devices('learner')}{why}"


def place(
    gpus: list[Gpu],
    *,
    tensor_parallel_size: int = 1,
    num_generators: int | None = None,
    learner_gpus: int | None = None,
) -> Placement:
    """Split ``gpus``: generators first, ``tensor_parallel_size`` GPUs each, then one GPU per learner rank.

    ``learner_gpus`` None: half the GPUs (rounded down, at least one);
    ``num_generators`` None: as many as the other GPUs hold. One GPU: the
    generator and the learner share it. ConfigError naming the setting when
    the split does not add up.
    """
    if not gpus:
        raise ConfigError("gpus: no GPU is visible to place the services on (nvidia-smi lists none)")
    tp = tensor_parallel_size
    if len(gpus) == 1:
        if tp > 1 or (num_generators or 1) > 1 or (learner_gpus or 1) > 1:
            raise ConfigError(
                "gpus 1: one GPU holds one generator (tensor_parallel_size 1) and one learner rank, sharing it"
            )
        return Placement(generators=((gpus[0],),), learner=(gpus[0],))
    learner = learner_gpus if learner_gpus is not None else max(1, len(gpus) // 2)
    rest = len(gpus) - learner
    if learner < 1 or rest < tp:
        raise ConfigError(
            f"learner_gpus {learner}: of {len(gpus)} GPUs that leaves {rest} for generators of "
            f"tensor_parallel_size {tp}; give the learner fewer"
        )
    count = num_generators if num_generators is not None else rest // tp
    if count < 1 or count * tp > rest:
        raise ConfigError(
            f"num_generators {count} x tensor_parallel_size {tp} = {count * tp} GPUs, but {rest} of the "
            f"{len(gpus)} are left beside the learner's {learner}"
        )
    generators = tuple(tuple(gpus[i * tp : (i + 1) * tp]) for i in range(count))
    return Placement(generators=generators, learner=tuple(gpus[len(gpus) - learner :]))
