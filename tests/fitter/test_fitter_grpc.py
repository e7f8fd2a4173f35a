"""The Fitter gRPC service over a real channel: submit points, read the
projection with intervals; bad points get INVALID_ARGUMENT naming them and
the service keeps answering; the Prometheus collector serves one snapshot."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asymptote.config import ListenSettings
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.rpc import start_server
from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, predict
from services.fitter.metrics import ProjectionCollector
from services.fitter.server import FitterServicer

A, B, C_MID, R0 = 0.61, 1.92, 2542.0, 0.2


def points(n: int = 30) -> list[services_pb2.CurvePoint]:
    compute = np.linspace(0.0, 2 * C_MID, n)
    rate = predict(np.maximum(compute, 1e-9), A, B, C_MID, R0)
    return [services_pb2.CurvePoint(compute=float(c), pass_rate=float(r), policy_version=i)
            for i, (c, r) in enumerate(zip(compute, rate))]


async def test_submit_and_read_projection_and_refuse_bad_points(tmp_path: Path) -> None:
    collector = Collector(tmp_path, "live", CurveFitSettings(), (2.0,), ComputeAxis(30.0), plot=False)
    health = Health("fitter")
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0), health,
        lambda s: services_pb2_grpc.add_FitterServicer_to_server(FitterServicer(collector), s),
        ["asymptote.contracts.v1.Fitter"],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = services_pb2_grpc.FitterStub(ch)
            proj = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="ablation-1", points=points()))
            assert proj.ok, proj.reason
            assert proj.a == pytest.approx(A, abs=0.01) and proj.b == pytest.approx(B, rel=0.1)
            assert proj.r0 == pytest.approx(R0)
            assert proj.a_interval.low <= proj.a <= proj.a_interval.high
            assert proj.projections and proj.projections[0].interval.low <= proj.projections[0].pass_rate
            again = await stub.GetProjection(services_pb2.GetProjectionRequest(run="ablation-1"))
            assert again == proj

            bad = points()
            bad[4].pass_rate = float("nan")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="x", points=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[4]" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="x", points=points()[1:]))
            assert "policy_version 0" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetProjection(services_pb2.GetProjectionRequest(run="nobody"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # Too few points: a projection that says why, not an error.
            few = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="few", points=points()[:3]))
            assert not few.ok and "too few points" in few.reason
            # The live run has no points yet: it says so.
            live = await stub.GetProjection(services_pb2.GetProjectionRequest())
            assert not live.ok and live.reason
    finally:
        await server.stop(None)

    # One snapshot per scrape: even when the projection changes between
    # calls, every gauge of a scrape comes from the same fit.
    other = services_pb2.Projection()
    other.CopyFrom(proj)
    other.a, other.b, other.c_mid = 0.5, 1.0, 100.0
    calls = iter([proj, other] * 10)
    registry = CollectorRegistry()
    registry.register(ProjectionCollector("r", lambda: next(calls), lambda: (30, 5084.0, 0.6), lambda: {"generator": 1.0}))
    for expected in (proj, other, proj):
        scraped = {
            s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
        }
        assert (scraped["asymptote_fitter_a"], scraped["asymptote_fitter_b"], scraped["asymptote_fitter_c_mid"]) == (
            pytest.approx(expected.a), pytest.approx(expected.b), pytest.approx(expected.c_mid))
        assert scraped["asymptote_fitter_points"] == 30
