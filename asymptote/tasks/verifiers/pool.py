"""Scoring completions in worker processes, each with a time limit.

Owns the ``ScoringPool``: a small pool of spawned processes (pebble) that
run a verifier on one completion at a time. A completion that takes longer
than ``timeout_s`` (huge LaTeX, nested braces, megabytes of text) has its
worker killed and replaced; it gets a ``timeout`` verdict, and the other
completions keep being scored by the remaining workers. A worker that dies
(out of memory, a crash in a C extension) gives an ``error`` verdict. Every
verdict's reason is counted in ``counts`` for metrics.

Workers are spawned, not forked: the generator's process holds vLLM's
threads, which a fork would copy mid-flight.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout

from pebble import ProcessExpired, ProcessPool

from asymptote.tasks.verifiers import VerifierSettings, make_verifier
from asymptote.tasks.verifiers.base import Reason, Verdict, Verifier

log = logging.getLogger(__name__)

_verifiers: dict[str, Verifier] = {}
"""A worker's verifiers, built once per settings."""


def _verifier(settings: VerifierSettings) -> Verifier:
    key = settings.model_dump_json()
    if key not in _verifiers:
        _verifiers[key] = make_verifier(settings)
    return _verifiers[key]


def _warm(settings: VerifierSettings) -> None:
    # Imports (math-verify and sympy take about a second) happen here, before
    # the worker takes a completion, so they never count against its limit.
    verifier = _verifier(settings)
    try:
        verifier.verdict("\\boxed{1}", verifier.check_reference("1"))
    except ValueError:
        pass  # a verifier whose references are not numbers


def _judge(settings: VerifierSettings, completion: str, reference: str) -> Verdict:
    return _verifier(settings).verdict(completion, reference)


class ScoringPool:
    """Verdicts for completions, computed in ``num_workers`` processes with a per-completion limit."""

    def __init__(self, settings: VerifierSettings, num_workers: int = 2, timeout_s: float = 5.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        make_verifier(settings)  # a missing plugin fails here, not in every worker
        self.settings = settings
        self.timeout_s = timeout_s
        self.counts: Counter[Reason] = Counter()
        self._pool = ProcessPool(
            max_workers=num_workers,
            initializer=_warm,
            initargs=(settings,),
            context=multiprocessing.get_context("spawn"),
        )

    async def judge(self, completion: str, reference: str) -> Verdict:
        """The verdict on one completion; ``timeout`` once it has run ``timeout_s`` in a worker."""
        future = self._pool.schedule(_judge, args=(self.settings, completion, reference), timeout=self.timeout_s)
        try:
            verdict: Verdict = await asyncio.wrap_future(future)
        except FutureTimeout:
            verdict = Verdict(False, "timeout")
            log.warning("scoring a completion of %d characters timed out after %gs", len(completion), self.timeout_s)
        except ProcessExpired as exc:
            verdict = Verdict(False, "error")
            log.warning("a scoring worker died (%s) on a completion of %d characters", exc, len(completion))
        except Exception as exc:  # a verifier that raised: its completion scores as an error, the rest go on
            verdict = Verdict(False, "error")
            log.warning("the verifier raised %s: %s", type(exc).__name__, exc)
        self.counts[verdict.reason] += 1
        return verdict

    async def judge_all(self, completions: list[str], reference: str) -> list[Verdict]:
        """Verdicts on a group of completions, scored concurrently."""
        return list(await asyncio.gather(*(self.judge(c, reference) for c in completions)))

    def close(self) -> None:
        """Stop the workers (a stuck one is killed)."""
        self._pool.stop()  # type: ignore[no-untyped-call]
        self._pool.join(timeout=5.0)
