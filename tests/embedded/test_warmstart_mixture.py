"""The warm start of a mixture: each problem taught in its own sub-task's format, one tokenizer for both."""

from __future__ import annotations

from pathlib import Path

from asymptote.tasks import DatasetSettings, MixtureEntry, MixtureSettings, MixtureTask, get_task, words, words_code
from asymptote.tasks.verifiers import CodeSettings
from services.embedded.build import ModelSpec
from services.embedded.warmstart import (
    WarmstartSettings,
    cache_key,
    format_for,
    score_problem,
    tiny_model_settings,
    tokenizer_for,
)

SPEC = ModelSpec(family="qwen3", num_kv_heads=2, head_dim=64, max_position_embeddings=256)


def files(folder: Path, code: bool) -> dict[str, Path]:
    folder.mkdir()
    paths = {}
    for split, rows in words.generate(24, 6, seed=3).items():
        paths[split] = folder / f"{split}.jsonl"
        paths[split].write_text(words.render([words_code.code_row(r) for r in rows] if code else rows))
    return paths


def mixture(tmp_path: Path, code_weight: float = 1.0) -> MixtureSettings:
    plain, code = files(tmp_path / "words", False), files(tmp_path / "code", True)
    return MixtureSettings(
        tasks=(
            MixtureEntry(
                name="words", weight=1.0, task=DatasetSettings(path=plain["train"], eval_path=plain["heldout"])
            ),
            MixtureEntry(
                name="code",
                weight=code_weight,
                task=DatasetSettings(
                    path=code["train"],
                    eval_path=code["heldout"],
                    preset="apps",
                    prompt_format=words_code.PROMPT_FORMAT,
                    verifier=CodeSettings(test_timeout_s=2.0),
                    check_gold=False,
                ),
            ),
        )
    )


def test_each_problem_is_taught_in_its_sub_tasks_format_and_paid_by_its_verifier(tmp_path: Path) -> None:
    settings = mixture(tmp_path)
    task = get_task("mixture", settings)
    assert isinstance(task, MixtureTask)
    tokenizer = tokenizer_for(task, SPEC)
    fmt = format_for(task, tokenizer)
    problems = list(task.problems("train"))
    words_problem, code_problem = problems[0], problems[-1]
    assert (task.sub_task_of(words_problem.prompt_id), task.sub_task_of(code_problem.prompt_id)) == ("words", "code")
    assert fmt.target(words_problem).endswith(f"</think>\n\n\\boxed{{{words_problem.reference}}}")
    assert "</think>\n\n```python\n" in fmt.target(code_problem) and fmt.target(code_problem).endswith("\n```")
    assert fmt.prompt(code_problem).endswith(f"{words_code.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert words_code.INSTRUCTION not in fmt.prompt(words_problem)
    for problem in (*problems[:4], *problems[-4:]):
        assert score_problem(task, fmt.target(problem), problem) == 1.0
    # A completion in the other sub-task's format earns nothing.
    assert score_problem(task, fmt.target(words_problem), code_problem) == 0.0
    assert score_problem(task, fmt.target(code_problem), words_problem) == 0.0
    # The tiny model of a dataset task, and a cache key that follows the files' content and the weights,
    # not the files' place.
    assert tiny_model_settings(settings)[0].family == "qwen3"
    (tmp_path / "moved").mkdir()
    (tmp_path / "reweighted").mkdir()
    moved, reweighted = mixture(tmp_path / "moved"), mixture(tmp_path / "reweighted", code_weight=2.0)
    key = cache_key(SPEC, settings, WarmstartSettings())
    assert cache_key(SPEC, moved, WarmstartSettings()) == key != cache_key(SPEC, reweighted, WarmstartSettings())
