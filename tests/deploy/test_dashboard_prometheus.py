"""Every query of the shipped Grafana dashboard returns data from a real
Prometheus (Debian's package) scraping a briefly running local stack.

Grafana is not packaged here, so the dashboard's PromQL is run against
Prometheus's HTTP API with the template variables replaced: the scrape
targets carry the labels the Prometheus Operator's ServiceMonitors give
them in a cluster (namespace, service, pod, and the release the chart's
ServiceMonitors add), ``$__rate_interval`` becomes
a window over the run, ``$run`` the run's name.

The fit panels need a fit whatever eight steps of training learned: the
run directory starts with a known eval series (``fitcheck.known_eval_rows``)
that the fitter loads and fits, while every other panel shows the run's
own numbers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import REPO, dashboard

from services.local.progress import read_jsonl
from tests.helpers.fitcheck import check_fit, known_eval_rows
from tests.helpers.waiting import wait_until

# The e2e tests' stack launcher (tests/e2e/conftest.py), reused as a fixture here.
_spec = importlib.util.spec_from_file_location("e2e_stack_launcher", REPO / "tests" / "e2e" / "conftest.py")
assert _spec and _spec.loader
_launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_launcher)
launch = _launcher.launch

NAMESPACE = "asymptote-e2e"
RELEASE = "lab"
"""The release label the chart's ServiceMonitors give every series."""
SCRAPE_INTERVAL_S = 1
MAX_STEPS = 8
# The known curve behind the seeded eval series: versions 1-8 at 600-4800
# accelerator-seconds, all past the early cutoff, rising from R0 towards A.
A, B, C_MID, R0 = 0.62, 1.5, 2400.0, 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(base: str, path: str, params: dict[str, str]) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def prometheus(prometheus_binary: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on a loopback port; write its scrape config to the returned path, then reload."""
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s"}, "scrape_configs": []}))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(ready, 60, "prometheus to answer ready", interval_s=0.3)
        yield base, config
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def scrape_config(stack: Any) -> dict[str, Any]:
    """One job per service, labelled as the chart's ServiceMonitors would label the targets."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for p in stack.procs:
        if p.http_port is None:
            continue
        component = p.name.split("-")[0]
        jobs.setdefault(component, []).append(
            {
                "targets": [f"127.0.0.1:{p.http_port}"],
                "labels": {
                    "namespace": NAMESPACE,
                    "release": RELEASE,
                    "service": f"asymptote-{component}",
                    "pod": p.name,
                },
            }
        )
    return {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{"job_name": f"asymptote-{c}", "static_configs": t} for c, t in sorted(jobs.items())],
    }


def panel_queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def substitute(expr: str, run: str, rate_window_s: int) -> str:
    out = (
        expr.replace("$__rate_interval", f"{rate_window_s}s")
        .replace("$namespace", NAMESPACE)
        .replace("$release", RELEASE)
        .replace("$run", re.escape(run))
    )
    assert "$" not in out, f"unreplaced variable in {out}"
    return out


def scraped_since(base: str, since_unix_s: float, num_targets: int) -> bool:
    """Every one of ``num_targets`` targets is up in a scrape that began after ``since_unix_s``."""
    ups = query(base, "/api/v1/query", {"query": "up"})["result"]
    started = query(base, "/api/v1/query", {"query": "timestamp(up)"})["result"]
    return (
        len(ups) == num_targets
        and all(float(s["value"][1]) == 1 for s in ups)
        and all(float(s["value"][1]) > since_unix_s for s in started)
    )


@pytest.mark.e2e
def test_every_dashboard_query_returns_data(launch: Any, prometheus: tuple[str, Path]) -> None:
    """Every panel's query returns the run's data; the fit's input is a known eval series.

    Eight steps may show no gain over R0, and then no fit: the run starts
    with ``known_eval_rows`` at versions 0-8 in its eval.jsonl, which the
    fitter fits (and it skips the run's own rounds at those versions).
    """
    base, config_path = prometheus
    started = time.time()
    evals = known_eval_rows(MAX_STEPS + 1, A, B, C_MID, R0, compute_per_version=600.0)
    # The seeded series covers the final version, so no eval round beyond R0's and the last is needed.
    with launch(
        eval_rows=evals,
        max_steps=MAX_STEPS,
        eval_every_versions=MAX_STEPS,
        batch_prompts=8,
        checkpoint_every_steps=4,
        final_eval_timeout_s=180,
    ) as (stack, progress):
        config_path.write_text(yaml.safe_dump(scrape_config(stack)))
        urllib.request.urlopen(urllib.request.Request(f"{base}/-/reload", method="POST"), timeout=10).close()
        assert stack.follow() == 0, progress.outcome
        finished = time.time()
        fit = json.loads((stack.run_dir / "fit.json").read_text())
        check_fit(fit, read_jsonl(stack.run_dir / "eval.jsonl"))
        assert fit["ok"] and fit["num_points"] == len(evals), fit
        assert fit["a"] == pytest.approx(A, abs=1e-3) and fit["c_mid"] == pytest.approx(C_MID, rel=1e-2)
        # Read once every target was scraped after the last step, while every service still runs.
        wait_until(
            lambda: scraped_since(base, finished, 4),
            30 * SCRAPE_INTERVAL_S,
            "prometheus to scrape all four services up after the last step",
            interval_s=SCRAPE_INTERVAL_S / 4,
        )
        targets = query(base, "/api/v1/targets", {})["activeTargets"]
        assert len(targets) == 4 and all(t["health"] == "up" for t in targets), targets
        at = time.time()
        window = int(at - started)
        run = stack.run_dir.name
        results: dict[str, list[dict[str, Any]]] = {}
        for title, expr in panel_queries():
            data = query(base, "/api/v1/query", {"query": substitute(expr, run, window), "time": f"{at:.3f}"})
            results[f"{title}: {expr}"] = data["result"]
        variables = {}
        for variable in dashboard()["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable.get("definition", ""))
            if match:
                selector = substitute(match.group(1), run, window)
                variables[variable["name"]] = query(
                    base, f"/api/v1/label/{match.group(2)}/values", {"match[]": selector, "start": f"{started:.0f}"}
                )
        steps = read_jsonl(stack.run_dir / "metrics.jsonl")

    empty = [name for name, series in results.items() if not series]
    assert not empty, f"{len(empty)} of {len(results)} dashboard queries returned nothing:\n" + "\n".join(empty)
    numbers = {name: [float(s["value"][1]) for s in series] for name, series in results.items()}
    finite = sum(1 for values in numbers.values() if any(math.isfinite(v) for v in values))
    print(
        f"{len(results)} dashboard queries returned data ({finite} with a finite value) "
        f"over a {window}s run of {len(steps)} steps"
    )
    assert finite == len(results), [n for n, v in numbers.items() if not any(math.isfinite(x) for x in v)]
    assert variables == {"namespace": [NAMESPACE], "release": [RELEASE], "run": [run]}

    def value(title_prefix: str, expr_part: str) -> float:
        (name,) = [n for n in numbers if n.startswith(title_prefix) and expr_part in n]
        return numbers[name][0]

    # The numbers are the run's, not just present.
    assert value("Policy versions", "max(asymptote_learner_policy_version") == MAX_STEPS
    assert value("Generators: desired vs running", "count(") == 1
    assert value("Fit", "asymptote_fitter_fit_ok") == 1
    assert value("A: asymptotic pass rate", "asymptote_fitter_a{") == pytest.approx(fit["a"])
    assert value("Entropy", "policy_entropy") == pytest.approx(steps[-1]["policy/entropy"], rel=1e-6)
    assert value("Samples/s trained", "rate(asymptote_learner_samples_trained_total") > 0
    assert value("Tokens/s per generator", "asymptote_generator_tokens_total") >= 0
    # A healthy run: every refusal reason and dead-letter source is there, at zero.
    (refused,) = [series for name, series in results.items() if name.startswith("Refused weight swaps by reason")]
    assert {s["metric"]["reason"]: float(s["value"][1]) for s in refused} == dict.fromkeys(
        ("invalid", "staging", "unreachable"), 0.0
    )
    assert value("Dead letters by source", "asymptote_broker_deadlettered_total") == 0
    assert value("Generator task errors by reason", "asymptote_generator_task_errors_total") == 0
