"""Every command and values snippet in docs/deploying.md (and the README's
``helm install``) is one a user can paste.

- Each shell block is split into commands as the shell would (quotes,
  ``\\`` continuations, ``&&``/``;``/``|``, heredocs, comments), and each
  ``kubectl``, ``helm``, ``hf`` and ``asymptote kube`` command, and each
  complete one quoted inline, is parsed against the subcommands and flags
  the tool accepts (tables below; ``asymptote kube`` by its own parser). A
  misspelled flag, a missing argument or an unknown subcommand fails.
- A few mistakes that parse are refused by name: ``kubectl run
  --overrides`` with arguments after ``--`` (the override's container
  replaces the generated one and drops them), a label selector on the
  release's instance that would also catch the umbrella's NATS, the
  deprecated ``huggingface-cli``.
- ``helm install``/``upgrade`` of a chart in this repository is rendered
  with the real Helm SDK with its ``-f`` files (a heredoc of the page, or a
  file of the repository) and ``--set`` values, in its ``-n`` namespace;
  every values snippet renders alone, and a Kubernetes object shown
  (the cert-manager Certificate) validates strictly against its schema.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import CHART, REPO, STACK_CHART, parse_manifests
from test_chart_validity import validate_object

from services.ops.kube import _parser as kube_parser

GUIDE = REPO / "docs" / "deploying.md"
README = REPO / "README.md"


# -- the page as a shell would read it ----------------------------------------------


@dataclass
class Page:
    commands: list[tuple[str, list[str]]] = field(default_factory=list)
    """(where, argv) of every simple command in a shell block, and every complete one quoted inline."""
    heredocs: dict[str, str] = field(default_factory=dict)
    """File name -> content of every ``cat > FILE <<'EOF'`` block."""
    yaml_blocks: list[tuple[str, str]] = field(default_factory=list)


def logical_lines(block: str) -> list[tuple[int, str]]:
    """(first line number, text) of each line as the shell reads it: quotes and ``\\`` continuations joined."""
    out: list[tuple[int, str]] = []
    current, quote, start, line_no = "", "", 0, 0
    i = 0
    while i < len(block):
        ch = block[i]
        if ch == "\n":
            line_no += 1
        if quote:
            current += ch
            if ch == quote:
                quote = ""
        elif ch == "\\" and block[i + 1 : i + 2] == "\n":
            current += " "
            i += 1
            line_no += 1
        elif ch == "#" and (not current or current[-1] in " \t"):
            while i < len(block) and block[i] != "\n":  # a comment, to the end of the line
                i += 1
            continue
        elif ch == "\n":
            if current.strip():
                out.append((start, current.strip()))
            current, start = "", line_no
        else:
            if ch in "'\"":
                quote = ch
            current += ch
        i += 1
    if current.strip():
        out.append((start, current.strip()))
    return out


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one logical line, split at ``&&``, ``||``, ``;`` and ``|`` outside quotes."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def read_page(path: Path) -> Page:
    page = Page()
    text = path.read_text()
    blocks = re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, flags=re.S | re.M)
    for match in blocks:
        indent, lang, body = match[1], match[2], match[3]
        body = "\n".join(line[len(indent) :] for line in body.splitlines())
        line0 = text[: match.start()].count("\n") + 2
        if lang == "yaml":
            page.yaml_blocks.append((f"{path.name}:{line0}", body))
        if lang != "bash":
            continue
        lines = body.splitlines()
        heredoc_lines: set[int] = set()
        for i, line in enumerate(lines):
            heredoc = re.search(r"cat > (\S+) <<'?(\w+)'?", line)
            if heredoc and i not in heredoc_lines:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == heredoc[2])
                page.heredocs[heredoc[1]] = "\n".join(lines[i + 1 : end])
                heredoc_lines.update(range(i + 1, end + 1))
        shell = "\n".join("" if i in heredoc_lines else line for i, line in enumerate(lines))
        for offset, line in logical_lines(shell):
            for argv in simple_commands(line):
                page.commands.append((f"{path.name}:{line0 + offset}", argv))
    # Complete commands quoted in the prose; one without a flag (`helm dependency build`) names a command.
    for match in re.finditer(r"`((?:kubectl|helm) [^`]+)`", text):
        argv = shlex.split(match[1])
        if any(a.startswith("-") for a in argv) and "..." not in argv:
            page.commands.append((f"{path.name}:{text[: match.start()].count(chr(10)) + 1}", argv))
    return page


# -- what the tools accept ------------------------------------------------------------

VALUE, FLAG, MANY = "value", "flag", "many"
KUBECTL_GLOBAL = {("-n", "--namespace"): VALUE, ("--context",): VALUE, ("--kubeconfig",): VALUE}
KUBECTL: dict[tuple[str, ...], tuple[str, dict[tuple[str, ...], str]]] = {
    # subcommand -> (positional arguments: "1", "1+", "2" or "1-2"; its flags)
    ("create", "namespace"): ("1", {("--dry-run",): VALUE, ("-o", "--output"): VALUE}),
    ("create", "secret", "generic"): (
        "1",
        {("--from-literal",): MANY, ("--from-file",): MANY, ("--type",): VALUE, ("--dry-run",): VALUE},
    ),
    ("get",): ("1-2", {("-o", "--output"): VALUE, ("-l", "--selector"): VALUE, ("-A", "--all-namespaces"): FLAG}),
    ("run",): (
        "1",
        {
            ("--image",): VALUE,
            ("--restart",): VALUE,
            ("--overrides",): VALUE,
            ("-i", "--stdin"): FLAG,
            ("-t", "--tty"): FLAG,
            ("--rm",): FLAG,
            ("--command",): FLAG,
            ("--env",): MANY,
        },
    ),
    ("port-forward",): ("2", {("--address",): VALUE}),
    ("rollout", "restart"): ("1", {("-l", "--selector"): VALUE}),
    ("rollout", "status"): ("1", {("--timeout",): VALUE, ("-w", "--watch"): FLAG}),
    ("delete",): ("1+", {("-l", "--selector"): VALUE, ("--all",): FLAG, ("--wait",): FLAG}),
    ("apply",): ("0", {("-f", "--filename"): MANY}),
    ("logs",): ("1", {("-f", "--follow"): FLAG, ("-c", "--container"): VALUE, ("--tail",): VALUE}),
    ("cp",): ("2", {("-c", "--container"): VALUE}),
}
HELM_GLOBAL = {("-n", "--namespace"): VALUE, ("--kube-context",): VALUE, ("--kubeconfig",): VALUE}
INSTALL_FLAGS = {
    ("--create-namespace",): FLAG,
    ("--wait",): FLAG,
    ("--atomic",): FLAG,
    ("--timeout",): VALUE,
    ("-f", "--values"): MANY,
    ("--set",): MANY,
    ("--set-string",): MANY,
    ("--version",): VALUE,
}
HELM: dict[tuple[str, ...], tuple[str, dict[tuple[str, ...], str]]] = {
    ("repo", "add"): ("2", {("--force-update",): FLAG}),
    ("repo", "update"): ("0", {}),
    ("install",): ("2", INSTALL_FLAGS),
    ("upgrade",): ("2", {**INSTALL_FLAGS, ("--install", "-i"): FLAG, ("--reuse-values",): FLAG}),
    ("uninstall",): ("1", {("--keep-history",): FLAG, ("--wait",): FLAG}),
    ("test",): ("1", {("--logs",): FLAG, ("--timeout",): VALUE}),
    ("template",): ("2", {**INSTALL_FLAGS, ("--output-dir",): VALUE, ("--kube-version",): VALUE}),
    ("dependency", "build"): ("1", {("--skip-refresh",): FLAG}),
    ("dependency", "update"): ("1", {("--skip-refresh",): FLAG}),
    ("dependency", "list"): ("1", {}),
    ("pull",): (
        "1",
        {
            ("--repo",): VALUE,
            ("--version",): VALUE,
            ("-d", "--destination"): VALUE,
            ("--untar",): FLAG,
            ("--verify",): FLAG,
        },
    ),
    ("package",): ("1", {("-d", "--destination"): VALUE, ("--version",): VALUE, ("--app-version",): VALUE}),
}
HF: dict[tuple[str, ...], tuple[str, dict[tuple[str, ...], str]]] = {
    ("download",): (
        "1+",
        {("--include",): "nargs", ("--exclude",): "nargs", ("--local-dir",): VALUE, ("--revision",): VALUE},
    )
}


class Refused(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise Refused(message)


def parse(
    tool: str, table: dict[tuple[str, ...], tuple[str, Any]], shared: dict[Any, str], argv: list[str]
) -> tuple[tuple[str, ...], argparse.Namespace, list[str]]:
    """(subcommand, its parsed flags and positionals, what followed ``--``); Refused names the mistake."""
    end = argv.index("--") if "--" in argv else len(argv)
    before, after = argv[1:end], argv[end + 1 :]
    words = [w for w in before if not w.startswith("-")]
    sub = next((s for s in sorted(table, key=len, reverse=True) if tuple(words[: len(s)]) == s), None)
    if sub is None:
        raise Refused(f"{tool} {' '.join(words[:2])}: not a subcommand this test knows; add it with its flags")
    count, flags = table[sub]
    parser = _Parser(prog=f"{tool} {' '.join(sub)}", add_help=False, allow_abbrev=False)
    for names, kind in {**shared, **flags}.items():
        dest = names[-1].lstrip("-").replace("-", "_")
        if kind == FLAG:
            parser.add_argument(*names, dest=dest, action="store_true")
        elif kind == MANY:
            parser.add_argument(*names, dest=dest, action="append")
        elif kind == "nargs":
            parser.add_argument(*names, dest=dest, nargs="+")
        else:
            parser.add_argument(*names, dest=dest)
    parser.add_argument("positionals", nargs="*")
    rest = list(before)
    for word in sub:  # the subcommand's words, wherever global flags put them
        rest.remove(word)
    parsed = parser.parse_args(rest)
    n = len(parsed.positionals)
    low, _, high = count.partition("-")
    plus = low.endswith("+")
    low_n = int(low.rstrip("+"))
    high_n = None if plus else int(high or low_n)
    if n < low_n or (high_n is not None and n > high_n):
        raise Refused(f"{tool} {' '.join(sub)}: takes {count} arguments, got {n}: {parsed.positionals}")
    return sub, parsed, after


def set_values(pairs: list[str]) -> dict[str, Any]:
    """Helm's ``--set a.b=c`` as nested values, with its type inference (booleans and integers)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        for item in pair.split(","):
            key, _, raw = item.partition("=")
            value: Any = {"true": True, "false": False}.get(raw, int(raw) if re.fullmatch(r"-?\d+", raw) else raw)
            *parents, leaf = key.split(".")
            node = values
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return values


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render_chart(chart_path: str, values: dict[str, Any], release: str, namespace: str) -> list[dict[str, Any]]:
    """Render a chart of this repository as helm would install it; the umbrella's asymptote part through its defaults."""
    path = (REPO / chart_path).resolve()
    if path == STACK_CHART:
        stack_defaults = yaml.safe_load((STACK_CHART / "values.yaml").read_text())
        unknown = set(values) - set(stack_defaults)
        assert not unknown, f"values for the umbrella chart that it has no section for: {sorted(unknown)}"
        _check_keys(values.get("nats", {}), stack_defaults["nats"], "nats")
        values = merged(stack_defaults["asymptote"], values.get("asymptote", {}))
    else:
        assert path == CHART, f"{chart_path}: not a chart of this repository"
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=release, namespace=namespace)
    return parse_manifests(files)


def _check_keys(values: dict[str, Any], known: dict[str, Any], where: str) -> None:
    """--set values for the NATS chart (not vendored here) must name settings its values in the umbrella show."""
    for key, value in values.items():
        assert key in known, f"{where}.{key}: not a setting of the umbrella's values.yaml"
        if isinstance(value, dict) and isinstance(known[key], dict):
            _check_keys(value, known[key], f"{where}.{key}")


# -- the checks -----------------------------------------------------------------------

PAGES = {"deploying.md": read_page(GUIDE), "README.md": read_page(README)}


def commands_of(tool: str) -> list[tuple[str, list[str], dict[str, str]]]:
    return [(where, argv, page.heredocs) for page in PAGES.values() for where, argv in page.commands if argv[0] == tool]


def test_the_pages_hold_the_commands_this_test_reads() -> None:
    """Guards the reader itself: what it finds on the pages, counted."""
    assert len(commands_of("kubectl")) >= 12
    assert len(commands_of("helm")) >= 15
    assert {"lab-values.yaml"} <= set(PAGES["deploying.md"].heredocs)
    readme_installs = [
        argv for where, argv, _ in commands_of("helm") if where.startswith("README") and argv[1] == "install"
    ]
    assert len(readme_installs) == 1


@pytest.mark.parametrize(("where", "argv"), [pytest.param(w, a, id=w) for w, a, _ in commands_of("kubectl")])
def test_kubectl_commands_parse(where: str, argv: list[str]) -> None:
    sub, parsed, after = parse("kubectl", KUBECTL, KUBECTL_GLOBAL, argv)
    if sub == ("run",) and parsed.overrides and "containers" in parsed.overrides:
        assert not after, f"{where}: kubectl run --overrides replaces the container: {after} after -- are dropped"
        assert (parsed.stdin and parsed.tty) or '"stdin":true' not in parsed.overrides
    selector = getattr(parsed, "selector", None) or ""
    if "app.kubernetes.io/instance=" in selector:
        assert re.search(r"app\.kubernetes\.io/(part-of|name)=asymptote", selector), (
            f"{where}: {selector!r} also selects the umbrella chart's NATS; add app.kubernetes.io/part-of=asymptote"
        )


@pytest.mark.parametrize(("where", "argv"), [pytest.param(w, a, id=w) for w, a, _ in commands_of("helm")])
def test_helm_commands_parse_and_local_charts_render(where: str, argv: list[str]) -> None:
    heredocs = {n: t for page in PAGES.values() for n, t in page.heredocs.items()}
    sub, parsed, after = parse("helm", HELM, HELM_GLOBAL, argv)
    assert not after, where
    if sub in (("dependency", "build"), ("dependency", "list"), ("package",)):
        assert (REPO / parsed.positionals[0] / "Chart.yaml").is_file(), where
    if sub not in (("install",), ("upgrade",), ("template",)) or not parsed.positionals[1].startswith("deploy/helm/"):
        return
    release, chart_path = parsed.positionals
    assert parsed.namespace, f"{where}: helm {sub[0]} without -n installs into the kubeconfig's namespace"
    values: dict[str, Any] = {}
    for name in parsed.values or []:
        text = heredocs[name] if name in heredocs else (REPO / name).read_text()
        values = merged(values, yaml.safe_load(text) or {})
    values = merged(values, set_values(parsed.set or []))
    objects = render_chart(chart_path, values, release, parsed.namespace)
    assert objects and all(o["metadata"].get("namespace") in (parsed.namespace, None) for o in objects), where


def test_the_readme_install_sets_namespace_nats_and_images() -> None:
    ((_, argv, _),) = [c for c in commands_of("helm") if c[0].startswith("README") and c[1][1] == "install"]
    _, parsed, _ = parse("helm", HELM, HELM_GLOBAL, argv)
    values = merged(yaml.safe_load((REPO / parsed.values[0]).read_text()), set_values(parsed.set))
    objects = render_chart(parsed.positionals[1], values, parsed.positionals[0], parsed.namespace)
    images = {
        c["image"].rsplit(":", 1)[0]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"registry.example.com/you/asymptote-{r}" for r in ("generator", "learner", "broker", "fitter")}
    broker = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-broker"))
    assert yaml.safe_load(broker["data"]["config.yaml"])["nats"]["url"] == "nats://nats.nats.svc:4222"
    assert parsed.namespace == "rl"


def test_hf_and_asymptote_kube_commands_parse() -> None:
    shell = [(w, a) for page in PAGES.values() for w, a in page.commands]
    assert not [w for w, a in shell if a[0] == "huggingface-cli"], "huggingface-cli is deprecated: hf download"
    downloads = [(w, a) for w, a in shell if a[0] == "hf"]
    assert downloads
    for where, argv in downloads:
        _, parsed, _ = parse("hf", HF, {}, argv)
        assert parsed.include and parsed.local_dir, where
    kube = [(w, a) for w, a in shell if a[:2] == ["asymptote", "kube"]]
    assert {a[2] for _, a in kube} >= {"status", "scale", "fetch"}
    for where, argv in kube:
        try:
            kube_parser().parse_args(argv[2:])
        except SystemExit as exc:  # --help exits 0, a mistake 2
            assert exc.code == 0 and "--help" in argv, f"{where}: {' '.join(argv)} does not parse"


def test_every_values_snippet_renders() -> None:
    """Each snippet is a part of a release's values: it renders over the images the page has the
    user push and name (``images.yaml``, and the sandbox pool's in its snippet), as the chart has none."""
    page = PAGES["deploying.md"]
    snippets = [(f"heredoc {n}", t) for n, t in page.heredocs.items() if n.endswith(".yaml")] + page.yaml_blocks
    assert snippets
    images = yaml.safe_load(page.heredocs["images.yaml"])
    assert set(images) == {"images"}
    for _, text in snippets:
        doc = yaml.safe_load(text)
        images = merged(images, {"images": doc.get("images") or {}})
    assert set(images["images"]) == {"generator", "learner", "broker", "fitter", "sandboxPool"}
    for where, text in snippets:
        doc = yaml.safe_load(text)
        if "apiVersion" in doc and "kind" in doc:
            validate_object(doc)  # a Kubernetes object shown, not values
            continue
        stack = set(doc) <= {"asymptote", "nats"}
        chart = STACK_CHART if stack else CHART
        values = merged({"asymptote": images} if stack else images, doc)
        objects = render_chart(str(chart.relative_to(REPO)), values, "lab", "rl")
        assert objects, where
