"""The generator loads weights from safetensors only, never from pickle.

Every file offered is a pickle whose loading would create a marker file
(as a malicious checkpoint would run code): the engine refuses a model
folder without safetensors before vLLM is imported and asks vLLM for the
safetensors format only; the worker refuses a staged version without
safetensors and ignores pickle files beside safetensors ones. The marker
never appears.
"""

from __future__ import annotations

import pickle
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asymptote.errors import WeightsError
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.worker_ext import StagedWeightsExtension

PICKLED_NAMES = ("pytorch_model.bin", "model.pt", "weights.pth", "model.ckpt")


class Payload:
    """Unpickling this creates ``marker``: the code a pickle-based checkpoint can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.marker), "w")


def pickled_folder(folder: Path, marker: Path, names: tuple[str, ...] = PICKLED_NAMES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(pickle.dumps(Payload(marker)))
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("name", PICKLED_NAMES)
async def test_engine_refuses_a_pickle_only_model_before_starting_vllm(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pickle-ran"
    model_dir = pickled_folder(tmp_path / "model", marker, (name,))
    # Were vLLM reached, this would be imported: it raises so the test would fail loudly.
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)
    with pytest.raises(WeightsError, match=rf"no \*\.safetensors in .*safetensors only; refusing {name}"):
        await Engine(EngineSettings(model_dir=model_dir)).start()
    assert not marker.exists()


async def test_engine_asks_vllm_for_safetensors_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pickle-ran"
    model_dir = pickled_folder(tmp_path / "model", marker)
    save_file({"w": torch.zeros(2)}, str(model_dir / "model.safetensors"))
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def engine_args(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise Stop

    fakes = {"vllm.engine.arg_utils": {"AsyncEngineArgs": engine_args}, "vllm.v1.engine.async_llm": {"AsyncLLM": None}}
    for name in ("vllm", "vllm.engine", "vllm.v1", "vllm.v1.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, attrs in fakes.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(Stop):
        await Engine(EngineSettings(model_dir=model_dir)).start()
    # vLLM's default "auto" would fall back to *.bin / *.pt files.
    assert seen["load_format"] == "safetensors" and seen["model"] == str(model_dir)
    assert not marker.exists()


def test_worker_refuses_a_pickle_only_version(tmp_path: Path) -> None:
    marker = tmp_path / "pickle-ran"
    version = pickled_folder(tmp_path / "v3", marker)
    with pytest.raises(WeightsError, match=r"safetensors only; refusing model\.ckpt, model\.pt, pytorch_model\.bin"):
        StagedWeightsExtension().stage_weights(str(version))
    assert not marker.exists()
    pickle.loads((version / "model.pt").read_bytes())  # what loading it would have done
    assert marker.exists()


def test_worker_loads_only_the_safetensors_beside_pickles(tmp_path: Path) -> None:
    marker = tmp_path / "pickle-ran"
    version = pickled_folder(tmp_path / "v4", marker)
    weights = {"model.embed_tokens.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(weights, str(version / "model.safetensors"))
    worker = StagedWeightsExtension()
    assert worker.stage_weights(str(version)) == (version / "model.safetensors").stat().st_size
    assert worker._staging is not None
    staged = worker._staging[1].result(timeout=30)
    assert worker.staged(str(version)) and staged.placement == "mapped"  # a worker with no model: the CPU
    assert staged.prepared is None  # nothing to pack into
    assert list(staged.tensors) == ["model.embed_tokens.weight"]
    torch.testing.assert_close(staged.tensors["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert not marker.exists()
    with pytest.raises(RuntimeError, match="are not being staged"):
        worker.staged(str(tmp_path / "v5"))
