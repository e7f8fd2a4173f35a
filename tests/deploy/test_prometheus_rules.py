"""The chart's alerts, as rendered, pass ``promtool check rules`` and
``promtool test rules`` (Debian's Prometheus package): every alert fires on
series that show its problem and stays silent on series of a healthy run,
and another namespace's series, or another release's in the same
namespace, never fire the release's rules.

The series carry the labels the Prometheus Operator's ServiceMonitors give
the services' targets (namespace, pod, and the release the chart's
ServiceMonitors add), and the metric names the services
export (services/*/metrics.py; counters with their ``_total`` suffix).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import NAMESPACE, RELEASE, render

ALERTS = {
    "AsymptoteGeneratorNotSwapping",
    "AsymptotePolicyStale",
    "AsymptoteLearnerStarved",
    "AsymptoteLearnerStalled",
    "AsymptoteDeadLettersGrowing",
    "AsymptoteHalfRunProjectionOff",
    "AsymptoteTruncationRateHigh",
}


def rule_spec() -> dict[str, Any]:
    (rule,) = render("many-generators-keda").of_kind("PrometheusRule")
    return dict(rule["spec"])


def annotations(alert: str, labels: dict[str, str], value: str = "") -> dict[str, str]:
    """The alert's annotations with its template filled as Prometheus fills it for these labels and value."""
    (rule,) = [r for g in rule_spec()["groups"] for r in g["rules"] if r.get("alert") == alert]
    out = {}
    for key, text in rule["annotations"].items():
        for name, label in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", label)
        out[key] = text.replace("{{ $value | humanizePercentage }}", value).replace("{{ $value }}", value)
        assert "{{" not in out[key], out[key]
    return out


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    labels = {"namespace": NAMESPACE, "release": RELEASE, **labels}
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def alert(name: str, at: str, *expected: dict[str, str], value: str = "") -> dict[str, Any]:
    severity = {r["alert"]: r["labels"]["severity"] for g in rule_spec()["groups"] for r in g["rules"]}[name]
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [
            {"exp_labels": {"severity": severity, **labels}, "exp_annotations": annotations(name, labels, value)}
            for labels in expected
        ],
    }


GEN = "asymptote_generator_policy_version"
LEARNER = "asymptote_learner_policy_version"
STEPS = "asymptote_learner_steps_total"
READY = "asymptote_broker_ready_groups"
COMPLETIONS = "asymptote_broker_completions_received_total"
ns = {"namespace": NAMESPACE, "release": RELEASE}


def rule_tests() -> list[dict[str, Any]]:
    """One promtool test per situation: the alerts it must fire, and the ones it must not."""
    stuck = {**ns, "pod": "generator-stuck"}
    return [
        {  # The learner publishes a version a minute; one generator stays on version 3.
            "interval": "1m",
            "input_series": [
                series(LEARNER, "0+1x60", pod="learner-0"),
                series(GEN, "0+1x60", pod="generator-ok"),
                series(GEN, "3x60", pod="generator-stuck"),
                series(GEN, "3x60", namespace="other", pod="generator-elsewhere"),
                series(GEN, "3x60", release="lab-other", pod="generator-of-another-release"),
            ],
            "alert_rule_test": [
                alert("AsymptoteGeneratorNotSwapping", "40m", stuck),
                alert("AsymptotePolicyStale", "10m"),  # lag 7: within the limit of 8
                alert("AsymptotePolicyStale", "15m"),  # lag 12 since 12m: pending for 5m
                alert("AsymptotePolicyStale", "30m", stuck, value="27"),
            ],
        },
        {  # Healthy: every generator follows the learner two versions behind.
            "interval": "1m",
            "input_series": [
                series(LEARNER, "0+1x60", pod="learner-0"),
                series(GEN, "0 0 0+1x58", pod="generator-ok"),
                series(STEPS, "0+1x60", pod="learner-0"),
                series(READY, "4x60", pod="broker-0"),
            ],
            "alert_rule_test": [
                alert(name, "40m")
                for name in (
                    "AsymptoteGeneratorNotSwapping",
                    "AsymptotePolicyStale",
                    "AsymptoteLearnerStarved",
                    "AsymptoteLearnerStalled",
                )
            ],
        },
        {  # Nothing moves at all (a paused run): the learner's version does not advance either.
            "interval": "1m",
            "input_series": [series(LEARNER, "5x60", pod="learner-0"), series(GEN, "5x60", pod="generator-ok")],
            "alert_rule_test": [alert("AsymptoteGeneratorNotSwapping", "40m")],
        },
        {  # The learner steps for 20 minutes, then no more while nothing waits: starved.
            "interval": "1m",
            "input_series": [series(STEPS, "0+1x20 20x40", pod="learner-0"), series(READY, "0x60", pod="broker-0")],
            "alert_rule_test": [
                alert("AsymptoteLearnerStarved", "30m"),  # a step 10 minutes ago
                alert("AsymptoteLearnerStarved", "40m", ns),
                alert("AsymptoteLearnerStalled", "40m"),
            ],
        },
        {  # The same learner while five groups wait for it: stalled.
            "interval": "1m",
            "input_series": [series(STEPS, "0+1x20 20x40", pod="learner-0"), series(READY, "5x60", pod="broker-0")],
            "alert_rule_test": [
                alert("AsymptoteLearnerStalled", "30m"),
                alert("AsymptoteLearnerStalled", "40m", ns, value="5"),
                alert("AsymptoteLearnerStarved", "40m"),
            ],
        },
        {  # Three rollouts dead-lettered at 11-13 minutes, none after.
            "interval": "1m",
            "input_series": [
                series("asymptote_broker_deadlettered_total", "0x10 1 2 3 3x30", pod="broker-0", source="rollouts"),
                series("asymptote_broker_deadlettered_total", "0x45", pod="broker-0", source="tasks"),
            ],
            "alert_rule_test": [
                alert("AsymptoteDeadLettersGrowing", "10m"),
                alert("AsymptoteDeadLettersGrowing", "15m", {**ns, "source": "rollouts"}),
                alert("AsymptoteDeadLettersGrowing", "30m"),
            ],
        },
        {  # Run a's first half projected 0.5 where 0.4 was measured (25% off); run b's 0.41 (2.5%).
            "interval": "1m",
            "input_series": [
                series("asymptote_fitter_half_run_projected_pass_rate", "0.5x20", pod="fitter-0", run="a"),
                series("asymptote_fitter_half_run_measured_pass_rate", "0.4x20", pod="fitter-0", run="a"),
                series("asymptote_fitter_half_run_projected_pass_rate", "0.41x20", pod="fitter-0", run="b"),
                series("asymptote_fitter_half_run_measured_pass_rate", "0.4x20", pod="fitter-0", run="b"),
            ],
            "alert_rule_test": [
                alert("AsymptoteHalfRunProjectionOff", "3m"),  # pending for 5m
                alert("AsymptoteHalfRunProjectionOff", "10m", {**ns, "pod": "fitter-0", "run": "a"}, value="25%"),
            ],
        },
        {  # 100 completions a minute, 5 truncated, then 20 from minute 30 on; another namespace and release at 50%.
            "interval": "1m",
            "input_series": [
                series(COMPLETIONS, "0+100x60", pod="broker-0", outcome="all"),
                series(COMPLETIONS, "0+5x30 150+20x30", pod="broker-0", outcome="truncated"),
                series(COMPLETIONS, "0+100x60", namespace="other", pod="broker-0", outcome="all"),
                series(COMPLETIONS, "0+50x60", namespace="other", pod="broker-0", outcome="truncated"),
                series(COMPLETIONS, "0+100x60", release="lab-other", pod="broker-1", outcome="all"),
                series(COMPLETIONS, "0+50x60", release="lab-other", pod="broker-1", outcome="truncated"),
            ],
            "alert_rule_test": [
                alert("AsymptoteTruncationRateHigh", "29m"),  # 5%: healthy
                alert("AsymptoteTruncationRateHigh", "40m"),  # 20% for 10m, not yet past the 15m window's mix
                alert("AsymptoteTruncationRateHigh", "58m", ns, value="20%"),
            ],
        },
    ]


@pytest.fixture(scope="module")
def promtool(prometheus_binary: str) -> str:
    """Debian's promtool, from the same package as prometheus."""
    found = shutil.which("promtool")
    assert found, "promtool is missing although prometheus is installed"
    return found


def write_rules(tmp_path: Path) -> Path:
    path = tmp_path / "asymptote-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_spec()["groups"]}, sort_keys=False))
    return path


def test_the_rules_are_the_alerts_the_chart_promises(promtool: str, tmp_path: Path) -> None:
    groups = rule_spec()["groups"]
    assert {r["alert"] for g in groups for r in g["rules"]} == ALERTS
    check = subprocess.run([promtool, "check", "rules", str(write_rules(tmp_path))], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in check.stdout, check.stdout


def test_every_alert_fires_on_its_problem_and_not_on_a_healthy_run(promtool: str, tmp_path: Path) -> None:
    rules = write_rules(tmp_path)
    tests = rule_tests()
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    silent = {t["alertname"] for case in tests for t in case["alert_rule_test"] if not t["exp_alerts"]}
    assert fired == silent == ALERTS  # each alert has a firing and a silent case
    spec = tmp_path / "asymptote-rules-test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_wrong_expectation_fails_promtool(promtool: str, tmp_path: Path) -> None:
    """The rule tests are not vacuous: expecting the healthy run's generator to alert fails."""
    rules = write_rules(tmp_path)
    healthy = rule_tests()[1]
    healthy["alert_rule_test"] = [alert("AsymptoteGeneratorNotSwapping", "40m", {**ns, "pod": "generator-ok"})]
    spec = tmp_path / "wrong.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [healthy]}))
    result = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 1 and "FAILED" in result.stdout + result.stderr, result.stdout + result.stderr


def test_the_rule_is_opt_in() -> None:
    assert not render("defaults").of_kind("PrometheusRule")
    (rule,) = render("many-generators-keda").of_kind("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    # Every selector is the release's: another release's series, in any namespace, never fire these rules.
    assert all(e.count("{") == e.count(f'{{namespace="{NAMESPACE}", release="{RELEASE}"') for e in exprs), exprs
