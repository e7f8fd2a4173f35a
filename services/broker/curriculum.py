"""The curriculum: which train prompt comes next.

Owns the per-epoch deterministic shuffle of the train split, the cursor,
each prompt's latest observed pass rate, and No-Positive-Resampling
(ScaleRL): from the epoch after a prompt's pass rate reached the retire
threshold, it is never issued again. The state is a protobuf message so the
broker can keep it in a JetStream KV bucket and resume after a restart.
Knows nothing about NATS.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

from asymptote.contracts.v1 import rollout_pb2
from asymptote.tasks import MixtureTask, Problem
from asymptote.tasks.mixture import next_sub_task


class Curriculum:
    def __init__(
        self,
        problems: Sequence[Problem],
        seed: int,
        retire_at: float,
        state: rollout_pb2.CurriculumState | None = None,
    ) -> None:
        if not problems:
            raise ValueError("the train split is empty: nothing to issue")
        self._problems = list(problems)
        # Pass rates are stored as float32 (CurriculumState.pass_rates): compare
        # against the float32 threshold, or a rate of exactly 0.9 (9 of 10)
        # reads back as 0.8999999762 and never retires.
        self._retire_at = _as_float32(retire_at)
        self.state = state if state is not None else rollout_pb2.CurriculumState(seed=seed)
        if not self.state.epoch_order:  # a fresh run (or a state saved without the order)
            self._set_order(self._epoch_order(self.state.epoch))

    def _epoch_order(self, epoch: int) -> list[int]:
        """Shuffled indices of the prompts still eligible in ``epoch``.

        Eligibility is decided at the epoch's start from the pass rates seen
        so far, so a prompt retired mid-epoch is still issued in this epoch's
        remaining order only if it was eligible when the epoch began.
        """
        rng = random.Random(f"{self.state.seed}:{epoch}")
        order = list(range(len(self._problems)))
        rng.shuffle(order)
        if epoch == 0:
            return order
        rates = self.state.pass_rates
        return [i for i in order if rates.get(self._problems[i].prompt_id, 0.0) < self._retire_at]

    @property
    def num_retired(self) -> int:
        return sum(1 for r in self.state.pass_rates.values() if r >= self._retire_at)

    def _set_order(self, order: list[int]) -> None:
        """Fix the epoch's order in the state, so a resumed broker continues it as it was."""
        del self.state.epoch_order[:]
        self.state.epoch_order.extend(order)

    def next(self) -> tuple[Problem, int, int]:
        """The next prompt with its (epoch, position); advances the cursor."""
        while self.state.cursor >= len(self.state.epoch_order):
            self.state.epoch += 1
            self.state.cursor = 0
            self._set_order(self._epoch_order(self.state.epoch))
            if not self.state.epoch_order and self.num_retired >= len(self._problems):
                raise RuntimeError("every train prompt is retired by No-Positive-Resampling: the run is done")
        position = int(self.state.cursor)
        problem = self._problems[self.state.epoch_order[position]]
        self.state.cursor += 1
        self.state.num_issued += 1
        return problem, int(self.state.epoch), position

    def at_epoch_end(self) -> bool:
        """Whether the last :meth:`next` took the epoch's last prompt (a chunk of issued tasks ends there,
        where :meth:`rewind` is exact)."""
        return self.state.cursor >= len(self.state.epoch_order)

    def mark(self) -> tuple[int, int, int]:
        """Where the cursor is, for :meth:`rewind`."""
        return int(self.state.epoch), int(self.state.cursor), int(self.state.num_issued)

    def rewinder(self) -> Callable[[], None]:
        """A call that undoes every :meth:`next` from now on (a chunk of tasks that could not be issued)."""
        mark = self.mark()
        return lambda: self.rewind(mark)

    def rewind(self, mark: tuple[int, int, int]) -> None:
        """Undo :meth:`next` calls since ``mark`` (a task that could not be issued)."""
        epoch, cursor, num_issued = mark
        if epoch != self.state.epoch:
            # The mark sat at the end of its epoch: cross into the next one afresh.
            self.state.epoch, self.state.cursor = epoch, len(self.state.epoch_order)
        else:
            self.state.cursor = cursor
        self.state.num_issued = num_issued

    def record(self, prompt_id: str, pass_rate: float) -> None:
        """Keep the latest observed pass rate of a prompt."""
        self.state.pass_rates[prompt_id] = pass_rate


class MixtureCurriculum:
    """The curricula of a mixture's sub-tasks, and the weighted draw among them.

    Each sub-task keeps its own epochs, shuffle, cursor and pass rates
    (No-Positive-Resampling per sub-task), saved in ``state.sub_tasks``
    under its name; the top-level state's ``num_issued`` counts every draw.
    Which sub-task gives the next prompt is ``mixture.next_sub_task`` over
    the sub-tasks' own ``num_issued``: deterministic and seeded, each
    sub-task's count within one of its weight's share at any point.
    """

    def __init__(
        self, task: MixtureTask, seed: int, retire_at: float, state: rollout_pb2.CurriculumState | None = None
    ) -> None:
        self.task = task
        self.state = state if state is not None else rollout_pb2.CurriculumState(seed=seed)
        self.weights = task.settings.weights
        self.sub_tasks: dict[str, Curriculum] = {}
        for index, name in enumerate(task.settings.names):
            fresh = name not in self.state.sub_tasks
            sub_state = self.state.sub_tasks[name]  # created empty when missing; a reference into the state
            if fresh:
                sub_state.seed = int(self.state.seed) + index  # sub-tasks shuffle apart
            self.sub_tasks[name] = Curriculum(
                task.sub_problems(name, "train"), int(sub_state.seed), retire_at, sub_state
            )
        self._last: Curriculum | None = None

    @property
    def num_retired(self) -> int:
        return sum(c.num_retired for c in self.sub_tasks.values())

    def counts(self) -> dict[str, int]:
        """Train prompts issued so far, by sub-task."""
        return {name: int(c.state.num_issued) for name, c in self.sub_tasks.items()}

    def next(self) -> tuple[Problem, int, int]:
        """The next prompt of the sub-task the draw picks, with its (epoch, position) in that sub-task."""
        name = next_sub_task(self.weights, self.counts(), int(self.state.seed))
        self._last = self.sub_tasks[name]
        problem, epoch, position = self._last.next()
        self.state.num_issued += 1
        return problem, epoch, position

    def at_epoch_end(self) -> bool:
        """Whether the last :meth:`next` took its sub-task's last prompt of an epoch."""
        return self._last is not None and self._last.at_epoch_end()

    def mark(self) -> tuple[int, dict[str, tuple[int, int, int]]]:
        return int(self.state.num_issued), {name: c.mark() for name, c in self.sub_tasks.items()}

    def rewinder(self) -> Callable[[], None]:
        """A call that undoes every :meth:`next` from now on, in every sub-task."""
        mark = self.mark()
        return lambda: self.rewind(mark)

    def rewind(self, mark: tuple[int, dict[str, tuple[int, int, int]]]) -> None:
        """Undo :meth:`next` calls since ``mark`` in every sub-task (a chunk ends at any sub-task's epoch end,
        so each sub-task's rewind is exact)."""
        num_issued, subs = mark
        self.state.num_issued = num_issued
        for name, sub_mark in subs.items():
            self.sub_tasks[name].rewind(sub_mark)

    def record(self, prompt_id: str, pass_rate: float) -> None:
        """Keep the latest observed pass rate of a prompt, in its sub-task's curriculum."""
        try:
            name = self.task.sub_task_of(prompt_id)
        except KeyError:
            return  # not a prompt of this mixture (a task of another run): nothing to learn from it
        self.sub_tasks[name].record(prompt_id, pass_rate)


def _as_float32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])
