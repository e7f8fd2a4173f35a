"""A generator's vLLM engine on its own: the baseline of generator efficiency.

Owns the standalone half of the generator-efficiency figure: the same
engine settings a generator of the local stack runs (services/generator
Engine, max_num_seqs, KV cache), the same task prompts, the same group size
and completion budget, and the same number of groups in flight as the
generator's ``max_inflight_groups``, with no broker, learner, swaps or
publishing around it. ``asymptote bench`` runs it in a process pinned to the
generator's cores and compares the tokens per second a generator achieves
inside a running RL loop against it.

    python -m benchmarks.generator --model-dir DIR --output FILE [--window-s 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from asymptote.tasks import TaskSettings, get_task, parse_task_settings
from services.generator.config import EngineSettings
from services.generator.engine import Engine


async def standalone_tokens_per_s(
    engine_settings: EngineSettings,
    task: TaskSettings,
    group_size: int,
    max_tokens: int,
    concurrency_groups: int,
    window_s: float,
    num_windows: int = 3,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Completion tokens per second with ``concurrency_groups`` groups always in flight.

    Each of ``concurrency_groups`` workers samples one group after another,
    as a generator's rollout loop keeps its engine full. After a warm-up of
    ``window_s``, the tokens of groups finishing within each of
    ``num_windows`` consecutive windows of ``window_s`` are counted; the
    median window's rate is reported (a busy machine slows single windows,
    not the median).
    """
    problems = list(get_task(task.name, task).problems("train"))
    prompts = itertools.cycle(p.prompt for p in problems)
    engine = Engine(engine_settings)
    started = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - started
    tokens = groups = 0
    stop = asyncio.Event()

    async def worker() -> None:
        nonlocal tokens, groups
        while not stop.is_set():
            _, samples = await engine.sample(next(prompts), group_size, temperature, 1.0, max_tokens)
            tokens += sum(len(s.token_ids) for s in samples)
            groups += 1

    windows: list[tuple[int, int, float]] = []
    workers = [asyncio.create_task(worker()) for _ in range(concurrency_groups)]
    try:
        await asyncio.sleep(window_s)  # warm-up: the engine full, its caches and threads settled
        for _ in range(num_windows):
            t0, tokens0, groups0 = time.perf_counter(), tokens, groups
            await asyncio.sleep(window_s)
            windows.append((tokens - tokens0, groups - groups0, time.perf_counter() - t0))
        stop.set()
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await engine.shutdown()
    rates = sorted(t / wall for t, _, wall in windows)
    return {
        "tokens_per_s": statistics.median(rates),
        "window_tokens_per_s": rates,
        "tokens": sum(t for t, _, _ in windows),
        "groups": sum(g for _, g, _ in windows),
        "wall_s": sum(w for _, _, w in windows),
        "window_s": window_s,
        "engine_start_s": start_s,
        "concurrency_groups": concurrency_groups,
        "group_size": group_size,
        "max_tokens": max_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True, help="JSON file for the result")
    parser.add_argument("--window-s", type=float, default=8.0, help="length of the warm-up and of each timed window")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=7)
    parser.add_argument(
        "--concurrency", type=int, default=32, help="groups in flight (the generator's max_inflight_groups)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--task", default="{}", help="JSON TaskSettings")
    args = parser.parse_args(argv)
    result = asyncio.run(
        standalone_tokens_per_s(
            EngineSettings(model_dir=args.model_dir, max_num_seqs=args.max_num_seqs),
            parse_task_settings(json.loads(args.task)),
            args.group_size,
            args.max_tokens,
            args.concurrency,
            args.window_s,
        )
    )
    args.output.write_text(json.dumps(result, indent=2))
    print(
        f"standalone engine: {result['tokens_per_s']:.0f} tokens/s over {result['groups']} groups "
        f"({result['concurrency_groups']} in flight)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
