"""The docs cannot go stale: the configuration reference is the generator's output, every link resolves, and so does
every reference the code makes to a docs page and its heading."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def load_gen_config_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose(text: str) -> str:
    """Markdown without its code blocks and code spans, where a link is only text."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file (or heading in a markdown file) does not exist."""
    broken = []
    for target in _LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


CODE_DIRS = ("asymptote", "services", "benchmarks", "scripts")
"""Where the project's Python lives; its docstrings and comments cite the docs."""
GENERATED = ("asymptote/contracts/",)
"""Generated code, which cites nothing."""

_DOC_REF = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:docs/[\w.-]+|README)\.md)(?:#([\w-]+))?")
_HEADINGS_AFTER = re.compile(r'\s*[,(]\s*((?:"[^"]+"(?:\s*(?:,|and)\s*)?)+)')
_QUOTED = re.compile(r'"([^"]+)"')
_SECTION_NUMBER = re.compile(r",?\s*sections?\s+\d")
_OUTSIDE = re.compile(r"(?<![\w.-])(?:([A-Z][A-Z_]*\.md)|RECIPE|ARCHITECTURE)(?![\w])")
"""A capitalised ``NAME.md`` (only README.md is one of the project's), or the design briefs behind the project,
which are not in it: its references are docs/*.md."""


def headings(path: Path) -> list[str]:
    """The headings of markdown ``path``, as text (code spans unwrapped), lower case."""
    return [h.replace("`", "").strip().lower() for h in _HEADING.findall(_FENCE.sub("", path.read_text()))]


def has_heading(path: Path, cited: str) -> bool:
    """``cited`` names a heading of ``path``: the whole heading, or the part before its colon or parenthesis
    ("Nothing lost" for "Nothing lost: the ledger")."""
    want = " ".join(cited.replace("`", "").split()).lower()
    return any(h == want or h.startswith((want + ":", want + " (")) for h in headings(path))


def code_texts(path: Path) -> list[tuple[int, str]]:
    """Each string constant (docstrings included) and each run of comment lines of ``path`` (joined, without their
    ``#``, so that a citation broken across lines reads whole), with the line it starts on."""
    source = path.read_text()
    texts = [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    run: list[str] = []
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if run and line != last + 1:
            texts.append((start, "\n".join(run)))
            run = []
        if not run:
            start = line
        run.append(token.string.lstrip("#").strip())
        last = line
    if run:
        texts.append((start, "\n".join(run)))
    return texts


def stale_references(path: Path, root: Path = REPO) -> list[str]:
    """References in ``path``'s docstrings and comments to a docs page, its anchor or a quoted heading that do not
    exist under ``root``, and citations of files the project does not have."""
    where = path.relative_to(root).as_posix()
    stale = []
    for first, text in code_texts(path):
        for match in _DOC_REF.finditer(text):
            line = first + text.count("\n", 0, match.start())
            page, anchor = match.group(1), match.group(2)
            dest = root / page
            if not dest.is_file():
                stale.append(f"{where}:{line}: {page} (no such file)")
                continue
            if anchor and anchor not in anchors(dest):
                stale.append(f"{where}:{line}: {page}#{anchor} (no such heading)")
            rest = text[match.end() :]
            if _SECTION_NUMBER.match(rest):
                stale.append(f"{where}:{line}: {page} cited by section number (its headings have none)")
            cited = _HEADINGS_AFTER.match(rest)
            for heading in _QUOTED.findall(cited.group(1)) if cited else []:
                if not has_heading(dest, heading):
                    stale.append(f'{where}:{line}: {page}, "{" ".join(heading.split())}" (no such heading)')
        for match in _OUTSIDE.finditer(text):
            line = first + text.count("\n", 0, match.start())
            if match.group(1) is None or not (root / match.group(1)).is_file():
                stale.append(f"{where}:{line}: {match.group(0)} (not a file of the project: cite docs/*.md)")
    return stale


def code_files() -> list[Path]:
    return sorted(
        path
        for folder in CODE_DIRS
        for path in (REPO / folder).rglob("*.py")
        if not path.relative_to(REPO).as_posix().startswith(GENERATED)
    )


def test_configuration_reference_is_generated_from_the_config_models() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert load_gen_config_docs().render() == committed, (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    )


def test_the_docs_are_there() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    for page in ("architecture", "configuration", "deploying", "benchmarks", "recipe", "testing", "tasks", "local"):
        assert f"docs/{page}.md" in names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == [], f"{path.relative_to(REPO)} links to what does not exist"


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [web](https://example.com/x) [self](#top)\n"
        "# Top\n"
        "[gone](missing.md) [bad anchor](there.md#nope) `[code](ignored.md)`\n"
        "```\n[fenced](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md (no such file)", "there.md#nope (no such heading)"]


def test_every_docs_reference_in_the_code_resolves() -> None:
    stale = [ref for path in code_files() for ref in stale_references(path)]
    assert stale == [], "references from the code to the docs that do not resolve:\n" + "\n".join(stale)


def test_the_reference_check_finds_stale_citations(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "recipe.md").write_text("# The recipe\n## Losses\n## Nothing lost: the ledger\n")
    (tmp_path / "README.md").write_text("# Project\n")
    module = tmp_path / "module.py"
    module.write_text(
        '"""Good: docs/recipe.md, docs/recipe.md#losses, docs/recipe.md, "Losses", README.md,\n'
        '(docs/recipe.md, "Nothing lost"), docs/recipe.md ("Losses", "The\n    recipe"); and bench.md is an output.\n\n'
        'Bad: docs/gone.md, docs/recipe.md#nope, docs/recipe.md, "No such", RECIPE.md section 2.\n"""\n'
        "\n"
        '# docs/recipe.md section 4 and ARCHITECTURE "Contracts",\n'
        '# and a heading broken across lines: docs/recipe.md, "Nothing\n'
        '# lost" is fine.\n'
        "x = 1\n"
    )
    assert stale_references(module, root=tmp_path) == [
        "module.py:5: docs/gone.md (no such file)",
        "module.py:5: docs/recipe.md#nope (no such heading)",
        'module.py:5: docs/recipe.md, "No such" (no such heading)',
        "module.py:5: RECIPE.md (not a file of the project: cite docs/*.md)",
        "module.py:8: docs/recipe.md cited by section number (its headings have none)",
        "module.py:8: ARCHITECTURE (not a file of the project: cite docs/*.md)",
    ]
