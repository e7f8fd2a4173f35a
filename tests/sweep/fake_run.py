"""A stand-in for ``asymptote up`` in the sweep controller's tests, for speed: a real child process that
appends a recorded curve's eval rows to its run directory's eval.jsonl, one every ``interval_s``.

    python fake_run.py CURVE.json --config CONFIG.yaml | --resume RUN_DIR

CURVE.json: ``{"interval_s": s, "rows": [eval rows], "crash_after": n}`` (``crash_after``: exit 1 once the
file holds n rows, at every start). It writes stack.json when it starts, continues after the rows already
written when resumed, and on SIGINT (a clean stop) or at its last row writes summary.json and exits 0.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import yaml


def main(argv: list[str]) -> int:
    curve = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if argv[1] == "--config":
        run_dir = Path(yaml.safe_load(Path(argv[2]).read_text(encoding="utf-8"))["run_dir"])
    else:
        run_dir = Path(argv[2])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stack.json").write_text("{}", encoding="utf-8")
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    eval_path = run_dir / "eval.jsonl"
    done = len(eval_path.read_text(encoding="utf-8").splitlines()) if eval_path.exists() else 0
    crash_after = curve.get("crash_after")
    with eval_path.open("a", encoding="utf-8") as out:
        for row in curve["rows"][done:]:
            if stopping:
                break
            if crash_after is not None and done >= crash_after:
                print(f"fake run: out of memory after {done} rows", flush=True)
                return 1
            out.write(json.dumps(row) + "\n")
            out.flush()
            done += 1
            time.sleep(curve["interval_s"])  # the run's own pace, as a real run's rounds take time
    (run_dir / "summary.json").write_text(json.dumps({"rows": done}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
