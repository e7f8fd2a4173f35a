"""The vLLM engine behind a generator: sampling and weight swaps.

Owns one ``vllm.v1.engine.async_llm.AsyncLLM`` (the same engine on CPU and
GPU), turning a prompt and sampling parameters into completions with the
sampled tokens' log-probs and per-token weight-version spans, and loading a
new weight version into the running engine: the whole model, or in a LoRA
run an adapter over the base, loaded in place into the engine's one LoRA
slot. Knows nothing about NATS, tasks or rewards. vLLM is imported lazily so
the module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from asymptote.codec import safetensors_files
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, WeightsError
from asymptote.faults import failpoint
from asymptote.lora import LoraSettings
from asymptote.routing import DTYPES, bytes_per_token, model_layout, moe_layers
from asymptote.sample import Sample
from services.generator.config import EngineSettings

log = logging.getLogger(__name__)

STAGE_POLL_S = 0.005
"""How often a swap asks the worker whether the checkpoint is read."""


UNFINISHED = frozenset({"abort", "error"})
"""vLLM finish reasons of a request cut short by the engine (shutting down, or failing), not by the model."""


class GenerationCut(RuntimeError):
    """The engine ended a request before the model did: its completions are not rollouts."""


class AdapterRefused(WeightsError):
    """vLLM would not load a version's LoRA adapter; the engine serves the adapter it had."""


LORA_NAME = "policy"
LORA_ID = 1
"""The one LoRA slot every version's adapter is loaded into, in place, and every request names."""


@dataclass(frozen=True)
class SwapReport:
    version: int
    paused_s: float
    """Generation stalled: from the scheduler pausing to its resuming."""
    num_running: int
    """Sequences in the engine across the swap (carried, in inflight mode)."""
    staged_s: float = 0.0
    """Reading the checkpoint into the worker, while generation continued."""
    pause_wait_s: float = 0.0
    """Waiting for the step under way to finish (drain: for running requests)."""
    load_s: float = 0.0
    """Of the pause, the load into the model in the engine's workers (the slowest); the rest is the
    engine's calls around it."""
    placement: str = ""
    """Where the version waited for the pause (EngineSettings.swap_staging, resolved)."""
    prepacked: bool = False
    """Whether the version was loaded and packed while staging (EngineSettings.swap_prepack)."""
    prepare_s: float = 0.0
    """Of the staging, loading and packing the version beside the live model (the slowest worker)."""


def check_platform(s: EngineSettings) -> None:
    """ConfigError naming the setting when this platform's vLLM cannot run ``s``.

    Imports vLLM only when there is something to check (a quantization, a staging place for GPUs).
    """
    if s.quantization is None and s.swap_staging in ("auto", "mapped"):
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms import current_platform

    if s.swap_staging not in ("auto", "mapped") and current_platform.device_type == "cpu":
        raise ConfigError(
            f"engine.swap_staging {s.swap_staging!r} stages for a GPU; vLLM's CPU build computes from the "
            "staged pages themselves: use auto or mapped"
        )
    if s.quantization is None:
        return

    if s.quantization not in QUANTIZATION_METHODS:
        # Checked here because CUDA keeps no list of its own (verify_quantization passes any name there).
        raise ConfigError(
            f"engine.quantization {s.quantization!r} is not a vLLM quantization method; "
            f"accepted: {', '.join(QUANTIZATION_METHODS)}"
        )
    if current_platform.device_type == "cpu":
        # vLLM keeps no list for CPU either, which it reads as "anything", yet
        # fp8 fails there only once the model loads, for want of CPU kernels.
        raise ConfigError(
            f"engine.quantization {s.quantization!r}: vLLM's CPU build serves unquantized models here; "
            "quantization needs a GPU generator"
        )
    try:
        current_platform.verify_quantization(s.quantization)
    except ValueError as exc:
        raise ConfigError(f"engine.quantization {s.quantization!r}: {exc}") from exc


def routing_layout(s: EngineSettings) -> rollout_pb2.RoutingLayout | None:
    """The routing this engine records (``routing_replay``; None: it records none), checked in one line each:
    replay asked for a model without routed experts, or an engine split into pipeline stages or (the CPU
    build's own capture) tensor-parallel ranks."""
    config_path = s.model_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    spec = model_layout(config)
    if (s.routing_replay is None and spec is None) or s.routing_replay is False:
        return None
    if spec is None:
        raise ConfigError(
            f"engine.routing_replay is on, but {s.model_dir} is not a mixture of experts (its config.json names "
            "no num_experts and num_experts_per_tok): set it false"
        )
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu" and s.tensor_parallel_size != 1:
        raise ConfigError(
            f"engine.routing_replay on the CPU build records routing in one worker: engine.tensor_parallel_size "
            f"{s.tensor_parallel_size} is not 1"
        )
    return spec


def engine_lora_rank(lora: LoraSettings) -> int:
    """The engine's ``max_lora_rank`` for an adapter of ``lora.rank``: the smallest vLLM accepts that holds
    it (vLLM sizes its slot buffers by it). ConfigError naming lora.rank above vLLM's largest."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(int(r) for r in get_args(MaxLoRARanks))
    fits = [r for r in ranks if r >= lora.rank]
    if not fits:
        raise ConfigError(f"lora.rank {lora.rank} is above vLLM's largest max_lora_rank, {ranks[-1]}: use at most that")
    return fits[0]


def check_lora(s: EngineSettings, lora: LoraSettings | None) -> None:
    """ConfigError in one line naming the setting when this engine cannot serve ``lora``'s adapters as the
    learner trains them: a rank above vLLM's largest, or a quantized base (the learner adapts the
    unquantized base, so sampling from a quantized one would be another policy than the one scored)."""
    if lora is None:
        return
    engine_lora_rank(lora)
    if s.quantization is not None:
        raise ConfigError(
            f"lora with engine.quantization {s.quantization!r}: the learner trains the adapter over the "
            "unquantized base, so the generators serve that base; leave engine.quantization unset"
        )
    config_path = s.model_dir / "config.json"
    quantized = json.loads(config_path.read_text()).get("quantization_config") if config_path.is_file() else None
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, dict) else "quantized"
        raise ConfigError(
            f"lora with engine.model_dir {s.model_dir}: its base is {method}-quantized (config.json "
            "quantization_config); the learner adapts an unquantized base: serve that one"
        )


def engine_args(s: EngineSettings, lora: LoraSettings | None = None) -> Any:
    """vLLM's ``AsyncEngineArgs`` for ``s`` (the same engine on CPU and GPU); with ``lora``, one LoRA slot
    sized for its rank, the base loaded once from ``model_dir``."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    overrides: dict[str, Any] = {}
    adapters: dict[str, Any] = {}
    if lora is not None:
        adapters = {"enable_lora": True, "max_lora_rank": engine_lora_rank(lora), "max_loras": 1}
    if s.fp32_lm_head and s.dtype != "float32":
        # ScaleRL's FP32 head: vLLM projects and normalises the logits in float32.
        overrides["head_dtype"] = "float32"
    args = AsyncEngineArgs(
        model=str(s.model_dir),
        tokenizer=str(s.model_dir),
        # Never vLLM's "auto", which falls back to pickle-based *.bin / *.pt files.
        load_format="safetensors",
        dtype=s.dtype,
        max_num_seqs=s.max_num_seqs,
        tensor_parallel_size=s.tensor_parallel_size,
        gpu_memory_utilization=s.gpu_memory_utilization,
        kv_cache_memory_bytes=s.kv_cache_memory_bytes,
        quantization=s.quantization,
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        # Log-probs of the distribution actually sampled from (after
        # temperature), which is what the learner's IS ratio divides by.
        logprobs_mode="processed_logprobs",
        max_logprobs=1,
        enable_prefix_caching=s.enable_prefix_caching,
        hf_overrides=overrides,
        worker_extension_cls="services.generator.worker_ext.StagedWeightsExtension",
        **adapters,
    )
    if s.max_model_len is not None:
        # Left unset, vLLM derives it from the model's config (its field is typed int, defaulting to None).
        args.max_model_len = s.max_model_len
    if worker_in_engine_core(s):
        args.distributed_executor_backend = "uni"
    if routing_layout(s) is not None and native_capture():
        # Untested here (docs/testing.md): vLLM's own capture, which needs Model Runner V2 and prefix caching.
        args.enable_return_routed_experts = True
        args.enable_prefix_caching = True
    return args


def worker_in_engine_core(s: EngineSettings) -> bool:
    """Whether the model runs in the engine core's own process (vLLM's ``uni`` executor), as vLLM runs one
    GPU: a CPU engine of one worker, whose worker vLLM's CPU build otherwise puts in a process of its own.

    That process costs a quarter of the engine's start (its own imports of vLLM and torch) and a hop per
    step (``python -m benchmarks.engine_start`` measures both against it). vLLM keeps it on the CPU
    to set the worker's OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``) before torch starts its threads;
    a process's threads then run on its CPU affinity instead (the local stack's ``pin_cores``).
    """
    from vllm.platforms import current_platform

    return bool(current_platform.device_type == "cpu" and s.tensor_parallel_size == 1)


def engine_core_start_method(s: EngineSettings) -> str | None:
    """How the engine core's process starts: ``fork`` with the model in it on a CPU, else vLLM's choice.

    The engine core keeps a process of its own (AsyncLLM always starts one). Building the engine's config
    sets vLLM's start method to spawn on the CPU, for its worker processes; with the model in the engine
    core there are none, and the core is forked from the generator's process as vLLM forks it on a GPU,
    so it starts with the imports made there instead of importing vLLM and torch again
    (``python -m benchmarks.engine_start`` measures it).
    """
    return "fork" if worker_in_engine_core(s) else None


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name]`` is ``value`` inside the block, as it was after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def native_capture() -> bool:
    """Whether routing is vLLM's own capture (a GPU's Model Runner V2), else the worker's (``capture``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.device_type != "cpu")


class Engine:
    def __init__(self, settings: EngineSettings, lora: LoraSettings | None = None) -> None:
        self.settings = settings
        self.lora = lora
        """A LoRA run: every version is an adapter, and nothing is sampled before the first is loaded."""
        self.version = 0
        self._adapter: Any = None
        """The LoRARequest every request carries once an adapter is loaded (never ``load_inplace``)."""
        self._adapter_loaded = asyncio.Event()
        self._llm: Any = None
        self._swap_lock = asyncio.Lock()
        self._staged_path: str | None = None
        """The folder the workers hold staged (``stage``), until a swap loads it."""
        self._version_changed = asyncio.Condition()
        self.num_running = 0
        self.routing: rollout_pb2.RoutingLayout | None = None
        """The routing every sample records (``EngineSettings.routing_replay``); None: none."""
        self._moe_layers: list[int] = []

    async def start(self) -> None:
        """Start vLLM on ``model_dir``'s safetensors weights; WeightsError if it has none.

        ConfigError, before the engine starts, for a setting this platform cannot run.
        """
        s = self.settings
        safetensors_files(s.model_dir)  # refused before vLLM is even imported
        check_platform(s)
        check_lora(s, self.lora)
        routing = routing_layout(s)

        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(s, self.lora)
        started = time.monotonic()
        in_core = worker_in_engine_core(s)
        # vLLM's CPU platform turns the ``uni`` executor back into a process of its own unless told that
        # engine processes run their workers in place, which it reads while building the engine's config.
        with env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "0") if in_core else contextlib.nullcontext():
            config = args.create_engine_config()
        method = engine_core_start_method(s)
        with env_set("VLLM_WORKER_MULTIPROC_METHOD", method) if method else contextlib.nullcontext():
            self._llm = AsyncLLM.from_vllm_config(
                config,
                enable_log_requests=args.enable_log_requests,
                disable_log_stats=args.disable_log_stats,
            )
        await self._llm.update_weight_version("0")
        if routing is not None:
            self._moe_layers = moe_layers(json.loads((s.model_dir / "config.json").read_text()))
            if not native_capture():
                (found,) = await self._llm.collective_rpc("install_routing_capture")
                if (found["moe_layers"], found["top_k"], found["num_experts"]) != (
                    self._moe_layers,
                    routing.top_k,
                    routing.num_experts,
                ):
                    raise ConfigError(f"the engine routes as {found}, {s.model_dir}/config.json says {routing}")
            self.routing = routing
        log.info("vLLM engine up in %.1fs (model %s)", time.monotonic() - started, s.model_dir)

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def sample(
        self,
        prompt: str | list[int],
        num_samples: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int = 0,
        on_progress: Callable[[int], None] | None = None,
        stop: Sequence[str] = (),
    ) -> tuple[list[int], list[Sample]]:
        """Sample ``num_samples`` completions of ``prompt`` (text, or token ids taken as they are);
        returns (prompt ids, samples).

        ``on_progress``, if given, is called with the fewest tokens any of the
        completions has so far, after every engine step that advanced them.
        ``stop``: strings that end a completion, kept in its text and tokens.
        """
        adapter = await self.adapter()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=num_samples,
            temperature=temperature,
            top_p=top_p if 0.0 < top_p < 1.0 else 1.0,
            max_tokens=max_tokens,
            logprobs=0,
            seed=seed or None,
            output_kind=RequestOutputKind.FINAL_ONLY if on_progress is None else RequestOutputKind.CUMULATIVE,
            stop=list(stop) or None,
            include_stop_str_in_output=bool(stop),
        )
        request: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        if self.settings.prefix_cache_salt == "version":
            # KV cached under an older version is never reused (sequences in flight keep their own).
            request["cache_salt"] = f"policy-v{self.version}"
        prompt_ids: list[int] | None = None
        num_cached = 0
        # Each completion's newest state, by index: streamed (CUMULATIVE)
        # outputs of a parallel request carry only the completions that moved.
        latest: dict[int, Any] = {}
        self.num_running += num_samples
        request_id = uuid.uuid4().hex
        try:
            async for out in self._llm.generate(request, params, request_id=request_id, lora_request=adapter):
                prompt_ids = list(out.prompt_token_ids or [])
                num_cached = int(out.num_cached_tokens or 0)
                for c in out.outputs:
                    latest[c.index] = c
                if on_progress is not None and len(latest) == num_samples:
                    on_progress(min(len(c.token_ids) for c in latest.values()))
        finally:
            self.num_running -= num_samples
        if prompt_ids is None:
            raise RuntimeError("vLLM returned no output")
        outputs = [latest[i] for i in sorted(latest)]
        cut = sorted({str(c.finish_reason) for c in outputs if str(c.finish_reason) in UNFINISHED})
        unfinished = [c for c in outputs if c.finish_reason is None]
        if cut or unfinished or len(outputs) != num_samples:
            # An engine shutting down aborts what it holds: such a completion
            # (often no tokens at all) must go back as a task, not out as data.
            raise GenerationCut(
                f"vLLM ended the request early ({', '.join(cut) or 'no finish reason'}): "
                f"{len(outputs) - len(unfinished)} of {num_samples} completions finished"
            )
        samples = [self._sample(c, num_cached) for c in outputs]
        if self.routing is not None:
            samples = await self._with_routing(request_id, len(prompt_ids), outputs, samples)
        return prompt_ids, samples

    async def _with_routing(
        self, request_id: str, num_prompt: int, outputs: list[Any], samples: list[Sample]
    ) -> list[Sample]:
        """``samples`` with the rows of their prompt and completion tokens but the last: vLLM's own
        (``routed_experts``, every decoder layer: the MoE layers' columns are kept) or the worker's capture."""
        assert self.routing is not None
        row_bytes = bytes_per_token(self.routing)
        if native_capture():
            taken = {
                i: np.ascontiguousarray(
                    c.routed_experts[:, self._moe_layers], dtype=DTYPES[self.routing.dtype]
                ).tobytes()
                for i, c in enumerate(outputs)
                if c.routed_experts is not None
            }
        else:
            (taken,) = await self._llm.collective_rpc("take_routing", kwargs={"request_id": request_id})
        out = []
        for i, x in enumerate(samples):
            rows = taken.get(i)
            want = num_prompt + len(x.token_ids) - 1
            if rows is None or len(rows) < want * row_bytes:
                raise RuntimeError(
                    f"routing capture returned {0 if rows is None else len(rows) // row_bytes} rows for sample {i}, "
                    f"its prompt and completion need {want}"
                )
            out.append(replace(x, routing=bytes(rows[: want * row_bytes])))
        return out

    def _sample(self, c: Any, num_cached_tokens: int = 0) -> Sample:
        token_ids = list(c.token_ids)
        logprobs: list[float] = []
        for tid, entry in zip(token_ids, c.logprobs or []):
            lp = entry.get(tid) if entry else None
            if lp is None:
                raise RuntimeError(f"vLLM returned no log-prob for sampled token {tid}")
            logprobs.append(float(lp.logprob))
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
        spans = [(int(s.version), int(s.start), int(s.end)) for s in (c.weight_versions or [])]
        if not spans and token_ids:
            spans = [(self.version, 0, len(token_ids))]
        stop_reason = c.stop_reason if isinstance(c.stop_reason, str) else None
        return Sample(
            token_ids,
            logprobs,
            spans,
            str(c.finish_reason or ""),
            c.text,
            stop_reason=stop_reason,
            num_cached_tokens=num_cached_tokens,
        )

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The log-prob of each token of ``token_ids`` after the first, given the ones before it.

        Scored by the weights the engine serves, as a forward pass over the
        whole sequence (vLLM's prompt log-probs, before any temperature).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(token_ids) < 2:
            raise ValueError(f"scoring needs at least two tokens, got {len(token_ids)}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        final = None
        request = TokensPrompt(prompt_token_ids=token_ids)
        adapter = await self.adapter()
        async for out in self._llm.generate(request, params, request_id=uuid.uuid4().hex, lora_request=adapter):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs")
        scored = []
        for position, (token, entry) in enumerate(zip(token_ids[1:], final.prompt_logprobs[1:]), start=1):
            if entry is None or token not in entry:
                raise RuntimeError(f"vLLM returned no log-prob for token {token} at position {position}")
            scored.append(float(entry[token].logprob))
        return scored

    async def adapter(self) -> Any:
        """The LoRARequest a request carries (None without LoRA), once an adapter is loaded: in a LoRA run
        nothing is sampled from the base alone, so a request waits for the first adapter here."""
        if self.lora is None:
            return None
        await self._adapter_loaded.wait()
        return self._adapter

    async def stage(self, weights_path: Path) -> None:
        """Stage ``weights_path`` in the engine's workers while generation goes on: the first part of a swap,
        so a ``swap`` of the same folder next only pauses to load it. The engine serves its version meanwhile.
        A LoRA adapter is not staged (it is small, and loaded in the pause)."""
        if self.lora is not None:
            return
        async with self._swap_lock:
            await self._stage(str(weights_path))

    async def _stage(self, path: str) -> None:
        await self._llm.collective_rpc(
            "stage_weights",
            kwargs={
                "weights_path": path,
                "placement": self.settings.swap_staging,
                "prepack": self.settings.swap_prepack,
            },
        )
        self._staged_path = path
        # The worker reads on a thread of its own while the engine steps;
        # asking whether it is done is a short call between two steps.
        while not all(await self._llm.collective_rpc("staged", kwargs={"weights_path": path})):
            await asyncio.sleep(STAGE_POLL_S)

    async def swap(self, weights_path: Path, version: int, mode: Literal["inflight", "drain"]) -> SwapReport:
        """Load ``weights_path`` as ``version`` into the running engine.

        The checkpoint is first read into the worker's memory, on a thread of
        the worker's, while generation continues; then the scheduler is paused
        between two engine steps, the staged tensors are loaded, the engine's
        weight version is set and the scheduler resumes. inflight: requests
        and their KV cache are kept, so sequences in flight continue under the
        new weights (PipelineRL).
        drain: running requests finish first (conventional on-policy RL).
        The load goes through vLLM's in-place layerwise reload, which repacks
        CPU kernels' weights; copying tensors into parameters corrupts them on CPU.
        With ``swap_prepack`` a CPU engine runs that reload while staging, into a
        twin of the model, and the pause only hands the result over.
        In a LoRA run ``weights_path`` is an adapter's folder (``swap_adapter``).
        """
        if self.lora is not None:
            return await self.swap_adapter(weights_path, version, mode)
        async with self._swap_lock:
            path = str(weights_path)
            started = time.monotonic()
            if self._staged_path != path:
                await self._stage(path)
            self._staged_path = None
            staged = time.monotonic()
            paused, running = await self._pause(mode, version)
            # Load, relabel and resume are sent back to back: the new label and
            # the resumption come strictly after the load, without a round trip
            # between them.
            results = await self._in_order(
                self._llm.collective_rpc("apply_staged_weights", kwargs={"weights_path": path}),
                self._llm.update_weight_version(str(version)),
                self._llm.resume_generation(),
            )
            resumed = time.monotonic()
            if isinstance(results[0], BaseException):
                # The load failed after verification: relabel to the version
                # still (or partly) in the engine and report it.
                await self._llm.update_weight_version(str(self.version))
                raise RuntimeError(f"loading version {version} into the engine failed: {results[0]}") from results[0]
            for r in results[1:]:
                if isinstance(r, BaseException):
                    raise r
            self.version = version
        async with self._version_changed:
            self._version_changed.notify_all()
        loads: list[dict[str, Any]] = results[0]
        return SwapReport(
            version,
            resumed - paused,
            running,
            staged_s=staged - started,
            pause_wait_s=paused - staged,
            load_s=max(load["load_s"] for load in loads),
            placement=loads[0]["placement"],
            prepacked=all(load["prepacked"] for load in loads),
            prepare_s=max(load["prepare_s"] for load in loads),
        )

    async def swap_adapter(self, adapter_dir: Path, version: int, mode: Literal["inflight", "drain"]) -> SwapReport:
        """Load the peft adapter in ``adapter_dir`` as ``version``, in place, into the engine's LoRA slot.

        The scheduler pauses as for whole weights (inflight: requests and KV
        kept, so sequences in flight continue under the new adapter), the
        adapter is loaded with ``load_inplace`` (the slot's contents decide
        every request's output, whatever path the request names), then the
        weight version is relabelled and the scheduler resumes, back to back.
        Only this call carries ``load_inplace``: vLLM's worker re-adds every
        request's LoRARequest at each step and would read it from disk each
        time. Requests name the staging root, which holds no adapter, so a
        reload from a request's path would fail loudly rather than serve a
        stale adapter. AdapterRefused, with the engine serving the adapter it
        had, when vLLM will not load it.
        """
        from vllm.lora.request import LoRARequest

        async with self._swap_lock:
            started = time.monotonic()
            paused, running = await self._pause(mode, version)
            try:
                await self._llm.add_lora(LoRARequest(LORA_NAME, LORA_ID, str(adapter_dir), load_inplace=True))
            except Exception as exc:
                await self._llm.resume_generation()
                raise AdapterRefused(f"version {version}: vLLM did not load its LoRA adapter: {exc}") from exc
            loaded = time.monotonic()
            for result in await self._in_order(
                self._llm.update_weight_version(str(version)), self._llm.resume_generation()
            ):
                if isinstance(result, BaseException):
                    raise result
            resumed = time.monotonic()
            self.version = version
            self._adapter = LoRARequest(LORA_NAME, LORA_ID, str(adapter_dir.parent))
            self._adapter_loaded.set()
        async with self._version_changed:
            self._version_changed.notify_all()
        return SwapReport(
            version,
            resumed - paused,
            running,
            pause_wait_s=paused - started,
            load_s=loaded - paused,
            placement="adapter",
        )

    async def _pause(self, mode: Literal["inflight", "drain"], version: int) -> tuple[float, int]:
        """Pause the scheduler for a swap to ``version``; returns when it paused and the sequences it holds.

        The engine core takes the pause between two steps; the step under way
        when it is asked still completes, so the stall starts on return.
        """
        await self._llm.engine_core.pause_scheduler_async(
            mode="keep" if mode == "inflight" else "wait", clear_cache=False
        )
        paused = time.monotonic()
        failpoint("generator.swap.paused", version)
        return paused, self.num_running

    @staticmethod
    async def _in_order(*calls: Any) -> list[Any]:
        """Send engine-core calls back to back and gather their results (an exception as its result): the
        engine core runs its utility calls one at a time in arrival order, so each runs after the last."""
        futures = []
        for call in calls:
            futures.append(asyncio.ensure_future(call))
            await asyncio.sleep(0)  # let it send before the next one is sent
        return list(await asyncio.gather(*futures, return_exceptions=True))

    async def wait_for_version(self, version: int) -> None:
        """Return once the engine serves ``version`` or a newer one."""
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.version >= version)
