"""Fill a model cache from the Hugging Face hub: a model's files and dataset files.

Owns the chart's download init container (``model.download``): before a
generator or the learner starts, ``python -m asymptote.download`` puts the
model's safetensors, config and tokenizer, and any dataset files, where the
services read them. It is idempotent: a folder that already holds what was
asked for (a ``.asymptote-fetched`` record naming the repository, revision
and patterns) is left alone, so pods sharing one claim download once and a
restarted pod does not download again. The token, for gated models, comes
from ``HF_TOKEN`` (the chart reads it from a Secret).

    python -m asymptote.download model REPO DEST [--revision R] [--allow PATTERN ...]
    python -m asymptote.download dataset REPO DEST [--revision R] [--allow PATTERN ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asymptote.errors import ConfigError

RECORD = ".asymptote-fetched"
MODEL_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "tokenizer*")
"""A model's weights (safetensors only: pickle-based files are never fetched), config and tokenizer."""

Download = Callable[..., Any]


def wanted(kind: str, repo: str, revision: str, patterns: list[str]) -> dict[str, Any]:
    return {"kind": kind, "repo": repo, "revision": revision, "allow": sorted(patterns)}


def already_fetched(dest: Path, want: dict[str, Any]) -> bool:
    """Whether ``dest`` holds a completed fetch of exactly ``want``."""
    try:
        return bool(json.loads((dest / RECORD).read_text()) == want)
    except (OSError, ValueError):
        return False


def fetch(
    kind: str, repo: str, dest: Path, revision: str, patterns: list[str], download: Download | None = None
) -> bool:
    """Fetch ``repo`` into ``dest`` unless it is there already; True if it downloaded.

    ``download`` is ``huggingface_hub.snapshot_download`` (its signature) unless given.
    """
    if "/" not in repo or repo.startswith("/") or repo.endswith("/"):
        raise ConfigError(f"repository {repo!r}: expected OWNER/NAME as on the Hugging Face hub")
    if kind not in ("model", "dataset"):
        raise ConfigError(f"kind {kind!r}: expected model or dataset")
    want = wanted(kind, repo, revision, patterns)
    if already_fetched(dest, want):
        return False
    if download is None:
        from huggingface_hub import snapshot_download

        download = snapshot_download
    dest.mkdir(parents=True, exist_ok=True)
    (dest / RECORD).unlink(missing_ok=True)  # a fetch of something else, or one cut short, is redone
    download(
        repo_id=repo,
        repo_type=kind,
        revision=revision,
        local_dir=str(dest),
        allow_patterns=patterns,
    )
    if kind == "model" and not any(dest.glob("*.safetensors")):
        raise ConfigError(
            f"{repo}@{revision} has no *.safetensors weights (pickle-based weights are never loaded); "
            f"fetched into {dest}: {sorted(p.name for p in dest.iterdir())[:10]}"
        )
    (dest / RECORD).write_text(json.dumps(want) + "\n")
    return True


def main(argv: list[str] | None = None, download: Download | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asymptote.download", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["model", "dataset"])
    parser.add_argument("repo", help="OWNER/NAME on the Hugging Face hub")
    parser.add_argument("dest", type=Path, help="folder to fill")
    parser.add_argument("--revision", default="main")
    parser.add_argument("--allow", action="append", default=None, help="file pattern (repeatable)")
    args = parser.parse_args(argv)
    patterns = args.allow or (list(MODEL_PATTERNS) if args.kind == "model" else ["*"])
    try:
        fetched = fetch(args.kind, args.repo, args.dest, args.revision, patterns, download)
    except ConfigError as exc:
        print(f"asymptote fetch: {exc}", file=sys.stderr)
        return 2
    print(f"{args.repo}@{args.revision} {'fetched into' if fetched else 'already in'} {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
