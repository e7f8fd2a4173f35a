"""Dataset files as a task: readers, bad-row reports, ids, held-out splits, presets (torch-free)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from asymptote.tasks import DatasetSettings, DatasetTask, get_task
from asymptote.tasks.dataset import FieldNames, load_problems, split_holdout
from asymptote.tasks.readers import DatasetError
from asymptote.tasks.verifiers import ExactSettings, MathSettings, make_verifier

GOOD = [{"id": f"q{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
# Row numbers 7-11 after the six good rows: one of each bad kind.
BAD: list[dict[str, Any]] = [
    {"id": "q7", "answer": "1"},  # no prompt
    {"id": "q8", "prompt": "   ", "answer": "1"},  # empty prompt
    {"id": "q0", "prompt": "Again?", "answer": "0"},  # duplicate id
    {"id": "q9", "prompt": "Broken?", "answer": "\\frac{"},  # answer math-verify cannot parse
    {"id": "q10", "prompt": "No answer?", "answer": None},  # missing answer
]
EXPECTED_BAD = {"missing_field": 2, "empty_prompt": 1, "duplicate_id": 1, "bad_answer": 1}


def write_jsonl(path: Path, rows: list[dict[str, Any]], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "prompt", "answer"])
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in ("id", "prompt", "answer")})
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in ("id", "prompt", "answer")} for r in rows]), path)
    return path


def write_hf(path: Path, rows: list[dict[str, Any]]) -> Path:
    import datasets

    datasets.Dataset.from_list([{k: r.get(k) for k in ("id", "prompt", "answer")} for r in rows]).save_to_disk(
        str(path)
    )
    return path


WRITERS = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet, "hf_disk": write_hf}
SUFFIX = {"jsonl": "data.jsonl", "csv": "data.csv", "parquet": "data.parquet", "hf_disk": "saved"}


def settings(path: Path, **kw: Any) -> DatasetSettings:
    return DatasetSettings(path=path, holdout_fraction=kw.pop("holdout_fraction", 0.25), **kw)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_reader_counts_bad_rows_and_quotes_the_first(tmp_path: Path, fmt: str) -> None:
    path = WRITERS[fmt](tmp_path / SUFFIX[fmt], GOOD + BAD)
    s = settings(path)
    problems, report = load_problems(path, s, make_verifier(s.verifier))
    assert [p.prompt_id for p in problems] == [f"q{i}" for i in range(6)]
    assert [p.reference for p in problems] == [str(2 * i) for i in range(6)]
    assert report.num_rows == 11 and report.num_loaded == 6
    # CSV has no null: its empty prompt cell reads "" and its empty answer ""
    # (an answer math-verify rejects), not a missing field.
    expected = (
        {"missing_field": 0 + 0, "empty_prompt": 2, "duplicate_id": 1, "bad_answer": 2}
        if fmt == "csv"
        else EXPECTED_BAD
    )
    assert {k: v for k, v in report.bad.items() if v} == {k: v for k, v in expected.items() if v}
    assert [(b.row, b.reason) for b in report.examples] == [
        (7, "empty_prompt" if fmt == "csv" else "missing_field"),
        (8, "empty_prompt"),
        (9, "duplicate_id"),
        (10, "bad_answer"),
        (11, "bad_answer" if fmt == "csv" else "missing_field"),
    ]
    assert "id q0 already used by row 1" in report.examples[2].detail
    assert "cannot parse the reference" in report.examples[3].detail
    summary = report.summary()
    assert summary.startswith(f"{path}: 6 of 11 rows loaded; 5 bad (")
    assert "row 9 duplicate_id" in summary


def test_jsonl_lines_that_are_not_objects_are_counted_with_their_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", GOOD[:2], ("{not json", "", "[1, 2]"))
    s = settings(path)
    problems, report = load_problems(path, s, make_verifier(s.verifier))
    assert len(problems) == 2 and report.num_rows == 4
    assert report.bad == {"unreadable": 2}
    assert [(b.row, b.detail) for b in report.examples] == [
        (3, "not JSON (Expecting property name enclosed in double quotes at column 2)"),
        (5, "a JSON list, not an object"),
    ]


def test_more_examples_than_the_cap_are_counted_not_quoted(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", GOOD[:1] + [{"prompt": "", "answer": "1", "id": f"e{i}"} for i in range(9)]
    )
    s = settings(path)
    _, report = load_problems(path, s, make_verifier(s.verifier))
    assert report.bad == {"empty_prompt": 9}
    assert [b.row for b in report.examples] == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_dataset_of_only_bad_rows_stops_with_the_report(tmp_path: Path, fmt: str) -> None:
    path = WRITERS[fmt](tmp_path / SUFFIX[fmt], [{"id": "a", "prompt": "", "answer": "1"}] * 3)
    task = DatasetTask(settings(path))
    with pytest.raises(DatasetError, match=r"no usable rows in .*: 0 of 3 rows loaded; 3 bad \(empty_prompt 3\)"):
        task.problems("train")


def test_missing_file_unknown_suffix_and_missing_split_are_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        DatasetTask(settings(tmp_path / "nope.jsonl")).problems("train")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"cannot tell the format of .*d\.txt"):
        DatasetTask(settings(tmp_path / "d.txt")).problems("train")
    import datasets

    saved = write_hf(tmp_path / "saved", GOOD)
    datasets.DatasetDict({"train": datasets.load_from_disk(str(saved))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match="has no split 'test'; it has train"):
        DatasetTask(settings(tmp_path / "dd", split="test")).problems("train")
    # Six rows, a quarter held out: round(1.5) = 2.
    assert len(DatasetTask(settings(tmp_path / "dd", split="train")).problems("train")) == 4


def test_settings_need_one_heldout_source_and_a_prompt_placeholder(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="needs eval_path"):
        DatasetSettings(path=tmp_path / "d.jsonl")
    with pytest.raises(ValidationError, match="not both"):
        DatasetSettings(path=tmp_path / "d.jsonl", eval_path=tmp_path / "e.jsonl", holdout_fraction=0.1)
    with pytest.raises(ValidationError, match="must contain"):
        settings(tmp_path / "d.jsonl", prompt_format="Question:")
    with pytest.raises(ValidationError, match=r"only \{prompt\}"):
        settings(tmp_path / "d.jsonl", prompt_format="{question}")


def test_ids_are_stable_across_reloads_and_row_order(tmp_path: Path) -> None:
    rows = [{"prompt": f"Problem {i}: what is {i}*3?", "answer": str(3 * i)} for i in range(40)]
    first = DatasetTask(settings(write_jsonl(tmp_path / "a.jsonl", rows)))
    again = DatasetTask(settings(write_jsonl(tmp_path / "b.jsonl", rows[::-1])))
    by_prompt = {p.prompt: p.prompt_id for p in first.problems("train")} | {
        p.prompt: p.prompt_id for p in first.problems("heldout")
    }
    assert len(set(by_prompt.values())) == 40
    assert all(pid.startswith("p-") and len(pid) == 18 for pid in by_prompt.values())
    for split in ("train", "heldout"):
        assert {p.prompt_id for p in again.problems(split)} == {p.prompt_id for p in first.problems(split)}
        assert all(by_prompt[p.prompt] == p.prompt_id for p in again.problems(split))
    # File ids: safe ones kept, others hashed the same way every time.
    odd = [{"id": "gsm8k/train/1", "prompt": "x?", "answer": "1"}, {"id": 7, "prompt": "y?", "answer": "2"}]
    ids = [
        p.prompt_id
        for p in load_problems(
            write_jsonl(tmp_path / "o.jsonl", odd), settings(tmp_path), make_verifier(MathSettings())
        )[0]
    ]
    assert ids[1] == "7" and ids[0].startswith("h-")
    assert ids == [
        p.prompt_id for p in load_problems(tmp_path / "o.jsonl", settings(tmp_path), make_verifier(MathSettings()))[0]
    ]


def test_seeded_holdout_fraction_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "prompt": f"p{i}", "answer": str(i)} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    a, b = DatasetTask(settings(path, holdout_fraction=0.1)), DatasetTask(settings(path, holdout_fraction=0.1))
    held = [p.prompt_id for p in a.problems("heldout")]
    assert len(held) == 20 and len(a.problems("train")) == 180
    assert held == [p.prompt_id for p in b.problems("heldout")]
    assert not set(held) & {p.prompt_id for p in a.problems("train")}
    other_seed = DatasetTask(settings(path, holdout_fraction=0.1, seed=1))
    assert set(held) != {p.prompt_id for p in other_seed.problems("heldout")}
    # The choice depends on ids only: reordered rows hold out the same problems.
    reordered = DatasetTask(settings(write_jsonl(tmp_path / "r.jsonl", rows[::-1]), holdout_fraction=0.1))
    assert {p.prompt_id for p in reordered.problems("heldout")} == set(held)
    train, heldout = split_holdout(a.problems("train")[:2], 0.01, 0)
    assert (len(train), len(heldout)) == (1, 1)


def test_eval_file_is_the_heldout_split_and_its_ids_leave_train(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    held = write_jsonl(tmp_path / "eval.jsonl", [GOOD[0], {"id": "e1", "prompt": "1+1?", "answer": "2"}])
    task = DatasetTask(DatasetSettings(path=train, eval_path=held))
    assert [p.prompt_id for p in task.problems("heldout")] == ["q0", "e1"]
    assert [p.prompt_id for p in task.problems("train")] == ["q1", "q2", "q3", "q4", "q5"]
    assert task.reports["train"].bad == {"duplicate_id": 1}
    assert "already used by the held-out file" in task.reports["train"].examples[0].detail


def test_gsm8k_layout_needs_no_mapping(tmp_path: Path) -> None:
    rows = [
        {
            "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
            "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72",
        },
        {"question": "A farm has 1,200 hens and buys 34 more. How many hens?", "answer": "1200+34\n#### 1,234"},
        {"question": "No marker here?", "answer": "The answer is 5."},
    ]
    task = DatasetTask(
        DatasetSettings(path=write_jsonl(tmp_path / "gsm8k.jsonl", rows), preset="gsm8k", holdout_fraction=0.5)
    )
    problems = [*task.problems("train"), *task.problems("heldout")]
    assert sorted(p.reference for p in problems) == ["1234", "72"]
    assert task.reports["train"].bad == {"bad_answer": 1}
    assert "no '#### <answer>' line" in task.reports["train"].examples[0].detail
    ref = next(p.reference for p in problems if p.reference == "72")
    assert task.score("They sold 72 clips in all, so \\boxed{72}.", ref) == 1.0
    assert task.score("\\boxed{71}", ref) == 0.0


def test_field_mapping_and_signed_rewards(tmp_path: Path) -> None:
    rows = [
        {"key": "k1", "q": "Capital of France?", "a": "Paris"},
        {"key": "k2", "q": "Capital of Italy?", "a": "Rome"},
    ]
    s = DatasetSettings(
        path=write_jsonl(tmp_path / "d.jsonl", rows),
        holdout_fraction=0.5,
        fields=FieldNames(prompt="q", answer="a", id="key"),
        verifier=ExactSettings(),
        reward_style="signed",
    )
    task = get_task("dataset", s)
    problems = {p.prompt_id: p for p in (*task.problems("train"), *task.problems("heldout"))}
    assert problems["k1"].prompt == "Capital of France?" and problems["k1"].reference == "paris"
    assert task.score("<think>maybe Lyon</think> Paris.", "paris") == 1.0
    assert task.score("Lyon", "paris") == -1.0
    assert task.score("<think>never finished", "paris") == -1.0


def test_reading_a_dataset_does_not_import_torch(tmp_path: Path) -> None:
    write_parquet(tmp_path / "d.parquet", GOOD)
    write_hf(tmp_path / "saved", GOOD)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from asymptote.tasks import DatasetSettings, get_task\n"
        f"for p in ({str(tmp_path / 'd.parquet')!r}, {str(tmp_path / 'saved')!r}):\n"
        "    t = get_task('dataset', DatasetSettings(path=Path(p), holdout_fraction=0.2))\n"
        "    assert len(t.problems('train')) == 5, p\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
