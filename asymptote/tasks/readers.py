"""Rows from dataset files: jsonl, parquet, csv and ``save_to_disk`` folders.

Owns turning a file into numbered rows (dicts) and nothing more: which
fields mean what, and which rows are bad, is dataset.py's business. A
row a reader cannot decode (a jsonl line that is not a JSON object) comes
back as an error string so it is counted with the other bad rows. Local
files only; ``datasets`` and ``pyarrow`` are imported when a file needs
them, and neither imports torch.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

FileFormat = Literal["auto", "jsonl", "parquet", "csv", "hf_disk"]
"""auto picks by suffix (.jsonl/.json, either gzipped, .parquet, .csv) or, for a folder, a save_to_disk dataset."""

_SUFFIXES: dict[str, FileFormat] = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}

Row = tuple[int, dict[str, Any] | str]
"""A 1-based row number (a jsonl line number) and the row, or why it could not be read."""


class DatasetError(ValueError):
    """A dataset that cannot be used at all: missing, unreadable, or with no good rows."""


def resolve_format(path: Path, file_format: FileFormat) -> FileFormat:
    """The format ``path`` is read as; DatasetError if it is missing or not recognised."""
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if file_format != "auto":
        return file_format
    if path.is_dir():
        return "hf_disk"
    suffixes = [s.lower() for s in path.suffixes]
    gzipped = suffixes[-2:-1] if suffixes[-1:] == [".gz"] else []
    found = _SUFFIXES.get(path.suffix.lower()) or ("jsonl" if gzipped and gzipped[0] in (".jsonl", ".json") else None)
    if found is None:
        raise DatasetError(
            f"cannot tell the format of {path} from its suffix; use .jsonl, .json (either may be .gz), .parquet, "
            ".csv, a folder "
            "written by datasets' save_to_disk, or set format"
        )
    return found


def read_rows(path: Path, file_format: FileFormat = "auto", split: str = "train") -> Iterator[Row]:
    """The rows of ``path``; ``split`` picks one split of a saved ``DatasetDict`` folder."""
    fmt = resolve_format(path, file_format)
    if fmt == "jsonl":
        return _jsonl(path)
    if fmt == "csv":
        return _csv(path)
    if fmt == "parquet":
        return _parquet(path)
    return _hf_disk(path, split)


def _jsonl(path: Path) -> Iterator[Row]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, f"not JSON ({exc.msg} at column {exc.colno})"
                continue
            yield number, value if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def _csv(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.DictReader(f)
        for number, row in enumerate(reader, start=1):
            # A row with more cells than the header puts the extras under None.
            yield number, {k: v for k, v in row.items() if k is not None}


def _parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors for a damaged or foreign file
        raise DatasetError(f"cannot read {path} as parquet: {exc}") from exc
    yield from enumerate(table.to_pylist(), start=1)


def _hf_disk(path: Path, split: str) -> Iterator[Row]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # FileNotFoundError for a folder save_to_disk did not write
        raise DatasetError(f"cannot read {path} as a datasets save_to_disk folder: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path} has no split {split!r}; it has {', '.join(sorted(loaded))}")
        loaded = loaded[split]
    for number, row in enumerate(loaded, start=1):
        yield number, dict(row)
