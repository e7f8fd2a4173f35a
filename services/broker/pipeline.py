"""The broker's loops over JetStream.

Owns issuing train tasks with back-pressure, consuming rollout groups into
the batcher, dead-lettering poison messages, scheduling eval rounds on
policy-version changes, and persisting the curriculum. The gRPC face is in
server.py; wiring in main.py. A mixture of tasks issues each train task
under its sub-task's name, drawn by weight (curriculum.MixtureCurriculum),
and holds one eval round per sub-task at each eval version.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, PayloadError
from asymptote.jetstream.deadletter import deadletter
from asymptote.jetstream.names import Names
from asymptote.jetstream.preflight import MessageSize
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.jetstream.pull import durable_puller
from asymptote.ledger import TRAIN_TASK_PREFIX, Event, Ledger
from asymptote.lifecycle import wait_or_stop
from asymptote.messages import decode, decode_group, max_group_bytes
from asymptote.policy import watch_policy
from asymptote.tasks import MixtureTask, MultiTurnSettings, Problem, Task, get_task, task_digest
from services.broker.batcher import ROLLOUT_COUNTS, Ackable, Batcher, pass_rate
from services.broker.config import BrokerConfig
from services.broker.curriculum import Curriculum, MixtureCurriculum
from services.broker.metrics import BrokerMetrics
from services.broker.shaping import score_truncated, shape_overlong

log = logging.getLogger(__name__)

STATE_KEY = "state"
MAX_DELIVER = 5
"""Redeliveries of a rollout group before JetStream gives up on it."""
FETCH_BATCH = 256
"""Rollout groups taken per fetch at most (a fetch returns what is there without waiting for more)."""
ADMIT_SLICE = 64
"""Groups admitted between two turns of the event loop (their drops stored as one ledger batch)."""
PENDING_RECOUNT_S = 0.5
"""How often the issuer reads the task queue's depth; in between it counts what it issued and received."""


class BrokerPipeline:
    def __init__(
        self,
        config: BrokerConfig,
        js: JetStreamContext,
        names: Names,
        curriculum_kv: KeyValue,
        policy_kv: KeyValue,
        metrics: BrokerMetrics,
    ) -> None:
        self.config = config
        self.js = js
        self.names = names
        self.curriculum_kv = curriculum_kv
        self.policy_kv = policy_kv
        self.metrics = metrics
        task = get_task(config.task.name, config.task)
        self.task = task
        self.task_digest = task_digest(config.task)
        """Carried by every task issued: a generator holding another task's digest dead-letters the task."""
        self.eval_sets = self._eval_sets(task)
        """Each eval round's prompts, by sub-task ("" for the one task of a single-task run)."""
        self.heldout: list[Problem] = [p for problems in self.eval_sets.values() for p in problems]
        self._train = list(task.problems("train"))
        self.curriculum: Curriculum | MixtureCurriculum | None = None
        self.publisher = Publisher(js)
        self.ledger = Ledger(js, names, "broker", self.publisher)
        self.batcher = Batcher(
            config.batch_prompts, config.staleness_bound, self.ledger, _stream_seq, zero_variance=config.zero_variance
        )
        self.pending_tasks = 0
        """Train tasks queued or being generated (and groups on their way back): the last count of the
        queue, plus what was issued since, less what was received since."""
        self._pending_counted = 0
        self._issued_since_count = 0
        self._received_since_count = 0
        # Flow measurements behind the outstanding-task limit (EWMAs).
        self.consume_rate: float | None = None
        """Groups per second the learner takes when fed (Batcher.learner_pace)."""
        self.issue_latency_s: float | None = None
        """Seconds from issuing a train task to its group arriving here."""
        self._state_dirty = False
        self._generators_seen: dict[str, float] = {}
        self._eval_lock = asyncio.Lock()
        # Issuing a task (ledger record, publish, cursor) and saving the
        # curriculum never interleave: a saved cursor covers only tasks whose
        # record and publish both happened.
        self._issue_lock = asyncio.Lock()
        # Train tasks wait for the first policy version, whose eval round
        # (R0) must be queued ahead of them so it runs on the initial weights.
        self.policy_seen = asyncio.Event()
        self.run_finished = False
        """The learner announced its final version (max_steps): generators are wanted only to drain the tasks left."""

    def _eval_sets(self, task: Task) -> dict[str, list[Problem]]:
        """The held-out prompts of each eval round: the task's, within the eval budget; a mixture's budget
        split evenly among its sub-tasks, a share a sub-task's split cannot fill going to the others, and
        (without eval.num_prompts) at least eval.min_prompts each: each round, over one sub-task's held-out
        split, is a point of that sub-task's curve."""
        config = self.config
        if not isinstance(task, MixtureTask):
            heldout = list(task.problems("heldout"))
            chosen = heldout[: config.eval_num_prompts(len(heldout))]
            log.info(
                "eval rounds: %d of %d held-out prompts x %d samples every %d versions",
                len(chosen),
                len(heldout),
                config.eval.num_samples,
                config.eval.every_versions,
            )
            return {"": chosen}
        names = task.settings.names
        subs = {name: task.sub_problems(name, "heldout") for name in names}
        task.problems("heldout")  # every sub-task's ids known to sub_task_of
        # Even shares of the budget; what a small held-out split leaves goes to the others.
        left = config.eval_num_prompts(sum(map(len, subs.values())))
        shares: dict[str, int] = {}
        for i, name in enumerate(sorted(names, key=lambda n: len(subs[n]))):
            shares[name] = min(len(subs[name]), math.ceil(left / (len(names) - i)))
            left -= shares[name]
            if config.eval.num_prompts is None:  # each round is a point of its own curve: min_prompts each
                shares[name] = max(shares[name], min(config.eval.min_prompts, len(subs[name])))
        for name in names:
            log.info(
                "eval rounds of %s: %d of %d held-out prompts x %d samples every %d versions",
                name,
                shares[name],
                len(subs[name]),
                config.eval.num_samples,
                config.eval.every_versions,
            )
        return {name: subs[name][: shares[name]] for name in names}

    def task_name_of(self, problem: Problem) -> str:
        """The ``task_name`` a task of ``problem`` carries: its sub-task in a mixture, else the task's name."""
        if isinstance(self.task, MixtureTask):
            return self.task.sub_task_of(problem.prompt_id)
        return self.config.task.name

    def largest_message(self) -> MessageSize:
        """The largest message this run makes: a rollout group of the longest prompt, every completion
        at max_tokens (what NATS's max_payload must admit; checked at start)."""
        s = self.config.sampling
        settings = self.config.task
        tasks = [e.task for e in settings.tasks] if settings.name == "mixture" else [settings]
        system = max((getattr(t, "system_prompt", None) or "" for t in tasks), key=len)
        prompt_bytes = max((len(p.prompt.encode()) for p in (*self._train, *self.heldout)), default=0)
        if isinstance(settings, MultiTurnSettings):
            # An episode's sequences hold at most max_episode_tokens after its first prompt, which holds
            # the environment's first messages and tools (at most max_observation_bytes). Sequences the
            # chat template re-rendered repeat their conversation as their own prompts: not counted.
            env = settings.environment
            return MessageSize(
                max_group_bytes(
                    s.group_size,
                    env.max_episode_tokens,
                    prompt_bytes + env.max_observation_bytes,
                    self.config.routing_bytes_per_token,
                ),
                f"a rollout group of {s.group_size} episodes x {env.max_episode_tokens} tokens",
                "the broker's sampling.group_size or the task's environment.max_episode_tokens",
            )
        return MessageSize(
            max_group_bytes(
                s.group_size, s.max_tokens, prompt_bytes + len(system.encode()), self.config.routing_bytes_per_token
            ),
            f"a rollout group of {s.group_size} x {s.max_tokens} tokens",
            "the broker's sampling.group_size or sampling.max_tokens",
        )

    # -- state -------------------------------------------------------------

    async def load_state(self) -> None:
        """The curriculum as the last broker saved it, or a fresh one where none was ever saved.

        Only a missing key means a fresh run. A state that cannot be read (undecodable bytes, a bucket
        that does not answer) is a ConfigError naming the bucket and key: the broker stops before it
        issues anything, and the saved state is left as it is, for a person to look at (a fresh
        curriculum would bring back every prompt it had retired).
        """
        where = f"curriculum state (bucket {self.names.curriculum_bucket!r}, key {STATE_KEY!r})"
        state = None
        try:
            entry = await self.curriculum_kv.get(STATE_KEY)
        except KeyNotFoundError:
            log.info("fresh curriculum: no %s yet", where)
        except Exception as exc:
            raise ConfigError(f"{where} cannot be read: {type(exc).__name__}: {exc}; nothing was changed") from exc
        else:
            try:
                # Empty bytes are a saved state too: the default one (epoch 0, cursor 0, nothing yet).
                state = decode(rollout_pb2.CurriculumState, entry.value or b"")
            except PayloadError as exc:
                raise ConfigError(
                    f"{where} is corrupt ({exc}); nothing was changed (delete the key to start afresh)"
                ) from exc
            log.info(
                "resuming curriculum: epoch %d, cursor %d, %d pass rates",
                state.epoch,
                state.cursor,
                len(state.pass_rates),
            )
        if isinstance(self.task, MixtureTask):
            self.curriculum = MixtureCurriculum(self.task, self.config.seed, self.config.pass_rate_retire, state)
        else:
            self.curriculum = Curriculum(self._train, self.config.seed, self.config.pass_rate_retire, state)
        # Tasks past the saved cursor may have been issued, and even ended,
        # under the previous broker: read what the ledger holds since the save
        # before issuing them again (see Ledger).
        from_seq = int(self.curriculum.state.ledger_seq) + 1
        await self.ledger.catch_up(from_seq)
        log.info("ledger read from sequence %d: %d tasks known", from_seq, self.ledger.num_known)

    async def save_state(self) -> None:
        assert self.curriculum is not None
        async with self._issue_lock:
            self.curriculum.state.ledger_seq = self.ledger.last_seq
            await self.curriculum_kv.put(STATE_KEY, self.curriculum.state.SerializeToString())
            self._state_dirty = False

    async def persist_loop(self, stop: asyncio.Event, interval_s: float = 2.0) -> None:
        while not stop.is_set():
            await wait_or_stop(stop, interval_s)
            if self._state_dirty:
                assert self.curriculum is not None
                # Here, not with the other gauges: it walks every prompt's pass rate.
                self.metrics.retired_prompts.set(self.curriculum.num_retired)
                try:
                    await self.save_state()
                except Exception as exc:
                    log.warning("curriculum state not saved (will retry): %s", exc)

    # -- issuing -----------------------------------------------------------

    async def count_pending_tasks(self) -> int:
        """Train tasks in the work queue: queued or leased, not yet acked."""
        info = await self.js.stream_info(self.names.tasks_stream, subjects_filter=self.names.train_tasks)
        return int((info.state.subjects or {}).get(self.names.train_tasks, 0))

    async def issue_loop(self, stop: asyncio.Event) -> None:
        """Keep pending tasks + groups waiting for the learner at the limit."""
        assert self.curriculum is not None
        if not self.policy_seen.is_set():
            log.info("waiting for the learner's first policy version before issuing train tasks")
        while not self.policy_seen.is_set():
            if await wait_or_stop(stop, 0.5):
                return
        loop = asyncio.get_running_loop()
        counted_at = -math.inf
        while not stop.is_set():
            self.batcher.taken.clear()
            if loop.time() - counted_at >= PENDING_RECOUNT_S:
                try:
                    self._pending_counted = await self.count_pending_tasks()
                except Exception as exc:
                    log.warning("cannot read the task queue depth: %s", exc)
                    await wait_or_stop(stop, 1.0)
                    continue
                counted_at = loop.time()
                self._issued_since_count = self._received_since_count = 0
            self.pending_tasks = max(0, self._pending_counted + self._issued_since_count - self._received_since_count)
            waiting = len(self.batcher.ready)
            limit = self.outstanding_limit()
            room = limit - self.pending_tasks - waiting
            served = self.batcher.served_at_version
            if self.config.mode == "sync" and served is not None and self.batcher.learner_version <= served:
                room = 0  # the learner is training on this version's batch
            try:
                left = room
                while left > 0:
                    left -= await self._issue_train_tasks(left)
            except Exception as exc:  # JetStream unavailable (a restart): the task is issued again
                log.warning("could not issue a train task (will retry): %s", exc)
                await wait_or_stop(stop, 1.0)
                continue
            self._update_gauges()
            # Room opens when the learner takes a batch: look again at once then.
            try:
                await asyncio.wait_for(self.batcher.taken.wait(), 0.05 if room > 0 else 0.2)
            except TimeoutError:
                pass

    def outstanding_limit(self) -> int:
        """Tasks queued or generating plus groups waiting: what keeps the learner fed.

        Little's law: the learner's consumption (groups/s) times the time from
        issuing a task to its group arriving, with a quarter of headroom, plus
        one batch in hand; at least one batch and never more than k + 1
        batches ahead, since groups further ahead would arrive stale. Until
        both are measured, two batches. Synchronous mode: one batch. A
        configured ``max_outstanding_tasks`` overrides it.

        The consumption is the learner's pace when fed, not the rate it got
        groups at: a starved learner takes only what arrives, and a limit
        sized on that keeps it starved.
        """
        c = self.config
        if c.mode == "sync" or c.max_outstanding_tasks is not None:
            return c.outstanding_limit
        b = c.batch_prompts
        if self.batcher.learner_pace is not None:
            self.consume_rate = self.batcher.learner_pace
        if not self.consume_rate or self.issue_latency_s is None:
            return 2 * b
        need = math.ceil(1.25 * self.consume_rate * self.issue_latency_s) + b
        return max(b, min(need, b * (c.staleness_bound + 1)))

    async def _issue_train_tasks(self, num: int) -> int:
        """Issue up to ``num`` train tasks of one epoch at once; returns how many.

        The chunk's ledger records are stored as one batch before any task is
        published, and each task carries that batch's sequence. A failure
        rewinds the cursor over the whole chunk, whose tasks are then issued
        again under the same ids (the task publish is idempotent under the
        task id, and a repeated "issued" record is harmless); a chunk ends
        with its epoch, where a rewind is still exact. A task the ledger
        says has ended (issued and finished under a broker that crashed
        before saving its cursor) is skipped, not issued again. Returns how
        many positions of the cursor the chunk took.
        """
        assert self.curriculum is not None
        async with self._issue_lock:
            rewind = self.curriculum.rewinder()
            tasks: list[rollout_pb2.GenerationTask] = []
            ahead = self.pending_tasks + len(self.batcher.ready)
            taken = 0
            while taken < num:
                task = self._train_task(*self.curriculum.next(), ahead=ahead + len(tasks))
                taken += 1
                if not self.ledger.known_ended(task.task_id):
                    tasks.append(task)
                if self.curriculum.at_epoch_end():
                    break
            try:
                # Recorded first: a task in the queue is always in the ledger.
                seq = await self.ledger.record(
                    *(
                        self.ledger.entry(t.task_id, Event.LEDGER_EVENT_ISSUED, policy_version=t.issued_at_version)
                        for t in tasks
                    )
                )
                for t in tasks:
                    t.ledger_seq = seq
                await self.publisher.publish_all(
                    [Outgoing(self.names.train_tasks, t.SerializeToString(), t.task_id) for t in tasks]
                )
            except BaseException:
                rewind()  # issued again, under the same ids, on the next try
                raise
        self.pending_tasks += len(tasks)
        self._issued_since_count += len(tasks)
        self._state_dirty = True
        self.metrics.tasks_issued.labels("train").inc(len(tasks))
        return taken

    def start_version(self, ahead: int) -> int:
        """The policy version a generator must hold before it starts a train task with ``ahead`` groups before it.

        PipelineRL-k: the group lands in the learner's batch ``ahead // B`` from now, trained at version
        ``learner_version + ahead // B``; sampled from a version more than k behind that, it would arrive
        stale. So a generator waits for the learner instead (the broker's drop stays as the safety net).
        Synchronous mode: the learner's current version.
        """
        v = self.batcher.learner_version
        if self.config.mode == "sync":
            return v
        return max(0, v + ahead // self.config.batch_prompts - self.config.staleness_bound)

    def _train_task(self, problem: Problem, epoch: int, position: int, ahead: int = 0) -> rollout_pb2.GenerationTask:
        s = self.config.sampling
        return rollout_pb2.GenerationTask(
            task_id=f"{TRAIN_TASK_PREFIX}e{epoch}-p{position}-{problem.prompt_id}",
            kind=rollout_pb2.TASK_KIND_TRAIN,
            task_name=self.task_name_of(problem),
            prompt_id=problem.prompt_id,
            prompt=problem.prompt,
            reference=problem.reference,
            sampling=rollout_pb2.SamplingParams(
                num_samples=s.group_size, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens
            ),
            issued_at_version=self.batcher.learner_version,
            issued_unix_s=time.time(),
            epoch=epoch,
            require_version=self.start_version(ahead),
            task_digest=self.task_digest,
        )

    async def issue_eval_round(self, version: int) -> None:
        """One eval task per held-out prompt, at ``version``; ids dedupe reissues. A mixture: one round
        per sub-task (``eval-v<version>-<sub-task>``), each over that sub-task's prompts."""
        assert self.curriculum is not None
        async with self._eval_lock:
            state = self.curriculum.state
            if state.eval_issued and version <= state.last_eval_version:
                return
            for sub_task, problems in self.eval_sets.items():
                await self._publish_eval_round(version, sub_task, problems)
            state.last_eval_version = version
            state.eval_issued = True
            await self.save_state()
            self.metrics.tasks_issued.labels("eval").inc(len(self.heldout))

    async def _publish_eval_round(self, version: int, sub_task: str, problems: list[Problem]) -> None:
        """The eval tasks of one round: ``sub_task``'s (a mixture's) or the task's (``sub_task`` empty)."""
        eval_id = f"eval-v{version}-{sub_task}" if sub_task else f"eval-v{version}"
        e = self.config.eval
        for problem in problems:
            task = rollout_pb2.GenerationTask(
                task_id=f"{eval_id}-{problem.prompt_id}",
                kind=rollout_pb2.TASK_KIND_EVAL,
                task_name=sub_task or self.config.task.name,
                prompt_id=problem.prompt_id,
                prompt=problem.prompt,
                reference=problem.reference,
                sampling=rollout_pb2.SamplingParams(
                    num_samples=e.num_samples,
                    temperature=e.temperature,
                    top_p=1.0,
                    max_tokens=self.config.sampling.max_tokens,
                ),
                issued_at_version=version,
                issued_unix_s=time.time(),
                eval_id=eval_id,
                eval_num_prompts=len(problems),
                require_version=version,
                task_digest=self.task_digest,
            )
            await self.js.publish(
                self.names.eval_tasks, task.SerializeToString(), headers={"Nats-Msg-Id": task.task_id}
            )
        log.info("eval round %s issued: %d prompts x %d samples", eval_id, len(problems), e.num_samples)

    async def _issue_eval_round_retrying(self, version: int, stop: asyncio.Event) -> None:
        """Issue the round, retrying while JetStream is unavailable (ids dedupe the retries)."""
        while not stop.is_set():
            try:
                await self.issue_eval_round(version)
                return
            except Exception as exc:
                log.warning("could not issue eval round v%d (will retry): %s", version, exc)
                await wait_or_stop(stop, 1.0)

    async def policy_loop(self, stop: asyncio.Event) -> None:
        """Track the learner's version; issue eval rounds on schedule."""
        async for policy in watch_policy(self.policy_kv, self.names, stop):
            await self.batcher.set_learner_version(int(policy.version))
            self.metrics.learner_version.set(policy.version)
            self.run_finished = bool(policy.final)
            if policy.version % self.config.eval.every_versions == 0 or policy.final or not self.policy_seen.is_set():
                await self._issue_eval_round_retrying(int(policy.version), stop)
            self.policy_seen.set()

    # -- consuming ---------------------------------------------------------

    async def consume_loop(self, stop: asyncio.Event) -> None:
        puller = await durable_puller(
            self.js,
            self.names.rollouts_stream,
            self.names.rollouts,
            self.names.broker_consumer,
            ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.config.ack_wait_s,
                max_deliver=MAX_DELIVER,
                max_ack_pending=-1,
            ),
        )
        while not stop.is_set():
            try:
                msgs = await puller.fetch(FETCH_BATCH, timeout_s=0.5)
            except TimeoutError:  # nats raises its subclass, or asyncio's own
                continue
            except Exception as exc:
                log.warning("fetch of rollout groups failed: %s", exc)
                await wait_or_stop(stop, 0.5)
                continue
            # In slices, letting the event loop run in between: the learner's
            # NextBatch and Ack calls wait for turns of it.
            for start in range(0, len(msgs), ADMIT_SLICE):
                await self._on_groups(msgs[start : start + ADMIT_SLICE])
                await asyncio.sleep(0)
            self._update_gauges()

    async def _on_groups(self, msgs: list[Msg]) -> None:
        """Decode, check against the ledger and admit fetched groups (their drops stored as one ledger batch)."""
        decoded = [(msg, group) for msg in msgs if (group := await self._decode(msg)) is not None]
        # A copy of a task that already ended (generated twice across a crash,
        # redelivered after a restart) is never admitted. The ledger knows the
        # tasks this broker issued or ended, and every task issued since it
        # last read the stream; the others (inherited from before a restart)
        # are looked up together, in one read from the oldest one's record.
        train = [g.group_id.startswith(TRAIN_TASK_PREFIX) for _, g in decoded]
        ended = [
            self.ledger.known_ended(g.group_id, int(g.task.ledger_seq)) if is_train else False
            for (_, g), is_train in zip(decoded, train)
        ]
        unknown = [i for i, e in enumerate(ended) if e is None]
        if unknown:
            tasks = [(decoded[i][1].group_id, int(decoded[i][1].task.ledger_seq)) for i in unknown]
            try:
                answers = await self.ledger.ended(tasks)
            except Exception as exc:  # JetStream hiccup: admit; a later copy is caught when held
                log.warning("ledger lookup of %d tasks failed: %s", len(tasks), exc)
                answers = [False] * len(tasks)
            for i, answer in zip(unknown, answers):
                ended[i] = answer
        # The bytes each group arrived in are what the learner gets, unless shaping changed the group.
        served = [None if self._on_arrival(group) else msg.data for msg, group in decoded]
        received = self.batcher.num_received
        before = [self.batcher.rollouts[key] for key in ROLLOUT_COUNTS]
        reasons = await self.batcher.admit_all([(g, msg, bool(e)) for (msg, g), e in zip(decoded, ended)], served)
        self._received_since_count += self.batcher.num_received - received
        self.metrics.groups_received.inc(len(decoded))
        for reason, n in Counter(r for r in reasons if r is not None).items():
            self.metrics.groups_dropped.labels(reason).inc(n)
        for key, was in zip(ROLLOUT_COUNTS, before):
            if counted := self.batcher.rollouts[key] - was:
                self.metrics.completions_received.labels("all" if key == "completions" else key).inc(counted)

    async def _decode(self, msg: Msg) -> rollout_pb2.RolloutGroup | None:
        """The message's valid group, or None once a poison message is dead-lettered."""
        try:
            return decode_group(msg.data)
        except PayloadError as exc:  # poison
            reason = str(exc)
            group_id = _group_id_of(msg)
            if group_id:
                await self.ledger.record(self.ledger.entry(group_id, Event.LEDGER_EVENT_DEADLETTERED, reason))
            await deadletter(self.js, self.names, msg, "rollouts", reason)
            self.metrics.deadlettered.labels("rollouts").inc()
            return None

    def _on_arrival(self, group: rollout_pb2.RolloutGroup) -> bool:
        """What a group tells before admission: its prompt's pass rate, the generation latency, who is
        generating; then what its truncated completions earn and DAPO's overlong shaping of its rewards, as
        configured. Returns whether it changed the group (shaped its rewards)."""
        assert self.curriculum is not None
        self._generators_seen[group.generator_id] = time.monotonic()
        if group.task.kind == rollout_pb2.TASK_KIND_TRAIN:
            self.curriculum.record(group.task.prompt_id, pass_rate(group))
            self._state_dirty = True
            # Both ends on the broker's clock, and up to the group's arrival here:
            # a group travelling back through the stream is in neither the task
            # queue nor the ready groups, yet the learner waits for it all the same.
            latency = time.time() - group.task.issued_unix_s
            if 0.0 < latency < 3600.0:
                prev = self.issue_latency_s
                self.issue_latency_s = latency if prev is None else 0.9 * prev + 0.1 * latency
            # After the pass rate, which is the verifier's.
            s = self.config.sampling
            changed = False
            if s.truncated_reward is not None and self.config.task.name != "multiturn":
                changed = score_truncated(group, s.truncated_reward)
            if s.overlong_cache_tokens is not None:
                shape_overlong(group, s.max_tokens, s.overlong_cache_tokens)
                changed = True
            return changed
        return False

    # -- upkeep ------------------------------------------------------------

    async def upkeep_loop(self, stop: asyncio.Event) -> None:
        """Heartbeat held messages; return batches the learner abandoned."""
        interval = max(1.0, self.config.ack_wait_s / 4)
        while not stop.is_set():
            await wait_or_stop(stop, interval)
            await self.batcher.heartbeat()
            await self.batcher.release_expired(self.config.batch_release_s)

    def desired_generators(self) -> int:
        """Generators the pipeline wants: more while the learner starves, one fewer
        while two batches or more wait for it (the learner is the bottleneck).
        0 once the learner's final version is out and its tasks (the final
        eval round) are answered, so an autoscaler can give the GPUs back."""
        if self.run_finished and self.pending_tasks == 0:
            return 0
        now = time.monotonic()
        active = sum(1 for t in self._generators_seen.values() if now - t < 60.0) or 1
        if len(self.batcher.ready) >= 2 * self.config.batch_prompts:
            return max(1, active - 1)
        if len(self.batcher.ready) >= self.config.batch_prompts:
            return active
        starving = 1.0 - len(self.batcher.ready) / self.config.batch_prompts
        return active + math.ceil(starving * active * 0.5) if self.pending_tasks > 0 else active

    def _update_gauges(self) -> None:
        m = self.metrics
        m.ready_groups.set(len(self.batcher.ready))
        m.handed_out_groups.set(sum(len(b.items) for b in self.batcher.handed_out.values()))
        m.pending_tasks.set(self.pending_tasks)
        if self.curriculum is not None:
            m.epoch.set(self.curriculum.state.epoch)
        m.desired_generators.set(self.desired_generators())
        m.outstanding_limit.set(self.outstanding_limit())


def _stream_seq(msg: Ackable) -> int | None:
    try:
        return int(msg.metadata.sequence.stream)  # type: ignore[attr-defined]
    except Exception:  # not a JetStream message (tests)
        return None


def _group_id_of(msg: Msg) -> str:
    """The task id a poison group was published under (its message id), if any."""
    msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
    return msg_id if msg_id.startswith(TRAIN_TASK_PREFIX) else ""
