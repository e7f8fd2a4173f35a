"""`asymptote up` on a machine with GPUs: which GPUs each process sees, and what each service is told.

No GPU here: the machine's GPUs are given as a list (what ``nvidia-smi``
would report), and the test reads the placement, each process's
``CUDA_VISIBLE_DEVICES``, the torchrun world and the configs the stack
writes. Starting vLLM's GPU build and the learner on CUDA is untested here
(README, "Untested here").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asymptote.errors import ConfigError
from services.local.config import StackConfig
from services.local.placement import Gpu, narrow, parse_smi, place
from services.local.stack import LocalStack
from tests.helpers.families import QWEN3_8B, config_only

GIB = 1024**3


def gpus(n: int, gib: int = 80) -> list[Gpu]:
    return [Gpu(str(i), gib * GIB) for i in range(n)]


def ids(group: tuple[Gpu, ...]) -> list[str]:
    return [g.id for g in group]


def test_nvidia_smi_s_list_is_narrowed_as_cuda_narrows_it() -> None:
    out = (
        "0, GPU-aaa, 81559, NVIDIA H100 80GB HBM3\n1, GPU-bbb, 81559, NVIDIA H100 80GB HBM3\n"
        "2, GPU-ccc, 40960, NVIDIA A100-PCIE-40GB\n"
    )
    rows = parse_smi(out)
    assert rows[2] == ("2", "GPU-ccc", 40960 * 1024 * 1024, "NVIDIA A100-PCIE-40GB")
    assert [g.id for g in narrow(rows, None)] == ["0", "1", "2"]
    assert [g.id for g in narrow(rows, "2,0")] == ["2", "0"]  # in the variable's order
    assert [g.name for g in narrow(rows, "2,0")] == ["NVIDIA A100-PCIE-40GB", "NVIDIA H100 80GB HBM3"]
    assert [g.id for g in narrow(rows, "GPU-bbb")] == ["GPU-bbb"]
    assert [g.id for g in narrow(rows, "1,7,2")] == ["1"]  # CUDA stops at the first it cannot find
    assert narrow(rows, "") == []


def test_eight_gpus_four_generators_and_four_learner_ranks() -> None:
    p = place(gpus(8))
    assert [ids(g) for g in p.generators] == [["0"], ["1"], ["2"], ["3"]]
    assert ids(p.learner) == ["4", "5", "6", "7"] and not p.shared
    assert [p.visible_devices(f"generator-{i}") for i in range(4)] == ["0", "1", "2", "3"]
    assert p.visible_devices("learner") == "4,5,6,7"
    assert p.visible_devices("broker") == p.visible_devices("fitter") == ""  # no GPU for the rest


def test_eight_gpus_two_tensor_parallel_generators_and_four_learner_ranks() -> None:
    p = place(gpus(8), tensor_parallel_size=2)
    assert [ids(g) for g in p.generators] == [["0", "1"], ["2", "3"]]
    assert ids(p.learner) == ["4", "5", "6", "7"]
    assert p.visible_devices("generator-1") == "2,3"


def test_one_gpu_is_shared_by_a_generator_and_the_learner() -> None:
    p = place(gpus(1))
    assert [ids(g) for g in p.generators] == [["0"]] and ids(p.learner) == ["0"]
    assert p.shared and p.generator_fraction == 0.4  # vLLM takes 40%, the learner the rest
    with pytest.raises(ConfigError, match="one GPU holds one generator"):
        place(gpus(1), tensor_parallel_size=2)


def test_a_split_that_does_not_add_up_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="num_generators 3 x tensor_parallel_size 2 = 6 GPUs, but 4"):
        place(gpus(8), tensor_parallel_size=2, num_generators=3)
    with pytest.raises(ConfigError, match="learner_gpus 8: of 8 GPUs that leaves 0"):
        place(gpus(8), learner_gpus=8)
    p = place(gpus(8), learner_gpus=2, num_generators=3)  # the rest may stay idle
    assert [ids(g) for g in p.generators] == [["0"], ["1"], ["2"]] and ids(p.learner) == ["6", "7"]


def model_dir(tmp_path: Path) -> Path:
    return config_only(tmp_path / "Qwen3-8B", QWEN3_8B)


def written(paths: dict[str, Path]) -> dict[str, dict[str, object]]:
    return {name: yaml.safe_load(path.read_text()) for name, path in paths.items()}


def test_the_stack_on_eight_gpus_writes_gpu_configs(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run", max_tokens=4096, max_steps=20))
    placement = stack.resolve_placement(gpus(8))
    assert placement is not None and (stack.num_generators, stack.learner_ranks) == (4, 4)
    paths = stack.write_configs(model_dir(tmp_path))
    configs = written(paths)
    assert sorted(configs) == [
        "broker",
        "fitter",
        "generator-0",
        "generator-1",
        "generator-2",
        "generator-3",
        "learner",
    ]
    engine = configs["generator-0"]["engine"]
    assert isinstance(engine, dict)
    assert (engine["dtype"], engine["kv_cache_memory_bytes"], engine["gpu_memory_utilization"]) == (
        "bfloat16",
        None,
        0.9,
    )
    assert (engine["tensor_parallel_size"], engine["fp32_lm_head"], engine["enforce_eager"]) == (1, True, False)
    learner = configs["learner"]
    assert (learner["device"], learner["activation_checkpointing"], learner["device_kind"]) == ("cuda", True, "gpu")
    # The planner's suggestion for 4 x 80 GiB ranks of Qwen3-8B and 512 + 4096-token sequences.
    assert isinstance(learner["micro_batch_tokens"], int) and learner["micro_batch_tokens"] >= 512 + 4096
    # Each process sees its own GPUs; the learner runs as four torchrun ranks on GPUs 4-7.
    started: dict[str, list[str]] = {}
    stack._spawn = lambda name, argv, **kw: started.setdefault(name, argv)  # type: ignore[method-assign,assignment,misc]
    stack.start_services(paths)
    assert {name: stack.process_env(name)["CUDA_VISIBLE_DEVICES"] for name in started} == {
        "broker": "",
        "fitter": "",
        "generator-0": "0",
        "generator-1": "1",
        "generator-2": "2",
        "generator-3": "3",
        "learner": "4,5,6,7",
    }
    assert "--nproc-per-node=4" in started["learner"]
    # What the services read back is what was written: a null stays None (not the field's default).
    from asymptote.config import load_config
    from services.generator.config import GeneratorConfig

    assert load_config(GeneratorConfig, paths["generator-0"], "ASY_GENERATOR").engine.kv_cache_memory_bytes is None


def test_the_stack_s_default_split_is_the_plan_s_balanced_one_on_a_known_card(tmp_path: Path) -> None:
    """Qwen3-8B, 32 x 16 completions of 4,096 tokens on 8 cards: the stack runs the split with the shortest
    step by the plan's estimate among those whose learner ranks fit, and says so; a card the estimate has no
    figures for, or a split the settings give, keeps half and half."""
    from services.ops.cost import ACCELERATORS, step_cost

    model = model_dir(tmp_path)
    config = StackConfig(run_dir=tmp_path / "run", model_dir=model, max_tokens=4096, batch_prompts=32, group_size=16)
    h100 = [Gpu(str(i), 80 * GIB, "NVIDIA H100 80GB HBM3") for i in range(8)]
    chosen = LocalStack(config).resolve_placement(h100)
    assert chosen is not None and "split by the plan's estimate on H100 SXM" in chosen.why
    assert chosen.why in chosen.describe()
    # By hand: every split of the eight whose learner fits, timed by the same estimate.
    from services.learner.activations import ModelShape
    from services.learner.memory import GeneratorSettings, plan_generator
    from services.local.planning import planned_learner

    shape = ModelShape.read(model)
    generator = plan_generator(
        shape,
        GeneratorSettings(dtype="bfloat16", gpu_memory_utilization=0.9),
        gpu_memory_gib=80,
        sequence_tokens=512 + 4096,
    )
    timed = {}
    for learner_gpus in range(1, 8):
        split = place(h100, learner_gpus=learner_gpus)
        try:
            planned_learner(config, model, split)
        except ConfigError:
            continue
        cost = step_cost(
            shape,
            generator,
            accelerator=ACCELERATORS["h100"],
            generator_gpus=8 - learner_gpus,
            learner_gpus=learner_gpus,
            batch_prompts=32,
            group_size=16,
            prompt_tokens=512,
            mean_completion_tokens=2048,
            activation_checkpointing=True,
        )
        timed[learner_gpus] = cost.step_s
    assert len(timed) >= 2 and 1 not in timed  # one 80 GiB rank cannot hold the 8B model's training state
    assert len(chosen.learner) == min(timed, key=lambda n: (timed[n], -n))
    assert len(chosen.generators) + len(chosen.learner) == 8
    unknown = LocalStack(config.model_copy(update={"run_dir": tmp_path / "run2"})).resolve_placement(gpus(8))
    assert unknown is not None and (len(unknown.generators), len(unknown.learner), unknown.why) == (4, 4, "")
    given = LocalStack(config.model_copy(update={"run_dir": tmp_path / "run3", "learner_gpus": 4}))
    placement = given.resolve_placement(h100)
    assert placement is not None and (len(placement.learner), placement.why) == (4, "")


def test_a_model_that_does_not_fit_the_learner_s_gpus_is_refused_in_one_line(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run", max_tokens=8192, max_steps=20))
    stack.resolve_placement(gpus(2))  # one learner GPU cannot hold the 8B model's training state
    with pytest.raises(ConfigError) as refused:
        stack.write_configs(model_dir(tmp_path))
    assert "\n" not in str(refused.value) and "not even one sequence" in str(refused.value)


def test_on_a_machine_without_gpus_the_embedded_default_is_unchanged(tmp_path: Path) -> None:
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run"))
    assert stack.resolve_placement([]) is None
    assert (stack.num_generators, stack.learner_ranks) == (1, 1)
    configs = written(stack.write_configs(model_dir(tmp_path)))
    engine = configs["generator-0"]["engine"]
    assert isinstance(engine, dict)
    assert (engine["dtype"], engine["kv_cache_memory_bytes"], engine["enforce_eager"]) == (
        "float32",
        128 * 1024 * 1024,
        True,
    )
    assert (configs["learner"]["device"], configs["learner"]["micro_batch_tokens"]) == ("auto", None)
    # gpus 0 keeps the CPU build even where GPUs are.
    cpu = LocalStack(StackConfig(run_dir=tmp_path / "run2", gpus=0))
    assert cpu.resolve_placement(gpus(8)) is None
    with pytest.raises(ConfigError, match="gpus 4: only 2 GPUs are visible"):
        LocalStack(StackConfig(run_dir=tmp_path / "run3", gpus=4)).resolve_placement(gpus(2))


QWEN3_0_6B = {
    **QWEN3_8B,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}


def test_one_gpu_runs_a_small_model_with_the_engine_and_the_learner_side_by_side(tmp_path: Path) -> None:
    small = config_only(tmp_path / "Qwen3-0.6B", QWEN3_0_6B)
    stack = LocalStack(StackConfig(run_dir=tmp_path / "run", max_tokens=2048, max_steps=20))
    stack.resolve_placement(gpus(1))
    paths = stack.write_configs(small)
    configs = written(paths)
    assert sorted(configs) == ["broker", "fitter", "generator-0", "learner"]
    engine = configs["generator-0"]["engine"]
    assert isinstance(engine, dict) and engine["gpu_memory_utilization"] == 0.4
    assert configs["learner"]["device"] == "cuda" and stack.learner_ranks == 1  # one process, no torchrun
    assert (
        stack.process_env("generator-0")["CUDA_VISIBLE_DEVICES"]
        == stack.process_env("learner")["CUDA_VISIBLE_DEVICES"]
        == "0"
    )
