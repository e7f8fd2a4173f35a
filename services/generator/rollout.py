"""The rollout loop: lease tasks, sample, score, publish, then ack.

Owns a generator's side of the task protocol. Keeps up to
``max_inflight_groups`` prompt groups in the engine at once (continuous
batching), scores each completion with the task's verifier, publishes one
``RolloutGroup`` (train) or ``EvalResult`` (eval) per task with the task id
as the JetStream message id, and acks the task only after the publish is
stored, so a crash at any point re-delivers the task and a re-publish is
deduplicated. A task it cannot decode, or whose task digest is not the one
this generator holds (another task's prompts and verifier), is terminated
and dead-lettered before anything is sampled; a train task's dead letter is
recorded in the ledger first, as the broker records a poison group's.

A multi-turn task (a generator given an ``EpisodeRunner``) plays
``num_samples`` episodes of its prompt instead of sampling completions:
the group's completions are the episodes' training samples in order, each
with its own prompt when it is not the group's (the first sample's) and,
after an episode's first, marked as continuing that episode; an episode's
reward is its environment's, else the verifier's on its final turn. An
episode that produced no sequence (its environment failed at reset or
before the model's first turn) ends with its reason, which is counted. A
train group leaves such episodes out; when none produced a sequence the
task is dead-lettered with the reason (recorded in the ledger first, so
nothing is lost and nothing is tried again: the environment, not the
engine, failed). An eval result counts such an episode as a wrong answer,
so a round keeps its size and completes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.envs import EnvTask
from asymptote.errors import PayloadError
from asymptote.jetstream.deadletter import deadletter
from asymptote.jetstream.names import ROLLOUT_MAX_BYTES, Names
from asymptote.jetstream.pull import durable_puller
from asymptote.ledger import TRAIN_TASK_PREFIX, Event, Ledger
from asymptote.messages import decode_task
from asymptote.routing import attach
from asymptote.sample import Sample
from services.generator.engine import Engine
from services.generator.episode import Episode, EpisodeRunner
from services.generator.metrics import GeneratorMetrics
from services.generator.mixing import MixtureScorer, Scorer
from services.generator.swapper import EvalHold

log = logging.getLogger(__name__)

MAX_DELIVER = 5
"""Deliveries of a task before JetStream stops retrying it."""
HAND_BACK_DELAY_S = 1.5
"""Redelivery delay of a task a draining generator hands back. Not zero: the
server may still hold a pull request of this generator's for up to a fetch
timeout (1 s) after its fetch returned, and a task redelivered into it would
wait out its lease."""


async def retire_consumers(js: JetStreamContext, names: Names) -> None:
    """Delete the task stream's consumers of earlier releases, whose filter overlaps today's two.

    Their unacknowledged tasks stay in the work queue and go out again through the new consumers.
    """
    for durable in names.retired_consumers:
        try:
            await js.delete_consumer(names.tasks_stream, durable)
            log.info("removed the task consumer %r of an earlier release", durable)
        except NotFoundError:
            pass


def completion(
    sample: Sample, reward: float, prompt_ids: list[int] | None = None, continues_episode: bool = False
) -> rollout_pb2.Completion:
    """One sequence of a group; ``prompt_ids`` only when the sequence's prompt is not the group's."""
    return rollout_pb2.Completion(
        prompt_token_ids=prompt_ids,
        continues_episode=continues_episode,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        version_spans=[rollout_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in sample.version_spans],
        reward=reward,
        truncated=sample.truncated,
        finish_reason=sample.finish_reason,
        text=sample.text,
        loss_mask=sample.loss_mask,
        interrupted=sample.interrupted,
    )


def processed_tokens(prompt_ids: list[int] | None, samples: list[Sample], episodes: list[Episode]) -> int:
    """The tokens a task ran through the model once each, what its FLOPs are counted from: a single-turn
    task's prompt once (its G samples share the prefill) and every sample's tokens (an interruption's phrase
    included); an episode's every training sample with its prompt (the environment's tokens, prefilled,
    included). Prefix-cache hits are not subtracted: what the cache saves depends on what else the engine
    held, and the axis must not."""
    if episodes:
        return sum(len(t.prompt_ids) + len(t.sample.token_ids) for e in episodes for t in e.samples)
    return len(prompt_ids or ()) + sum(len(x.token_ids) for x in samples)


class NoSequence(ValueError):
    """None of a task's episodes produced a sequence to train on."""


def episode_completions(
    episodes: list[Episode], rewards: list[float]
) -> tuple[list[int], list[rollout_pb2.Completion]]:
    """A multi-turn group's prompt (its first sequence's) and completions: every episode's training samples in
    order, each with its episode's reward, its own prompt where it is not the group's, and every sample after
    an episode's first marked as continuing it. An episode without a sequence is left out; NoSequence, naming
    the first one's end, when no episode has one."""
    played = [(e, r) for e, r in zip(episodes, rewards, strict=True) if e.samples]
    if not played:
        first = episodes[0] if episodes else None
        why = f" ({first.end_reason}: {first.error})" if first is not None else ""
        raise NoSequence(f"none of the task's {len(episodes)} episodes produced a sequence{why}")
    group_prompt = played[0][0].samples[0].prompt_ids
    out = []
    for episode, reward in played:
        for j, t in enumerate(episode.samples):
            own = t.prompt_ids if t.prompt_ids != group_prompt else None
            out.append(completion(t.sample, reward, own, continues_episode=j > 0))
    return group_prompt, out


class EnginePlace:
    """A multi-turn task's place in the engine, held only while one of its episodes samples a turn.

    While every episode of the task waits on its environment (for a worker,
    a reset or a tool call) the task counts as parked and its place goes to
    a task that can sample now; an episode about to sample takes the place
    back, waiting for one if the engine is full. Enter it around each turn's
    engine call; ``close`` when the task's episodes are done.
    """

    def __init__(self, loop: RolloutLoop) -> None:
        self._loop = loop
        self._sampling = 0
        self._lock = asyncio.Lock()
        loop._park()  # no episode samples yet

    async def __aenter__(self) -> None:
        async with self._lock:
            if self._sampling == 0:
                self._loop._unpark()
                try:
                    await self._loop._slots.acquire()
                except BaseException:
                    self._loop._park()
                    raise
            self._sampling += 1

    async def __aexit__(self, *_: object) -> None:
        self._sampling -= 1
        if self._sampling == 0:
            self._loop._slots.release()
            self._loop._park()

    def close(self) -> None:
        """The task's episodes are done: it is no longer parked (its task ends, or goes on to score)."""
        assert self._sampling == 0, "an episode still samples"
        self._loop._unpark()


class RolloutLoop:
    def __init__(
        self,
        engine: Engine,
        js: JetStreamContext,
        names: Names,
        generator_id: str,
        max_inflight_groups: int,
        ack_wait_s: float,
        metrics: GeneratorMetrics,
        meter: ComputeMeter,
        scorer: Scorer,
        hold: EvalHold | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.engine = engine
        self.episodes = episodes
        """Plays a multi-turn task's episodes (None: tasks are single-turn)."""
        self.hold = hold or EvalHold(0)
        """Eval tasks leased, so that the swapper keeps the version their round is sampled at."""
        self.js = js
        self.names = names
        self.generator_id = generator_id
        self.max_inflight = max_inflight_groups
        self.ack_wait_s = ack_wait_s
        self.metrics = metrics
        self.meter = meter
        self.scorer = scorer
        """Renders, length-controls and scores the run's task (or each task of a mixture)."""
        self.ledger = Ledger(js, names, "generator")
        """Where the dead letters of train tasks are recorded (the broker records every other outcome)."""
        self._inflight: set[asyncio.Task[None]] = set()
        self._parked = 0
        """Started tasks that wait for the version they name (an eval round issued ahead of this engine):
        they hold no place in the engine, so a task the engine can sample now is never stuck behind them."""
        self._slots = asyncio.Semaphore(max_inflight_groups)
        """Places in the engine: a parked task takes one when its version arrives."""
        self._waiting: deque[Msg] = deque()
        """Tasks leased and not started yet (at most ``prefetch``)."""
        self.prefetch = max(1, max_inflight_groups // 4)
        self._drain = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=MAX_DELIVER,
            max_ack_pending=-1,
        )
        await retire_consumers(self.js, self.names)
        sub = await self.js.pull_subscribe(
            self.names.train_tasks,
            durable=self.names.generators_consumer,
            stream=self.names.tasks_stream,
            config=config,
        )
        evals = await durable_puller(
            self.js, self.names.tasks_stream, self.names.eval_tasks, self.names.generators_eval_consumer, config
        )
        busy_since: float | None = None
        while not stop.is_set():
            self._start_waiting()
            # Lease up to a quarter more than the engine holds: when a group
            # finishes, the next task starts at once from the local backlog
            # instead of after a round trip to JetStream.
            room = self.max_inflight + self.prefetch - len(self._inflight) - len(self._waiting)
            if room <= 0:
                await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                # Eval tasks first, and ahead of leased train tasks: a round is sampled by the
                # version it names, not by whichever version the train queue has reached by then.
                urgent = await evals.fetch_available(room)
                for msg in urgent:
                    self._hold_for(msg)
                self._waiting.extendleft(reversed(urgent))
                room -= len(urgent)
                msgs = await sub.fetch(batch=room, timeout=0.2 if self._inflight else 1.0) if room > 0 else []
            except TimeoutError:  # nats raises its subclass, or asyncio's own
                msgs = []
            except Exception as exc:
                log.warning("task fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            self._waiting.extend(msgs)
            self._start_waiting()
            # Device time counts as busy while any group is in the engine.
            now = time.monotonic()
            if busy_since is not None:
                self.meter.add_busy(now - busy_since)
            busy_since = now if self._inflight else None
            self.metrics.inflight_groups.set(len(self._inflight))
        # nats-py's connection drain waits on a pull subscription's inbox for
        # good (tasks a lingering pull request brought in would sit there):
        # close it first; anything it held is redelivered after its lease.
        try:
            await sub.unsubscribe()
        except Exception as exc:
            log.debug("unsubscribe from the task queue failed: %s", exc)
        # Hand back leased tasks that never started (another generator takes
        # them after HAND_BACK_DELAY_S rather than after the lease expires).
        self._drain.set()
        self._waiting.extend(evals.take_buffered())
        while self._waiting:
            try:
                await self._waiting.popleft().nak(delay=HAND_BACK_DELAY_S)
            except Exception as exc:
                log.debug("nak of an unstarted task failed: %s", exc)
        # Drain: let in-flight groups finish and publish (they are leased).
        if self._inflight:
            log.info("draining %d in-flight groups", len(self._inflight))
            await asyncio.wait(self._inflight, timeout=30.0)

    def _start_waiting(self) -> None:
        """Start leased tasks while the engine has room (also called as each group finishes)."""
        while self._waiting and len(self._inflight) - self._parked < self.max_inflight and not self._drain.is_set():
            msg = self._waiting.popleft()
            t = asyncio.create_task(self._handle(msg))
            self._inflight.add(t)
            t.add_done_callback(self._finished)
            t.add_done_callback(functools.partial(self._release, id(msg)))

    def _hold_for(self, msg: Msg) -> None:
        """Hold swaps for a leased eval task until it is done (a message that does not decode holds nothing:
        it is refused as soon as it starts)."""
        try:
            task = decode_task(msg.data)
        except PayloadError:
            return
        self.hold.begin(id(msg), int(task.require_version))

    def _release(self, key: int, _: asyncio.Task[None]) -> None:
        self.hold.end(key)

    def _park(self) -> None:
        """A started task gives up its place in the engine while it waits: another may start."""
        self._parked += 1
        self._start_waiting()

    def _unpark(self) -> None:
        self._parked -= 1

    def _finished(self, t: asyncio.Task[None]) -> None:
        self._inflight.discard(t)
        self._start_waiting()

    async def _handle(self, msg: Msg) -> None:
        try:
            task = decode_task(msg.data)
        except PayloadError as exc:
            await self._refuse(msg, _task_id_of(msg), str(exc), "poison")
            return
        try:
            self.scorer.check(task)
        except ValueError as exc:  # another task's digest
            train_id = task.task_id if task.kind == rollout_pb2.TASK_KIND_TRAIN else ""
            await self._refuse(msg, train_id, str(exc), "task_digest")
            return
        heartbeat = asyncio.create_task(self._heartbeat(msg))
        try:
            if task.require_version > self.engine.version:
                # Eval rounds and synchronous mode: sample only from the
                # version the task names (the lease is kept alive meanwhile).
                # A generator draining hands such a task back instead: the
                # version may come only after it is gone.
                self._park()  # its place in the engine goes to a task that can start now
                waiting = asyncio.create_task(self.engine.wait_for_version(int(task.require_version)))
                draining = asyncio.create_task(self._drain.wait())
                try:
                    await asyncio.wait({waiting, draining}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                    draining.cancel()
                    self._unpark()
                if self._drain.is_set() and task.require_version > self.engine.version:
                    await msg.nak(delay=HAND_BACK_DELAY_S)
                    return
            kind = "train" if task.kind == rollout_pb2.TASK_KIND_TRAIN else "eval"
            started = time.time()
            s = task.sampling
            prompt = self.scorer.prompt(task.task_name, task.prompt)
            episodes: list[Episode] = []
            if self.episodes is not None:
                # Each turn takes the engine's place; waits on the environment leave it to other tasks.
                episodes = await self._play(task, prompt)
            else:
                length = self.scorer.length_control(task.task_name)
                async with self._slots:
                    if length is None:
                        prompt_ids, samples = await self.engine.sample(
                            prompt, s.num_samples, s.temperature, s.top_p, s.max_tokens, int(s.seed)
                        )
                    else:
                        prompt_ids, samples = await length.sample(
                            self.engine,
                            task.task_id,
                            prompt,
                            s.num_samples,
                            s.temperature,
                            s.top_p,
                            s.max_tokens,
                            int(s.seed),
                        )
            if self.episodes is not None:
                rewards = await self._episode_rewards(task, episodes)
                self._count_episodes(kind, episodes)
                samples = [t.sample for e in episodes for t in e.samples]
                if task.kind == rollout_pb2.TASK_KIND_TRAIN:
                    try:
                        prompt_ids, completions = episode_completions(episodes, rewards)
                    except NoSequence as exc:
                        await self._refuse(msg, task.task_id, str(exc), "no_sequence")
                        return
            else:
                rewards = await self.scorer.rewards(task.task_name, [x.text for x in samples], task.reference)
                completions = [completion(x, r) for x, r in zip(samples, rewards)]
            # Tokens the engine sampled: an episode's environment tokens were tokenised, not generated.
            num_tokens = sum(len(x.token_ids) for x in samples) - sum(e.num_env_tokens for e in episodes)
            num_processed = processed_tokens(prompt_ids if self.episodes is None else None, samples, episodes)
            if task.kind == rollout_pb2.TASK_KIND_TRAIN:
                group = self._group(task, prompt_ids, completions, samples, started)
                if self.engine.routing is not None and self.episodes is None:
                    rows = [x.routing for x in samples]
                    try:
                        if any(r is None for r in rows):
                            raise PayloadError(f"group {task.task_id}: a sample carries no routing")
                        attach(group, [r for r in rows if r is not None], self.engine.routing, ROLLOUT_MAX_BYTES)
                    except PayloadError as exc:
                        await self._refuse(msg, task.task_id, str(exc), "routing")
                        return
                payload, subject = group.SerializeToString(), self.names.rollouts
            else:
                result = self._eval_result(task, samples, rewards, num_tokens)
                payload, subject = result.SerializeToString(), self.names.eval_results
            await self.js.publish(subject, payload, headers={"Nats-Msg-Id": task.task_id})
            await msg.ack()
            self.metrics.tokens.labels(kind).inc(num_tokens)
            self.metrics.completions.labels(kind).inc(len(samples))
            self.metrics.completions_interrupted.labels(kind).inc(sum(x.interrupted for x in samples))
            self.metrics.completions_truncated.labels(kind).inc(sum(x.truncated for x in samples))
            self.metrics.groups.labels(kind).inc()
            self.meter.add_tokens(num_tokens, eval=kind == "eval", num_processed=num_processed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine or NATS trouble: hand the task back
            self.metrics.task_errors.labels(type(exc).__name__).inc()
            log.warning("task %s failed, handing it back: %s", task.task_id, exc)
            try:
                await msg.nak(delay=1.0)
            except Exception:
                pass
        finally:
            heartbeat.cancel()

    async def _play(self, task: rollout_pb2.GenerationTask, prompt: str) -> list[Episode]:
        """``num_samples`` episodes of ``task`` at once, each turn under the task's sampling."""
        assert self.episodes is not None
        runner, s = self.episodes, task.sampling
        env_task = EnvTask(task_id=task.task_id, prompt=prompt, reference=task.reference)
        # A seeded task's episodes get seeds of their own, apart by more than their turns' offsets.
        stride = runner.settings.max_turns
        place = EnginePlace(self)
        playing = [
            asyncio.ensure_future(
                runner.run(env_task, s.temperature, s.top_p, int(s.seed) + i * stride if s.seed else 0, place=place)
            )
            for i in range(s.num_samples)
        ]
        try:
            return list(await asyncio.gather(*playing))
        except BaseException:
            # The task fails (it is handed back): its other episodes stop now rather than go on sampling.
            for episode in playing:
                episode.cancel()
            await asyncio.gather(*playing, return_exceptions=True)
            raise
        finally:
            place.close()

    async def _episode_rewards(self, task: rollout_pb2.GenerationTask, episodes: list[Episode]) -> list[float]:
        """Each episode's reward: its environment's, else the verifier's on its final turn."""
        unrewarded = [i for i, e in enumerate(episodes) if e.reward is None]
        judged = await self.scorer.rewards(task.task_name, [episodes[i].final_turn for i in unrewarded], task.reference)
        rewards = [e.reward for e in episodes]
        for i, r in zip(unrewarded, judged, strict=True):
            rewards[i] = r
        return [float(r) for r in rewards if r is not None]

    def _count_episodes(self, kind: str, episodes: list[Episode]) -> None:
        m = self.metrics
        for e in episodes:
            m.episodes.labels(kind, e.end_reason).inc()
            m.episode_turns.observe(e.num_turns)
            m.tool_calls.inc(e.num_tool_calls)
            m.tool_errors.inc(e.num_tool_errors)
            m.env_s.inc(e.env_s)
            m.env_tokens.inc(e.num_env_tokens)

    async def _refuse(self, msg: Msg, train_id: str, reason: str, error: str) -> None:
        """Dead-letter a task no generator configured like this one can take, counted under ``error``.

        A train task (``train_id``: an id the broker issued) gets its outcome
        in the ledger before its dead letter, as the broker records a poison
        group's, so the audit counts it dead-lettered rather than lost. When
        the ledger cannot be written the task is handed back and refused
        again on its next delivery.
        """
        if train_id.startswith(TRAIN_TASK_PREFIX):
            try:
                await self.ledger.record(self.ledger.entry(train_id, Event.LEDGER_EVENT_DEADLETTERED, reason))
            except Exception as exc:
                log.warning("ledger record of refused task %s failed, handing it back: %s", train_id, exc)
                await msg.nak(delay=1.0)
                return
        await deadletter(self.js, self.names, msg, "tasks", reason)
        self.metrics.task_errors.labels(error).inc()

    async def _heartbeat(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            try:
                await msg.in_progress()
            except Exception as exc:
                log.debug("in_progress failed: %s", exc)

    def _group(
        self,
        task: rollout_pb2.GenerationTask,
        prompt_ids: list[int],
        completions: list[rollout_pb2.Completion],
        samples: list[Sample],
        started: float,
    ) -> rollout_pb2.RolloutGroup:
        # Over every version span of every sequence: the broker's staleness gate reads the oldest.
        versions = [v for x in samples for v, _, _ in x.version_spans] or [self.engine.version]
        return rollout_pb2.RolloutGroup(
            group_id=task.task_id,
            task=task,
            prompt_token_ids=prompt_ids,
            completions=completions,
            generator_id=self.generator_id,
            started_unix_s=started,
            finished_unix_s=time.time(),
            min_version=min(versions),
            max_version=max(versions),
        )

    def _eval_result(
        self, task: rollout_pb2.GenerationTask, samples: list[Sample], rewards: list[float], num_tokens: int
    ) -> rollout_pb2.EvalResult:
        versions = [v for x in samples for v, _, _ in x.version_spans] or [self.engine.version]
        tokens_by_version: dict[int, int] = {}
        for x in samples:
            for v, start, end in x.version_spans:
                tokens_by_version[v] = tokens_by_version.get(v, 0) + end - start
        return rollout_pb2.EvalResult(
            tokens_by_version=tokens_by_version,
            eval_id=task.eval_id,
            task_id=task.task_id,
            prompt_id=task.prompt_id,
            num_samples=len(rewards),
            num_correct=sum(1 for r in rewards if r > 0),
            eval_version=task.issued_at_version,
            min_version=min(versions),
            max_version=max(versions),
            eval_num_prompts=task.eval_num_prompts,
            task=task.task_name if isinstance(self.scorer, MixtureScorer) else "",
            generator_id=self.generator_id,
            finished_unix_s=time.time(),
            num_tokens=num_tokens,
        )


def _task_id_of(msg: Msg) -> str:
    """The id an undecodable task was published under (its message id), if any."""
    return str((msg.headers or {}).get("Nats-Msg-Id", ""))
