"""Two runs on one nats-server, apart by their prefixes: a user's model directory, and math and code
in one run.

One nats-server (JetStream, a user and a password) is started here; two
local stacks name it (``nats_url``, the credentials from ASY_NATS_USER and
ASY_NATS_PASSWORD) under the prefixes ``runa`` and ``runb`` and run at the
same time, as two releases share a cluster's NATS. Each completes its steps
and final eval, each ledger counts its own tasks with 0 lost and 0 trained
twice, and the server holds each run's streams under its own prefix and
none under the default ``asy``.

``runa`` is ``asymptote up --model DIR``: a random-initialised Qwen3 model
directory (q/k norms; the arithmetic task's character tokenizer) runs
through the whole stack: the learner loads it through the Auto classes,
the generator's vLLM engine serves it, and each new version reaches the
generator. A random model earns no reward on the arithmetic task, so every
group is flat; under the default batch semantics (``zero_variance: drop``)
the broker still hands them out, so the learner steps and announces
versions. What is asserted is the plumbing: versions advance, the generator
loads them (its gauge, and the versions on the tokens of the groups it
published), and the final eval round is sampled by the final version.
Llama is the built tiny model's family, which ``runb`` and every other
end-to-end run trains through the same model-directory path; the stack's
path is the same for every family past loading, where they differ: vLLM and
the learner agree on Llama, Qwen2 and Qwen3 before and after a swap
(tests/generator/test_architectures.py).

``runb`` is the words+code workload: a mixture of the word problems
answered in a box (math-verify, under interruption length control) and the
same problems answered by a Python program run in the sandbox (the code
verifier), half and half. A few steps cannot be relied on to learn, so what
is asserted is the path: the learner trains every step, new versions reach
the generator, thinking budgets interrupt word-problem completions from the
first steps on and the summary reports the interruption and truncation
rates the steps' metrics add up to, each eval round is one per sub-task
with rows tagged by it, the fitter keeps a curve and a fit of each, the
summary names each one's held-out pass rate, and the ledger accounts for
every task.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from asymptote.config import NatsSettings
from asymptote.jetstream.connect import connect
from asymptote.nats_local import new_password, start_nats
from asymptote.tasks import LengthControlSettings, MixtureEntry, MixtureSettings
from services.local.config import StackConfig
from services.local.progress import length_rates, read_jsonl
from services.local.stack import NATS_PASSWORD_ENV, NATS_USER_ENV, LocalStack
from services.local.workloads import workload_task
from tests.helpers.exposition import gauge
from tests.helpers.families import build

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 4
OWN_MODEL, MIXED = "runa", "runb"
BATCH_PROMPTS = {OWN_MODEL: 4, MIXED: 8}
GROUP_SIZE = {OWN_MODEL: 2, MIXED: 4}
SHORT_BUDGETS = LengthControlSettings(thinking_budget_tokens=(8, 40), answer_budget_tokens=16)
"""Budgets of 8-40 tokens against thinking of 16-23: the first steps interrupt for certain (the default's
16-64 interrupts about one word-problem group in eight)."""


def mixture() -> MixtureSettings:
    words = workload_task("words").model_copy(update={"length_control": SHORT_BUDGETS})
    return MixtureSettings(
        tasks=(
            MixtureEntry(name="words", weight=1.0, task=words),
            MixtureEntry(name="code", weight=1.0, task=workload_task("words-code")),
        )
    )


async def stream_names(settings: NatsSettings) -> set[str]:
    nc = await connect(settings, "two-runs-test")
    try:
        return {info.config.name or "" for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


def config(tmp_path: Path, url: str, prefix: str, **fields: Any) -> StackConfig:
    return StackConfig(
        **{
            "run_dir": tmp_path / prefix,
            "cache_dir": REPO / ".cache" / "asymptote",
            "startup_timeout_s": 240,
            "workload": "arithmetic",
            "pin_cores": False,  # two stacks side by side: the kernel places their processes
            "nats_url": url,
            "prefix": prefix,
            "max_steps": MAX_STEPS,
            "eval_every_versions": MAX_STEPS,
            "eval_num_samples": 1,
            "checkpoint_every_steps": MAX_STEPS,
            **fields,
        }
    )


@pytest.mark.e2e
# A fresh clone builds the mixture's warm start first (its own BPE tokenizer and both formats).
@pytest.mark.timeout(1200)
def test_two_stacks_with_their_own_prefixes_share_one_nats_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user, password = "asymptote", new_password()
    server = start_nats(tmp_path / "nats", user=user, password=password)
    monkeypatch.setenv(NATS_USER_ENV, user)
    monkeypatch.setenv(NATS_PASSWORD_ENV, password)
    own = config(tmp_path, server.url, OWN_MODEL, model_dir=build("qwen3", tmp_path / "qwen3"))
    mixed = config(
        tmp_path,
        server.url,
        MIXED,
        workload="words+code",
        task=mixture(),
        zero_variance="keep",  # every group trains: the steps do not wait on lucky groups
        # A shorter warm start than the default's, probed once on a few problems: this run checks the
        # path, not the skill (the warm start's own probes and held-out pass rate are tested apart).
        warmstart={"max_steps": 60, "check_every_steps": 60, "num_probe_problems": 16, "eval_samples_per_prompt": 1},
    )
    stacks = {
        c.prefix: LocalStack(
            c.model_copy(update={"batch_prompts": BATCH_PROMPTS[c.prefix], "group_size": GROUP_SIZE[c.prefix]})
        )
        for c in (own, mixed)
    }
    codes: dict[str, int] = {}
    try:
        for stack in stacks.values():
            stack.__enter__()
            stack.start()
        assert not any(p.name == "nats-server" for s in stacks.values() for p in s.procs)  # neither started one
        threads = [
            threading.Thread(target=lambda s=stack: codes.__setitem__(s.config.prefix, s.follow()))
            for stack in stacks.values()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        for stack in stacks.values():
            stack.save_final_metrics()
        streams = asyncio.run(stream_names(stacks[OWN_MODEL].nats_settings()))
    finally:
        for stack in stacks.values():
            stack.__exit__(None, None, None)
        server.stop()
    assert codes == {OWN_MODEL: 0, MIXED: 0}, [s.progress.outcome for s in stacks.values()]
    for prefix in stacks:
        assert {f"{prefix.upper()}_TASKS", f"{prefix.upper()}_ROLLOUTS"} <= streams
    assert not any(name.startswith("ASY_") for name in streams), streams
    for prefix, stack in stacks.items():
        ledger = json.loads((stack.run_dir / "ledger.json").read_text())
        assert (ledger["lost"], ledger["trained_twice"]) == (0, 0), ledger
        assert ledger["trained"] == MAX_STEPS * BATCH_PROMPTS[prefix]  # its own tasks only, not the other run's
        steps = read_jsonl(stack.run_dir / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
        evals = read_jsonl(stack.run_dir / "eval.jsonl")
        rounds = 1 if prefix == OWN_MODEL else 2  # a round per sub-task of the mixture
        assert sorted(e["policy_version"] for e in evals) == sorted([0, MAX_STEPS] * rounds)
        # No batch carries tokens of a version its learner had not made yet (whether a later batch carries
        # versions after 0 depends on how far ahead the generator ran: not asserted).
        assert all(s["batch/max_token_version"] <= s["step"] - 1 for s in steps)
        # The generator loaded the versions its own learner made, up to the last.
        generator = (stack.run_dir / "metrics" / "generator-0.prom").read_text()
        assert gauge(generator, "asymptote_generator_policy_version") == MAX_STEPS
        assert gauge(generator, "asymptote_generator_swaps_total") >= 1
    assert json.loads((stacks[OWN_MODEL].run_dir / "stack.json").read_text())["model_dir"].endswith("qwen3")
    check_mixed_run(stacks[MIXED].run_dir)


def check_mixed_run(run_dir: Path) -> None:
    """The words+code run: interruptions counted, a round, curve and fit per sub-task, every task accounted."""
    model_dir = Path(yaml.safe_load((run_dir / "config" / "generator-0.yaml").read_text())["engine"]["model_dir"])
    meta = json.loads((model_dir / "warmstart.json").read_text())
    assert meta["task"]["name"] == "mixture" and meta["num_steps"] >= 1
    batch, group = BATCH_PROMPTS[MIXED], GROUP_SIZE[MIXED]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert max(s["batch/max_token_version"] for s in steps) >= 1
    assert sum(s["rollout/interrupted"] for s in steps[:3]) > 0
    # Every trained completion was counted among those generated (the rates' denominator).
    assert sum(s["batch/samples"] for s in steps) == MAX_STEPS * batch * group
    assert sum(s["rollout/completions"] for s in steps) >= MAX_STEPS * batch * group
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["length"] == length_rates(steps)
    assert 0.0 < summary["length"]["interruption_rate"] < 1.0
    assert summary["length"]["truncation_rate"] is not None and 0.0 <= summary["length"]["truncation_rate"] < 1.0

    evals = read_jsonl(run_dir / "eval.jsonl")
    versions = [0, MAX_STEPS]
    assert Counter(e["task"] for e in evals) == {"words": len(versions), "code": len(versions)}
    for name in ("words", "code"):
        assert sorted(e["policy_version"] for e in evals if e["task"] == name) == versions
    fit = json.loads((run_dir / "fit.json").read_text())
    assert set(fit["tasks"]) == {"words", "code"}
    assert all(fit["tasks"][t]["num_points"] == len(versions) for t in ("words", "code"))
    assert set(summary["heldout_by_task"]) == {"words", "code"} and set(summary["fit"]["tasks"]) == {"words", "code"}
    for name in ("words", "code"):
        rows = [e for e in evals if e["task"] == name]
        assert summary["heldout_by_task"][name]["heldout_pass_rate_final"] == rows[-1]["pass_rate"]
    ledger = summary["ledger"]
    assert (ledger["lost"], ledger["trained_twice"]) == (0, 0)
    assert ledger["trained"] == MAX_STEPS * batch
