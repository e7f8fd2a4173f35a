"""A generator's vLLM engine on its own: the baseline of generator efficiency.

Owns the standalone half of the generator-efficiency figure: the same
engine settings a generator of the local stack runs (services/generator
Engine, max_num_seqs, KV cache), the same task prompts, the same group size
and completion budget, and the same number of groups in flight as the
generator's ``max_inflight_groups``, with no broker, learner, swaps or
publishing around it. ``asymptote bench`` runs it in a process pinned to the
generator's cores and compares the tokens per second a generator achieves
inside a running RL loop against it.

    python -m services.generator.bench --model-dir DIR --output FILE [--groups 400]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

from asymptote.tasks import TaskSettings, get_task
from services.generator.config import EngineSettings
from services.generator.engine import Engine


async def standalone_tokens_per_s(
    engine_settings: EngineSettings,
    task: TaskSettings,
    group_size: int,
    max_tokens: int,
    concurrency_groups: int,
    num_groups: int,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Completion tokens per second over ``num_groups`` groups, ``concurrency_groups`` at a time.

    One warm-up round of ``concurrency_groups`` groups runs first and is not
    timed; the groups are then timed in three windows and the median window's
    rate is reported (a busy machine slows single windows, not the median).
    """
    problems = list(get_task(task.name, task).problems("train"))
    prompts = itertools.cycle(p.prompt for p in problems)
    engine = Engine(engine_settings)
    started = time.monotonic()
    await engine.start()
    start_s = time.monotonic() - started
    slots = asyncio.Semaphore(concurrency_groups)

    async def one(prompt: str) -> int:
        async with slots:
            _, samples = await engine.sample(prompt, group_size, temperature, 1.0, max_tokens)
        return sum(len(s.token_ids) for s in samples)

    windows: list[tuple[int, float]] = []
    try:
        await asyncio.gather(*(one(next(prompts)) for _ in range(concurrency_groups)))
        for _ in range(3):
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(next(prompts)) for _ in range(max(1, num_groups // 3))))
            windows.append((sum(counts), time.perf_counter() - t0))
    finally:
        await engine.shutdown()
    rates = sorted(tokens / wall for tokens, wall in windows)
    return {
        "tokens_per_s": rates[1],
        "window_tokens_per_s": rates,
        "tokens": sum(t for t, _ in windows),
        "groups": 3 * max(1, num_groups // 3),
        "wall_s": sum(w for _, w in windows),
        "engine_start_s": start_s,
        "concurrency_groups": concurrency_groups,
        "group_size": group_size,
        "max_tokens": max_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.generator.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True, help="JSON file for the result")
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=32, help="groups in flight (the generator's max_inflight_groups)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--task", default="{}", help="JSON TaskSettings")
    args = parser.parse_args(argv)
    result = asyncio.run(standalone_tokens_per_s(
        EngineSettings(model_dir=args.model_dir, max_num_seqs=args.max_num_seqs),
        TaskSettings.model_validate(json.loads(args.task)),
        args.group_size, args.max_tokens, args.concurrency, args.groups,
    ))
    args.output.write_text(json.dumps(result, indent=2))
    print(f"standalone engine: {result['tokens_per_s']:.0f} tokens/s over {result['groups']} groups "
          f"({result['concurrency_groups']} in flight)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
