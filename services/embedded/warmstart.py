"""Warm start: the short supervised pass that makes the tiny model RL-ready.

Owns supervised fine-tuning of a freshly built model on the task's train
split (loss on completion tokens only), the held-out sampled pass rate used
to judge it, and the on-disk cache of finished model directories keyed by
every setting that shaped them. What the model sees and is taught is a
``Format``: on the arithmetic task, the bare prompt and the reference + EOS
(character tokenizer); on a dataset task whose rows carry a worked
``solution`` (the embedded word problems, asymptote/tasks/words.py), the
prompt through the chat template and ``<think>`` steps ``</think>`` then ``\\boxed{answer}``
+ EOS, with a byte-level BPE tokenizer trained here on the train rows. A
code task's answer is its row's gold program in a fenced ```` ```python ````
block instead of the box (the words-code rows, asymptote/tasks/words_code.py);
a mixture teaches each sub-task's problems in that sub-task's format.

The pass is deliberately short: RL needs a policy that solves some problems
sometimes (a pass rate well above 0 and well below 1 when sampled at
temperature 1), not one that has converged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from pydantic import Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from asymptote.config import Frozen
from asymptote.logs import setup_logging
from asymptote.tasks import (
    ALPHABET,
    ArithmeticSettings,
    ArithmeticTask,
    DatasetSettings,
    LengthControlSettings,
    MixtureSettings,
    MixtureTask,
    MultiTurnSettings,
    MultiTurnTask,
    Problem,
    Task,
    TaskSettingsValue,
    get_task,
)
from asymptote.tasks.code import CODE_LAYOUTS, fenced, gold_program
from asymptote.tasks.dataset import prompt_id_of
from asymptote.tasks.mixture import mixture_prompt_id
from asymptote.tasks.multiturn import OPERATIONAL_ENVIRONMENT_FIELDS
from asymptote.tasks.prompts import render_prompt
from asymptote.tasks.readers import DatasetError, read_rows
from asymptote.tasks.words import SOLUTION_FIELD
from services.embedded.build import (
    TEST_VOCAB_SIZE,
    ModelSpec,
    build_model,
    build_tokenizer,
    save_model_dir,
    train_bpe_tokenizer,
)
from services.embedded.sampling import sample_groups
from services.embedded.warmstart_turns import MULTITURN_FORMAT_VERSION, demonstrations, episode_pass_rate
from services.learner.model import completion_logprobs, count_parameters, pack

log = logging.getLogger(__name__)

# Bump when the meaning of the cached directory changes (layout, training code)
# so stale caches are not reused.
CACHE_FORMAT = 2


class WarmstartSettings(Frozen):
    """The supervised pass: train until a target sampled pass rate, within a step budget.

    Stopping on a measured pass rate rather than a fixed step count matters
    here: small transformers learn addition after a plateau whose length
    varies with seed and floating-point details (a few hundred steps, more or
    less), so a fixed count could end anywhere between 0 and 0.9.
    """

    max_steps: int = Field(default=1200, ge=0)
    """Optimizer steps at most (about 2 minutes of one core with the default model)."""
    target_pass_rate: float = Field(default=0.3, gt=0, le=1)
    """Stop once the probe's pass rate, sampled at temperature 1, reaches this."""
    check_every_steps: int = Field(default=10, ge=1)
    """Steps between probe measurements."""
    num_probe_problems: int = Field(default=256, ge=1)
    """Train problems in the probe (two samples each); held-out stays unseen."""
    batch_size: int = Field(default=128, ge=1)
    """Problems per step."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate after warm-up (constant: the stopping step is not known ahead)."""
    warmup_steps: int = Field(default=20, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    seed: int = 0
    """Seed of batch order and probe sampling."""
    eval_samples_per_prompt: int = Field(default=4, ge=1)
    """Samples per held-out prompt when reporting the finished model's pass rate."""


@dataclass(frozen=True)
class EvalResult:
    pass_rate: float
    """Mean reward over all held-out prompts and samples."""
    num_prompts: int
    num_samples: int
    truncation_rate: float
    """Fraction of samples that hit max_new_tokens without EOS."""


DATASET_MODEL: dict[str, object] = {
    "family": "qwen3",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
    "max_position_embeddings": 256,
}
"""The tiny model built for a dataset task (ModelSpec fields): Qwen3-shaped, as the GPU examples' models
are, with room for a chat-rendered prompt, its thinking and the answer."""
MULTITURN_MODEL: dict[str, object] = {**DATASET_MODEL, "max_position_embeddings": 512}
"""A multi-turn task's: room for the tools' schemas in the prompt and an episode's turns after it."""
DATASET_WARMSTART: dict[str, object] = {
    "max_steps": 800,
    "target_pass_rate": 0.28,
    "check_every_steps": 25,
    "num_probe_problems": 128,
    "batch_size": 32,
    "lr": 0.002,
}
"""The warm start of the tiny model on a dataset task's worked solutions (WarmstartSettings fields). On the
word problems it stops near 350 steps, where sampling at temperature 1 solves about a quarter of the
held-out problems and the most likely answer is right about twice as often: the room RL's sharpening has
(its interruption length control starts the stack lower still)."""


def tiny_model_settings(
    task: TaskSettingsValue, model: dict[str, object] | None = None, warmstart: dict[str, object] | None = None
) -> tuple[ModelSpec, WarmstartSettings]:
    """The tiny model's shape and warm start for ``task``: the task kind's defaults under ``model`` and
    ``warmstart`` (overrides, as a stack config gives them)."""
    dataset = isinstance(task, (DatasetSettings, MixtureSettings, MultiTurnSettings))
    shape = MULTITURN_MODEL if isinstance(task, MultiTurnSettings) else DATASET_MODEL if dataset else {}
    spec = ModelSpec.model_validate({**shape, **(model or {})})
    settings = WarmstartSettings.model_validate({**(DATASET_WARMSTART if dataset else {}), **(warmstart or {})})
    return spec, settings


BPE_VOCAB_SIZE = TEST_VOCAB_SIZE
"""Vocabulary of the BPE tokenizer trained for a dataset task's tiny model."""
MULTITURN_BPE_VOCAB_SIZE = 768
"""A multi-turn task's: its episodes carry the tools' schemas and the chat template's tool instructions,
which take about 230 tokens of a calculator episode's prompt at this size (about 275 at 512)."""


@dataclass(frozen=True)
class Format:
    """What the model is shown for a problem and the completion it is taught (EOS is added after it)."""

    prompt: Callable[[Problem], str]
    target: Callable[[Problem], str]
    add_special_tokens: bool = True
    """Let the tokenizer add its specials (BOS) to the prompt; off for chat-rendered text."""


ARITHMETIC_FORMAT = Format(prompt=lambda p: p.prompt, target=lambda p: p.reference)
"""The bare prompt, and the reference answer."""


INTERRUPTED_SHARE = 0.25
"""Share of a dataset warm start's targets cut off by the interruption phrase: length control appends
it to completions that think past their budget, and the model must answer after it."""
DATASET_FORMAT_VERSION = 2
"""Bump when the dataset format's targets change, so cached dataset models are rebuilt."""
CODE_FORMAT_VERSION = 1
"""Bump when a code task's targets (the fenced gold program) change; in the cache key of code tasks and
mixtures only."""


def thinking_completion(
    solution: str, reference: str, interruption: str | None = None, seed: str = "", program: str | None = None
) -> str:
    """``<think>`` with the worked steps, then the answer in ``\\boxed{}`` (or, with ``program``, that
    program in a fenced Python block: a code task's answer, which the code verifier runs).

    With ``interruption`` (length control's phrase, which closes the
    thinking), the steps stop after a number of them fixed by ``seed`` and
    the phrase stands in for ``</think>``.
    """
    answer = fenced(program) if program is not None else f"\\boxed{{{reference}}}"
    if interruption is None:
        return f"<think>\n{solution}\n</think>\n\n{answer}"
    steps = [step for step in solution.removesuffix(".").split(". ") if step]
    kept = random.Random(seed).randint(0, max(0, len(steps) - 1))
    thinking = "".join(f"{step}. " for step in steps[:kept])
    return f"<think>\n{thinking}{interruption}\n\n{answer}"


def interrupted(prompt_id: str, share: float = INTERRUPTED_SHARE) -> bool:
    """Whether this problem's warm-start target is an interrupted one (by a hash of its id)."""
    digest = hashlib.blake2b(prompt_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def worked_solutions(settings: DatasetSettings) -> dict[str, str]:
    """Each row's ``solution`` by problem id, over the train and held-out files; DatasetError when a row has none."""
    out: dict[str, str] = {}
    names = settings.field_names
    for path in (settings.path, settings.eval_path):
        if path is None:
            continue
        for number, row in read_rows(path, settings.format, settings.split):
            if not isinstance(row, dict) or names.prompt not in row:
                continue
            solution = row.get(SOLUTION_FIELD)
            if not isinstance(solution, str) or not solution.strip():
                raise DatasetError(
                    f"{path} row {number}: a warm start on a dataset needs a worked '{SOLUTION_FIELD}' in every row"
                )
            file_id = row.get(names.id) if names.id is not None else None
            out[prompt_id_of(file_id, str(row[names.prompt]))] = solution.strip()
    return out


def gold_programs(settings: DatasetSettings) -> dict[str, str]:
    """A code layout's gold program of each row by problem id, over the train and held-out files;
    DatasetError when a row has none (a code task's warm start teaches it)."""
    assert settings.preset in CODE_LAYOUTS, "only code layouts have gold programs"
    out: dict[str, str] = {}
    names = settings.field_names
    for path in (settings.path, settings.eval_path):
        if path is None:
            continue
        for number, row in read_rows(path, settings.format, settings.split):
            if not isinstance(row, dict) or names.prompt not in row:
                continue
            try:
                program = gold_program(row, settings.preset)
            except ValueError:
                program = None
            if not program:
                raise DatasetError(f"{path} row {number}: a warm start on a code task needs a gold solution per row")
            file_id = row.get(names.id) if names.id is not None else None
            out[prompt_id_of(file_id, str(row[names.prompt]))] = program.strip()
    return out


def _programs(settings: DatasetSettings) -> dict[str, str] | None:
    """The gold programs a code task's warm start answers with; None for a task answered in a box."""
    return gold_programs(settings) if settings.preset in CODE_LAYOUTS else None


def _program(programs: dict[str, str] | None, prompt_id: str) -> str | None:
    return programs[prompt_id] if programs is not None else None


def dataset_format(settings: DatasetSettings, tokenizer: PreTrainedTokenizerBase) -> Format:
    """The chat-rendered prompt, and the worked solution in ``<think>`` before the ``\\boxed{}`` answer
    (a code layout's: before its gold program in a fenced Python block); with length control on, a share
    of the problems (``interrupted``) is cut off by its phrase."""
    solutions = worked_solutions(settings)
    programs = _programs(settings)
    phrase = settings.length_control.interruption_phrase if settings.length_control.enabled else None

    def target(p: Problem) -> str:
        cut = phrase if phrase is not None and interrupted(p.prompt_id) else None
        program = _program(programs, p.prompt_id)
        return thinking_completion(solutions[p.prompt_id], p.reference, cut, seed=p.prompt_id, program=program)

    return Format(
        prompt=lambda p: render_prompt(p.prompt, settings, tokenizer),
        target=target,
        add_special_tokens=False,
    )


def mixture_format(task: MixtureTask, tokenizer: PreTrainedTokenizerBase) -> Format:
    """Each problem of a mixture in its own sub-task's format (its ids are the sub-task's, prefixed)."""
    formats = {name: format_for(sub, tokenizer) for name, sub in task.sub_tasks.items()}

    def own(p: Problem) -> tuple[Format, Problem]:
        name = task.sub_task_of(p.prompt_id)
        return formats[name], Problem(p.prompt_id.removeprefix(mixture_prompt_id(name, "")), p.prompt, p.reference)

    def prompt(p: Problem) -> str:
        fmt, problem = own(p)
        return fmt.prompt(problem)

    def target(p: Problem) -> str:
        fmt, problem = own(p)
        return fmt.target(problem)

    # One tokenization for every problem: chat-rendered text unless every sub-task wants its specials.
    specials = all(f.add_special_tokens for f in formats.values())
    return Format(prompt=prompt, target=target, add_special_tokens=specials)


def format_for(task: Task, tokenizer: PreTrainedTokenizerBase) -> Format:
    """The warm start's format for ``task``: dataset tasks think then box (code tasks: then a program),
    the arithmetic task answers bare, a mixture each problem as its sub-task does."""
    if isinstance(task, MixtureTask):
        return mixture_format(task, tokenizer)
    settings = getattr(task, "settings", None)
    return dataset_format(settings, tokenizer) if isinstance(settings, DatasetSettings) else ARITHMETIC_FORMAT


def score_problem(task: Task, completion_text: str, problem: Problem) -> float:
    """``problem``'s reward for ``completion_text``: a mixture's by the problem's sub-task."""
    if isinstance(task, MixtureTask):
        return task.score_in(task.sub_task_of(problem.prompt_id), completion_text, problem.reference)
    return task.score(completion_text, problem.reference)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, problems: list[Problem], fmt: Format = ARITHMETIC_FORMAT
) -> list[list[int]]:
    return [tokenizer(fmt.prompt(p), add_special_tokens=fmt.add_special_tokens)["input_ids"] for p in problems]


def encode_targets(
    tokenizer: PreTrainedTokenizerBase, problems: list[Problem], fmt: Format = ARITHMETIC_FORMAT
) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    return [tokenizer(fmt.target(p), add_special_tokens=False)["input_ids"] + [eos] for p in problems]


def max_new_tokens_for(
    tokenizer: PreTrainedTokenizerBase, problems: list[Problem], slack: int = 2, fmt: Format = ARITHMETIC_FORMAT
) -> int:
    """Longest target + EOS + slack: room to be wrong without running long."""
    return max(len(t) for t in encode_targets(tokenizer, problems, fmt)) + slack


@torch.no_grad()
def sampled_pass_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    problems: Sequence[Problem],
    num_samples_per_prompt: int,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    seed: int = 0,
    batch_rows: int = 1024,
    fmt: Format = ARITHMETIC_FORMAT,
    length: LengthControlSettings | None = None,
) -> EvalResult:
    """Mean reward over ``num_samples_per_prompt`` samples of every problem; with ``length`` (a task's
    length control) the samples of a problem are one group under a thinking budget drawn per problem and
    ``seed``, as a generator samples an eval task."""
    problems = list(problems)
    max_new = max_new_tokens or max_new_tokens_for(tokenizer, problems, fmt=fmt)
    rows = [p for p in problems for _ in range(num_samples_per_prompt)]
    prompt_ids = encode_prompts(tokenizer, rows, fmt)
    keys = [f"eval:{seed}:{p.prompt_id}" for p in rows]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total, truncated = 0.0, 0
    for start in range(0, len(rows), batch_rows):
        end = start + batch_rows
        out = sample_groups(
            model, tokenizer, prompt_ids[start:end], keys[start:end], max_new, length, temperature, gen
        ).samples
        texts = tokenizer.batch_decode(out.completions, skip_special_tokens=True)
        total += sum(score_problem(task, t, p) for t, p in zip(texts, rows[start:end]))
        truncated += sum(out.truncated)
    model.train(was_training)
    return EvalResult(
        pass_rate=total / len(rows),
        num_prompts=len(problems),
        num_samples=len(rows),
        truncation_rate=truncated / len(rows),
    )


def evaluate_pass_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    num_samples_per_prompt: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    length: LengthControlSettings | None = None,
) -> EvalResult:
    """Held-out pass rate: mean reward over k samples of every held-out prompt (a multi-turn task's: k
    episodes)."""
    problems = task.problems("heldout")
    return probe(model, tokenizer, task, problems, num_samples_per_prompt, temperature, seed, max_new_tokens, length)


def probe(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    problems: Sequence[Problem],
    num_samples_per_prompt: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_new_tokens: int | None = None,
    length: LengthControlSettings | None = None,
) -> EvalResult:
    """The sampled pass rate on ``problems`` in the task's own form: completions, or whole episodes;
    ``max_new_tokens`` and ``length`` as in :func:`sampled_pass_rate` (single-turn tasks)."""
    if isinstance(task, MultiTurnTask):
        rates = episode_pass_rate(model, tokenizer, task, problems, num_samples_per_prompt, temperature, seed)
        return EvalResult(rates.pass_rate, rates.num_prompts, rates.num_samples, rates.truncation_rate)
    return sampled_pass_rate(
        model,
        tokenizer,
        task,
        problems,
        num_samples_per_prompt,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        fmt=format_for(task, tokenizer),
        length=length,
    )


def training_pairs(
    task: Task, tokenizer: PreTrainedTokenizerBase, problems: Sequence[Problem]
) -> tuple[list[list[int]], list[list[int]]]:
    """The supervised pass's prompts and targets (EOS included): one per problem in the task's format, or one
    per model turn of each problem's demonstrated episode (a multi-turn task)."""
    if isinstance(task, MultiTurnTask):
        demos = demonstrations(task, tokenizer, problems, worked_solutions(task.settings.dataset))
        return [p for d in demos for p in d.prompts], [t for d in demos for t in d.turns]
    fmt = format_for(task, tokenizer)
    return encode_prompts(tokenizer, list(problems), fmt), encode_targets(tokenizer, list(problems), fmt)


@dataclass(frozen=True)
class WarmstartReport:
    losses: list[float]
    """Training loss of every step taken."""
    num_steps: int
    probe_pass_rate: float
    """Last probe measurement (train problems, temperature 1)."""
    reached_target: bool
    train_seconds: float
    """Wall time of the pass, probes included."""


def supervised_pass(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    settings: WarmstartSettings,
    log_every: int = 50,
) -> WarmstartReport:
    """Train ``model`` in place on the train split until the probe reaches the target.

    Loss: mean negative log-likelihood of completion tokens (the format's target + EOS; on a multi-turn
    task, each demonstrated turn is a sample of its own).
    """
    problems = list(task.problems("train"))
    prompts, targets = training_pairs(task, tokenizer, problems)
    probed = problems[: settings.num_probe_problems]
    if isinstance(task, MixtureTask):  # every sub-task in the probe: its problems come sub-task after sub-task
        probed = problems[:: max(1, len(problems) // settings.num_probe_problems)][: settings.num_probe_problems]
    rng = random.Random(settings.seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    model.train()
    losses: list[float] = []
    probe_rate, reached = 0.0, False
    started = time.perf_counter()
    for step in range(settings.max_steps):
        if len(order) < settings.batch_size:
            # Epoch-style shuffling: every sample once before any twice.
            fresh = list(range(len(prompts)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[: settings.batch_size], order[settings.batch_size :]
        batch = pack([prompts[i] for i in idx], [targets[i] for i in idx], tokenizer.pad_token_id)
        logp = completion_logprobs(model, batch)
        loss = -(logp.sum() / batch.completion_mask.sum())
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * min(1.0, (step + 1) / max(1, settings.warmup_steps))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % settings.check_every_steps == 0:
            probe_rate = probe(model, tokenizer, task, probed, 2, seed=settings.seed + step).pass_rate
            reached = probe_rate >= settings.target_pass_rate
        if log_every and ((step + 1) % log_every == 0 or reached):
            log.info(
                "warmstart step %d/%d loss %.4f probe pass rate %.3f (%.1fs)",
                step + 1,
                settings.max_steps,
                sum(losses[-log_every:]) / len(losses[-log_every:]),
                probe_rate,
                time.perf_counter() - started,
            )
        if reached:
            break
    model.eval()
    if not reached:
        log.warning(
            "warm start used all %d steps without the probe reaching %.2f (last %.3f)",
            settings.max_steps,
            settings.target_pass_rate,
            probe_rate,
        )
    return WarmstartReport(
        losses=losses,
        num_steps=len(losses),
        probe_pass_rate=probe_rate,
        reached_target=reached,
        train_seconds=time.perf_counter() - started,
    )


def _file_digest(path: Path) -> str:
    """Hash of a file's bytes, or of every file under a folder (names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if f.is_file():
            h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(spec: ModelSpec, task_settings: TaskSettingsValue, settings: WarmstartSettings) -> str:
    """Hash of everything that shapes the finished model (and the code's format version).

    A dataset task's files are hashed by content: editing them makes a new model, moving them does not.
    """
    fields: dict[str, object] = {
        "format": CACHE_FORMAT,
        "model": spec.model_dump(mode="json"),
        "task": task_settings.model_dump(mode="json"),
        "warmstart": settings.model_dump(mode="json", exclude={"eval_samples_per_prompt"}),
    }
    if isinstance(task_settings, DatasetSettings):
        # Where the files are, and whether code rows' gold solutions are run at load, shape no model.
        fields["task"] = task_settings.model_dump(mode="json", exclude={"path", "eval_path", "check_gold"})
        fields["data"] = [_file_digest(p) for p in (task_settings.path, task_settings.eval_path) if p is not None]
        fields["bpe_vocab_size"] = BPE_VOCAB_SIZE
        fields["dataset_format"] = DATASET_FORMAT_VERSION
        if task_settings.preset in CODE_LAYOUTS:
            fields["code_format"] = CODE_FORMAT_VERSION
    if isinstance(task_settings, MixtureSettings):
        located = {"__all__": {"task": {"path", "eval_path", "check_gold"}}}
        fields["task"] = task_settings.model_dump(mode="json", exclude={"tasks": located})
        fields["data"] = [
            _file_digest(p)
            for e in task_settings.tasks
            if isinstance(e.task, DatasetSettings)
            for p in (e.task.path, e.task.eval_path)
            if p is not None
        ]
        fields["bpe_vocab_size"] = BPE_VOCAB_SIZE
        fields["dataset_format"] = DATASET_FORMAT_VERSION
        fields["code_format"] = CODE_FORMAT_VERSION
    if isinstance(task_settings, MultiTurnSettings):
        dataset = task_settings.dataset
        fields["task"] = task_settings.model_dump(
            mode="json",
            exclude={
                "dataset": {"path", "eval_path", "check_gold"},
                "environment": set(OPERATIONAL_ENVIRONMENT_FIELDS),
            },
        )
        fields["data"] = [_file_digest(p) for p in (dataset.path, dataset.eval_path) if p is not None]
        fields["bpe_vocab_size"] = MULTITURN_BPE_VOCAB_SIZE
        fields["multiturn_format"] = MULTITURN_FORMAT_VERSION
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_for(task: Task, spec: ModelSpec) -> PreTrainedTokenizerFast:
    """The arithmetic task's character tokenizer (one token per character its problems can hold); for every
    other task, BPE trained on the warm start's train texts (``tokenizer_texts``)."""
    if isinstance(task, ArithmeticTask):
        return build_tokenizer(ALPHABET, spec.vocab_multiple)
    size = MULTITURN_BPE_VOCAB_SIZE if isinstance(task, MultiTurnTask) else BPE_VOCAB_SIZE
    return train_bpe_tokenizer(tokenizer_texts(task), size)


def tokenizer_texts(task: Task) -> list[str]:
    """What a dataset task's (or a mixture's) BPE tokenizer is trained on: each train problem's prompt
    (as its prompt format words it) and taught completion, and the interruption phrase."""
    if isinstance(task, MixtureTask):
        return [text for sub in task.sub_tasks.values() for text in tokenizer_texts(sub)]
    if isinstance(task, MultiTurnTask):
        # Whole demonstrated episodes as the chat template renders them (the tools' schemas included),
        # rendered with a tokenizer that carries the same template.
        renderer = train_bpe_tokenizer(["a b"], BPE_VOCAB_SIZE)
        problems = task.problems("train")
        solutions = worked_solutions(task.settings.dataset)
        return [d.text for d in demonstrations(task, renderer, problems, solutions)]
    settings = getattr(task, "settings", None)
    if not isinstance(settings, DatasetSettings):
        raise ValueError(f"task {task.name!r} is not a dataset task: no BPE tokenizer to train for it")
    solutions = worked_solutions(settings)
    programs = _programs(settings)
    texts = [
        f"{settings.prompt_format.format(prompt=p.prompt) if programs is not None else p.prompt}\n"
        f"{thinking_completion(solutions[p.prompt_id], p.reference, program=_program(programs, p.prompt_id))}"
        for p in task.problems("train")
    ]
    # The interruption phrase, often enough to be merged: length control appends it.
    texts += [settings.length_control.interruption_phrase] * 16
    return texts


LOCKS_DIR = ".locks"
"""The folder of the cache's lock files (one per key; they stay, empty, as lock files do)."""


def prepare_model(
    cache_dir: Path,
    spec: ModelSpec | None = None,
    task_settings: TaskSettingsValue | None = None,
    settings: WarmstartSettings | None = None,
) -> Path:
    """The warm-started model directory for these settings, built once and cached.

    The directory is ``cache_dir/warmstart-<key>``; it is written in a
    temporary sibling and renamed into place, so a crash never leaves a
    half-written model that a later run would take as finished.
    """
    spec = spec or ModelSpec()
    task_settings = task_settings or ArithmeticSettings()
    settings = settings or WarmstartSettings()
    cache_dir = Path(cache_dir)
    final = cache_dir / f"warmstart-{cache_key(spec, task_settings, settings)}"
    if (final / "config.json").is_file():
        log.info("warm-started model found in cache: %s", final)
        return final
    locks = cache_dir / LOCKS_DIR
    locks.mkdir(parents=True, exist_ok=True)
    # One builder per key: a second process (another run, a parallel test worker) waits and takes its result.
    with FileLock(locks / f"{final.name}.lock"):
        if (final / "config.json").is_file():
            log.info("warm-started model found in cache: %s", final)
            return final
        return _build_into(final, spec, task_settings, settings)


def _build_into(final: Path, spec: ModelSpec, task_settings: TaskSettingsValue, settings: WarmstartSettings) -> Path:
    """Build and warm-start the model, written beside ``final`` and renamed into place."""
    cache_dir = final.parent
    tmp = Path(tempfile.mkdtemp(prefix=".warmstart-", dir=cache_dir))
    try:
        task = get_task(task_settings.name, task_settings)
        tokenizer = tokenizer_for(task, spec)
        model = build_model(spec, tokenizer)
        log.info(
            "warm start: %s parameters, up to %d steps of %d problems",
            f"{count_parameters(model):,}",
            settings.max_steps,
            settings.batch_size,
        )
        report = supervised_pass(model, tokenizer, task, settings)
        result = evaluate_pass_rate(model, tokenizer, task, settings.eval_samples_per_prompt)
        log.info(
            "warm start done: %d steps in %.1fs, held-out sampled pass rate %.3f",
            report.num_steps,
            report.train_seconds,
            result.pass_rate,
        )
        save_model_dir(model, tokenizer, tmp)
        (tmp / "warmstart.json").write_text(
            json.dumps(
                {
                    "model": spec.model_dump(mode="json"),
                    "task": task_settings.model_dump(mode="json"),
                    "warmstart": settings.model_dump(mode="json"),
                    "num_parameters": count_parameters(model),
                    "num_steps": report.num_steps,
                    "reached_target": report.reached_target,
                    "probe_pass_rate": report.probe_pass_rate,
                    "train_seconds": round(report.train_seconds, 2),
                    "final_loss": report.losses[-1] if report.losses else None,
                    "heldout_pass_rate": result.pass_rate,
                    "heldout_num_samples": result.num_samples,
                },
                indent=2,
            )
        )
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same key first; theirs is as good.
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build and warm-start the tiny local model.")
    parser.add_argument("--out", type=Path, required=True, help="cache directory for model directories")
    parser.add_argument("--max-steps", type=int, default=None, help="override warmstart max_steps")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging("warmstart", "text", args.log_level)
    torch.set_num_threads(1)
    settings = WarmstartSettings() if args.max_steps is None else WarmstartSettings(max_steps=args.max_steps)
    path = prepare_model(args.out, settings=settings)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
