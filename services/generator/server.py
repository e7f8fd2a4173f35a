"""The generator's gRPC face: Generator.Generate and Generator.Status."""

from __future__ import annotations

import math

import grpc

from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.health import Health
from services.generator.engine import Engine, GenerationCut
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import completion

MAX_SAMPLES = 256
MAX_TOKENS_CAP = 65_536


def _request_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean the request itself was bad (vLLM's validation error has its own class)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMValidationError)


class GeneratorServicer(services_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, health: Health, instance_id: str, metrics: GeneratorMetrics) -> None:
        self.engine = engine
        self.health = health
        self.instance_id = instance_id
        self.metrics = metrics

    async def Generate(
        self, request: services_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.GenerateResponse:
        s = request.sampling
        num = s.num_samples or 1
        max_tokens = s.max_tokens or 16
        temperature = s.temperature if s.temperature > 0 else 1.0
        if not request.prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if num > MAX_SAMPLES or max_tokens > MAX_TOKENS_CAP:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"num_samples must be <= {MAX_SAMPLES} and max_tokens <= {MAX_TOKENS_CAP}",
            )
        # Zero means the default; a negative or NaN value is a mistake, not a request for it.
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"temperature is {s.temperature}: must be a finite number >= 0 (0 takes the default, 1.0)",
            )
        if not 0.0 <= s.top_p <= 1.0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"top_p is {s.top_p}: must be in [0, 1] (0 or 1: no nucleus truncation)",
            )
        if not self.health.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"generator not ready: {self.health.detail}")
        try:
            prompt_ids, samples = await self.engine.sample(
                request.prompt, num, temperature, s.top_p, max_tokens, int(s.seed)
            )
        except _request_errors() as exc:  # vLLM's own checks: prompt too long for the model, and the like
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request refused by the engine: {exc}")
        except GenerationCut as exc:  # the engine is shutting down or failed: try again elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return services_pb2.GenerateResponse(
            completions=[completion(x, 0.0) for x in samples],
            policy_version=self.engine.version,
            prompt_token_ids=prompt_ids,
        )

    async def Status(
        self, request: services_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.ServiceStatus:
        return services_pb2.ServiceStatus(
            service="generator",
            instance_id=self.instance_id,
            ready=self.health.ready,
            detail=self.health.detail,
            policy_version=self.engine.version,
            gauges={
                "running_sequences": float(self.engine.num_running),
                "swaps": self.metrics.swaps._value.get(),
            },
        )
