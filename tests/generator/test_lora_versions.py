"""A LoRA run's versions on a generator: the adapter the settings put over the base, and nothing else.

The signature a generator checks versions against is the learner's served
adapter, tensor for tensor, for each tested architecture. Over a real gRPC
``Learner.PullWeights``, a version that is the base pushed without its
adapter (the failure where a generator silently serves the base), or an
adapter with tensors missing, is refused by name before it reaches the
engine, which holds no adapter and samples nothing until one comes; the
adapter then loads, counted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from asymptote.codec import DecodedWeights, WireTensor, read_signature
from asymptote.config import ListenSettings
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, WeightsError
from asymptote.health import Health
from asymptote.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, adapter_config, adapter_signature
from asymptote.rpc import start_server
from services.generator.config import EngineSettings
from services.generator.engine import Engine, SwapReport
from services.generator.metrics import GeneratorMetrics
from services.generator.swapper import Swapper
from services.generator.weights import GrpcWeightSource, check_adapter
from services.learner import adapter
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import empty_model
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.trainer import Trainer
from services.learner.weights import Version, WeightStore
from tests.helpers.families import build

LORA = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3", tmp_path_factory.mktemp("one"))


def lora_trainer(model_dir: Path, lora: LoraSettings = LORA) -> Trainer:
    trainer = Trainer(empty_model(model_dir), LossSettings(), OptimizerSettings(), lora=lora, packing=False)
    trainer.start(model_dir)
    return trainer


@pytest.mark.parametrize("lora", [LORA, LoraSettings(rank=2, target_modules=("q_proj", "down_proj"))])
def test_the_generators_signature_is_the_learners_served_adapter(model_dir: Path, lora: LoraSettings) -> None:
    trainer = lora_trainer(model_dir, lora)
    served = trainer.served_signature()
    assert served and adapter_signature(read_signature(model_dir), lora) == served


def test_the_adapter_config_is_the_one_peft_writes(model_dir: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(model_dir)
    signature = trainer.served_signature() or {}
    adapter.write_config(LORA, str(model_dir), dict.fromkeys(signature), tmp_path)
    written = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    ours = adapter_config(LORA, signature, str(model_dir))
    assert {k: written[k] for k in ours if k != "target_modules"} == {
        k: v for k, v in ours.items() if k != "target_modules"
    }
    assert sorted(written["target_modules"]) == ours["target_modules"]


def test_a_target_module_the_base_lacks_is_refused_in_one_line(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^lora.target_modules: the base has no decoder linear layer named qkv\b"):
        adapter_signature(read_signature(model_dir), LoraSettings(rank=2, target_modules=("qkv",)))


class Recorder:
    """A swap target that records the folders it is given, as a LoRA engine would load them."""

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[int, list[str]]] = []

    async def swap(self, weights_path: Path, version: int, mode: str) -> SwapReport:
        self.loaded.append((version, sorted(p.name for p in weights_path.iterdir())))
        self.version = version
        return SwapReport(version, 0.0, 0, placement="adapter")


@pytest.fixture
async def learner(model_dir: Path) -> AsyncIterator[tuple[WeightStore, str]]:
    store = WeightStore(read_signature(model_dir), keep=16)  # any version: each test publishes its own
    health = Health("learner")
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: add_learner_to_server(LearnerServicer(store, health, "test", dict), s),
        ["asymptote.contracts.v1.Learner"],
    )
    try:
        yield store, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


def publish(store: WeightStore, version: int, tensors: dict[str, torch.Tensor]) -> Version:
    """``tensors`` (float32) as the learner's ``version``, whatever they are: the store serves what it is given."""
    assert all(t.dtype == torch.float32 for t in tensors.values())
    store.signature = {n: ("float32", tuple(t.shape)) for n, t in tensors.items()}
    store.names = sorted(tensors)
    return store.snapshot_tensors(version, ((n, tensors[n]) for n in store.names))


def announce(v: Version, endpoint: str) -> rollout_pb2.PolicyVersion:
    return rollout_pb2.PolicyVersion(version=v.version, weights_endpoint=endpoint, digest=v.digest)


async def test_the_base_pushed_without_its_adapter_is_refused_and_never_served(
    model_dir: Path, learner: tuple[WeightStore, str], tmp_path: Path
) -> None:
    store, endpoint = learner
    metrics = GeneratorMetrics()
    engine = Recorder()
    swapper = Swapper(engine, GrpcWeightSource(), model_dir, tmp_path / "staged", "inflight", metrics, lora=LORA)
    trainer = lora_trainer(model_dir)
    names = sorted(trainer.served_signature() or {})
    full = dict(trainer.served_tensors(names))
    base = {n: t for path in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(str(path)).items()}
    partial = {n: t for n, t in full.items() if ".mlp." not in n}
    for version, tensors, says in (
        (0, base, "no LoRA adapter in it"),
        (1, partial, "of the LoRA adapter's"),
    ):
        assert await swapper.update(announce(publish(store, version, tensors), endpoint)) is False
        assert says in swapper.refused[version]
        assert "\n" not in swapper.refused[version]
    assert engine.loaded == [] and metrics.adapter_versions._value.get() == 0
    assert metrics.swaps_refused.labels("invalid")._value.get() == 2
    assert swapper.awaiting_adapter  # still no adapter: the engine samples nothing meanwhile

    assert await swapper.update(announce(publish(store, 2, full), endpoint)) is True
    assert engine.loaded == [(2, [ADAPTER_CONFIG, ADAPTER_WEIGHTS])]
    assert metrics.adapter_versions._value.get() == 1 and not swapper.awaiting_adapter
    assert list(swapper.staging.root.iterdir()) == []  # the loaded adapter's folder is gone, no spare kept


def test_a_version_announced_first_is_taken_whatever_its_number(qwen3_dir: Path, tmp_path: Path) -> None:
    """The engine starts at version 0 with no adapter: the learner's version 0 is still pulled."""
    taken: list[int] = []

    class Taking(Swapper):
        async def update(self, policy: rollout_pb2.PolicyVersion) -> bool:
            taken.append(int(policy.version))
            self.awaiting_adapter = False
            self.engine.version = int(policy.version)
            return True

    s = Taking(
        Recorder(), GrpcWeightSource(), qwen3_dir, tmp_path / "staged", "inflight", GeneratorMetrics(), lora=LORA
    )

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.create_task(s.swap_loop(stop))
        s.latest = rollout_pb2.PolicyVersion(version=0)
        s._announced.set()
        for _ in range(100):
            if taken:
                break
            await asyncio.sleep(0.01)
        s._announced.set()  # version 0 again: now held, not taken twice
        await asyncio.sleep(0.05)
        stop.set()
        await loop

    asyncio.run(go())
    assert taken == [0]


def test_check_adapter_names_the_tensor_whose_shape_is_not_the_bases(qwen3_dir: Path) -> None:
    signature = adapter_signature(read_signature(qwen3_dir), LORA)
    name = min(n for n in signature if ".lora_A." in n)
    tensors: dict[str, WireTensor] = {}
    for n, (_, shape) in signature.items():
        rows = shape[0] * 2 if n == name else shape[0]
        tensors[n] = WireTensor.from_numpy(torch.zeros((rows, *shape[1:])).numpy())
    with pytest.raises(WeightsError, match=rf"tensor '{name}' is float32\[8, "):
        check_adapter(DecodedWeights(3, "", tensors), signature)


class NoEngine:
    """Where vLLM would be: fails the test if anything is generated."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("sampled from the base alone")


async def test_a_lora_engine_samples_nothing_before_its_first_adapter(qwen3_dir: Path) -> None:
    engine = Engine(EngineSettings(model_dir=qwen3_dir), LORA)
    engine._llm = NoEngine()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.sample("12+34=", 1, 1.0, 1.0, 4), 0.2)
    assert engine.num_running == 0
