"""Write the embedded word-problem datasets (data/words/*.jsonl, data/words-code/*.jsonl) from their seed.

The files are generated, never edited by hand: asymptote/tasks/words.py
owns the templates (asymptote/tasks/words_code.py the code layout), and a
test fails when the shipped files differ from what this script writes. Run ``python scripts/gen_word_problems.py`` after
changing the templates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asymptote.tasks import words_code
from asymptote.tasks.words import DATA_DIR, SEED, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help=f"folder to write (default {DATA_DIR})")
    parser.add_argument(
        "--code-out",
        type=Path,
        default=words_code.DATA_DIR,
        help=f"folder of the code layout (default {words_code.DATA_DIR})",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="generation seed (the shipped files use the default)")
    args = parser.parse_args(argv)
    for split, path in write(args.out, args.seed).items():
        print(f"{split}: {path}")
    for split, path in words_code.write(args.code_out, args.seed).items():
        print(f"code {split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
