"""Weight swaps in a running vLLM engine: mid-sequence, and refusals.

One real ``AsyncLLM`` (the CPU build) on a purpose-built tiny Llama whose
two policy versions differ only in the LM head, so the KV cache computed
under version 0 is exactly what version 1 would have computed: the tokens
after a mid-sequence swap must then follow version 1 exactly, and their
log-probs must equal a transformers forward pass of version 1 on the same
prefix. Version 0 favours one character, version 1 another, so the switch
is visible in the text.

Refusals go through the real path: a real gRPC ``Learner.PullWeights``
server streams each bad update, the swapper verifies and refuses it, and
the engine keeps serving the version it had.

A request the engine cuts short (aborted, as vLLM's engine core does when
it shuts down) is an error, never a completion; the rollout loop over a
real nats-server hands such a task back, and when draining publishes what
it has in flight and hands back at once what waits for a later version.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from asymptote.codec import DecodedWeights, WireTensor, read_signature, signature_num_bytes, version_digest
from asymptote.compute import ComputeMeter
from asymptote.config import ListenSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.nats_local import nats_server
from asymptote.rpc import start_server
from asymptote.tasks import ALPHABET, ArithmeticSettings, task_digest
from services.embedded.build import ModelSpec, build_model, build_tokenizer, save_model_dir
from services.generator.config import EngineSettings
from services.generator.engine import Engine, GenerationCut
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import RolloutLoop
from services.generator.scoring import TaskScorer
from services.generator.swapper import EvalHold, Swapper
from services.generator.weights import SPARE_FILE, GrpcWeightSource, stage
from services.learner.model import load_model
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore, to_wire
from tests.helpers.badinput import BAD_INPUTS, send_bad_request, send_bad_requests
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.vllm]

OLD_CHAR, NEW_CHAR = "3", "7"
BONUS = 0.5  # LM-head weight on the constant feature: ~4 nats for the favoured character
MAX_TOKENS = 100
SWAP_AFTER_TOKENS = 20
LOGPROB_TOL = 2e-3
"""vLLM's CPU kernels against transformers' eager float32 forward: observed
differences are ~1e-5; 2e-3 leaves room for other kernels while staying far
below the ~4-nat gap between the two versions' favoured tokens."""


def _head(model: torch.nn.Module, favoured: int, eos: int) -> None:
    """LM head column 0 reads the constant feature: +BONUS for one token, EOS suppressed."""
    with torch.no_grad():
        w = model.lm_head.weight
        w[:, 0] = 0.0
        w[favoured, 0] = BONUS
        w[eos, 0] = -2.0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("swap")
    spec = ModelSpec(tie_word_embeddings=False, max_position_embeddings=128, init_seed=3)
    tok = build_tokenizer(ALPHABET, spec.vocab_multiple)
    model = build_model(spec, tok)
    with torch.no_grad():
        # A constant, dominant feature in dimension 0 of every embedding: after
        # the final RMSNorm it is ~+9 at every position, whatever the context.
        model.model.embed_tokens.weight[:, 0] = 1.0
    old_id, new_id = tok.convert_tokens_to_ids(OLD_CHAR), tok.convert_tokens_to_ids(NEW_CHAR)
    _head(model, old_id, tok.eos_token_id)
    v0_dir = save_model_dir(model, tok, root / "v0")
    _head(model, new_id, tok.eos_token_id)
    v1_dir = save_model_dir(model, tok, root / "v1")
    return {"v0": v0_dir, "v1": v1_dir, "tok": tok, "old_id": old_id, "new_id": new_id, "root": root}


@pytest.fixture(scope="module")
async def engine(models: dict[str, object]) -> AsyncIterator[Engine]:
    eng = Engine(EngineSettings(model_dir=models["v0"], max_num_seqs=16, kv_cache_memory_bytes=64 * 1024 * 1024))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def _version1_folder(models: dict[str, object]) -> Path:
    """v1 staged the way the swapper stages a pulled version."""
    v1 = load_model(models["v1"])
    tensors = {n: to_wire(t) for n, t in v1.state_dict().items() if n in read_signature(models["v0"])}
    weights = DecodedWeights(1, version_digest(tensors), tensors)
    return stage(weights, models["root"] / "staged", models["v0"])


def _reference_logprobs(model_dir: Path, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    model = load_model(model_dir).eval()
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(token_ids) - 1)
    return logp[positions, torch.tensor(token_ids)]


async def test_mid_sequence_swap_continues_under_new_weights(engine: Engine, models: dict[str, object]) -> None:
    folder = _version1_folder(models)
    n = 4
    under_way = asyncio.Event()

    def progress(num_tokens: int) -> None:
        if num_tokens >= SWAP_AFTER_TOKENS:
            under_way.set()

    task = asyncio.create_task(engine.sample("12+34=", n, 1.0, 1.0, MAX_TOKENS, seed=2, on_progress=progress))
    await asyncio.wait_for(under_way.wait(), 120)
    report = await engine.swap(folder, 1, "inflight")
    prompt_ids, samples = await task

    assert engine.version == 1
    assert report.num_running == n, "every sequence of the request was carried across the swap"
    tok, old_id, new_id = models["tok"], models["old_id"], models["new_id"]
    for s in samples:
        # Not aborted, not recomputed: the request ran to its length under both versions.
        assert s.finish_reason == "length" and len(s.token_ids) == MAX_TOKENS
        assert len(s.version_spans) == 2, s.version_spans
        (v_a, a0, a1), (v_b, b0, b1) = s.version_spans
        assert (v_a, v_b) == (0, 1) and a0 == 0 and a1 == b0 and b1 == MAX_TOKENS
        switch = b0
        assert 0 < switch < MAX_TOKENS
        before, after = s.token_ids[:switch], s.token_ids[switch:]
        # The favoured character flips at the switch (visible in the text).
        assert before.count(old_id) / len(before) > 0.5 and before.count(new_id) / len(before) < 0.2
        assert after.count(new_id) / len(after) > 0.5 and after.count(old_id) / len(after) < 0.2
        text = tok.decode(s.token_ids, skip_special_tokens=True)
        assert text.count(OLD_CHAR) > 0 and text.count(NEW_CHAR) > 0
        # Reported log-probs equal each version's own forward pass on the same prefix.
        got = torch.tensor(s.logprobs)
        ref0 = _reference_logprobs(models["v0"], prompt_ids, s.token_ids)
        ref1 = _reference_logprobs(models["v1"], prompt_ids, s.token_ids)
        assert (got[:switch] - ref0[:switch]).abs().max().item() < LOGPROB_TOL
        assert (got[switch:] - ref1[switch:]).abs().max().item() < LOGPROB_TOL
        # And differ from the other version's, so the check has teeth.
        assert (got[switch:] - ref0[switch:]).abs().max().item() > 1.0


# -- refusals ------------------------------------------------------------------


def _corrupt(good: Version, kind: str) -> tuple[Version, str]:
    """A bad version of ``kind`` and the error text the swapper must give."""
    name = min(good.tensors)
    t = good.tensors[name]
    tensors = dict(good.tensors)
    if kind == "nan":
        arr = t.to_numpy().copy()
        arr.flat[0] = float("nan")
        tensors[name] = WireTensor.from_numpy(arr)
        return Version(good.version, tensors, version_digest(tensors)), "NaN or Inf"
    if kind == "inf":
        arr = t.to_numpy().copy()
        arr.flat[-1] = float("inf")
        tensors[name] = WireTensor.from_numpy(arr)
        return Version(good.version, tensors, version_digest(tensors)), "NaN or Inf"
    if kind == "dtype":
        tensors[name] = WireTensor.from_numpy(t.to_numpy().astype("float16"))
        return Version(good.version, tensors, version_digest(tensors)), f"tensor {name!r} is float16"
    if kind == "shape":
        tensors[name] = WireTensor.from_numpy(t.to_numpy().reshape(-1)[:-1].copy())
        return Version(good.version, tensors, version_digest(tensors)), f"tensor {name!r} is float32"
    if kind == "names":
        tensors["model.not_a_layer.weight"] = tensors.pop(name)
        return Version(good.version, tensors, version_digest(tensors)), "tensor names differ"
    if kind == "missing":
        del tensors[name]
        return Version(good.version, tensors, version_digest(tensors)), "tensor names differ"
    if kind == "corrupted":  # bytes changed after the digest was taken
        arr = t.to_numpy().copy()
        arr.flat[0] += 1.0
        tensors[name] = WireTensor.from_numpy(arr)
        return Version(good.version, tensors, good.digest), "digest mismatch"
    if kind == "announced":  # data intact, announcement names another digest
        return good, "differs from the announced"
    raise ValueError(kind)


BAD_KINDS = ["nan", "inf", "dtype", "shape", "names", "missing", "corrupted", "announced"]


async def test_bad_updates_are_refused_and_the_engine_keeps_serving(
    engine: Engine, models: dict[str, object], tmp_path: Path
) -> None:
    signature = read_signature(models["v0"])
    store = WeightStore(signature, keep=64)
    health = Health("learner")
    servicer = LearnerServicer(store, health, "test", dict)
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: add_learner_to_server(servicer, s),
        ["asymptote.v1.Learner"],
    )
    metrics = GeneratorMetrics()
    swapper = Swapper(engine, GrpcWeightSource(), models["v0"], tmp_path / "staged", "inflight", metrics)
    endpoint = f"127.0.0.1:{port}"
    try:
        start = engine.version
        v1 = load_model(models["v1"])
        good = store.snapshot(start + 1, v1)

        for i, kind in enumerate(BAD_KINDS):
            version = start + 100 + i
            bad, message = _corrupt(replace(good, version=version), kind)
            store.put(bad)
            announced = "0" * 64 if kind == "announced" else bad.digest
            policy = rollout_pb2.PolicyVersion(version=version, weights_endpoint=endpoint, digest=announced)
            with BAD_INPUTS.trying("weights", f"swapper update: {kind}"):
                assert await swapper.update(policy) is False, kind
                assert message in swapper.refused[version], (kind, swapper.refused[version])
                assert engine.version == start, f"{kind}: the engine left the version it had"
                # Still serving: a request completes under the version it had.
                _, samples = await engine.sample("12+34=", 2, 1.0, 1.0, 5, seed=i + 1)
            assert all(s.version_spans == [(start, 0, 5)] for s in samples), (kind, samples[0].version_spans)

        refused = metrics.swaps_refused.labels("invalid")._value.get()
        assert refused == len(BAD_KINDS)
        # A good update after all that loads.
        policy = rollout_pb2.PolicyVersion(version=good.version, weights_endpoint=endpoint, digest=good.digest)
        assert await swapper.update(policy) is True
        assert engine.version == good.version
        # Eight refusals and a swap later, staging holds one version: the loaded file, kept as the spare.
        spare = swapper.staging.root / SPARE_FILE
        assert sorted(p.name for p in swapper.staging.root.iterdir()) == [SPARE_FILE]
        assert swapper.staging.usage() == spare.stat().st_size < signature_num_bytes(signature) + 64 * 1024
        # The engine copied the weights: scribbling NaNs over the file changes nothing it scores.
        with open(spare, "r+b") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")
            f.seek(data_start)
            f.write(b"\xff" * (spare.stat().st_size - data_start))
        prompt_ids, samples = await engine.sample("12+34=", 2, 1.0, 1.0, 6, seed=99)
        for s in samples:
            assert s.version_spans == [(good.version, 0, len(s.token_ids))]
            gap = (torch.tensor(s.logprobs) - _reference_logprobs(models["v1"], prompt_ids, s.token_ids)).abs().max()
            assert gap.item() < LOGPROB_TOL
    finally:
        await server.stop(None)


async def test_a_swap_through_a_delta_loads_the_same_weights_as_a_whole_pull(
    engine: Engine, models: dict[str, object], tmp_path: Path
) -> None:
    """A version rebuilt from a delta over the staged one, loaded into vLLM, samples exactly as the same
    version pulled whole does: same staged bytes, same tokens, same log-probs."""
    signature = read_signature(models["v0"])
    model = load_model(models["v1"])
    store = WeightStore(signature, keep=4)
    start = engine.version
    base = store.snapshot(start + 1, model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a step's worth: 5% of every tensor's elements move a little
        for p in model.parameters():
            moved = torch.rand(p.shape, generator=generator) < 0.05
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2 * moved)
    step = store.snapshot(start + 2, model)
    again = store.put(Version(start + 3, step.tensors, step.digest))  # the same bytes, pulled whole below
    health = Health("learner")
    servicer = LearnerServicer(store, health, "test", dict)
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0), health, lambda s: add_learner_to_server(servicer, s), []
    )

    def announced(v: Version) -> rollout_pb2.PolicyVersion:
        return rollout_pb2.PolicyVersion(version=v.version, weights_endpoint=f"127.0.0.1:{port}", digest=v.digest)

    def staged(swapper: Swapper) -> bytes:
        raw = (swapper.staging.root / SPARE_FILE).read_bytes()
        return raw[8 + int.from_bytes(raw[:8], "little") :]

    try:
        metrics = GeneratorMetrics()
        by_delta = Swapper(engine, GrpcWeightSource(metrics=metrics), models["v0"], tmp_path / "a", "inflight", metrics)
        assert await by_delta.update(announced(base)) and await by_delta.update(announced(step))
        pulled = {kind: metrics.weight_pulls.labels(kind)._value.get() for kind in ("delta", "full", "fallback")}
        assert pulled == {"delta": 1, "full": 1, "fallback": 0}
        assert metrics.weight_pull_bytes.labels("delta")._value.get() < 0.5 * step.num_bytes
        prompt_ids, from_delta = await engine.sample("12+34=", 2, 1.0, 1.0, 12, seed=7)

        whole_metrics = GeneratorMetrics()
        whole = Swapper(
            engine, GrpcWeightSource(metrics=whole_metrics), models["v0"], tmp_path / "b", "inflight", whole_metrics
        )
        assert await whole.update(announced(again))
        assert whole_metrics.weight_pulls.labels("full")._value.get() == 1
        assert staged(by_delta) == staged(whole)
        _, from_whole = await engine.sample("12+34=", 2, 1.0, 1.0, 12, seed=7)
    finally:
        await server.stop(None)
    assert [s.token_ids for s in from_delta] == [s.token_ids for s in from_whole]
    assert [s.logprobs for s in from_delta] == [s.logprobs for s in from_whole]
    # The check has teeth: the step changed what the model scores.
    ref_base = _reference_logprobs(models["v1"], prompt_ids, from_delta[0].token_ids)
    assert (torch.tensor(from_delta[0].logprobs) - ref_base).abs().max().item() > 1e-3


# -- tied embeddings -------------------------------------------------------------


# -- Generate over gRPC ------------------------------------------------------------


GENERATE = "/asymptote.contracts.v1.Generator/Generate"
STATUS = "/asymptote.contracts.v1.Generator/Status"


def _generate(prompt: str = "1+2=", **sampling: Any) -> bytes:
    return services_pb2.GenerateRequest(
        prompt=prompt, sampling=rollout_pb2.SamplingParams(**sampling)
    ).SerializeToString()


async def test_generate_refuses_bad_requests_and_keeps_serving(engine: Engine) -> None:
    from services.generator.server import GeneratorServicer

    health = Health("generator")
    await health.unblock("starting")
    servicer = GeneratorServicer(engine, health, "test", GeneratorMetrics())
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: services_pb2_grpc.add_GeneratorServicer_to_server(servicer, s),
        ["asymptote.contracts.v1.Generator"],
    )
    nan, inf = float("nan"), float("inf")
    bad = {
        "empty prompt": (_generate(""), "prompt is empty"),
        "too many samples": (_generate(num_samples=10_000), "num_samples must be <= 256"),
        "too many tokens": (_generate(max_tokens=1_000_000), "max_tokens <= 65536"),
        "prompt longer than the model": (_generate("1+" * 100 + "=", max_tokens=4), "request refused by the engine"),
        "NaN temperature": (_generate(temperature=nan), "temperature is nan"),
        "infinite temperature": (_generate(temperature=inf), "temperature is inf"),
        "negative temperature": (_generate(temperature=-1.0), "temperature is -1.0"),
        "NaN top_p": (_generate(top_p=nan), "top_p is nan"),
        "infinite top_p": (_generate(top_p=-inf), "top_p is -inf"),
        "negative top_p": (_generate(top_p=-0.5), "top_p is -0.5"),
        "top_p above 1": (_generate(top_p=2.0), "top_p is 2.0"),
    }
    rng = random.Random(13)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for what, (request, named) in bad.items():
                answer = await send_bad_request(ch, "gRPC Generator", GENERATE, request, timeout_s=60)
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and named in answer.details, (what, answer)
            # Random bytes, truncations and bit flips of a small valid request: a flip that leaves
            # it valid is served (at most 127 samples of the model's length), anything else refused.
            valid = {
                GENERATE: _generate(num_samples=1, max_tokens=3, seed=1),
                STATUS: services_pb2.StatusRequest().SerializeToString(),
            }
            for method, good in valid.items():
                *answers, too_big = await send_bad_requests(ch, "gRPC Generator", method, good, rng, 40, timeout_s=60)
                for answer in answers:
                    assert answer.code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) or answer.unparsable, (
                        method,
                        answer.request[:40],
                        answer.code,
                        answer.details,
                    )
                    assert answer.code == grpc.StatusCode.OK or answer.details
                assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, too_big.code, too_big.details)
            # Still serving, and it says which version sampled.
            stub = services_pb2_grpc.GeneratorStub(ch)
            good = await stub.Generate(
                services_pb2.GenerateRequest(
                    prompt="12+34=", sampling=rollout_pb2.SamplingParams(num_samples=2, max_tokens=5)
                ),
                timeout=60,
            )
            assert len(good.completions) == 2 and good.policy_version == engine.version
            assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in good.completions)
            status = await stub.Status(services_pb2.StatusRequest(), timeout=10)
            assert (status.service, status.ready) == ("generator", True)
    finally:
        await server.stop(None)


# -- requests the engine cuts short, and draining --------------------------------


async def _sampling_under_way(engine: Engine, num_tokens: int = 5) -> asyncio.Task[Any]:
    under_way = asyncio.Event()

    def progress(n: int) -> None:
        if n >= num_tokens:
            under_way.set()

    task = asyncio.create_task(engine.sample("1+2=", 4, 1.0, 1.0, MAX_TOKENS, seed=5, on_progress=progress))
    await asyncio.wait_for(under_way.wait(), 120)
    return task


async def test_a_request_the_engine_cuts_short_is_refused_not_returned(engine: Engine) -> None:
    """An engine shutting down aborts what it holds; those stubs (often no tokens) are no completions."""
    task = await _sampling_under_way(engine)
    await engine._llm.pause_generation(mode="abort")  # what vLLM's engine core does on SIGTERM
    try:
        with pytest.raises(GenerationCut, match=r"ended the request early \(abort\)"):
            await asyncio.wait_for(task, 60)
    finally:
        await engine._llm.resume_generation()
    # The engine serves on; EOS is suppressed, so a request runs to its length.
    _, samples = await engine.sample("1+2=", 2, 1.0, 1.0, 8, seed=1)
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(8, "length"), (8, "length")]


def _task(task_id: str, kind: int, require_version: int = 0, num_samples: int = 4) -> rollout_pb2.GenerationTask:
    return rollout_pb2.GenerationTask(
        task_id=task_id,
        kind=kind,
        task_name="arithmetic",
        prompt_id=task_id,
        prompt="1+2=",
        reference="3",
        sampling=rollout_pb2.SamplingParams(num_samples=num_samples, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS),
        require_version=require_version,
        eval_id="eval-x" if kind == rollout_pb2.TASK_KIND_EVAL else "",
        eval_num_prompts=1 if kind == rollout_pb2.TASK_KIND_EVAL else 0,
        task_digest=task_digest(ArithmeticSettings()),  # the rollout loop's own task: its default scorer's
    )


@asynccontextmanager
async def _jetstream(root: Path, names: Names) -> AsyncIterator[Any]:
    """JetStream on a nats-server of its own under ``root``, with the run's streams declared."""
    import nats as nats_py

    with nats_server(root / "nats") as server:
        nc = await nats_py.connect(server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js, names)
            yield js
        finally:
            await nc.close()


def _watched_loop(
    engine: Engine,
    js: Any,
    names: Names,
    max_inflight_groups: int,
    metrics: GeneratorMetrics,
    monkeypatch: pytest.MonkeyPatch,
    hold: EvalHold | None = None,
) -> tuple[RolloutLoop, asyncio.Event]:
    """A rollout loop on the real engine, watched: the event is set once a group's tokens are under way."""
    loop = RolloutLoop(
        engine,
        js,
        names,
        "gen-test",
        max_inflight_groups=max_inflight_groups,
        ack_wait_s=30.0,
        metrics=metrics,
        meter=ComputeMeter("generator", "gen-test", "cpu", 1),
        scorer=TaskScorer(ArithmeticSettings(), engine.settings.model_dir, metrics),
        hold=hold,
    )
    under_way = asyncio.Event()
    sample = engine.sample

    async def watched(*args: Any, **kwargs: Any) -> Any:
        return await sample(*args, **kwargs, on_progress=lambda n: n >= 5 and under_way.set())

    monkeypatch.setattr(engine, "sample", watched)
    return loop, under_way


async def _fetch_groups(sub: Any, num: int) -> list[rollout_pb2.RolloutGroup]:
    groups: list[rollout_pb2.RolloutGroup] = []
    while len(groups) < num:
        try:
            groups += [rollout_pb2.RolloutGroup.FromString(m.data) for m in await sub.fetch(num, timeout=1)]
        except TimeoutError:
            pass
    return groups


async def test_rollout_loop_hands_back_cut_and_unservable_tasks(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a real nats-server: a group the engine cuts short is not published but generated again;
    a draining loop publishes the group it has in flight and hands back at once a task waiting
    for a version it does not serve, instead of holding its lease until the drain times out."""
    names = Names("draintest")
    async with _jetstream(tmp_path, names) as js:
        metrics = GeneratorMetrics()
        loop, under_way = _watched_loop(engine, js, names, 4, metrics, monkeypatch)
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        cut = _task("train-cut", rollout_pb2.TASK_KIND_TRAIN, num_samples=16)
        await js.publish(names.train_tasks, cut.SerializeToString(), headers={"Nats-Msg-Id": cut.task_id})
        await asyncio.wait_for(under_way.wait(), 120)
        await engine._llm.pause_generation(mode="abort")  # as vLLM's engine core does on SIGTERM
        await engine._llm.resume_generation()

        # The cut task's second go is published whole.
        rollouts = await js.pull_subscribe(names.rollouts, durable="check", stream=names.rollouts_stream)
        groups = await asyncio.wait_for(_fetch_groups(rollouts, 1), 120)
        assert metrics.task_errors.labels("GenerationCut")._value.get() == 1

        # Draining with a group generating and a task waiting for a later version: the waiting task is taken
        # first, then the group, and the drain begins as soon as the group is under way (it has far more
        # tokens to go than the turn of the loop the stop takes; a drain begun after it ended would prove
        # nothing, and waiting for both at once let it end first).
        later = _task("eval-later", rollout_pb2.TASK_KIND_EVAL, require_version=engine.version + 1000)
        await js.publish(names.eval_tasks, later.SerializeToString(), headers={"Nats-Msg-Id": later.task_id})

        async def waiting_task_in() -> None:
            while not loop._inflight:
                await asyncio.sleep(0.002)  # pacing: between polls of a wait bounded by wait_for below

        await asyncio.wait_for(waiting_task_in(), 60)
        under_way.clear()
        drained = _task("train-drained", rollout_pb2.TASK_KIND_TRAIN, num_samples=16)
        await js.publish(names.train_tasks, drained.SerializeToString(), headers={"Nats-Msg-Id": drained.task_id})
        await asyncio.wait_for(under_way.wait(), 60)
        assert len(loop._inflight) == 2 and engine.num_running > 0
        stop.set()
        await asyncio.wait_for(running, 60)
        groups += await asyncio.wait_for(_fetch_groups(rollouts, 1), 10)

        assert metrics.task_errors.labels("GenerationCut")._value.get() == 1
        assert [g.group_id for g in groups] == ["train-cut", "train-drained"]
        for g in groups:  # whole groups only: every completion ran to its length
            assert [len(c.token_ids) for c in g.completions] == [MAX_TOKENS] * g.task.sampling.num_samples
        # The unservable task is back in the queue, now: its second delivery, not after a lease.
        tasks = await js.pull_subscribe(
            names.eval_tasks, durable=names.generators_eval_consumer, stream=names.tasks_stream
        )
        [again] = await tasks.fetch(1, timeout=5)
        assert rollout_pb2.GenerationTask.FromString(again.data).task_id == "eval-later"
        assert again.metadata.num_delivered == 2


async def test_eval_tasks_go_before_the_train_tasks_queued_ahead_of_them(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a real nats-server: an eval task published behind four train tasks is sampled third
    (after the group in the engine and the one already leased), not fifth as a shared queue would.
    Eval tasks have a consumer of their own, and the loop takes from it first. While it is leased,
    the eval task holds swaps away from the version it is sampled at (tests/generator/test_eval_hold.py)."""
    names = Names("evalfirst")
    hold = EvalHold(max_versions=4)
    leased: list[tuple[int, bool]] = []  # (version held, whether newer versions were held back then)
    begin = hold.begin

    def recorded_begin(key: int, version: int) -> None:
        begin(key, version)
        leased.append((version, hold.holds(engine.version, engine.version + 1)))

    monkeypatch.setattr(hold, "begin", recorded_begin)
    async with _jetstream(tmp_path, names) as js:
        loop, under_way = _watched_loop(engine, js, names, 1, GeneratorMetrics(), monkeypatch, hold)
        for i in range(4):
            t = _task(f"train-{i}", rollout_pb2.TASK_KIND_TRAIN, num_samples=8)
            await js.publish(names.train_tasks, t.SerializeToString(), headers={"Nats-Msg-Id": t.task_id})
        stop = asyncio.Event()
        running = asyncio.create_task(loop.run(stop))
        await asyncio.wait_for(under_way.wait(), 120)  # train-0 in the engine

        async def backlog_full() -> bool:
            return len(loop._waiting) >= 1  # train-1 leased, waiting for the engine

        # Polled often: the eval task must be published while train-0 still runs.
        await wait_until_async(backlog_full, 30, "train-1 to be leased", interval_s=0.002)
        e = _task("eval-now", rollout_pb2.TASK_KIND_EVAL, num_samples=2)
        await js.publish(names.eval_tasks, e.SerializeToString(), headers={"Nats-Msg-Id": e.task_id})

        finished: dict[str, float] = {}  # task id -> when its group or result was finished

        async def collect() -> None:
            rollouts = await js.pull_subscribe(names.rollouts, durable="order", stream=names.rollouts_stream)
            results = await js.pull_subscribe(names.eval_results, durable="order", stream=names.evals_stream)
            while len(finished) < 5:
                for sub in (rollouts, results):
                    try:
                        msgs = await sub.fetch(5, timeout=0.2)
                    except TimeoutError:
                        continue
                    for m in msgs:
                        if sub is rollouts:
                            group = rollout_pb2.RolloutGroup.FromString(m.data)
                            finished[group.task.task_id] = group.finished_unix_s
                        else:
                            result = rollout_pb2.EvalResult.FromString(m.data)
                            finished[result.task_id] = result.finished_unix_s

        await asyncio.wait_for(collect(), 180)
        stop.set()
        await asyncio.wait_for(running, 60)
    # One group at a time in the engine: the finishing order is the serving order.
    assert sorted(finished, key=finished.__getitem__) == ["train-0", "train-1", "eval-now", "train-2", "train-3"]
    # The eval task held swaps from its lease until it was done; the train tasks held nothing.
    assert leased == [(0, True)] and not hold.holds(engine.version, engine.version + 1)
