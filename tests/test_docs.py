"""The docs cannot go stale: the configuration reference is the generator's output, and every link resolves."""

from __future__ import annotations

import importlib.util
import re
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


def test_configuration_reference_is_generated_from_the_config_models() -> None:
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert load_gen_config_docs().render() == committed, (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py"
    )


def test_the_docs_are_there() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    for page in ("architecture", "configuration", "deploying", "benchmarks", "recipe", "testing"):
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
