"""The sandbox's cost per program and how closely it keeps the deadline, per backend this machine has.

Owns two figures for each backend whose self-test passes here:

- overhead: the median wall time of a trivial program (``pass``) run in the
  sandbox, against the same interpreter started bare (``python -I -B -c
  pass`` through ``subprocess.run``), runs interleaved so both see the same
  machine; target: at most 25 ms more.
- deadline: how long past its deadline an endless loop and a sleep are
  killed (the runner's wall clock to the last process gone); target: the
  worst at most 100 ms. Also the processes left running after all runs
  (target 0; the escapes suite asserts it too).

    python -m benchmarks.sandbox --output DIR [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

from asymptote.sandbox import Sandbox
from benchmarks.figure import Figure, Target, not_run, write_and_print

BENCH_FILE_NAME = "sandbox_bench.json"
OVERHEAD_TARGET_S = 0.025
DEADLINE_TARGET_S = 0.1
DEADLINE_S = 0.2


def _backends() -> dict[str, Sandbox]:
    from asymptote.sandbox import SandboxSettings, SandboxUnavailable, select_sandbox

    found: dict[str, Sandbox] = {}
    for name in ("bubblewrap", "landlock"):
        try:
            found[name] = select_sandbox(SandboxSettings.model_validate({"backend": name})).sandbox
        except SandboxUnavailable:
            continue
    return found


def strays() -> list[int]:
    """Processes still running a sandboxed program (its file name on their command line)."""
    from asymptote.sandbox.bubblewrap import PROGRAM_NAME

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if PROGRAM_NAME.encode() in cmdline:
                found.append(int(entry.name))
    return found


def _quantiles(xs: list[float]) -> dict[str, float]:
    ordered = sorted(xs)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def overhead_figure(name: str, sandbox: Sandbox, runs: int) -> Figure:
    from asymptote.sandbox import Limits
    from asymptote.sandbox.bubblewrap import interpreter

    exe, _ = interpreter(getattr(sandbox, "python", None))
    run = sandbox.run
    limits = Limits(timeout_s=10.0)
    bare, boxed = [], []
    for _ in range(runs):
        start = time.monotonic()
        subprocess.run([exe, "-I", "-B", "-c", "pass"], check=True, capture_output=True)
        bare.append(time.monotonic() - start)
        result = run("pass", b"", limits)
        assert result.ok, result
        boxed.append(result.time_s)
    extra = statistics.median(boxed) - statistics.median(bare)
    return Figure(
        name=f"sandbox_overhead_{name}",
        value=extra,
        unit="s",
        ratio=statistics.median(boxed) / statistics.median(bare),
        baseline=f"the bare interpreter {statistics.median(bare) * 1e3:.1f} ms (median)",
        measured=f"median wall time of `pass` in the {name} sandbox minus bare, {runs} runs each, interleaved",
        targets=(Target(of="value", direction="at most", bound=OVERHEAD_TARGET_S),),
        details={"bare_s": _quantiles(bare), "sandbox_s": _quantiles(boxed), "interpreter": exe},
    )


def deadline_figure(name: str, sandbox: Sandbox, runs: int) -> Figure:
    from asymptote.sandbox import Limits

    run = sandbox.run
    limits = Limits(timeout_s=DEADLINE_S)
    past = []
    for i in range(runs):
        program = "while True: pass" if i % 2 == 0 else "import time; time.sleep(60)"
        result = run(program, b"", limits)
        assert result.killed == "timeout", result
        past.append(result.time_s - DEADLINE_S)
    return Figure(
        name=f"sandbox_deadline_{name}",
        value=max(past),
        unit="s",
        ratio=max(past) / DEADLINE_TARGET_S,
        baseline=f"the deadline {DEADLINE_S * 1e3:.0f} ms",
        measured=f"time past the deadline until the last process was gone, worst of {runs} runs "
        "(endless loop and sleep alternating)",
        targets=(Target(of="value", direction="at most", bound=DEADLINE_TARGET_S),),
        details={"past_deadline_s": _quantiles(past), "stray_processes_after": len(strays())},
    )


def figures(runs: int) -> list[Figure]:
    found = _backends()
    if not found:
        targets = (Target(of="value", direction="at most", bound=OVERHEAD_TARGET_S),)
        return [not_run("sandbox_overhead", "s", targets, "no sandbox backend passed its self-test")]
    out = []
    for name, sandbox in found.items():
        out.append(overhead_figure(name, sandbox, runs))
        out.append(deadline_figure(name, sandbox, max(10, runs // 5)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--runs", type=int, default=200, help="programs per backend for the overhead figure")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    write_and_print(figures(args.runs), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
