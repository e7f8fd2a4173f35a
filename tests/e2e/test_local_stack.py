"""The embedded default end to end: nats-server, broker, learner, fitter and
a vLLM generator as separate processes on loopback, trained for a few steps,
with hundreds of malformed and invalid messages published on every subject
mid-run (tests/helpers/poison.py).

Asserts what the run directory and the services' endpoints say, never
log text: the learner consumed generator-produced groups, the policy version
advanced, generators loaded the new weights (the versions on the tokens of
the groups they published), eval points and a fit were written, every bad
message landed in the dead-letter stream with a reason and no service
restarted, the good traffic was all trained (the ledger balances), every
listening socket is on loopback, the NATS password is in no file of the run
and on no command line, and when a dependency dies the survivors report it
on /readyz. Nothing is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from asymptote.jetstream.names import Names
from services.local.progress import read_jsonl
from services.local.stack import LocalStack
from tests.helpers.badinput import BAD_INPUTS
from tests.helpers.fitcheck import check_fit
from tests.helpers.poison import INTERFACE, deadletters, inject
from tests.helpers.waiting import wait_until

MAX_STEPS = 10
EVAL_PROMPTS = 64


def readyz(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies awaiting a reaper do not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def stack_processes(stack: LocalStack) -> list[psutil.Process]:
    """Every live process the stack started: each service runs in its own process
    group (vLLM's engine processes and torchrun's ranks included)."""
    groups = {p.popen.pid for p in stack.procs}
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) in groups:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return found


def listening_sockets(stack: LocalStack) -> list[tuple[str, str, int]]:
    """(process, address, port) of every TCP listener and bound UDP socket of every process the stack started."""
    found = []
    for proc in stack_processes(stack):
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and conn.laddr):
                    found.append((" ".join(proc.cmdline()[:4]), conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return found


@pytest.mark.e2e
@pytest.mark.faults
def test_local_stack_trains_and_reports_failures(launch: Callable[..., Any]) -> None:
    # The learner runs as two data-parallel ranks under torchrun (gloo): rank 0
    # is the service, rank 1 follows its steps (parity: tests/learner/test_distributed.py).
    names = Names()
    sent: Counter[str] = Counter()
    with launch(
        max_steps=MAX_STEPS,
        eval_every_versions=5,
        eval_num_prompts=EVAL_PROMPTS,  # rounds of 64 of the 200 held-out
        checkpoint_every_steps=5,
        learner_ranks=2,
    ) as (stack, progress):
        config = stack.config

        def injector() -> None:  # the bad traffic, from the learner's first step on, mixed with the run's
            wait_until(
                lambda: read_jsonl(stack.run_dir / "metrics.jsonl"),
                config.startup_timeout_s + 600,
                "the learner's first step",
                interval_s=0.2,
            )
            sent.update(asyncio.run(inject(stack.nats_settings(), names)))

        thread = threading.Thread(target=injector, daemon=True)
        thread.start()
        outcome = stack.follow()
        thread.join(60)
        restarts = stack.run_dir / "restarts.jsonl"
        for restart in read_jsonl(restarts):
            BAD_INPUTS.record_crash(INTERFACE, json.dumps(restart, sort_keys=True))
        assert outcome == 0, progress.outcome
        assert not thread.is_alive(), "the injector did not finish"
        assert sum(sent.values()) >= 200
        # The run may end while the last bad messages are still being judged: wait for every one to land.
        got: Counter[str] = Counter()

        def all_deadlettered() -> bool:
            got.clear()
            got.update(asyncio.run(deadletters(stack.nats_settings(), names)))
            return got == sent

        try:
            wait_until(all_deadlettered, 60.0, "every bad message to be dead-lettered", interval_s=0.5)
        finally:
            print("sent:", dict(sent), "dead-lettered:", dict(got))
        assert got == sent
        assert not restarts.exists(), "a service crashed on bad input"
        ledger = stack.audit_ledger()
        assert ledger is not None and ledger["ok"], ledger

        steps = read_jsonl(stack.run_dir / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
        assert ledger["trained"] == sum(int(s["batch/prompts"]) for s in steps)
        assert all(s["batch/prompts"] == config.batch_prompts for s in steps)
        assert all(s["batch/samples"] == config.batch_prompts * config.group_size for s in steps)
        assert all(s["dist/ranks"] == 2 for s in steps)
        # The generator loaded new weights: later batches hold tokens sampled
        # by versions > 0, and never by a version the learner had not made.
        assert max(s["batch/max_token_version"] for s in steps) >= 1
        assert all(s["batch/max_token_version"] <= s["step"] - 1 for s in steps)
        # Versions in a batch lag the learner by at most k.
        assert all(s["staleness/max"] <= config.max_staleness_versions for s in steps)
        # The first step trains on version-0 data against the same weights: IS ratio 1.
        assert steps[0]["is/rho_max"] == pytest.approx(1.0, abs=1e-3)

        evals = read_jsonl(stack.run_dir / "eval.jsonl")
        assert [e["policy_version"] for e in evals] == [0, 5, 10]
        assert all(e["num_prompts"] == EVAL_PROMPTS for e in evals)
        # Rounds are issued at versions 0, 5 and 10, but sampled by whichever versions the generators
        # hold when they reach them (a round can wait behind k batches of train tasks): the compute
        # axis follows the sampling versions, so two rounds sampled by one version share its compute.
        assert evals[0]["compute"] < evals[1]["compute"] <= evals[2]["compute"]
        assert [e["sampled_version"] for e in evals] == sorted(e["sampled_version"] for e in evals)
        # Each round sits at the compute of the versions that sampled its tokens, token-weighted,
        # and never before the version it was issued for.
        for e in evals:
            tokens = {int(v): n for v, n in e["tokens_by_version"].items()}
            computes = {int(v): c for v, c in e["compute_by_version"].items()}
            assert tokens and set(tokens) == set(computes), e
            assert (
                e["policy_version"] <= min(tokens)
                and e["min_version"] <= min(tokens) <= max(tokens) <= e["max_version"]
            )
            weighted = sum(n * computes[v] for v, n in tokens.items()) / sum(tokens.values())
            assert e["compute"] == pytest.approx(weighted)
            assert e["sampled_version"] == pytest.approx(sum(v * n for v, n in tokens.items()) / sum(tokens.values()))
            assert [computes[v] for v in sorted(computes)] == sorted(computes.values())
        fit = json.loads((stack.run_dir / "fit.json").read_text())
        assert fit["num_points"] == 3
        # Fitted or refused, fit.json must be the fitter's verdict on these rows (tests/helpers/fitcheck.py).
        check_fit(fit, evals)
        assert sorted(p.name for p in (stack.run_dir / "checkpoints").glob("ckpt-*")) == [
            "ckpt-00000005",
            "ckpt-00000010",
        ]

        # Local mode: every listener of every process (nats-server, services, vLLM, torchrun) is on loopback.
        listeners = listening_sockets(stack)
        assert len({port for _, _, port in listeners}) >= 9  # nats + gRPC and HTTP of the four services
        assert not [s for s in listeners if s[1] not in LOOPBACK], listeners
        # Command lines are readable by every local user: no process has the password on its own.
        cmdlines = [" ".join(p.cmdline()) for p in stack_processes(stack)]
        # nats-server, broker, fitter, learner (torchrun; its ranks have sessions of their own), generator
        # and its vLLM engine core (forked, the model in it) at least.
        assert len(cmdlines) >= 6 and not [c for c in cmdlines if stack.nats_password in c]
        stack.save_final_metrics()  # metrics/<service>.prom, searched for the password below

        # A dependency dies: every service says so on /readyz.
        nats_proc = next(p for p in stack.procs if p.name == "nats-server")
        os.killpg(nats_proc.popen.pid, signal.SIGKILL)
        services = [p for p in stack.procs if p.http_port is not None]
        reported: dict[str, str] = {}

        def all_report_nats() -> bool:
            for p in services:
                status, body = readyz(p.http_port)  # type: ignore[arg-type]
                if status == 503 and "nats" in str(body.get("detail")):
                    reported[p.name] = str(body["detail"])
            return len(reported) == len(services)

        wait_until(all_report_nats, 30, "every service to report nats down on /readyz", interval_s=0.5)
        assert sorted(reported) == sorted(p.name for p in services), reported
        assert stack.dead() == [nats_proc]
    assert all(p.popen.poll() is not None for p in stack.procs)
    assert not [p.name for p in stack.procs if group_alive(p.popen.pid)], "processes left behind"
    # NATS required this run's credentials; no file of the run holds them: logs
    # (shutdown included), configs, metrics, checkpoints, the JetStream store.
    assert stack.nats_password and list((stack.run_dir / "metrics").glob("*.prom"))
    written = [f for f in stack.run_dir.rglob("*") if f.is_file()]
    assert not [str(f) for f in written if stack.nats_password.encode() in f.read_bytes()]
