"""``asymptote up`` runs the sandbox pool as a process for a code task only, and points the generators at it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asymptote.config import load_config
from asymptote.sandbox import SandboxSettings
from asymptote.tasks import ArithmeticSettings, DatasetSettings
from asymptote.tasks.verifiers import CodeSettings
from services.generator.config import GeneratorConfig
from services.local.config import StackConfig
from services.local.stack import LocalStack
from services.sandbox_pool.config import SandboxPoolConfig
from tests.helpers.waiting import wait_until

ROW = {
    "id": "1",
    "prompt": "Print 2.",
    "answer": json.dumps({"kind": "stdio", "cases": [{"input": "", "output": "2"}]}),
}


def code_task(tmp_path: Path) -> DatasetSettings:
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    return DatasetSettings(
        path=data,
        holdout_fraction=0.5,
        verifier=CodeSettings(sandbox=SandboxSettings(backend="bubblewrap", unsafe_no_sandbox=True)),
    )


def model_dir(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    return out


@pytest.mark.parametrize("task", ["words", "arithmetic"])
def test_no_pool_for_a_task_without_programs(tmp_path: Path, task: str) -> None:
    config = (
        StackConfig(run_dir=tmp_path / "run")
        if task == "words"
        else StackConfig(run_dir=tmp_path / "run", task=ArithmeticSettings())
    )
    stack = LocalStack(config)
    paths = stack.write_configs(model_dir(tmp_path))
    assert stack.sandbox_pool_path is None
    assert not (tmp_path / "run" / "config" / "sandbox-pool.yaml").exists()
    assert "sandbox-pool" not in stack.ports
    assert load_config(GeneratorConfig, paths["generator-0"], "ASY_NONE", environ={}).sandbox_pool is None
    stack.start_sandbox_pool()
    assert [p.name for p in stack.procs] == []


def test_a_code_task_gets_a_pool_and_the_generators_use_it(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run", task=code_task(tmp_path), num_generators=2))
    paths = stack.write_configs(model_dir(tmp_path))
    assert stack.sandbox_pool_path is not None
    pool = load_config(SandboxPoolConfig, stack.sandbox_pool_path, "ASY_NONE", environ={})
    assert (pool.grpc.host, pool.grpc.port) == ("127.0.0.1", stack.ports["sandbox-pool"][0])
    assert (pool.sandbox.backend, pool.sandbox.unsafe_no_sandbox, pool.sandbox.pool) == ("bubblewrap", True, None)
    for i in range(2):
        generator = load_config(GeneratorConfig, paths[f"generator-{i}"], "ASY_NONE", environ={})
        assert generator.sandbox_pool is not None
        assert generator.sandbox_pool.endpoint == f"127.0.0.1:{pool.grpc.port}"
        assert generator.task == stack.config.task  # the task (and its digest) as the broker has it


def test_the_stack_runs_the_pool_as_a_supervised_process(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run", task=code_task(tmp_path)))
    stack.run_dir.mkdir(parents=True)
    stack.write_configs(model_dir(tmp_path))
    try:
        stack.start_sandbox_pool()
        (proc,) = stack.procs
        assert proc.name == "sandbox-pool"

        def ready() -> bool:
            stack.poll_ready()
            assert proc.popen.poll() is None, proc.tail()
            return proc.ready

        wait_until(ready, 60.0, "the stack's sandbox pool to be ready")
    finally:
        stack.stop()
    assert proc.popen.returncode == 0
