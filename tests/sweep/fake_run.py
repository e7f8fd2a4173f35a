"""A stand-in for ``asymptote up`` in the sweep controller's tests, for speed: a real child process that
appends a recorded curve's rows to its run directory, as far as its test releases them.

    python fake_run.py CURVE.json --config CONFIG.yaml | --resume RUN_DIR

CURVE.json: ``{"rows": [eval rows], "steps": [metrics rows], "crash_after": n, "ignore_sigterm": bool}``.
Row i of ``steps`` (when given) is appended to metrics.jsonl just before eval row i. The test paces the
run by writing a count to ``release`` beside the run directory: the run writes rows up to that count and
waits for more (an event, not a pace of its own). ``crash_after``: exit 1 once eval.jsonl holds n rows, at
every start. It writes stack.json when it starts, continues after the rows already written when resumed,
and on SIGTERM (a clean stop; ignored with ``ignore_sigterm``) or after its last row writes summary.json and
exits 0.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import yaml

POLL_S = 0.005


def main(argv: list[str]) -> int:
    curve = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if argv[1] == "--config":
        run_dir = Path(yaml.safe_load(Path(argv[2]).read_text(encoding="utf-8"))["run_dir"])
    else:
        run_dir = Path(argv[2])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stack.json").write_text("{}", encoding="utf-8")
    release = run_dir.parent / "release"
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if curve.get("ignore_sigterm") else stop)
    eval_path, metrics_path = run_dir / "eval.jsonl", run_dir / "metrics.jsonl"
    done = len(eval_path.read_text(encoding="utf-8").splitlines()) if eval_path.exists() else 0
    rows, steps = curve["rows"], curve.get("steps")
    crash_after = curve.get("crash_after")
    while done < len(rows) and not stopping:
        if crash_after is not None and done >= crash_after:
            print(f"fake run: out of memory after {done} rows", flush=True)
            return 1
        released = int(release.read_text(encoding="utf-8") or 0) if release.exists() else 0
        if done >= released:
            time.sleep(POLL_S)
            continue
        if steps is not None:
            with metrics_path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(steps[done]) + "\n")
        with eval_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(rows[done]) + "\n")
        done += 1
    (run_dir / "summary.json").write_text(json.dumps({"rows": done}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
