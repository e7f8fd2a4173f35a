"""Two runs on one nats-server, apart by their prefixes; one of them trains a user's model directory.

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
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from exposition import gauge
from families import build

from asymptote.config import NatsSettings
from asymptote.jetstream.connect import connect
from asymptote.nats_local import new_password, start_nats
from services.local.config import StackConfig
from services.local.progress import read_jsonl
from services.local.stack import NATS_PASSWORD_ENV, NATS_USER_ENV, LocalStack

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 4
OWN_MODEL, BUILT = "runa", "runb"


async def stream_names(settings: NatsSettings) -> set[str]:
    nc = await connect(settings, "two-runs-test")
    try:
        return {info.config.name or "" for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


def config(tmp_path: Path, url: str, prefix: str, **fields: Any) -> StackConfig:
    return StackConfig(
        run_dir=tmp_path / prefix,
        cache_dir=REPO / ".cache" / "asymptote",
        startup_timeout_s=240,
        workload="arithmetic",
        nats_url=url,
        prefix=prefix,
        max_steps=MAX_STEPS,
        eval_every_versions=MAX_STEPS,
        eval_num_samples=1,
        checkpoint_every_steps=MAX_STEPS,
        **fields,
    )


@pytest.mark.e2e
def test_two_stacks_with_their_own_prefixes_share_one_nats_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user, password = "asymptote", new_password()
    server = start_nats(tmp_path / "nats", user=user, password=password)
    monkeypatch.setenv(NATS_USER_ENV, user)
    monkeypatch.setenv(NATS_PASSWORD_ENV, password)
    own = config(tmp_path, server.url, OWN_MODEL, model_dir=build("qwen3", tmp_path / "qwen3"), batch_prompts=4)
    built = config(tmp_path, server.url, BUILT, batch_prompts=4, zero_variance="keep")
    stacks = {c.prefix: LocalStack(c.model_copy(update={"group_size": 2})) for c in (own, built)}
    codes: dict[str, int] = {}
    try:
        for stack in stacks.values():  # one after the other: the second finds a warm-started model cached
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
    assert codes == {OWN_MODEL: 0, BUILT: 0}, [s.progress.outcome for s in stacks.values()]
    for prefix in stacks:
        assert {f"{prefix.upper()}_TASKS", f"{prefix.upper()}_ROLLOUTS"} <= streams
    assert not any(name.startswith("ASY_") for name in streams), streams
    for stack in stacks.values():
        ledger = json.loads((stack.run_dir / "ledger.json").read_text())
        assert (ledger["lost"], ledger["trained_twice"]) == (0, 0), ledger
        assert ledger["trained"] == MAX_STEPS * 4  # its own tasks only, not the other run's
        steps = read_jsonl(stack.run_dir / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
        assert [e["policy_version"] for e in read_jsonl(stack.run_dir / "eval.jsonl")] == [0, MAX_STEPS]
        # No batch carries tokens of a version its learner had not made yet (whether a later batch carries
        # versions after 0 depends on how far ahead the generator ran: not asserted).
        assert all(s["batch/max_token_version"] <= s["step"] - 1 for s in steps)
        # The generator loaded the versions its own learner made, up to the last.
        generator = (stack.run_dir / "metrics" / "generator-0.prom").read_text()
        assert gauge(generator, "asymptote_generator_policy_version") == MAX_STEPS
        assert gauge(generator, "asymptote_generator_swaps_total") >= 1
    assert json.loads((stacks[OWN_MODEL].run_dir / "stack.json").read_text())["model_dir"].endswith("qwen3")
