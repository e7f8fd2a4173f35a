"""A NATS server that cannot carry the run is refused at start, in one line
naming the setting to change: a max_payload below the run's largest rollout
group, JetStream off, more stream replicas than servers. Real nats-servers
configured each way; the broker run as the pods run it (``asymptote broker``)
where the line it prints is the point.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from asymptote.config import ListenSettings, NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.errors import ConfigError
from asymptote.jetstream.names import ROLLOUT_MAX_BYTES
from asymptote.jetstream.preflight import MIB, MessageSize, check_max_payload
from asymptote.messages import GROUP_BYTES_PER_TOKEN, max_group_bytes
from asymptote.nats_local import NatsServer, free_port, nats_server_binary, start_nats
from asymptote.runtime import service_runtime
from asymptote.tasks import get_task
from services.broker.config import BrokerConfig
from services.broker.main import serve
from services.broker.metrics import BrokerMetrics

REPO = Path(__file__).resolve().parents[2]
ONE_MIB = 1024 * 1024


@pytest.fixture(scope="module")
def small_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """nats-server with JetStream and NATS's default max_payload, 1 MiB, set explicitly."""
    server = start_nats(Path(tmp_path_factory.mktemp("nats-1mib")), max_payload_bytes=ONE_MIB)
    try:
        yield server
    finally:
        server.stop()


def broker_config(url: str, group_size: int, max_tokens: int, **extra: object) -> BrokerConfig:
    return BrokerConfig.model_validate(
        {
            "nats": {"url": url},
            "prefix": "preflight",
            "grpc": {"port": free_port()},
            "http": {"port": free_port()},
            "task": {"name": "arithmetic", "num_train": 40, "num_heldout": 3, "max_digits": 2},
            "sampling": {"group_size": group_size, "max_tokens": max_tokens},
            "log_format": "text",
            **extra,
        }
    )


def run_broker(config: BrokerConfig, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``asymptote broker --config FILE``, as a pod runs it."""
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    run_cli = "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", run_cli, "broker", "--config", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_group_larger_than_max_payload_is_refused_at_start_in_one_line(
    small_nats: NatsServer, tmp_path: Path
) -> None:
    """16 completions of up to 8192 tokens: 2.06 MiB a group at most, over the server's 1 MiB."""
    config = broker_config(small_nats.url, group_size=16, max_tokens=8192)
    proc = run_broker(config, tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, errors
    (line,) = errors
    task = get_task("arithmetic", config.task)
    longest = max(len(p.prompt.encode()) for split in ("train", "heldout") for p in task.problems(split))
    need = max_group_bytes(16, 8192, longest)
    print(line)
    assert "max_payload 1.00 MiB" in line and f"{need / MIB:.2f} MiB" in line, line
    assert "a rollout group of 16 x 8192 tokens" in line
    assert "sampling.group_size or sampling.max_tokens" in line and "raise max_payload" in line
    assert 2.0 * MIB < need < 2.2 * MIB  # 16 x 8192 tokens x 16 bytes, plus the prompt and framing


async def test_a_group_within_max_payload_starts(small_nats: NatsServer) -> None:
    """The same server takes a broker whose largest group fits (16 x 2048 tokens: 0.56 MiB)."""
    config = broker_config(small_nats.url, group_size=16, max_tokens=2048)
    stop = asyncio.Event()
    broker = asyncio.create_task(serve(config, stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc.port}") as channel:
            status = await services_pb2_grpc.BrokerStub(channel).Status(
                services_pb2.StatusRequest(), wait_for_ready=True, timeout=30
            )
        assert status.service == "broker"
    finally:
        stop.set()
        await asyncio.wait_for(broker, 30)


def test_over_the_rollouts_stream_limit_names_the_sampling_settings() -> None:
    need = MessageSize(max_group_bytes(64, 16384, 100), "a rollout group of 64 x 16384 tokens", "sampling.max_tokens")
    with pytest.raises(ConfigError, match=r"over the rollouts stream's 8.00 MiB message limit: lower sampling"):
        check_max_payload(64 * ONE_MIB, need, "nats://x:4222")
    fits = MessageSize(ROLLOUT_MAX_BYTES, "a group", "s")
    check_max_payload(ROLLOUT_MAX_BYTES, fits, "nats://x:4222")  # equal is enough


def test_the_estimate_bounds_a_worst_case_group_and_is_not_loose() -> None:
    """A group at the estimate's limits (ids near 2**21, 8 text bytes a token, a loss mask, version
    spans, a long prompt) serializes within max_group_bytes, and to more than 90% of it."""
    rng = random.Random(3)
    group_size, max_tokens, prompt = 4, 3000, "How many apples? " * 40
    completions = [
        rollout_pb2.Completion(
            token_ids=[rng.randrange(2**20, 2**21) for _ in range(max_tokens)],
            logprobs=[-rng.random() for _ in range(max_tokens)],
            version_spans=[rollout_pb2.VersionSpan(version=v, start=v * 300, end=(v + 1) * 300) for v in range(10)],
            reward=1.0,
            truncated=True,
            finish_reason="length",
            text="abcdefgh" * max_tokens,
            loss_mask=[1] * max_tokens,
        )
        for _ in range(group_size)
    ]
    task = rollout_pb2.GenerationTask(
        task_id="train-e0-p0-x", prompt=prompt, reference="42", task_digest="0" * 16, task_name="dataset"
    )
    group = rollout_pb2.RolloutGroup(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=[rng.randrange(2**20, 2**21) for _ in range(len(prompt))],
        completions=completions,
        generator_id="generator-x",
    )
    size = len(group.SerializeToString())
    bound = max_group_bytes(group_size, max_tokens, len(prompt.encode()))
    print(f"worst-case group: {size} bytes, estimate {bound} ({size / bound:.1%}), {GROUP_BYTES_PER_TOKEN} B/token")
    assert size <= bound
    assert size > 0.9 * (bound - 64 * 1024)  # the fixed allowance aside, the per-token figure is tight


async def test_jetstream_off_is_refused_naming_it(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        settings = NatsSettings(url=f"nats://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match=r"has JetStream off: start nats-server with -js") as refused:
            async with service_runtime(
                "broker", settings, "preflight", ListenSettings(port=0), BrokerMetrics().registry, nats_wait_s=20
            ):
                pytest.fail("the service started without JetStream")
        assert "\n" not in str(refused.value)
    finally:
        proc.terminate()
        proc.wait(10)


async def test_more_replicas_than_servers_is_refused_naming_stream_replicas(nats: NatsServer) -> None:
    settings = NatsSettings(url=nats.url, stream_replicas=3)
    with pytest.raises(ConfigError) as refused:
        async with service_runtime("learner", settings, "replicas", ListenSettings(port=0), BrokerMetrics().registry):
            pytest.fail("the service started with streams it cannot replicate")
    message = str(refused.value)
    print(message)
    assert message.startswith("nats.stream_replicas is 3 but NATS at") and "a single server" in message
    assert "set nats.stream_replicas (the chart's nats.streamReplicas)" in message and "\n" not in message
