"""A run's metrics mirrored to TensorBoard and to W&B (offline), each row once, as the files grow.

The real writers: TensorBoard's event files read back with its own
EventAccumulator, and a W&B run in offline mode (nothing leaves the
machine) read back from its transaction log. Rows arrive in two parts, a
half-written line among them, and a step trained again after a restart is
left out.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.local.config import StackConfig
from services.local.trackers import TENSORBOARD_DIR, Mirror


def step_row(step: int) -> dict[str, object]:
    return {"step": step, "policy_version": step, "unix_s": 1e9 + step, "loss": 0.5 / step, "reward/mean": 0.1 * step,
            "staleness/hist/0": 3.0, "note": "text is left out"}  # fmt: skip


def eval_row(version: int) -> dict[str, object]:
    return {"policy_version": version, "pass_rate": 0.2 + 0.01 * version, "compute": 100.0 * version,
            "tokens_by_version": {"0": 12}}  # fmt: skip


def append(path: Path, rows: list[dict[str, object]], tail: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_tensorboard_and_wandb_get_each_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    config = StackConfig(run_dir=run, report_to=("tensorboard", "wandb")).model_dump(mode="json")
    mirror = Mirror(run, ("tensorboard", "wandb"), "test-run", config)
    assert mirror.poll() == 0  # nothing written yet
    append(run / "metrics.jsonl", [step_row(1), step_row(2)], tail='{"step": 3, "lo')  # the last line half-written
    append(run / "eval.jsonl", [eval_row(0)])
    assert mirror.poll() == 3
    with (run / "metrics.jsonl").open("a") as f:
        f.write('ss": 0.1}\n')
    append(run / "metrics.jsonl", [step_row(2), step_row(4)])  # step 2 again: trained again after a restart
    append(run / "eval.jsonl", [eval_row(4)])
    assert mirror.poll() == 3  # step 3 (now whole), step 4, the eval at version 4
    mirror.close()

    events = EventAccumulator(str(run / TENSORBOARD_DIR))
    events.Reload()
    loss = [(e.step, round(e.value, 6)) for e in events.Scalars("train/loss")]
    assert loss == [(1, 0.5), (2, 0.25), (3, 0.1), (4, 0.125)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("eval/pass_rate")] == [(0, 0.2), (4, 0.24)]
    assert [e.value for e in events.Scalars("eval/compute")] == [0.0, 400.0]
    assert "train/note" not in events.Tags()["scalars"] and "train/staleness/hist/0" in events.Tags()["scalars"]

    history = wandb_history(next(run.glob("wandb/offline-run-*/run-*.wandb")))
    train = [(row["train/step"], row["train/loss"]) for row in history if "train/step" in row]
    assert train == [(1, 0.5), (2, 0.25), (3, 0.1), (4, 0.125)]
    evals = [(row["eval/policy_version"], row["eval/pass_rate"]) for row in history if "eval/policy_version" in row]
    assert evals == [(0, 0.2), (4, pytest.approx(0.24))]


def wandb_history(path: Path) -> list[dict[str, object]]:
    """The rows ``wandb.log`` wrote to an offline run's transaction log (LevelDB's log format: 32 KiB blocks
    of records, each a 7-byte header of checksum, length and type, then a protobuf ``Record``)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, chunks = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            chunks.append(body)
        elif kind in (2, 3):  # its first or a middle part
            pending += body
        elif kind == 4:  # its last part
            chunks.append(pending + body)
            pending = b""
    rows = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
