"""A task read from a dataset file, scored by a configurable verifier.

Owns the ``dataset`` task's settings, the mapping of a file's fields to
problems, the bad-row report, prompt ids and the held-out split. Bad rows
(unreadable, a missing field, an empty prompt, a duplicate id, an answer
the verifier cannot use) are counted, with the first few as examples, and
logged; a file with no good row stops with a ``DatasetError``.

Prompt ids are stable across restarts (the curriculum keys its state by
them): a file's own id, kept as it is when it is safe in NATS subjects and
file names and hashed otherwise, or, when the file has no id field, a hash
of the prompt. The held-out split is its own file (``eval_path``) or a
seeded fraction chosen by hashing ids, so it stays the same when rows are
reordered. Prompts stay as the file's text: the generator applies the chat
template (see prompts.py).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from asymptote.config import Frozen
from asymptote.tasks.base import Problem, Split
from asymptote.tasks.code import (
    CODE_LAYOUTS,
    ID_FIELD,
    PROMPT_FIELD,
    TESTS_FIELD,
    CodeLayout,
    code_tests,
    fenced,
    gold_program,
)
from asymptote.tasks.length import LengthControlSettings
from asymptote.tasks.readers import DatasetError, FileFormat, read_rows
from asymptote.tasks.verifiers import MathSettings, RewardStyle, Verifier, VerifierSettings, make_verifier, reward
from asymptote.tasks.verifiers.base import Verdict

log = logging.getLogger(__name__)

MAX_EXAMPLES = 5
"""Bad rows quoted in a report, per file."""
BadReason = Literal[
    "unreadable", "missing_field", "empty_prompt", "bad_prompt", "duplicate_id", "bad_answer", "gold_fails"
]


class FieldNames(Frozen):
    """Which field of a row holds what."""

    prompt: str = "prompt"
    """Field with the prompt text."""
    answer: str = "answer"
    """Field with the reference answer."""
    id: str | None = "id"
    """Field with a stable row id; a file without it gets ids hashed from the prompt; None never reads one."""


Preset = Literal["none", "gsm8k", "apps", "taco", "codecontests", "deepcoder", "mbpp", "humaneval"]
"""gsm8k: fields question/answer, and the reference is what follows the answer's '#### ' (commas dropped).
The others are code layouts (asymptote/tasks/code.py): the tests are read from the row's own fields and
checked by the code verifier, and a gold solution that fails them makes a bad row."""
_PRESET_FIELDS: dict[Preset, FieldNames] = {
    "none": FieldNames(),
    "gsm8k": FieldNames(prompt="question", answer="answer", id="id"),
    **{p: FieldNames(prompt=PROMPT_FIELD[p], answer=TESTS_FIELD[p], id=ID_FIELD[p]) for p in CODE_LAYOUTS},
}


class DatasetSettings(Frozen):
    """A task read from local files (jsonl, parquet, csv, or a datasets save_to_disk folder)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: Literal["dataset"] = "dataset"
    """Task kind."""
    path: Path
    """Train file, or a folder written by datasets' save_to_disk."""
    format: FileFormat = "auto"
    """File format; auto reads it from the suffix (a folder is a save_to_disk dataset)."""
    split: str = "train"
    """Split read from a saved DatasetDict folder (path and eval_path alike)."""
    eval_path: Path | None = None
    """Held-out file in the same layout; exclusive with holdout_fraction."""
    holdout_fraction: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Fraction of the train file held out instead, chosen by seed and id; exclusive with eval_path."""
    seed: int = 0
    """Seed of the held-out choice."""
    preset: Preset = "none"
    """A known layout: gsm8k reads question/answer and the number after '####' with no mapping."""
    fields: FieldNames | None = None
    """Field names; None takes the preset's (prompt, answer, id without a preset)."""
    system_prompt: str | None = None
    """System message put before every prompt (a leading paragraph under the plain template)."""
    template: Literal["chat", "plain"] = "chat"
    """chat: the tokenizer's chat template (instruct models); plain: the text as is (base models)."""
    prompt_format: str = "{prompt}"
    """Text of the user turn, with {prompt} where the row's prompt goes."""
    verifier: VerifierSettings = MathSettings()
    """How completions are checked against the answers."""
    reward_style: RewardStyle = "binary"
    """binary: rewards in {0, 1}; signed: in {-1, +1}."""
    score_timeout_s: float = Field(default=5.0, gt=0.0)
    """Time one completion's scoring may take; past it the completion is wrong (reason timeout)."""
    num_score_workers: int = Field(default=2, ge=1)
    """Processes that score completions in each generator."""
    length_control: LengthControlSettings = LengthControlSettings()
    """Interruption length control (ScaleRL): thinking budget, answer budget, interruption phrase; off by
    default. The broker's max_tokens still caps a whole completion."""
    check_gold: bool = True
    """Code presets: run each row's gold solution against its tests at load; a row whose gold fails is bad."""

    @model_validator(mode="before")
    @classmethod
    def _code_verifier(cls, data: Any) -> Any:
        # A code layout is checked by running programs: its verifier is code unless one is named.
        if isinstance(data, dict) and data.get("preset") in CODE_LAYOUTS and "verifier" not in data:
            return {**data, "verifier": {"kind": "code"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> DatasetSettings:
        if self.preset in CODE_LAYOUTS and self.verifier.kind != "code":
            raise ValueError(f"preset {self.preset} holds code tests: it needs verifier {{kind: code}}")
        if self.eval_path is not None and self.holdout_fraction is not None:
            raise ValueError("give eval_path or holdout_fraction, not both")
        if self.eval_path is None and self.holdout_fraction is None:
            raise ValueError("the held-out split needs eval_path (a file) or holdout_fraction (e.g. 0.05)")
        try:
            filled = self.prompt_format.format(prompt="\0")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"prompt_format {self.prompt_format!r} is not a format with only {{prompt}}: {exc}"
            ) from None
        if "\0" not in filled:
            raise ValueError(f"prompt_format {self.prompt_format!r} must contain {{prompt}}")
        return self

    @property
    def field_names(self) -> FieldNames:
        return self.fields or _PRESET_FIELDS[self.preset]


@dataclass(frozen=True, slots=True)
class BadRow:
    """One rejected row, quoted in the report."""

    row: int
    """1-based row number (the line number in a jsonl file)."""
    reason: BadReason
    detail: str


@dataclass
class LoadReport:
    """What reading one file kept and rejected."""

    source: str
    num_rows: int = 0
    num_loaded: int = 0
    bad: Counter[BadReason] = field(default_factory=Counter)
    examples: list[BadRow] = field(default_factory=list)

    def reject(self, row: int, reason: BadReason, detail: str) -> None:
        self.bad[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(BadRow(row, reason, detail))

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    def summary(self) -> str:
        """One paragraph: counts by reason, then the first bad rows."""
        head = f"{self.source}: {self.num_loaded} of {self.num_rows} rows loaded"
        if not self.bad:
            return head
        counts = ", ".join(f"{reason} {n}" for reason, n in sorted(self.bad.items()))
        quoted = "; ".join(f"row {b.row} {b.reason}: {b.detail}" for b in self.examples)
        return f"{head}; {self.num_bad} bad ({counts}); first: {quoted}"


_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def prompt_id_of(file_id: object | None, prompt: str) -> str:
    """The problem id: a safe file id as is, another one hashed (``h-``), or the prompt hashed (``p-``)."""
    if file_id is None:
        return "p-" + _hash(prompt)
    text = str(file_id)
    return text if _SAFE_ID.match(text) else "h-" + _hash(text)


def gsm8k_reference(answer: str) -> str:
    """The number after GSM8K's ``#### `` marker, commas dropped; ValueError without one."""
    marker = answer.rfind("####")
    if marker < 0:
        raise ValueError("no '#### <answer>' line")
    value = answer[marker + 4 :].strip().replace(",", "")
    if not value:
        raise ValueError("nothing after '####'")
    return value


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_problems(
    path: Path, settings: DatasetSettings, verifier: Verifier, taken: set[str] | None = None
) -> tuple[list[Problem], LoadReport]:
    """The good rows of ``path`` as problems, and the report on the rest.

    ``taken`` holds ids already used (the held-out file's): a row with one
    of them is a duplicate. DatasetError when no row is good.
    """
    names = settings.field_names
    rows = list(read_rows(path, settings.format, settings.split))
    report = LoadReport(source=str(path), num_rows=len(rows))
    has_ids = names.id is not None and any(isinstance(r, dict) and names.id in r for _, r in rows)
    seen: dict[str, int] = {}
    already = taken or set()
    problems: list[Problem] = []
    golds: list[tuple[int, int, str]] = []
    for number, row in rows:
        if isinstance(row, str):
            report.reject(number, "unreadable", row)
            continue
        missing = [n for n in (names.prompt, names.answer) if row.get(n) is None]
        if has_ids and names.id is not None and row.get(names.id) in (None, ""):
            missing.append(names.id)
        if missing:
            report.reject(number, "missing_field", f"no {', '.join(missing)} (fields: {', '.join(map(str, row))})")
            continue
        prompt = row[names.prompt]
        if not isinstance(prompt, str):
            report.reject(number, "bad_prompt", f"{names.prompt} is a {type(prompt).__name__}, not text")
            continue
        if not prompt.strip():
            report.reject(number, "empty_prompt", f"{names.prompt} is {_quote(prompt)}")
            continue
        answer = str(row[names.answer])
        gold = None
        try:
            if settings.preset == "gsm8k":
                answer = gsm8k_reference(answer)
            if settings.preset in CODE_LAYOUTS:
                layout: CodeLayout = settings.preset
                answer = code_tests(row, layout).model_dump_json()
                gold = gold_program(row, layout) if settings.check_gold else None
            reference = verifier.check_reference(answer)
        except ValueError as exc:
            report.reject(number, "bad_answer", f"{exc} in {_quote(answer)}")
            continue
        pid = prompt_id_of(row[names.id] if has_ids and names.id is not None else None, prompt)
        if pid in seen or pid in already:
            where = f"row {seen[pid]}" if pid in seen else "the held-out file"
            report.reject(number, "duplicate_id", f"id {pid} already used by {where}")
            continue
        seen[pid] = number
        problems.append(Problem(prompt_id=pid, prompt=prompt, reference=reference))
        if gold is not None:
            golds.append((number, len(problems) - 1, gold))
    if golds:
        problems = _drop_failing_gold(problems, golds, verifier, report)
    report.num_loaded = len(problems)
    if not problems:
        raise DatasetError(f"no usable rows in {path}: {report.summary()}")
    (log.warning if report.bad else log.info)("dataset %s", report.summary())
    return problems, report


GOLD_WORKERS = 4
"""Gold solutions checked at once (each a sandboxed process; the threads only wait)."""


def _drop_failing_gold(
    problems: list[Problem], golds: list[tuple[int, int, str]], verifier: Verifier, report: LoadReport
) -> list[Problem]:
    """``problems`` without those whose gold solution fails its own tests (each counted as a bad row)."""
    with ThreadPoolExecutor(max_workers=GOLD_WORKERS) as pool:
        verdicts = list(pool.map(lambda g: verifier.verdict(fenced(g[2]), problems[g[1]].reference), golds))
    failing = set()
    for (number, index, _), verdict in zip(golds, verdicts):
        if not verdict.correct:
            failing.add(index)
            report.reject(number, "gold_fails", f"the row's own solution is {verdict.reason} on its tests")
    return [p for i, p in enumerate(problems) if i not in failing]


def split_holdout(problems: Sequence[Problem], fraction: float, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): ``round(fraction * n)`` problems (at least one, leaving one) chosen by hashing
    ``seed`` and each id, so the choice depends on neither row order nor the other rows' ids."""
    if len(problems) < 2:
        raise DatasetError(f"holding out a fraction needs at least 2 problems, the dataset has {len(problems)}")
    num = min(max(1, round(fraction * len(problems))), len(problems) - 1)
    ranked = sorted(problems, key=lambda p: _hash(f"{seed}:{p.prompt_id}"))
    chosen = {p.prompt_id for p in ranked[:num]}
    return [p for p in problems if p.prompt_id not in chosen], [p for p in problems if p.prompt_id in chosen]


class DatasetTask:
    """Problems from dataset files; completions judged by the configured verifier (in this process)."""

    name: str

    def __init__(self, settings: DatasetSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.verifier = make_verifier(settings.verifier)
        self.reports: dict[Split, LoadReport] = {}
        self._splits: dict[Split, list[Problem]] | None = None

    def problems(self, split: Split) -> Sequence[Problem]:
        """The problems of ``split``, read on first use; DatasetError for a file with no good row."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if self._splits is None:
            self._splits = self._load()
        return self._splits[split]

    def _load(self) -> dict[Split, list[Problem]]:
        s = self.settings
        if s.eval_path is not None:
            heldout, self.reports["heldout"] = load_problems(s.eval_path, s, self.verifier)
            train, self.reports["train"] = load_problems(s.path, s, self.verifier, {p.prompt_id for p in heldout})
        else:
            assert s.holdout_fraction is not None  # the settings' validator requires one of the two
            everything, self.reports["train"] = load_problems(s.path, s, self.verifier)
            train, heldout = split_holdout(everything, s.holdout_fraction, s.seed)
        log.info("dataset task: %d train and %d held-out problems", len(train), len(heldout))
        return {"train": train, "heldout": heldout}

    def score(self, completion_text: str, reference: str) -> float:
        """The reward of a completion, judged here with no time limit (generators use a ScoringPool)."""
        if not isinstance(completion_text, str) or not isinstance(reference, str):
            return reward(_ERROR, self.settings.reward_style)
        try:
            verdict = self.verifier.verdict(completion_text, reference)
        except Exception:  # a plugin that breaks its contract scores as an error
            verdict = _ERROR
        return reward(verdict, self.settings.reward_style)


_ERROR = Verdict(False, "error")
