"""``asymptote up`` stopped by Ctrl-C and ``asymptote bench`` by SIGTERM, mid-run, leave no process behind,
and ``asymptote up --resume`` continues the stopped run.

Python's default for SIGTERM ends a process without running its ``finally``
blocks, so a command that started services in sessions of their own would
leave them all running (nats-server, broker, fitter, learner ranks,
generators and their vLLM engines). Each command here runs with a marker in
its environment, which every process it starts inherits; after the signal
the command must exit with 130 and no process on the machine may still
carry the marker. ``bench`` is stopped once every service of its stack runs (its
generator before vLLM's engine is up: the same teardown as ``up``'s, which
is stopped with its engine's processes running and checked for them too).
``up`` is stopped after its first eval round as Ctrl-C in a terminal stops
it (SIGINT to its whole process group, whatever shares it), with far more
steps to go than the stop can race, and resumed from what it says for a few
steps more; the stop acked every batch the final checkpoint holds: the run then ends with one continuous
curve (eval rounds at increasing versions, before and after the stop, one
fit over all of them), every step trained once, and the ledger at 0 lost,
0 trained twice.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from services.local.progress import read_jsonl
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
MARKER = "ASY_TEST_STOP_MARKER"


def marked(token: str) -> list[psutil.Process]:
    """Every live process (zombies aside) whose environment carries ``MARKER=token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def engine_processes(token: str) -> set[psutil.Process]:
    """Every process under the run's generators once a vLLM engine core is among them (the deepest point
    of the tree), else none. vLLM's processes retitle themselves, which overwrites the environment the
    marker is read from, so they are found as descendants; and a generator has other children (its scoring
    pool) before its engine's."""
    found: set[psutil.Process] = set()
    for proc in marked(token):
        try:
            if "generator" not in proc.cmdline():
                continue
            below = proc.children(recursive=True)
            if any("VLLM::EngineCore" in " ".join([p.name(), *p.cmdline()]) for p in below):
                found.update(below)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def services_running(token: str) -> bool:
    """Whether every service of the stack has a process: nats-server, broker, fitter, learner, generator."""
    roles: set[str] = set()
    for proc in marked(token):
        try:
            cmd = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        roles.update(r for r in ("broker", "fitter", "learner", "generator") if r in cmd)
        if cmd and Path(cmd[0]).name == "nats-server":
            roles.add("nats-server")
    return roles == {"nats-server", "broker", "fitter", "learner", "generator"}


def alive(procs: set[psutil.Process]) -> set[psutil.Process]:
    """Those of ``procs`` still running (zombies aside)."""
    running = set()
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.add(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return running


def as_in_a_terminal() -> None:
    """In the command's process before it starts: SIGINT at its default, as a terminal's foreground job has it.

    A shell starts background jobs with SIGINT ignored, and a process keeps an ignored SIGINT ignored
    (Python then installs no KeyboardInterrupt handler): a suite run in the background would send its
    Ctrl-C to a command that cannot hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["up", "bench"])
def test_a_stop_mid_run_leaves_no_process(command: str, tmp_path: Path) -> None:
    argv = {
        "up": ["up", "--run-dir", str(tmp_path / "run"), "--config", str(small_run(tmp_path))],
        "bench": ["bench", "--output", str(tmp_path / "bench"), "--quick", "--only", "stack"],
    }[command]
    token = secrets.token_hex(8)
    with (tmp_path / "out.log").open("wb") as out:
        main = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            cwd=REPO,
            env=dict(os.environ, **{MARKER: token}),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=as_in_a_terminal,
        )
    try:
        if command == "up":
            wait_until(
                lambda: bool(engine_processes(token)) or main.poll() is not None, 300, "a generator's vLLM engine"
            )
        else:
            wait_until(lambda: services_running(token) or main.poll() is not None, 300, "every service of the stack")
        assert main.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
        engine = engine_processes(token)
        started = {p.pid for p in marked(token)} - {main.pid}
        # nats-server, broker, fitter, learner (torchrun and its rank, or one process) and generator; its engine
        assert len(started) >= 5 and (engine or command == "bench"), (started, engine)
        if command == "up":  # mid-run: past the first eval round, steps going on
            wait_until(
                lambda: trained_past(tmp_path / "run", STOP_AFTER) or main.poll() is not None, 300, f"step {STOP_AFTER}"
            )
        engine |= engine_processes(token)  # any started since
        if command == "up":  # Ctrl-C: the terminal signals the foreground process group
            os.killpg(main.pid, signal.SIGINT)
        else:
            main.send_signal(signal.SIGTERM)
        assert main.wait(timeout=120) == 130, (tmp_path / "out.log").read_text()[-3000:]
        wait_until(lambda: not marked(token) and not alive(engine), 60, "every process the command started to end")
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)
        for proc in marked(token) + list(alive(engine_processes(token))):
            proc.kill()
    if command == "up":
        said = (tmp_path / "out.log").read_text()
        assert f"resume with: asymptote up --resume {tmp_path / 'run'}" in said, said[-2000:]
        resume_and_check(tmp_path / "run", token)


EVAL_EVERY = 4
STOP_AFTER = 5
"""The step after which ``up`` is stopped: past its first eval round after version 0."""
STOPPED_RUN_STEPS = 1000
"""The stopped run's max_steps: far more than it can train before the stop lands (steps take half a
second on an idle machine, so a run of ten could end first)."""
RESUMED_STEPS = 5
"""Steps the resumed run trains past the stop (``up --resume --max-steps``)."""


def small_run(tmp_path: Path) -> Path:
    """The stop-and-resume run: the arithmetic workload, eval rounds of 32 prompts x 1 every EVAL_EVERY
    versions (the rounds are what the curve's continuity is checked on, not a pass rate)."""
    path = tmp_path / "up.yaml"
    path.write_text(
        f"workload: arithmetic\nmax_steps: {STOPPED_RUN_STEPS}\neval_every_versions: {EVAL_EVERY}\n"
        "eval_num_samples: 1\neval_num_prompts: 32\npin_cores: false\n"
    )
    return path


def resumed_max_steps(stopped_at: int) -> int:
    """RESUMED_STEPS past the stop, never a multiple of the eval interval: the final version is evaluated
    all the same."""
    target = stopped_at + RESUMED_STEPS
    return target + 1 if target % EVAL_EVERY == 0 else target


def trained_past(run_dir: Path, step: int) -> bool:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return bool(rows) and int(rows[-1]["step"]) >= step and bool(read_jsonl(run_dir / "eval.jsonl"))


def resume_and_check(run_dir: Path, token: str) -> None:
    """``up --resume`` the stopped run to its end; one continuous curve, every step once, nothing lost."""
    stopped_at = int(read_jsonl(run_dir / "metrics.jsonl")[-1]["step"])
    evals_before = len(read_jsonl(run_dir / "eval.jsonl"))
    stopped = json.loads((run_dir / "summary.json").read_text())  # the stopped run's, before the resume's
    stopped_ledger = json.loads((run_dir / "ledger.json").read_text())
    # The stop acked every batch its final checkpoint holds: the learner was stopped before the broker.
    trained = sum(int(r["batch/prompts"]) for r in read_jsonl(run_dir / "metrics.jsonl"))
    assert (stopped_ledger["trained"], stopped_ledger["lost"]) == (trained, 0), stopped_ledger
    max_steps = resumed_max_steps(stopped_at)
    with (run_dir.parent / "resume.log").open("wb") as out:
        resumed = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--resume", str(run_dir), "--max-steps", str(max_steps)],
            cwd=REPO,
            env=dict(os.environ, **{MARKER: token}),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
    assert resumed.returncode == 0, (run_dir.parent / "resume.log").read_text()[-3000:]
    # Both stops drained: every service ended by itself after SIGTERM (a learner retrying its last ack to a
    # broker stopped beside it used to hold on until it was killed, 40 s later).
    summary = json.loads((run_dir / "summary.json").read_text())
    assert stopped["killed_at_stop"] == [] and summary["killed_at_stop"] == [], (stopped, summary)
    assert summary["outcome"] == "completed", summary
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # The stop drained: its final checkpoint held every step, so none was trained twice.
    assert [int(r["step"]) for r in rows] == list(range(1, max_steps + 1)), stopped_at
    evals = read_jsonl(run_dir / "eval.jsonl")
    versions = [int(e["policy_version"]) for e in evals]
    # Each version's round once. A round the stop cut short ends after the resume, when its redelivered
    # prompts come back, so its row may follow later rounds' (rows are appended as rounds end).
    assert len(versions) == len(set(versions)) and len(evals) > evals_before >= 1
    assert min(versions) == 0 and max(versions) >= max_steps
    fit = json.loads((run_dir / "fit.json").read_text())
    assert fit["num_points"] == len(evals)  # one fit over the rounds of both parts
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert (ledger["lost"], ledger["trained_twice"]) == (0, 0), ledger
