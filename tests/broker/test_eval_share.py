"""Eval rounds cost little by default: at most ``eval.max_share`` of the train completions between rounds.

By hand, for the defaults and for the settings users run: a round of n prompts x k samples every v
versions costs n*k completions against v*B*G train completions.
"""

from __future__ import annotations

import pytest

from services.broker.config import BrokerConfig


def config(**eval_settings: object) -> BrokerConfig:
    return BrokerConfig.model_validate(
        {"batch_prompts": 48, "sampling": {"group_size": 16}, "eval": {"every_versions": 10, **eval_settings}}
    )


def test_gsm8k_at_the_8b_preset_evaluates_a_small_share_of_what_it_trains() -> None:
    # GSM8K's test split (1,319) x 4 every 10 versions of 48 x 16 was 5,276 / 7,680 = 69% of generation.
    c = config(num_samples=4)
    n = c.eval_num_prompts(1319)
    assert n == 144  # 0.075 x 10 x 48 x 16 / 4
    assert n * 4 / (10 * 48 * 16) == pytest.approx(0.075)


def test_a_small_held_out_split_is_used_whole_and_the_floor_holds() -> None:
    assert config(num_samples=4).eval_num_prompts(100) == 100
    tight = BrokerConfig.model_validate({"batch_prompts": 4, "sampling": {"group_size": 2}})
    assert tight.eval_num_prompts(500) == 64  # 0.1 x 10 x 4 x 2 / 4 = 2 prompts: the floor of 64 instead
    assert tight.eval_num_prompts(30) == 30


def test_a_given_num_prompts_wins_and_the_share_is_settable() -> None:
    assert config(num_prompts=500).eval_num_prompts(1319) == 500
    assert config(num_prompts=5000).eval_num_prompts(1319) == 1319
    assert config(num_samples=4, max_share=0.05).eval_num_prompts(1319) == 96


def test_a_share_of_zero_is_refused() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_share"):
        config(max_share=0)
