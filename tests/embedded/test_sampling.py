"""The single-process sampler under interruption length control (services/embedded/sampling.py).

Checked against the rules a generator carries out (services/generator/length.py): the group's budget, the
stop where thinking closes, the phrase out of the loss, the answer budget; and every sampled token's
log-prob against a plain forward pass of the whole sequence, row by row.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asymptote.tasks import DatasetSettings, DatasetTask, words
from asymptote.tasks.length import LengthControlSettings, draw_thinking_budget
from services.embedded.build import ModelSpec, build_model
from services.embedded.onpolicy import OnPolicySettings, Rollouts, _update
from services.embedded.sampling import length_control_of, sample_groups, think_end_id
from services.embedded.warmstart import encode_prompts, format_for, tokenizer_for
from services.learner.model import Samples, sample

SPEC = ModelSpec(family="qwen3", num_kv_heads=2, head_dim=64, max_position_embeddings=256)
LENGTH = LengthControlSettings(thinking_budget_tokens=(6, 14), answer_budget_tokens=5, seed=3)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetTask, object, torch.nn.Module]:
    root = tmp_path_factory.mktemp("words")
    rows = words.generate(48, 8, seed=7)
    for split, split_rows in rows.items():
        (root / f"{split}.jsonl").write_text(words.render(split_rows))
    task = DatasetTask(
        DatasetSettings(
            path=root / "train.jsonl", eval_path=root / "heldout.jsonl", template="chat", length_control=LENGTH
        )
    )
    tokenizer = tokenizer_for(task, SPEC)
    torch.manual_seed(0)
    model = build_model(SPEC, tokenizer).eval()
    # A random model almost never closes its thinking or ends: raise both tokens' logits so that every
    # way a completion can go (closes, ends, runs to its budget) shows in a few dozen rows.
    bias = torch.zeros(len(tokenizer))
    bias[think_end_id(tokenizer, LENGTH.think_end)] = 3.5
    bias[tokenizer.eos_token_id] = 2.5
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias)
    return task, tokenizer, model


def reference_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-probs of ``completion`` after ``prompt`` from one unpadded forward pass of the whole sequence."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[positions, torch.tensor(completion)]


def test_groups_follow_the_generators_length_rules(setup: tuple[DatasetTask, object, torch.nn.Module]) -> None:
    task, tokenizer, model = setup
    assert length_control_of(task) == LENGTH
    problems = task.problems("train")[:12]
    group = 4
    prompts = [p for p in encode_prompts(tokenizer, problems, format_for(task, tokenizer)) for _ in range(group)]
    keys = [f"k{i}" for i in range(len(problems)) for _ in range(group)]
    out = sample_groups(model, tokenizer, prompts, keys, MAX_TOKENS, LENGTH, generator=torch.Generator().manual_seed(1))
    think_end = think_end_id(tokenizer, LENGTH.think_end)
    eos = tokenizer.eos_token_id
    phrase = tokenizer.encode(LENGTH.interruption_phrase, add_special_tokens=False)
    kinds = {"closed": 0, "ended": 0, "interrupted": 0}
    for n, (ids, logps, mask) in enumerate(zip(out.samples.completions, out.samples.logprobs, out.loss_masks)):
        budget = draw_thinking_budget(LENGTH, keys[n])
        assert len(ids) == len(logps) == len(mask) <= MAX_TOKENS
        if out.interrupted[n]:
            kinds["interrupted"] += 1
            # The budget's tokens, none closing the thinking or ending, then the phrase out of the loss.
            assert think_end not in ids[:budget] and eos not in ids[:budget]
            assert ids[budget : budget + len(phrase)] == phrase
            assert mask == [1] * budget + [0] * len(phrase) + [1] * (len(ids) - budget - len(phrase))
            assert logps[budget : budget + len(phrase)] == [0.0] * len(phrase)
            assert len(ids) - budget - len(phrase) <= LENGTH.answer_budget_tokens
        elif think_end in ids:
            kinds["closed"] += 1
            at = ids.index(think_end)
            assert at < budget and eos not in ids[:at] and 0 not in mask
            assert len(ids) - at - 1 <= LENGTH.answer_budget_tokens
        else:
            kinds["ended"] += 1
            assert ids[-1] == eos and len(ids) <= budget and 0 not in mask
        assert out.samples.truncated[n] == (ids[-1] != eos)
        sampled = torch.tensor(mask, dtype=torch.bool)
        want = reference_logprobs(model, prompts[n], ids)
        torch.testing.assert_close(torch.tensor(logps)[sampled], want[sampled], atol=1e-5, rtol=0)
    assert min(kinds.values()) >= 3, kinds
    # One budget per group: every row of a key was held to the same draw (checked above per row), and the
    # draws differ across keys.
    assert len({draw_thinking_budget(LENGTH, k) for k in keys}) > 1


def test_without_length_control_it_is_the_plain_sampler(setup: tuple[DatasetTask, object, torch.nn.Module]) -> None:
    task, tokenizer, model = setup
    prompts = encode_prompts(tokenizer, task.problems("train")[:6], format_for(task, tokenizer))
    plain = sample(
        model, prompts, 12, tokenizer.eos_token_id, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(4)
    )
    out = sample_groups(model, tokenizer, prompts, ["a"] * 6, 12, None, generator=torch.Generator().manual_seed(4))
    assert out.samples == plain
    assert out.loss_masks == [[1] * len(c) for c in plain.completions] and not any(out.interrupted)


def test_per_row_limits_and_stop_tokens(setup: tuple[DatasetTask, object, torch.nn.Module]) -> None:
    task, tokenizer, model = setup
    prompts = encode_prompts(tokenizer, task.problems("train")[:8], format_for(task, tokenizer))
    stop = think_end_id(tokenizer, LENGTH.think_end)
    limits = [1, 2, 3, 5, 8, 13, 21, 34]
    out = sample(
        model,
        prompts,
        limits,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(2),
        stop_ids=[stop],
    )
    for ids, limit, cut in zip(out.completions, limits, out.truncated):
        ends = [i for i, t in enumerate(ids) if t in (stop, tokenizer.eos_token_id)]
        assert ends in ([], [len(ids) - 1])  # a row stops at its first stop or EOS token, which it keeps
        assert cut == (not ends) and (len(ids) == limit if cut else len(ids) <= limit)
    with pytest.raises(ValueError, match="one for all rows or one per row"):
        sample(model, prompts, [4, 4], tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_a_think_end_of_several_tokens_is_refused(setup: tuple[DatasetTask, object, torch.nn.Module]) -> None:
    _, tokenizer, _ = setup
    with pytest.raises(ValueError, match=r"'</answer-now>' is \d+ tokens of this tokenizer"):
        think_end_id(tokenizer, "</answer-now>")


def test_the_loop_leaves_injected_tokens_out_of_its_loss(setup: tuple[DatasetTask, object, torch.nn.Module]) -> None:
    """A token with loss mask 0 is context only: its sampling log-prob does not move the loss, a sampled
    token's does."""
    task, tokenizer, _ = setup
    torch.manual_seed(0)
    model = build_model(SPEC, tokenizer)
    prompts = encode_prompts(tokenizer, task.problems("train")[:2], format_for(task, tokenizer))
    s = OnPolicySettings(num_prompts_per_step=2, group_size=2)
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]]
    completions = [[40, 41, 42, 43], [44, 45, 46], [47, 48, 49, 50], [51, 52]]
    masks = [[1, 0, 0, 1], [1, 1, 1], [1, 0, 1, 1], [1, 1]]

    def loss(logprobs: list[list[float]]) -> float:
        rollouts = Rollouts(
            rows=rows,
            samples=Samples(completions=completions, logprobs=logprobs, truncated=[False] * 4),
            loss_masks=masks,
            rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
        )
        frozen = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(frozen.parameters(), lr=0.0)
        return _update(frozen, optimizer, rollouts, s, 0.0, tokenizer.pad_token_id)["loss/value"]

    base = [[-1.0] * len(c) for c in completions]
    masked = [row.copy() for row in base]
    masked[0][1], masked[0][2], masked[2][1] = -7.0, -0.1, -3.0  # only where the mask is 0
    sampled = [row.copy() for row in base]
    sampled[0][3] = -7.0
    assert loss(masked) == loss(base)
    assert loss(sampled) != loss(base)
