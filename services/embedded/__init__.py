"""The embedded recipe: what ``asymptote up`` trains on a machine with no model of its own.

Owns the tiny model's builder (``build``: random-initialised Hugging Face
models and locally trained tokenizers, also the tests' and benchmarks'
model maker), its supervised warm starts (``warmstart``, and
``warmstart_turns`` for multi-turn episodes), the formats each workload is
taught in, the transformers sampler the warm start probes with
(``sampling``) and the single-process on-policy baseline the benchmarks
compare the services with (``onpolicy``). The workloads themselves are
config files, examples/workloads/*.yaml.

A recipe, not a deployable: the local stack, the command line, the
benchmarks and the tests import it; no service and nothing in the shared
runtime does (tests/test_contracts.py), so every image's code path is the
one a user's own model and dataset take.
"""
