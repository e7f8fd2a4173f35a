"""The built-in arithmetic task: problems, splits and verifier (torch-free)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from asymptote.tasks import ALPHABET, ArithmeticSettings, ArithmeticTask, Problem, Task, get_task, task_names


def _value(prompt: str) -> int:
    expr = prompt.rstrip("=")
    op = "+" if "+" in expr else "-"
    a, b = expr.split(op)
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_registry_returns_default_task() -> None:
    task = get_task("arithmetic")
    assert isinstance(task, ArithmeticTask)
    assert isinstance(task, Task)
    assert task.name == "arithmetic"
    assert task_names() == ["arithmetic", "dataset", "mixture", "multiturn"]


def test_registry_rejects_unknown_names_and_foreign_settings() -> None:
    with pytest.raises(ValueError, match="unknown task 'sudoku'"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="takes ArithmeticSettings"):
        get_task("arithmetic", settings=object())  # type: ignore[arg-type]


def test_default_splits_sizes_disjoint_and_deterministic() -> None:
    first, second = get_task("arithmetic"), get_task("arithmetic")
    heldout, train = first.problems("heldout"), first.problems("train")
    assert len(heldout) == 200
    assert len(train) == 20_000
    assert list(heldout) == list(second.problems("heldout"))
    assert list(train) == list(second.problems("train"))
    assert not {p.prompt for p in heldout} & {p.prompt for p in train}
    assert len({p.prompt_id for p in (*heldout, *train)}) == 20_200


def test_default_format_padded_operands_reversed_answer() -> None:
    problem = get_task("arithmetic").problems("heldout")[0]
    assert problem == Problem(prompt_id=problem.prompt_id, prompt="063+004=", reference="76")
    assert problem.prompt_id.startswith("arith-") and len(problem.prompt_id) == 6 + 16


@pytest.mark.parametrize(
    ("settings", "example"),
    [
        (ArithmeticSettings(reverse_answer=False, pad_operands=False), ("37+485=", "522")),
        (ArithmeticSettings(), ("037+485=", "225")),
    ],
)
def test_every_reference_is_the_exact_answer(settings: ArithmeticSettings, example: tuple[str, str]) -> None:
    task = get_task("arithmetic", settings.model_copy(update={"num_train": 500}))
    for p in (*task.problems("heldout"), *task.problems("train")):
        answer = str(_value(p.prompt))
        assert p.reference == (answer[::-1] if settings.reverse_answer else answer)
        assert set(p.prompt) <= set(ALPHABET) and set(p.reference) <= set(ALPHABET)
    prompt, reference = example
    assert str(_value(prompt)) == "522"
    assert task.score(reference, reference) == 1.0


def test_subtraction_never_negative_and_digit_bounds() -> None:
    task = get_task(
        "arithmetic",
        ArithmeticSettings(operations=("+", "-"), min_digits=2, max_digits=4, pad_operands=False, num_train=2000),
    )
    problems = [*task.problems("heldout"), *task.problems("train")]
    assert {"+", "-"} <= {c for p in problems for c in p.prompt if c in "+-"}
    for p in problems:
        assert _value(p.prompt) >= 0
        operands = p.prompt.rstrip("=").replace("-", "+").split("+")
        assert all(2 <= len(x) <= 4 for x in operands)


def test_seed_changes_problems_and_heldout_is_stable_under_train_size() -> None:
    base = get_task("arithmetic", ArithmeticSettings(num_train=100))
    bigger = get_task("arithmetic", ArithmeticSettings(num_train=300))
    other_seed = get_task("arithmetic", ArithmeticSettings(num_train=100, seed=1))
    assert list(base.problems("heldout")) == list(bigger.problems("heldout"))
    assert list(base.problems("train")) == list(bigger.problems("train"))[:100]
    assert [p.prompt for p in base.problems("heldout")] != [p.prompt for p in other_seed.problems("heldout")]


def test_small_space_fills_train_with_everything_left() -> None:
    # 1-digit + 1-digit: exactly 100 problems exist.
    task = get_task("arithmetic", ArithmeticSettings(max_digits=1, num_heldout=10, num_train=1000))
    assert len(task.problems("heldout")) == 10
    assert len(task.problems("train")) == 90


def test_settings_are_validated() -> None:
    with pytest.raises(ValidationError, match="min_digits"):
        ArithmeticSettings(min_digits=3, max_digits=2)
    with pytest.raises(ValidationError):
        ArithmeticSettings(unknown_field=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        ArithmeticSettings(operations=("*",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split must be"):
        get_task("arithmetic").problems("test")  # type: ignore[arg-type]
    assert ArithmeticSettings.model_fields["num_heldout"].description


@pytest.mark.parametrize(
    ("completion", "reference", "reward"),
    [
        ("522", "522", 1.0),
        ("  522\n", "522", 1.0),
        ("522", " 522 ", 1.0),
        ("5220", "522", 0.0),
        ("52", "522", 0.0),
        ("225", "522", 0.0),
        ("5 22", "522", 0.0),
        ("", "522", 0.0),
        ("<eos>", "522", 0.0),
        ("\x00\xff\u2603", "522", 0.0),
        (None, "522", 0.0),
    ],
)
def test_verifier_cases(completion: object, reference: str, reward: float) -> None:
    assert get_task("arithmetic").score(completion, reference) == reward  # type: ignore[arg-type]


@given(st.text())
def test_verifier_never_raises_and_returns_zero_or_one(text: str) -> None:
    reward = get_task("arithmetic").score(text, "522")
    assert reward == (1.0 if text.strip() == "522" else 0.0)
