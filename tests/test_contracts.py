"""The generated contracts are current, live under asymptote.contracts, and the torch-free core stays torch-free."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = ROOT / "asymptote" / "contracts" / "v1"


def load_gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the repository root; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"subprocess failed:\n{result.stderr[-4000:]}"
    return result.stdout


def test_generated_code_is_current(tmp_path: Path) -> None:
    generated = load_gen_protos().generate(tmp_path)
    assert generated, "no .proto files found"
    names = sorted(p.name for p in generated)
    committed = sorted(p.name for p in CONTRACTS.iterdir() if p.is_file() and "_pb2" in p.name)
    # No stale module from a deleted .proto, no module missing.
    assert names == committed
    stale = [p.name for p in generated if p.read_bytes() != (CONTRACTS / p.name).read_bytes()]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale} differ from proto/"
    for pkg in (
        tmp_path / "asymptote",
        tmp_path / "asymptote" / "contracts",
        tmp_path / "asymptote" / "contracts" / "v1",
    ):
        assert (pkg / "__init__.py").exists()
    # Every generated module landed in the contracts package, nowhere else.
    assert all(p.parent == tmp_path / "asymptote" / "contracts" / "v1" for p in generated)


def test_generated_modules_are_not_a_top_level_proto_package() -> None:
    stems = sorted({p.name.split(".")[0] for p in CONTRACTS.glob("*_pb2*.py")})
    assert {"rollout_pb2", "tensors_pb2", "services_pb2", "services_pb2_grpc"} <= set(stems)
    code = f"""
import importlib, importlib.util, sys
stems = {stems!r}
for stem in stems:
    module = importlib.import_module("asymptote.contracts.v1." + stem)
    if stem.endswith("_pb2"):
        d = module.DESCRIPTOR
        assert d.name == "asymptote/contracts/v1/" + stem[:-4] + ".proto", d.name
        assert d.package == "asymptote.contracts.v1", d.package
        for dep in d.dependencies:
            assert dep.name.startswith(("asymptote/contracts/v1/", "google/protobuf/")), dep.name
print(sorted(m for m in sys.modules if m == "proto" or m.startswith("proto.")))
# The repository's proto/ folder holds .proto sources only: nothing under it is a Python module.
print([s for s in stems
       if importlib.util.find_spec("proto.asymptote.contracts.v1." + s) is not None
       or importlib.util.find_spec("proto." + s) is not None])
"""
    imported_proto, findable = run_python(code).strip().splitlines()
    assert imported_proto == "[]"
    assert findable == "[]"
    for path in CONTRACTS.glob("*_pb2*.py"):
        text = path.read_text()
        assert "from proto" not in text and "import proto" not in text, path.name


TORCH_FREE_MODULES = (
    "asymptote.config",
    "asymptote.codec",
    "asymptote.jetstream.names",
    "asymptote.jetstream.connect",
    "asymptote.jetstream.publish",
    "asymptote.jetstream.pull",
    "asymptote.jetstream.deadletter",
    "asymptote.messages",
    "asymptote.health",
    "asymptote.rpc",
    "asymptote.runtime",
    "asymptote.policy",
    "asymptote.best_round",
    "asymptote.compute",
    "asymptote.tasks",
    "asymptote.envs",
    "services.broker.main",
    "services.fitter.main",
    "services.fitter.curve",
    "services.sandbox_pool.main",
    "asymptote.sandbox.remote",
    "services.local.stack",
    "services.cli",
    "services.ops.kube",
    "services.ops.kube_fetch",
    "services.ops.podexec",
    "services.ops.labels",
    "services.sweep.rule",
    "services.sweep.pruner",
)


def test_torch_free_core_does_not_import_torch_or_vllm() -> None:
    code = (
        f"import {', '.join(TORCH_FREE_MODULES)}; import sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    )
    loaded = ast.literal_eval(run_python(code).strip().splitlines()[-1])
    assert loaded == [], f"torch/vllm imported by the torch-free core: {loaded[:10]}"


DEPLOYABLES = ("generator", "broker", "learner", "fitter", "sandbox_pool")
COMPOSERS = ("local", "embedded", "ops", "sweep")
"""The folders of services/ that are not deployables: the local stack (``asymptote up``), the embedded
recipe (the tiny model, its warm starts, the single-process baseline), the operator tools
(``asymptote plan`` and ``asymptote kube``) and the sweep (its rule and Optuna pruner, which read the
fitter's pure curve and decision modules). They compose the services; no service imports them."""


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_no_service_imports_another() -> None:
    # Each deployable ships alone (its own image): it may import the shared
    # runtime and itself, never another service, the embedded recipe, the
    # benchmarks or the operator tools. Only the local stack, the benchmarks
    # and the command line compose them.
    crossing = []
    for service in DEPLOYABLES:
        others = (
            *tuple(f"services.{s}" for s in DEPLOYABLES if s != service),
            *tuple(f"services.{s}" for s in COMPOSERS),
            "services.cli",
            "benchmarks",
        )
        for path in sorted((ROOT / "services" / service).rglob("*.py")):
            for module in imported_modules(path):
                if module.startswith(others):
                    crossing.append(f"{path.relative_to(ROOT)} imports {module}")
    assert crossing == []


def test_no_deployable_reaches_the_embedded_recipe() -> None:
    """Walking every import from each deployable's ``main`` (lazy ones included) never reaches
    services/embedded/, and neither does the shared runtime: the tiny model, its warm starts and the
    single-process baseline are the local stack's recipe, not part of any image's code path."""
    graph = import_graph()
    reached = {service: reachable(graph, f"services.{service}.main") for service in DEPLOYABLES}
    runtime = {m for m in graph if m.split(".")[0] == "asymptote"}
    reached["asymptote"] = set().union(*(reachable(graph, m) for m in runtime))
    embedded = {name: sorted(m for m in found if m.startswith("services.embedded")) for name, found in reached.items()}
    assert embedded == {name: [] for name in reached}
    # The walk sees what it should: the local stack's model preparation does reach the room.
    assert "services.embedded.warmstart" in reachable(graph, "services.local.prepare")


OWN_TOOLS = {
    "learner": {
        "export": "`asymptote export`: a checkpoint as a Hugging Face model directory, read from the learner's "
        "own checkpoints; run by the command line, and in the learner's pod by `asymptote kube fetch`",
    },
    "fitter": {
        "offline": "`asymptote fit`: the fitter's curve, fit and plot over eval.jsonl files, offline",
    },
}
"""Modules of a deployable that its ``main`` does not import, each the service's own tool, with its reason."""
LOADED_BY_NAME = {
    "services.generator.worker_ext": "services/generator/engine.py",
}
"""Modules of a deployable that its code names in a string for another process to import (vLLM's Worker
loads the engine's ``worker_extension_cls``), and the file that names them."""


def test_every_file_of_a_deployable_is_on_its_code_path() -> None:
    """The import walk from each deployable's ``main`` reaches every module of its folder, or the walk from
    one of its OWN_TOOLS (each named with its reason) does: a module nothing of the service runs is
    something else's (the embedded recipe, a benchmark baseline) and belongs in its own room."""
    graph = import_graph()
    for module, naming in LOADED_BY_NAME.items():
        assert f'"{module}.' in (ROOT / naming).read_text(), f"{naming} no longer names {module}"
    stray = {}
    for service in DEPLOYABLES:
        starts = [
            f"services.{service}.main",
            *(m for m in LOADED_BY_NAME if m.startswith(f"services.{service}.")),
            *(f"services.{service}.{tool}" for tool in OWN_TOOLS.get(service, {})),
        ]
        found = set().union(*(reachable(graph, m) for m in starts))
        stray[service] = sorted(m for m in graph if m.startswith(f"services.{service}.") and m not in found)
    assert stray == {service: [] for service in DEPLOYABLES}


def test_the_sweep_reads_only_the_fitters_pure_modules() -> None:
    """The sweep's rule compares runs with the fitter's own fit and rule, and nothing else of the fitter: its
    curve, kernels and decision modules (no NATS, gRPC, files or Prometheus), so that it can later ship
    apart from the fitter with those modules alone. The controller draws its arms with the fitter's curve
    plot (data in, a PNG out). Its spec resolves arms into the local stack's config, and reads no service's
    code beyond the config modules that config is made of."""
    graph = import_graph()
    rule = set().union(*(reachable(graph, m) for m in ("services.sweep.rule", "services.sweep.pruner")))
    others = sorted(m for m in rule if m.startswith("services.") and not m.startswith("services.sweep"))
    assert others == ["services.fitter", "services.fitter.curve", "services.fitter.decision", "services.fitter.kernels"]
    reached = set().union(*(reachable(graph, m) for m in graph if m.startswith("services.sweep")))
    code = sorted(
        m
        for m in reached
        if m.startswith("services.")
        and not m.startswith(("services.sweep", "services.local"))
        and m.split(".")[-1] not in ("config", *m.split(".")[1:2])
        and m not in (*others, "services.fitter.plot")
    )
    assert code == []


def test_services_holds_the_services_and_their_composers_only() -> None:
    """services/ is the five deployables, the local stack, the embedded recipe, the operator tools, the
    sweep and the command line. No module there but the command line imports a benchmark (it dispatches ``asymptote
    bench`` lazily), judged by what modules import, not by their file names."""
    folders = sorted(p.name for p in (ROOT / "services").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted([*DEPLOYABLES, *COMPOSERS])
    assert sorted(p.name for p in (ROOT / "services").glob("*.py")) == ["__init__.py", "cli.py"]
    graph = import_graph()
    benches = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.startswith("services.") and name != "services.cli"
        for target in targets
        if target.split(".")[0] == "benchmarks"
    )
    assert benches == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others, itself included."""
    seen = {start}
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            # ``import a.b.c`` runs a/__init__ and a/b/__init__ too.
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in graph and module not in seen:
                    seen.add(module)
                    todo.append(module)
    return seen


PROJECT_PACKAGES = ("asymptote", "benchmarks", "services")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports of a module that run when it is imported (those inside functions excluded)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (at any depth, lazy and TYPE_CHECKING
    imports included), except the lazy imports inside services/cli.py's functions."""
    paths = {module_name(p): p for pkg in PROJECT_PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = top_level_imports(tree) if name == "services.cli" else list(ast.walk(tree))
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], node.module or ""])
                module = (base if node.level else node.module or "").strip(".")
                # ``from package import name``: the submodule if it is one, else the package itself.
                subs = {f"{module}.{alias.name}" for alias in node.names} & paths.keys()
                targets.update(subs or {module})
        graph[name] = set()
        for target in targets:
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_import_graph_has_no_circle() -> None:
    """Dependencies point one way across asymptote/, services/ and benchmarks/.

    Every import counts, at any depth (a lazy import inside a function and an
    import under ``TYPE_CHECKING`` are still a dependency), with one named
    exception: the imports inside the functions of ``services/cli.py``. The
    command line sits above everything it dispatches to (the services, the
    local stack, ``benchmarks.run``, ``services.ops.kube``) and imports each lazily
    inside its subcommand; its module-level imports still count.
    """
    graph = import_graph()
    assert {
        "benchmarks.run",
        "benchmarks.figure",
        "services.ops.kube",
        "services.cli",
        "asymptote.config",
    } <= graph.keys()
    assert "benchmarks.figure" in graph["benchmarks.run"]  # the graph sees the edges it should
    assert not graph["services.cli"] & {"benchmarks.run", "services.ops.kube"}  # only lazily, excluded
    assert import_circles(graph) == []


def test_the_ledgers_event_names_are_every_ledger_event() -> None:
    # asymptote.ledger.Event stands in for the protobuf enum's wrapper on hot paths: it must
    # name every value the contract has, with the contract's numbers.
    from asymptote.contracts.v1 import rollout_pb2
    from asymptote.ledger import TERMINAL, Event

    names = {k: v for k, v in vars(Event).items() if k.startswith("LEDGER_EVENT_")}
    assert names == dict(rollout_pb2.LedgerEvent.items())
    assert TERMINAL == {rollout_pb2.LEDGER_EVENT_TRAINED, rollout_pb2.LEDGER_EVENT_FILTERED, 4}
    assert rollout_pb2.LedgerEvent.Name(4) == "LEDGER_EVENT_DEADLETTERED"


TESTED_ELSEWHERE = {
    "ops": ("tests/deploy/test_kube_cli.py", "tests/learner/test_plan.py"),
}
"""Folders of services/ whose tests live beside what they read: ``asymptote kube`` against the fake Kubernetes
API with the chart it operates (tests/deploy/), ``asymptote plan`` with the memory planner it prints."""


def test_the_tests_mirror_the_code() -> None:
    """Each folder of services/ has its tests in the folder of the same name under tests/, and the modules
    many tests share are the package tests/helpers/ (imported by name), not loose files beside the tests."""
    tests = ROOT / "tests"
    for folder in (*DEPLOYABLES, *COMPOSERS):
        if folder in TESTED_ELSEWHERE:
            assert all((ROOT / path).exists() for path in TESTED_ELSEWHERE[folder]), folder
            continue
        assert list((tests / folder).glob("test_*.py")), f"tests/{folder}/ holds no test of services/{folder}/"
    loose = sorted(p.name for p in tests.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")
    assert loose == []
    assert (tests / "helpers" / "__init__.py").is_file()
