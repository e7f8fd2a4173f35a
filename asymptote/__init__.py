"""Asymptote's shared, torch-free runtime.

Everything here is imported by more than one service: configuration
loading, logging, the metrics and health HTTP server, gRPC bootstrap, NATS
names and wiring, the tensor codec, compute accounting, tasks and verifiers.
Nothing here imports torch, vllm or any service package.
"""

__version__ = "0.1.0"
