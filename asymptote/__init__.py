"""Asymptote's shared, torch-free runtime.

Everything here is imported by more than one service: configuration
loading, logging, the metrics and health HTTP server, gRPC bootstrap, NATS
names and wiring, the tensor codec, compute accounting, tasks and verifiers.
Nothing here imports torch, vllm or any service package.
"""

import os

# Before anything imports gRPC (it reads this once): no gRPC fork handlers. Services fork children that
# never use gRPC (sandboxed programs, vLLM's engine core); gRPC's handlers, run in such a child between fork
# and exec while another thread is inside gRPC, crash that child (SIGABRT, SIGSEGV) at random.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__version__ = "0.1.0"
