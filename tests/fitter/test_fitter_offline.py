"""The offline ``fit`` command on eval logs written to a temporary run directory."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from benchmarks.figure import Target
from benchmarks.fitter import BENCH_FILE_NAME, RECOVERY_FILE_NAME, bench_fit, bench_fitter
from benchmarks.fitter import main as bench_main
from services.fitter.curve import CurveFitSettings, predict
from services.fitter.evals import EvalFileError, read_eval_log
from services.fitter.offline import EXIT_BAD_INPUT, EXIT_OK, load_run, main, main_fit, plot_run
from tests.helpers.badinput import BAD_INPUTS

A, B, C_MID, R0 = 0.610, 1.92, 2542.0, 0.20
REPO_ROOT = Path(__file__).resolve().parents[2]


def _write_run(run_dir: Path, a: float = A, b: float = B, c_mid: float = C_MID, seed: int = 0) -> Path:
    """A run of 60 evals up to 3x C_mid with noise sd 0.005, plus the step-0 eval."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": 0, "policy_version": 0, "compute": 0.0, "pass_rate": R0, "extra": "kept out"})]
    for index in range(1, 61):
        compute = index * 3.0 * c_mid / 60
        pass_rate = float(np.clip(predict(compute, a, b, c_mid, R0) + rng.normal(0.0, 0.005), 0.0, 1.0))
        lines.append(
            json.dumps({"step": 10 * index, "policy_version": 10 * index, "compute": compute, "pass_rate": pass_rate})
        )
    path = run_dir / "eval.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _console(width: int = 200) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=width, color_system=None), buffer


SETTINGS = CurveFitSettings(num_bootstrap_resamples=100)


def test_fit_command_writes_fit_json_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run-a"
    _write_run(run_dir)
    console, output = _console()
    target = 6.0 * C_MID
    monkeypatch.chdir(tmp_path)
    code = main_fit([run_dir], None, SETTINGS, [target], console=console)
    assert code == EXIT_OK
    # The run directory's fit.json belongs to the live fitter: offline output goes elsewhere.
    assert not (run_dir / "fit.json").exists()
    run_dir = tmp_path / "fit-report"

    report = json.loads((run_dir / "fit.json").read_text())
    assert set(report) == {"settings", "runs", "comparison", "comparison_verdict"}
    assert report["comparison"] == [] and report["comparison_verdict"] is None
    run = report["runs"]["run-a"]
    assert set(run) >= {"a", "b", "c_mid", "r0", "intervals", "projections", "num_points_used", "rmse"}
    assert run["r0"] == R0
    assert run["a"] == pytest.approx(A, abs=0.02)
    assert run["b"] == pytest.approx(B, abs=0.3)
    assert run["c_mid"] == pytest.approx(C_MID, rel=0.1)
    assert run["rmse"] == pytest.approx(0.005, abs=0.0015)
    # All 60 points: the default early cutoff is at compute 0.
    assert run["num_points_used"] == 60
    assert run["intervals"]["level"] == 0.95
    low, high = run["intervals"]["a"]
    assert low <= run["a"] <= high and high - low < 0.05
    (projection,) = run["projections"]
    assert projection["compute"] == target
    assert projection["pass_rate"] == pytest.approx(float(predict(target, A, B, C_MID, R0)), abs=0.015)
    assert projection["interval"][0] <= projection["pass_rate"] <= projection["interval"][1]

    text = output.getvalue()
    assert "run-a" in text and f"{run['a']:.3f}" in text

    # The half-run check: fit on compute <= 1.5 C_mid (30 of the 60 points), project to 3 C_mid.
    half = run["half_run_projection"]
    assert half["reason"] == ""
    assert half["final_compute"] == pytest.approx(3.0 * C_MID)
    assert half["half_compute"] == pytest.approx(1.5 * C_MID)
    assert half["points_in_first_half"] == 30
    assert half["points_used"] == 30  # the default cutoff at compute 0 keeps them all
    records = [json.loads(line) for line in (tmp_path / "run-a" / "eval.jsonl").read_text().splitlines()]
    assert half["measured"] == records[-1]["pass_rate"]
    assert half["error"] == pytest.approx(half["projected"] - half["measured"])
    assert abs(half["projected"] - float(predict(3.0 * C_MID, A, B, C_MID, R0))) < 0.02
    assert half["interval"][0] <= half["projected"] <= half["interval"][1]
    assert "Half-run check" in text and f"{half['error']:+.3f}" in text

    png = run_dir / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 600
    # A blank canvas has one colour; a drawn plot has many distinct pixel values.
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50


def test_fit_command_compares_several_runs(tmp_path: Path) -> None:
    """Asymptotes within the margin (0.62 and 0.61), efficiencies apart (B 2.4 and 1.4): at the compute both
    reached the faster is 0.055 ahead, far beyond its interval, so the comparison decides by the pass rate."""
    first = tmp_path / "fast"
    second = tmp_path / "slow"
    _write_run(first, a=0.62, b=2.4, seed=1)
    _write_run(second, a=0.61, b=1.4, seed=2)
    out = tmp_path / "out"
    console, output = _console()
    code = main_fit([first, second / "eval.jsonl"], out, SETTINGS, [], console=console)
    assert code == EXIT_OK
    report = json.loads((out / "fit.json").read_text())
    assert set(report["runs"]) == {"fast", "slow"}
    # Default target: twice each run's largest compute.
    assert report["runs"]["fast"]["projections"][0]["compute"] == pytest.approx(6.0 * C_MID)
    rows = report["comparison"]
    assert [(row["name"], row["rank"], row["determined"]) for row in rows] == [("fast", 1, True), ("slow", 2, True)]
    decision = rows[0]["decisions"]["slow"]
    assert (decision["outcome"], decision["decided_by"]) == ("a_higher", "pass_rate")
    assert rows[0]["target_compute"] == pytest.approx(3.0 * C_MID) and decision["interval"][0] > 0.02
    assert report["comparison_verdict"].startswith("decided: fast > slow (pass rate at 2.12 device-hours +0.05")
    # Each names the other as a rival within the margin: compare, not continue.
    assert report["runs"]["fast"]["recommendation"] == "compare"
    assert report["runs"]["fast"]["recommendation_reason"].endswith(
        "of slow: compare them (asymptote fit with both runs)"
    )
    assert "Recipe comparison at 2.12 device-hours" in output.getvalue()
    assert (out / "curve.png").stat().st_size > 20_000


def test_fit_command_leaves_a_fit_at_its_bound_unranked_and_undecided(tmp_path: Path) -> None:
    """A run heading to A = 0.9 over the paper's A range (0.45..0.80) ends at A = 0.800, its bound;
    it must not be ranked above a run whose A = 0.61 the data pin down. Each table row leads with whether
    its fit is determined, the undetermined one shows A's interval only, and at 80 columns no run name is
    broken and nothing is cut (issue 51: names wrapped, and a "* at the bound" legend with nothing starred)."""
    long_names = ("cispo-at-bound-lr2e-4", "cispo-steady-lr1e-4")
    _write_run(tmp_path / long_names[0], a=0.9, seed=1)
    _write_run(tmp_path / long_names[1], a=0.61, seed=2)
    out = tmp_path / "out"
    console, output = _console(width=80)
    settings = CurveFitSettings(a_min=0.45, a_max=0.8, num_bootstrap_resamples=100)
    code = main_fit([tmp_path / name for name in long_names], out, settings, [], console=console)
    assert code == EXIT_OK
    report = json.loads((out / "fit.json").read_text())
    at_bound, steady = (report["runs"][name] for name in long_names)
    assert list(at_bound)[:3] == ["determined", "why_not_determined", "not_determined"]
    assert at_bound["determined"] is False and "a" not in at_bound and "b" not in at_bound
    assert at_bound["not_determined_point_estimates"]["a"] == pytest.approx(0.8)
    assert at_bound["at_bound"] == ["A"] and at_bound["identifiable"] is False
    assert all("pass_rate" not in projection for projection in at_bound["projections"])
    assert at_bound["recommendation"] == "continue"
    assert at_bound["why_not_determined"] == "A at the bound of the search range: run longer"
    assert steady["determined"] is True and steady["why_not_determined"] == "" and "a" in steady
    rows = {row["name"]: row for row in report["comparison"]}
    assert rows[long_names[1]]["rank"] == 1 and rows[long_names[0]]["rank"] is None
    assert rows[long_names[0]]["verdict"].startswith("not ranked: not determined: A at the bound")
    assert report["comparison_verdict"].startswith(f"undecided: {long_names[1]} vs {long_names[0]} (b not determined")
    text = " ".join(output.getvalue().split())
    assert "not determined: A at the bound of the search range: run longer" in text
    assert "* at the bound" not in text and "*" not in output.getvalue()
    lines = output.getvalue().splitlines()
    assert not [line for line in lines if len(line) > 80] and "…" not in output.getvalue()
    # Every table row carries its run's whole name on one line; the fit table's lead with the determination.
    fit_table = lines[: next(i for i, line in enumerate(lines) if line.startswith("Half-run check"))]
    for name, said in ((long_names[0], "no"), (long_names[1], "yes")):
        (row,) = [line for line in fit_table if line.strip().startswith(name + " ")]
        assert row.split()[1] == said, row
    (row,) = [line for line in fit_table if line.strip().startswith(long_names[0] + " ")]
    assert row.split()[2:] == ["in", "[0.785,", "0.800]"]  # its A only as an interval


def test_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write_run(tmp_path / "run")
    lines = path.read_text().splitlines()
    lines[2] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    console, output = _console()
    assert main_fit([path], tmp_path / "out", SETTINGS, [], console=console) == EXIT_BAD_INPUT
    assert f"{path}:3: not valid JSON" in output.getvalue()
    assert not (tmp_path / "out" / "fit.json").exists()


def test_missing_field_and_bad_value_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text(
        '{"step": 0, "policy_version": 0, "compute": 0, "pass_rate": 0.2}\n'
        "\n"
        '{"step": 1, "policy_version": 1, "compute": 5}\n'
    )
    with pytest.raises(EvalFileError, match=r"eval.jsonl:3: pass_rate: Field required"):
        read_eval_log(path)
    path.write_text('{"step": 1, "policy_version": 1, "compute": 5, "pass_rate": 1.5}\n')
    with pytest.raises(EvalFileError, match=r"eval.jsonl:1: pass_rate: Input should be less than or equal to 1"):
        read_eval_log(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(EvalFileError, match=r"eval.jsonl:1: expected a JSON object"):
        read_eval_log(path)


def test_missing_file_and_empty_run_directory(tmp_path: Path) -> None:
    console, output = _console()
    assert main_fit([tmp_path / "nope.jsonl"], None, SETTINGS, [], console=console) == EXIT_BAD_INPUT
    assert "does not exist" in output.getvalue()
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(EvalFileError, match=r"has no eval\.jsonl"):
        load_run(tmp_path / "empty-run", "empty-run")


def test_r0_is_step_zero_else_smallest_compute_and_repeated_steps_keep_the_last(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    records = [
        {"step": 20, "policy_version": 2, "compute": 20.0, "pass_rate": 0.5},
        {"step": 0, "policy_version": 0, "compute": 0.0, "pass_rate": 0.1},
        {"step": 10, "policy_version": 1, "compute": 10.0, "pass_rate": 0.3},
        {"step": 10, "policy_version": 1, "compute": 10.0, "pass_rate": 0.35},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    run = load_run(path, "r")
    assert run.r0 == 0.1
    assert run.compute.tolist() == [10.0, 20.0]
    assert run.pass_rate.tolist() == [0.35, 0.5]
    path.write_text("".join(json.dumps(record) + "\n" for record in records if record["step"] != 0))
    run = load_run(path, "r")
    assert run.r0 == 0.35
    assert run.compute.tolist() == [20.0]


def test_a_run_too_young_to_fit_is_reported_and_others_still_written(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _write_run(good)
    short = tmp_path / "short"
    short.mkdir()
    (short / "eval.jsonl").write_text(
        '{"step": 0, "policy_version": 0, "compute": 0, "pass_rate": 0.2}\n'
        '{"step": 1, "policy_version": 1, "compute": 100, "pass_rate": 0.3}\n'
    )
    console, output = _console()
    # Too few points is a young run, not bad input: said, and the command succeeds.
    assert main_fit([good, short], tmp_path / "out", SETTINGS, [], console=console) == EXIT_OK
    report = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert "too few points" in report["runs"]["short"]["error"]
    assert report["runs"]["short"]["half_run_projection"]["reason"] == "needs at least two curve points after R0, got 1"
    assert report["runs"]["good"]["a"] == pytest.approx(A, abs=0.02)
    assert "fit failed" in output.getvalue()
    said = " ".join(output.getvalue().split())
    assert "fit: run 'short' is too young to fit (too few points after the early cutoff" in said
    assert "run it longer" in said
    assert (tmp_path / "out" / "curve.png").exists()


def test_plot_run_draws_a_fitted_run_and_a_run_not_yet_fittable(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    _write_run(run_dir)
    path = plot_run(run_dir, "live", SETTINGS)
    assert path == run_dir / "curve.png"
    assert path.stat().st_size > 20_000
    early = tmp_path / "early"
    early.mkdir()
    (early / "eval.jsonl").write_text(
        '{"step": 0, "policy_version": 0, "compute": 0, "pass_rate": 0.2}\n'
        '{"step": 1, "policy_version": 1, "compute": 100, "pass_rate": 0.3}\n'
    )
    assert plot_run(early, "early", SETTINGS).stat().st_size > 5_000


def test_command_line_reads_settings_from_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "cli-run"
    _write_run(run_dir)
    config = tmp_path / "fit.yaml"
    config.write_text("num_bootstrap_resamples: 40\nrng_seed: 9\n")
    monkeypatch.setenv("ASY_FIT__EARLY_CUTOFF_COMPUTE", "2000")
    code = main([str(run_dir), "--config", str(config), "-t", "10000", "-t", "20000", "-o", str(tmp_path / "o")])
    assert code == EXIT_OK
    report = json.loads((tmp_path / "o" / "fit.json").read_text())
    assert report["settings"]["num_bootstrap_resamples"] == 40
    assert report["settings"]["rng_seed"] == 9
    run = report["runs"]["cli-run"]
    assert run["cutoff_compute"] == 2000.0
    # Points at compute >= 2000 of 60 spaced 3 x 2542 / 60 = 127.1 apart: indices 16..60.
    assert run["num_points_used"] == 45
    assert [p["compute"] for p in run["projections"]] == [10000.0, 20000.0]
    assert "cli-run" in capsys.readouterr().out


def test_fitter_modules_stay_torch_free_and_import_lazily() -> None:
    code = (
        "import sys\n"
        "import services.fitter.curve, services.fitter.plot, services.fitter.offline, benchmarks.fitter\n"
        "import services.fitter.holdout, services.fitter.evals\n"
        "print(sorted(m for m in ('torch', 'vllm', 'matplotlib') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip() == "[]"
    assert result.stderr == ""


def _degenerate_log(path: Path, case: str) -> str:
    """Write an eval log with one kind of bad data; return what the error must say."""
    compute = [0.0] + [100.0 * i for i in range(1, 21)]
    rates = [R0] + [float(predict(c, A, B, 800.0, R0)) for c in compute[1:]]
    expected = {
        "nan": "pass_rate: Input should be a finite number",
        "inf": "compute: Input should be a finite number",
        "negative_compute": "compute: Input should be greater than or equal to 0",
        "decreasing_compute": "cumulative compute must not decrease",
        "r0_above_one": "pass_rate: Input should be less than or equal to 1",
        "constant": "all pass rates equal",
        "too_few": "too few points after the early cutoff",
        "no_gain": "no gain over R0",
    }[case]
    if case == "nan":
        rates[7] = math.nan
    elif case == "inf":
        compute[7] = math.inf
    elif case == "negative_compute":
        compute[7] = -5.0
    elif case == "decreasing_compute":
        compute[7] = 150.0
    elif case == "r0_above_one":
        rates[0] = 1.5
    elif case == "constant":
        rates[1:] = [0.4] * 20
    elif case == "too_few":
        compute, rates = compute[:4], rates[:4]
    elif case == "no_gain":
        rates[1:] = [0.1] * 10 + [0.15] * 10
    path.write_text(
        "".join(
            json.dumps({"step": i, "policy_version": i, "compute": c, "pass_rate": r}) + "\n"
            for i, (c, r) in enumerate(zip(compute, rates))
        )
    )
    return expected


def fit_command(path: Path, out: Path, bad_input: bool = False) -> subprocess.CompletedProcess[str]:
    """``asymptote fit PATH -o OUT`` as a user runs it, in a process of its own; ``bad_input``: a log the
    command must refuse, recorded in the bad-input report (by its contents)."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "fit", str(path), "-o", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "300"},
    )
    if bad_input:
        output = result.stdout + result.stderr
        BAD_INPUTS.record("command line", f"fit {path.read_text()}", crashed="Traceback" in output)
    return result


@pytest.mark.parametrize(
    "case", ["nan", "inf", "negative_compute", "decreasing_compute", "r0_above_one", "constant", "no_gain"]
)
def test_command_line_refuses_degenerate_logs_with_exit_2_and_no_traceback(tmp_path: Path, case: str) -> None:
    path = tmp_path / case / "eval.jsonl"
    path.parent.mkdir()
    expected = _degenerate_log(path, case)
    result = fit_command(path, tmp_path / "out", bad_input=True)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    message = " ".join(result.stderr.split())  # rich may wrap a long message
    assert expected in message
    if case in ("nan", "inf", "negative_compute", "decreasing_compute", "r0_above_one"):
        # Unreadable input: named by file and line, nothing written.
        line = 1 if case == "r0_above_one" else 8
        assert f"eval.jsonl:{line}:" in message
        assert not (tmp_path / "out").exists()
    else:
        assert f"run '{case}'" in message
        assert json.loads((tmp_path / "out" / "fit.json").read_text())["runs"][case]["error"]


def test_decreasing_compute_names_both_steps(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text(
        '{"step": 0, "policy_version": 0, "compute": 0, "pass_rate": 0.2}\n'
        '{"step": 20, "policy_version": 20, "compute": 50, "pass_rate": 0.3}\n'
        '{"step": 10, "policy_version": 10, "compute": 80, "pass_rate": 0.25}\n'
    )
    with pytest.raises(
        EvalFileError,
        match=r"eval.jsonl:2: compute 50 at step 20 is below compute 80 at step 10 "
        r"\(.*eval.jsonl:3\)",
    ):
        read_eval_log(path)


def test_margin_and_targets_are_checked(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    console, output = _console()
    assert main_fit([run_dir], tmp_path / "o", SETTINGS, [], console=console, margin=-0.1) == EXIT_BAD_INPUT
    assert "margin must be a finite pass-rate difference >= 0, got -0.1" in output.getvalue()
    assert main_fit([run_dir], tmp_path / "o", SETTINGS, [math.nan], console=console) == EXIT_BAD_INPUT
    assert "target compute values must be finite and > 0" in output.getvalue()
    assert not (tmp_path / "o").exists()


def test_bench_fitter_reports_against_the_target(tmp_path: Path) -> None:
    figure = bench_fitter(quick=True)
    report = figure.details
    assert figure.name == "fitter_fit_and_bootstrap_1000_points"
    assert figure.targets == (Target(of="value", direction="under", bound=2.0),) and figure.unit == "s"
    assert figure.value is not None and figure.met == (figure.value < 2.0)
    assert report["num_points"] == 1000 and report["num_bootstrap_resamples"] == 200
    assert report["repeats"] == 3 and len(report["total_s_each"]) == 3
    assert figure.value == sorted(report["total_s_each"])[1]
    assert report["scalar_grid_nodes"] == 160 * 100  # A in 0.205..1.000 by 0.005, 100 C_mid values
    assert report["scalar_grid_over_vectorised_fit"] == pytest.approx(
        report["scalar_grid_s_extrapolated"] / report["fit_s"]
    )
    assert bench_main(["--output", str(tmp_path), "--quick"]) == 0
    written = json.loads((tmp_path / BENCH_FILE_NAME).read_text())
    assert set(written) == set(figure.as_json())
    # The A-recovery figure: the same seeded trials give the same errors, written in full.
    recovery = json.loads((tmp_path / RECOVERY_FILE_NAME).read_text())
    assert recovery["name"] == "fitter_a_recovery_fast_early_rise" and recovery["met"] is True
    ours = recovery["details"]["compute_cutoff_8000"]
    assert len(ours["errors"]) == 100 and recovery["value"] == ours["max_abs_error"] <= 0.02
    assert ours["max_abs_error"] == pytest.approx(max(abs(e) for e in ours["errors"]))
    assert recovery["details"]["relative_cutoff_5000"]["median_error"] > 0.03


def test_bench_reports_times_and_the_target() -> None:
    report = bench_fit(num_points=200, settings=CurveFitSettings(num_bootstrap_resamples=20))
    assert report["num_points"] == 200
    assert report["num_bootstrap_resamples"] == 20
    assert report["target_s"] == 2.0
    assert 0.0 < report["fit_s"] < report["total_s"]
    assert report["total_s"] == pytest.approx(report["fit_s"] + report["bootstrap_s"])


def test_command_line_says_a_young_run_is_young_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "young" / "eval.jsonl"
    path.parent.mkdir()
    expected = _degenerate_log(path, "too_few")
    result = fit_command(path, tmp_path / "out")
    assert result.returncode == EXIT_OK, result.stderr
    said = " ".join(result.stdout.split())
    assert "is too young to fit" in said and expected in said and "Traceback" not in result.stderr


def test_each_fit_says_its_axis_and_old_device_second_logs_still_read(tmp_path: Path) -> None:
    """Rows without ``compute_unit`` (written before the FLOPs axis) are device-seconds; a log whose rows change
    unit mid-run is refused naming the line; runs on different axes are not compared."""
    old = tmp_path / "old"
    _write_run(old)
    new = tmp_path / "new"
    path = _write_run(new)
    rows = [{**json.loads(line), "compute_unit": "flops"} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    console, output = _console()
    assert main_fit([old, new], tmp_path / "out", SETTINGS, [], console=console) == EXIT_OK
    report = json.loads((tmp_path / "out" / "fit.json").read_text())
    assert report["runs"]["old"]["compute_unit"] == "device_seconds"
    assert report["runs"]["new"]["compute_unit"] == "flops"
    assert report["comparison"] == []  # one run on each axis: nothing to compare
    text = " ".join(output.getvalue().split())
    assert "C in each run's unit" in text
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    lines = path.read_text().splitlines()
    lines[5] = json.dumps({**json.loads(lines[5]), "compute_unit": "device_seconds"})
    (mixed / "eval.jsonl").write_text("\n".join(lines) + "\n")
    errors, said = _console()
    assert main_fit([mixed], tmp_path / "out2", SETTINGS, [], console=errors) == EXIT_BAD_INPUT
    assert "eval.jsonl:6: compute in device_seconds where" in " ".join(said.getvalue().split())


def test_a_log_of_r0_alone_is_refused_in_one_line_with_exit_2_and_nothing_written(tmp_path: Path) -> None:
    path = tmp_path / "one-row" / "eval.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 0, "policy_version": 0, "compute": 0, "pass_rate": 0.2}\n')
    result = fit_command(path, tmp_path / "out", bad_input=True)
    assert result.returncode == EXIT_BAD_INPUT, result.stdout
    assert result.stderr.strip().splitlines() == [
        f"asymptote fit: {path}: only R0's evaluation (step 0), no curve point after it"
    ]
    assert not (tmp_path / "out").exists() and "Traceback" not in result.stderr
