"""Settings for a user's own model by its size: what ``asymptote up --model`` trains with unless told otherwise.

The stack's own defaults are the tiny model's (a learning rate of 1e-4,
completions of 96 tokens); a real model given them would train at hundreds
of times the paper's learning rate and truncate every thought. With
``--model``, each of the fields below that neither ``--config`` nor a flag
sets comes from the preset for the model's size:

| preset | parameters | lr | warm-up | batch x group | max_tokens | thinking budget |
|---|---|---|---|---|---|---|
| tiny | under 100M | the stack's defaults (1e-4, 10, 16 x 8, 96) | | | | the task's |
| small | 100M to 1B | 1e-6 | 50 | 32 x 8 | 4,096 | 2,048-3,584 |
| paper-8b | 1B and up | 5e-7 | 100 | 48 x 16 | 8,192 | 4,096-7,680 |

paper-8b is ScaleRL's 8B recipe (AdamW at 5e-7 after 100 warm-up steps,
48 prompts x 16 completions, 8k-token completions with interruption length
control); small halves the lengths and the batch for models that learn
faster per step, at twice the paper's rate. The thinking budget applies to
a dataset task whose length control is off; the answer budget is 512.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asymptote.tasks import DatasetSettings
from services.local.config import StackConfig

LARGE_LR_FACTOR = 10.0
"""A learning rate this many times the preset's, on a model of 100M parameters or more, is warned about."""
ANSWER_BUDGET = 512


@dataclass(frozen=True)
class Preset:
    name: str
    min_parameters: int
    settings: dict[str, Any]
    """StackConfig fields: lr, warmup_steps, batch_prompts, group_size, max_tokens (none for tiny)."""
    lr: float
    """The learning rate the warning compares against."""

    def thinking_budget(self) -> tuple[int, int] | None:
        tokens = self.settings.get("max_tokens")
        return None if tokens is None else (tokens // 2, tokens - ANSWER_BUDGET)


PRESETS = (
    Preset("tiny", 0, {}, lr=1e-4),
    Preset(
        "small",
        100_000_000,
        {"lr": 1e-6, "warmup_steps": 50, "batch_prompts": 32, "group_size": 8, "max_tokens": 4096},
        lr=1e-6,
    ),
    Preset(
        "paper-8b",
        1_000_000_000,
        {"lr": 5e-7, "warmup_steps": 100, "batch_prompts": 48, "group_size": 16, "max_tokens": 8192},
        lr=5e-7,
    ),
)


def preset_for(num_parameters: int) -> Preset:
    """The preset of a model of ``num_parameters``: the largest whose threshold it reaches."""
    return [p for p in PRESETS if num_parameters >= p.min_parameters][-1]


def apply_preset(config: StackConfig, given: set[str], num_parameters: int) -> tuple[StackConfig, Preset, list[str]]:
    """``config`` with the preset's settings in the fields not in ``given`` (what the config file and the
    flags set), the preset, and the warnings to show at start."""
    preset = preset_for(num_parameters)
    update = {field: value for field, value in preset.settings.items() if field not in given}
    budget = preset.thinking_budget()
    task = config.task
    if (
        budget is not None
        and isinstance(task, DatasetSettings)
        and "length_control" not in task.model_fields_set
        and not task.length_control.enabled
        and "max_tokens" not in given
    ):
        control = task.length_control.model_copy(
            update={"thinking_budget_tokens": budget, "answer_budget_tokens": ANSWER_BUDGET}
        )
        update["task"] = task.model_copy(update={"length_control": control})
    fitted = StackConfig.model_validate({**config.model_dump(), **update}) if update else config
    warnings = []
    if num_parameters >= PRESETS[1].min_parameters and fitted.lr >= LARGE_LR_FACTOR * preset.lr:
        warnings.append(
            f"lr {fitted.lr:g} is {fitted.lr / preset.lr:.0f}x the {preset.name} preset's {preset.lr:g} for a model "
            f"of {num_parameters / 1e6:,.0f}M parameters: a tiny model's rate that is likely to diverge"
        )
    return fitted, preset, warnings


def describe(config: StackConfig, preset: Preset, num_parameters: int) -> str:
    """The start line: the model's size, its preset, and the settings the run takes."""
    task = config.task
    budget = task.length_control.thinking_budget_tokens if isinstance(task, DatasetSettings) else None
    thinking = f", thinking {budget[0]}-{budget[1]}" if budget else ""
    return (
        f"preset {preset.name} ({num_parameters / 1e6:,.0f}M parameters): lr {config.lr:g}, warm-up "
        f"{config.warmup_steps}, batch {config.batch_prompts} x {config.group_size}, max_tokens "
        f"{config.max_tokens}{thinking} (flags and --config override)"
    )
