"""The charts deploy offline as docs/deploying.md ("Offline and air-gapped") says.

- The NATS dependency is one exact version, and ``Chart.lock`` (committed, not
  ignored) records it with the digest Helm computes from ``Chart.yaml``: this
  test recomputes it, checks its computation against Helm's own, and
  ``helm dependency build`` accepts the lock (it refuses one out of sync
  before it fetches anything).
- The page's offline steps are carried out, with the Helm SDK, on the files
  a clone has (``git ls-files``: nothing ignored, no ``charts/`` left over).
  ``helm pull`` cannot reach the NATS repository here, so a stand-in archive
  of the pinned name and version (a chart written here, not NATS's) takes
  its place; everything after it is the page's: the archive carried into
  ``charts/``, the asymptote chart packaged beside it, ``helm dependency
  list`` reporting both ``ok``, and ``helm template`` / ``helm install``
  rendering the umbrella with the walkthrough's values, the NATS values
  reaching the chart named ``nats``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_render import CHART, REPO, STACK_CHART, Rendered, parse_manifests
from test_deploying_commands import (
    HELM,
    HELM_GLOBAL,
    logical_lines,
    merged,
    parse,
    read_page,
    set_values,
    simple_commands,
)

GUIDE = REPO / "docs" / "deploying.md"
NATS_VERSION = "1.3.16"
"""The NATS chart the umbrella's values are written for (and docs/deploying.md names)."""

_DEPENDENCY_FIELDS = ("name", "version", "repository", "condition", "tags", "enabled", "import-values", "alias")
"""chart.Dependency's JSON fields in Go's order; all but name and repository are ``omitempty``."""


def helm_lock_digest(requirements: list[dict[str, Any]], locked: list[dict[str, Any]]) -> str:
    """Chart.lock's digest as Helm computes it (resolver.HashReq): the sha256 of
    ``json.Marshal([2][]*chart.Dependency{Chart.yaml's, the lock's})``."""

    def go_json(dep: dict[str, Any]) -> dict[str, Any]:
        return {k: dep[k] for k in _DEPENDENCY_FIELDS if k in ("name", "repository") or dep.get(k)}

    text = json.dumps([[go_json(d) for d in requirements], [go_json(d) for d in locked]], separators=(",", ":"))
    # Go's encoder escapes these three for HTML; json.dumps does not.
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_helm_computes_the_lock_digest_as_this_test_does(tmp_path: Path) -> None:
    """Helm writes a lock for local dependencies offline: its digest is the one computed above."""
    for name in ("a", "b"):
        (tmp_path / name / "templates").mkdir(parents=True)
        (tmp_path / name / "Chart.yaml").write_text(f"apiVersion: v2\nname: {name}\nversion: 0.3.1\n")
    top = tmp_path / "top"
    (top / "templates").mkdir(parents=True)
    requirements = [
        {"name": "a", "version": "0.3.1", "repository": "file://../a"},
        {"name": "b", "version": "^0.3.0", "repository": "file://../b", "condition": "b.enabled"},
    ]
    (top / "Chart.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v2", "name": "top", "version": "0.1.0", "dependencies": requirements})
    )
    helm.dependency_update(top)
    lock = yaml.safe_load((top / "Chart.lock").read_text())
    assert [d["version"] for d in lock["dependencies"]] == ["0.3.1", "0.3.1"]
    assert lock["digest"] == helm_lock_digest(requirements, lock["dependencies"])
    assert lock["digest"] != helm_lock_digest(requirements[:1], lock["dependencies"][:1])


def stack_dependencies() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    chart = yaml.safe_load((STACK_CHART / "Chart.yaml").read_text())
    return chart["dependencies"], yaml.safe_load((STACK_CHART / "Chart.lock").read_text())


def test_the_nats_chart_is_one_version_locked_as_helm_locks_it(tmp_path: Path) -> None:
    requirements, lock = stack_dependencies()
    wanted = {d["name"]: d for d in requirements}
    assert wanted["nats"]["version"] == NATS_VERSION  # an exact version, not a range
    assert re.fullmatch(r"\d+\.\d+\.\d+", wanted["nats"]["version"])
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert lock["dependencies"] == [
        {"name": "asymptote", "repository": "file://../asymptote", "version": app_version},
        {"name": "nats", "repository": wanted["nats"]["repository"], "version": NATS_VERSION},
    ]
    assert lock["digest"] == helm_lock_digest(requirements, lock["dependencies"])
    # `helm dependency build` accepts the lock: it checks it against Chart.yaml first, and only then
    # fails here, reading the NATS repository's index (or, with network, fetches exactly the pin).
    work = tmp_path / "repo"
    shutil.copytree(CHART, work / "asymptote")
    shutil.copytree(STACK_CHART, work / "asymptote-stack", ignore=shutil.ignore_patterns("charts"))
    try:
        helm.dependency_build(work / "asymptote-stack", skip_refresh=True)
    except helm.HelmRepoError as exc:
        assert "out of sync" not in str(exc), exc
    else:
        assert sorted(p.name for p in (work / "asymptote-stack" / "charts").iterdir()) == [
            f"asymptote-{app_version}.tgz",
            f"nats-{NATS_VERSION}.tgz",
        ]
    # Not vacuous: a Chart.yaml that moved without its lock is refused, naming the lock.
    chart_yaml = work / "asymptote-stack" / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace(f"version: {NATS_VERSION}", "version: ^1.2.0"))
    with pytest.raises(helm.HelmRepoError, match=r"Chart\.lock\) is out of sync"):
        helm.dependency_build(work / "asymptote-stack", skip_refresh=True)


# -- the page's steps, on a clone -----------------------------------------------------------


def clone(dest: Path) -> Path:
    """The files of deploy/ and examples/ a clone of this checkout has: tracked, or new and not ignored."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "deploy", "examples"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in listed:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def offline_steps() -> list[list[str]]:
    """The simple commands of the shell blocks in the page's "Offline and air-gapped" section."""
    text = GUIDE.read_text()
    section = text.split("\n## Offline and air-gapped\n", 1)[1].split("\n## ", 1)[0]
    steps = []
    for block in re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M):
        for _, line in logical_lines(block):
            steps += simple_commands(line)
    return steps


def stand_in_nats(workdir: Path, version: str) -> Path:
    """A chart named nats at ``version`` that renders the values the umbrella gives it."""
    chart = workdir / "stand-in" / "nats"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(f"apiVersion: v2\nname: nats\nversion: {version}\n")
    (chart / "templates" / "seen.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-nats-values-seen\n"
        "data:\n  values.json: {{ toJson .Values | quote }}\n"
    )
    return chart


def test_the_page_s_offline_steps_render_the_umbrella_from_a_clone(tmp_path: Path) -> None:
    page = read_page(GUIDE)
    root = clone(tmp_path / "clone")
    assert (root / "deploy/helm/asymptote-stack/Chart.lock").is_file()  # committed, so a clone has it
    assert not (root / "deploy/helm/asymptote-stack/charts").exists()
    requirements, _ = stack_dependencies()
    nats = next(d for d in requirements if d["name"] == "nats")
    done: list[str] = []
    renders: dict[str, Rendered] = {}
    for argv in offline_steps():
        if argv[0] in ("echo", "sha256sum"):
            continue  # checks the real archive's digest; the stand-in has its own
        if argv[0] == "mkdir":
            assert argv[1] == "-p"
            (root / argv[2]).mkdir(parents=True, exist_ok=True)
        elif argv[0] == "cp":
            shutil.copy(root / argv[1], root / argv[2])
        elif argv[0] == "helm":
            sub, parsed, _ = parse("helm", HELM, HELM_GLOBAL, argv)
            if sub == ("pull",):
                (name,) = parsed.positionals
                assert (name, parsed.repo, parsed.version) == ("nats", nats["repository"], nats["version"])
                archive = helm.package(stand_in_nats(tmp_path, parsed.version), destination=root)
                assert Path(archive).name == f"nats-{NATS_VERSION}.tgz"  # the name `helm pull` writes
            elif sub == ("package",):
                helm.package(root / parsed.positionals[0], destination=root / parsed.destination)
            elif sub == ("dependency", "list"):
                statuses = {d["name"]: (d["version"], d["status"]) for d in helm.dependency_list(root / argv[3])}
                assert statuses == {"asymptote": ("0.1.0", "ok"), "nats": (NATS_VERSION, "ok")}
            elif sub in (("template",), ("install",)):
                release, chart = parsed.positionals
                values: dict[str, Any] = {}
                for name in parsed.values or []:
                    # A file the page writes (a heredoc), else one of the clone.
                    text = page.heredocs[name] if name in page.heredocs else (root / name).read_text()
                    values = merged(values, yaml.safe_load(text))
                values = merged(values, set_values(parsed.set or []))
                with helm.Chart.load(root / chart) as loaded:
                    files = loaded.render(values, name=release, namespace=parsed.namespace)
                renders[f"{sub[0]} {chart}"] = Rendered(files, parse_manifests(files))
            else:
                pytest.fail(f"helm {' '.join(sub)}: a step of the page this test does not carry out")
        else:
            pytest.fail(f"{argv[0]}: a step of the page this test does not carry out")
        done.append(" ".join(argv[:3]))
    assert set(renders) == {
        "template deploy/helm/asymptote",
        "template deploy/helm/asymptote-stack",
        "install deploy/helm/asymptote-stack",
    }, done

    app = renders["template deploy/helm/asymptote"]
    broker = yaml.safe_load(app.get("ConfigMap", "lab-asymptote-broker")["data"]["config.yaml"])
    assert broker["nats"]["url"] == "nats://nats.nats.svc:4222"

    stack = renders["install deploy/helm/asymptote-stack"]
    assert stack.files == renders["template deploy/helm/asymptote-stack"].files
    seen = json.loads(stack.get("ConfigMap", "lab-nats-values-seen")["data"]["values.json"])
    umbrella_nats = yaml.safe_load((STACK_CHART / "values.yaml").read_text())["nats"]
    assert seen["config"]["merge"]["max_payload"] == umbrella_nats["config"]["merge"]["max_payload"] == 9437184
    assert seen["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert set(seen["container"]["env"]) == {"ASYMPTOTE_NATS_USER", "ASYMPTOTE_NATS_PASSWORD"}
    broker = yaml.safe_load(stack.get("ConfigMap", "lab-asymptote-broker")["data"]["config.yaml"])
    assert broker["nats"]["url"] == "nats://lab-nats.rl.svc:4222" and broker["nats"]["stream_replicas"] == 3
    images = {
        c["image"].rsplit(":", 1)[0]
        for o in stack.objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {f"registry.example.com/you/asymptote-{r}" for r in ("generator", "learner", "broker", "fitter")}
