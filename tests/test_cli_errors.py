"""Every ``asymptote`` subcommand answers a user's mistake in one line, not a traceback.

Each case runs the command line in a fresh interpreter, as a user would,
and checks: exit status 2, exactly one line on stderr that names the flag
(or argument) at fault, no traceback anywhere, and that neither torch nor
vLLM was imported, so the mistake was refused before anything heavy ran.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.badinput import BAD_INPUTS

REPO = Path(__file__).resolve().parents[1]
INTERFACE = "command line"
# services.cli's own ``if __name__ == "__main__"`` line, plus a report of the heavy modules loaded.
RUN_CLI = (
    "import sys\n"
    "from services.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as exit:\n"  # argparse's refusals exit from inside main
    "    code = exit.code\n"
    "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))\n"
    "sys.exit(code)\n"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli-errors")
    made = {
        "not_yaml": "engine: [model_dir\n",
        "unknown_key": "no_such_setting: 1\n",
        "a_list": "- 1\n- 2\n",
        "bad_value": "batch_prompts: -3\n",
        "bad_model": "model:\n  hidden_size: -4\n",
        "model_overrides": "model:\n  hidden_size: 64\n",
        "dataset_task": "task:\n  name: dataset\n  path: absent.jsonl\n  holdout_fraction: 0.1\n",
    }
    for name, text in made.items():
        (d / f"{name}.yaml").write_text(text)
    (d / "train.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')
    (d / "other_fields.jsonl").write_text('{"q": "1+1?", "a": "2"}\n')
    return {name: d / f"{name}.yaml" for name in made} | {
        "train": d / "train.jsonl",
        "other_fields": d / "other_fields.jsonl",
        "missing": d / "missing.yaml",
        "dir": d,
        "model_without_norm": _model_without_a_weight(d / "model-without-norm", "model.norm.weight"),
    }


def _model_without_a_weight(out: Path, name: str) -> Path:
    """A model directory whose checkpoint lacks the weight ``name`` (built here, in the test's process)."""
    from safetensors.torch import load_file, save_file

    from asymptote.tasks import ALPHABET
    from services.embedded.build import ModelSpec, create_model_dir

    spec = ModelSpec(hidden_size=32, num_heads=1, num_layers=1, intermediate_size=64, max_position_embeddings=32)
    create_model_dir(spec, ALPHABET, out)
    tensors = load_file(str(out / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


CASES: dict[str, tuple[list[str], str]] = {
    # id: (arguments, what the line must name); an argument "{name}" is that file of the fixture above.
    "broker-missing-config": (["broker", "--config", "{missing}"], "--config"),
    "broker-bad-value": (["broker", "--config", "{bad_value}"], "--config"),
    "generator-not-yaml": (["generator", "--config", "{not_yaml}"], "--config"),
    "learner-unknown-key": (["learner", "--config", "{unknown_key}"], "--config"),
    "fitter-not-a-mapping": (["fitter", "--config", "{a_list}"], "--config"),
    "up-negative-max-steps": (["up", "--max-steps", "-5"], "--max-steps"),
    "up-no-generators": (["up", "--generators", "0"], "--generators"),
    "up-too-many-ranks": (["up", "--learner-ranks", "99"], "--learner-ranks"),
    "up-resume-not-a-run": (["up", "--resume", "{dir}"], "--resume"),
    "up-unknown-tracker": (["up", "--report-to", "tensorbord"], "--report-to"),
    "up-run-dir-not-creatable": (["up", "--run-dir", "/proc/asymptote/run"], "--run-dir"),
    "up-missing-config": (["up", "--config", "{missing}"], "--config"),
    # Refused by the model-preparing child process; the stack says it once, as its own.
    "up-bad-model-in-config": (["up", "--config", "{bad_model}", "--run-dir", "{dir}"], "model.hidden_size"),
    "up-model-not-a-model-dir": (["up", "--model", "{dir}", "--run-dir", "{dir}"], "--model"),
    "up-model-and-tiny-model-settings": (["up", "--config", "{model_overrides}", "--model", "{dir}"], "--model"),
    "up-model-missing-a-weight": (
        ["up", "--model", "{model_without_norm}", "--run-dir", "{dir}"],
        "checkpoint lacks: model.norm.weight",
    ),
    "up-dataset-without-model": (["up", "--dataset", "{train}", "--holdout-fraction", "0.5"], "--model"),
    "up-dataset-missing": (
        ["up", "--model", "{dir}", "--dataset", "{missing}", "--holdout-fraction", "0.5"],
        "--dataset",
    ),
    "up-eval-dataset-without-dataset": (["up", "--eval-dataset", "{train}"], "--dataset"),
    "up-dataset-without-a-heldout-split": (["up", "--model", "{dir}", "--dataset", "{train}"], "--holdout-fraction"),
    "up-dataset-two-heldout-splits": (
        ["up", "--model", "{dir}", "--dataset", "{train}", "--eval-dataset", "{train}", "--holdout-fraction", "0.5"],
        "--eval-dataset",
    ),
    "up-holdout-fraction-out-of-range": (
        ["up", "--model", "{dir}", "--dataset", "{train}", "--holdout-fraction", "1.5"],
        "--holdout-fraction",
    ),
    "up-dataset-fields-not-found": (
        ["up", "--model", "{dir}", "--dataset", "{other_fields}", "--holdout-fraction", "0.5"],
        "rows have fields q, a, not prompt and answer",
    ),
    "up-dataset-task-in-config-without-model": (["up", "--config", "{dataset_task}"], "--config task"),
    "up-unknown-preset": (["up", "--dataset", "{train}", "--preset", "mmlu"], "--preset"),
    "fit-not-yaml": (["fit", "{dir}", "--config", "{not_yaml}"], "--config"),
    "bench-output-not-creatable": (["bench", "--output", "/proc/asymptote/bench"], "--output"),
    "prepare-model-not-json": (["prepare-model", "--request", "{cache_dir: x"], "--request"),
    "prepare-model-not-an-object": (["prepare-model", "--request", "[1, 2]"], "--request"),
    "prepare-model-no-cache-dir": (["prepare-model", "--request", "{}"], "--request"),
    "prepare-model-unknown-key": (["prepare-model", "--request", '{"cache_dir": "c", "size": 3}'], "--request"),
    "kube-negative-replicas": (["kube", "scale", "generators", "-1"], "replicas"),
    "kube-negative-timeout": (["kube", "health", "--timeout-s", "-1", "127.0.0.1:9"], "--timeout-s"),
    "kube-target-without-port": (["kube", "health", "localhost"], "HOST:PORT"),
    "unknown-command": (["serve"], "unknown command 'serve'"),
    # argparse's own refusals: a value of the wrong type, a flag no command has, a missing argument.
    "up-max-steps-not-a-number": (["up", "--max-steps", "abc"], "--max-steps"),
    "broker-unknown-flag": (["broker", "--no-such-flag"], "--no-such-flag"),
    "generator-config-without-value": (["generator", "--config"], "--config"),
    "fit-no-runs": (["fit"], "paths"),
    "fit-missing-run": (["fit", "{missing}"], "missing.yaml"),
    "bench-flag-with-a-value": (["bench", "--quick=3"], "--quick"),
    "kube-timeout-not-a-number": (["kube", "health", "--timeout-s", "soon", "127.0.0.1:9"], "--timeout-s"),
    "kube-no-command": (["kube"], "command"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mistake_is_one_line_naming_the_flag(case: str, files: dict[str, Path]) -> None:
    template, named = CASES[case]
    argv = [str(files[arg[1:-1]]) if arg[1:-1] in files else arg for arg in template]
    proc = subprocess.run(
        [sys.executable, "-c", RUN_CLI, *argv],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    BAD_INPUTS.record(INTERFACE, " ".join(argv), crashed="Traceback" in output)
    assert "Traceback" not in output, output
    assert proc.returncode == 2, output
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    said_by = "asymptote:" if case == "unknown-command" else f"asymptote {argv[0]}"
    assert lines[0].startswith(said_by) and named in lines[0], lines[0]
    heavy = ast.literal_eval(proc.stdout.splitlines()[-1])
    assert heavy == [], f"{heavy} imported before refusing {argv}"


def test_the_command_s_conventions(capsys: pytest.CaptureFixture[str]) -> None:
    """Bare ``asymptote`` prints the commands and exits 0; ``--version``; no abbreviated flags;
    internal commands stay out of the list; help says a flag's default."""
    from asymptote import __version__
    from services.cli import main

    assert main([]) == 0 and "asymptote <command>" in capsys.readouterr().out
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"asymptote {__version__}"
    with pytest.raises(SystemExit) as refused:
        main(["up", "--max", "5"])  # --max-steps is not guessed from a prefix
    assert refused.value.code == 2 and "unrecognized arguments: --max 5" in capsys.readouterr().err
    main(["--help"])
    assert "prepare-model" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    assert done.value.code == 0 and "(default: 0.02)" in capsys.readouterr().out  # --margin's
