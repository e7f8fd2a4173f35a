"""``python -m asymptote.download``, the chart's download init containers' command.

The Hugging Face hub cannot be reached from the test machines, so the
download call (``huggingface_hub.snapshot_download``) is replaced by a
stand-in that writes the files a repository would hold; everything around
it (what is asked for, idempotence, refusals) runs as in a pod.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asymptote.download import MODEL_PATTERNS, RECORD, main


class Hub:
    """Writes ``files`` into ``local_dir`` as snapshot_download would; records each call."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        for name in self.files:
            (Path(kwargs["local_dir"]) / name).write_text("x")
        return str(kwargs["local_dir"])


def test_a_model_is_fetched_once_with_its_weights_config_and_tokenizer(tmp_path: Path) -> None:
    hub = Hub(["model.safetensors", "config.json", "tokenizer.json"])
    dest = tmp_path / "models" / "qwen3"
    argv = ["model", "Qwen/Qwen3-8B", str(dest), "--revision", "v1"]
    assert main(argv, hub) == 0
    assert hub.calls == [
        {
            "repo_id": "Qwen/Qwen3-8B",
            "repo_type": "model",
            "revision": "v1",
            "local_dir": str(dest),
            "allow_patterns": list(MODEL_PATTERNS),
        }
    ]
    assert json.loads((dest / RECORD).read_text())["repo"] == "Qwen/Qwen3-8B"
    # A second pod (or a restart) on the same volume finds it there.
    assert main(argv, hub) == 0
    assert len(hub.calls) == 1
    # Another revision is fetched again.
    assert main(["model", "Qwen/Qwen3-8B", str(dest), "--revision", "v2"], hub) == 0
    assert [c["revision"] for c in hub.calls] == ["v1", "v2"]


def test_a_fetch_cut_short_is_done_again(tmp_path: Path) -> None:
    class Dies(Hub):
        def __call__(self, **kwargs: Any) -> str:
            super().__call__(**kwargs)
            raise ConnectionError("connection reset")

    dest = tmp_path / "m"
    with pytest.raises(ConnectionError):
        main(["model", "o/m", str(dest)], Dies(["model.safetensors"]))
    assert not (dest / RECORD).exists()
    hub = Hub(["model.safetensors", "config.json"])
    assert main(["model", "o/m", str(dest)], hub) == 0 and len(hub.calls) == 1


def test_a_dataset_takes_the_files_asked_for(tmp_path: Path) -> None:
    hub = Hub(["train.parquet"])
    assert main(["dataset", "openai/gsm8k", str(tmp_path / "d"), "--allow", "main/*.parquet"], hub) == 0
    assert hub.calls[0]["repo_type"] == "dataset" and hub.calls[0]["allow_patterns"] == ["main/*.parquet"]


@pytest.mark.parametrize(
    ("argv", "files", "message"),
    [
        (["model", "qwen3", "D"], [], "repository 'qwen3': expected OWNER/NAME"),
        (["model", "o/m", "D"], ["pytorch_model.bin", "config.json"], "o/m@main has no *.safetensors weights"),
    ],
)
def test_bad_requests_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], files: list[str], message: str
) -> None:
    argv = [str(tmp_path / a) if a == "D" else a for a in argv]
    assert main(argv, Hub(files)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "D" / RECORD).exists()
