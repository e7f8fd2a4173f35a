"""The fitter's configuration (one frozen model, loaded by asymptote.config)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from asymptote.compute import ComputeUnit
from asymptote.config import ListenSettings, ServiceSettings
from services.fitter.curve import CurveFitSettings


class FitterConfig(ServiceSettings):
    """Fitter: the validation curve, its sigmoid fit and the projections."""

    grpc: ListenSettings = ListenSettings(port=50081)
    """gRPC listener (Fitter service and health)."""
    http: ListenSettings = ListenSettings(port=9104)
    """HTTP listener (/metrics, /healthz, /readyz)."""
    run_dir: Path = Path("runs/latest")
    """Where eval.jsonl, fit.json and curve.png go."""
    run_name: str = "run"
    """Name of this run in projections, plots and gauges."""
    curve: CurveFitSettings = CurveFitSettings()
    """How the curve is fitted and its uncertainty estimated."""
    target_compute_multiples: tuple[float, ...] = (2.0, 10.0)
    """Project the pass rate at these multiples of the compute spent so far."""
    compute_axis: ComputeUnit = "flops"
    """The curve's compute axis: FLOPs of the tokens trained and generated (alike under any machine load), or
    device-seconds held (the cost, which stretches with load). A run whose eval.jsonl began on one keeps it."""
    planned_compute: float | None = Field(default=None, gt=0.0)
    """The run's compute budget, in the axis's unit (FLOPs by default): projected and recommended against; None
    looks to the asymptote."""
    telemetry_stale_s: float = Field(default=30.0, gt=0.0)
    """An instance silent for this long is treated as gone (its compute stops growing)."""
    plot: bool = True
    """Write curve.png on every refit."""
