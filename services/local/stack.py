"""``asymptote up``: the embedded default, one machine, no GPU.

Owns starting a real nats-server with JetStream in the run directory, the
warm-started tiny model (built once, cached), one config file per service
derived from the stack's few dials, the four services as separate OS
processes on loopback ports (and, for a code task only, the sandbox pool
the generators send programs to), following the run to its end (restarting
exited processes), and a clean stop that leaves no process behind. What is
shown while it runs, and the summary, is services.local.progress's.
Torch-free: the model is prepared in a child process.

    with LocalStack(config) as stack:  # leaving stops everything, writes the summary
        stack.start()
        code = stack.follow()
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import BaseModel, SecretStr
from rich.live import Live

from asymptote.codec import count_stored_parameters
from asymptote.config import ListenSettings, NatsSettings, dump_config, merge
from asymptote.errors import ConfigError
from asymptote.faults import DIR_ENV as FAILPOINT_DIR_ENV
from asymptote.faults import ENV as FAILPOINTS_ENV
from asymptote.lifecycle import die_with_parent, interrupt_on_sigterm
from asymptote.nats_local import free_port, new_password, start_nats
from asymptote.routing import bytes_per_token, model_layout
from asymptote.sandbox import Limits, PoolClientSettings, sandbox_sections
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings
from services.fitter.config import FitterConfig
from services.generator.config import EngineSettings, GeneratorConfig
from services.learner.config import LearnerConfig, OptimizerSettings
from services.local import torchrun
from services.local.config import StackConfig
from services.local.placement import Gpu, Placement, visible_gpus
from services.local.planning import learner_on_gpus, placement_of
from services.local.progress import Progress
from services.local.trackers import Mirror
from services.sandbox_pool.config import SandboxPoolConfig

log = logging.getLogger(__name__)

HOLD_VERSIONS: int = GeneratorConfig.model_fields["eval_hold_versions"].default
"""The generators' eval hold, at most half the run's staleness bound."""
SERVICE_ORDER = ("fitter", "broker", "learner", "generator")
"""Start order; the stop order is the reverse (generators drain first)."""
INTERRUPTED = 130
"""``LocalStack.run``'s exit code when Ctrl-C, SIGTERM or SIGHUP stopped it (128 + SIGINT, the shell's)."""
PREPARE_REFUSAL = "asymptote prepare-model: "
"""How ``asymptote prepare-model`` begins the one line that refuses its request."""
STOP_GRACE_S = 40.0
"""How long a stop waits for each phase's services to drain and exit after SIGTERM before it kills them."""
STOP_PHASES = (("learner", "generator"), ("broker", "fitter", "sandbox"))
"""The order a stop sends SIGTERM in, by service (nats-server last): the learner's final checkpoint acks
its batches to the broker, and the generators hand their finished groups on, so the broker outlives both."""
NATS_USER_ENV, NATS_PASSWORD_ENV = "ASY_NATS_USER", "ASY_NATS_PASSWORD"
"""Where the credentials of a nats-server the config names (``StackConfig.nats_url``) come from."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    http_port: int | None = None
    ready: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    cpus: set[int] | None = None
    restarts: int = 0
    """Restarts over the run."""
    crash_loop: int = 0
    """Restarts in a row, each exit soon after its start: sets the backoff and the give-up point."""
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None

    def tail(self, num_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


SERVICE_ENV_PREFIXES = tuple(
    f"ASY_{role.upper()}__" for role in ("broker", "learner", "generator", "fitter", "sandbox_pool")
)
"""The environment overrides of the services' configs (asymptote.config.load_config): never passed on."""

ServiceConfig = TypeVar("ServiceConfig", bound=BaseModel)


def with_section(config: ServiceConfig, section: dict[str, Any]) -> ServiceConfig:
    """``config`` with a StackConfig ``services`` section merged over it (checked when the stack config was)."""
    if not section:
        return config
    return type(config).model_validate(merge(config.model_dump(), section))


class LocalStack:
    """One local run's processes, from start to a clean stop; a context manager.

    Leaving the ``with`` block (normally, by an exception or Ctrl-C) saves
    each live service's last metrics, audits the ledger, stops every process
    and writes the run's summary.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = (config.run_dir or Path("runs") / stamp).resolve()
        self.procs: list[Proc] = []
        self.nats_port = free_port()
        # Credentials made for this run: handed to services in their
        # environment (as a Kubernetes Secret would be), never written to
        # their config files or logs.
        if config.nats_url is not None:  # a nats-server already running: its credentials, if any, as given
            self.nats_user = os.environ.get(NATS_USER_ENV) or None
            self.nats_password = os.environ.get(NATS_PASSWORD_ENV) or None
        else:
            self.nats_user = "asymptote" if config.nats_auth else None
            self.nats_password = new_password() if config.nats_auth else None
        self.progress = Progress(self.run_dir, config.max_steps)
        self.mirror: Mirror | None = None
        """The run's metrics mirrored to the trackers of ``report_to`` (started with the services)."""
        self.placement: Placement | None = None
        """Which GPUs each process sees; None: the CPU (``resolve_placement`` at start)."""
        self.sandbox_pool_path: Path | None = None
        """The sandbox pool's config, written for a code task only (``write_sandbox_pool_config``)."""
        self.killed_at_stop: list[str] = []
        """Processes that had not ended by themselves when the stack stopped, so were killed (summary.json)."""
        self._stopping = threading.Event()
        """Set once the stop begins: from then on nothing is restarted, and ``follow`` returns."""
        self._supervision = threading.Lock()
        """Held by a round of supervision and by the start of the stop: a restart under way when the stop
        begins finishes first (and its process is stopped with the rest); none begins after."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- set-up ------------------------------------------------------------

    def prepare_model(self) -> Path:
        """Warm-start (or find in the cache) the tiny model, or check the configured model_dir, in a child process."""
        c = self.config
        request = json.dumps(
            {
                "cache_dir": str(c.cache_dir.resolve()),
                "task": c.task.model_dump(mode="json"),
                "model": c.model,
                "warmstart": c.warmstart,
                "model_dir": None if c.model_dir is None else str(c.model_dir.resolve()),
            }
        )
        if c.model_dir is None:
            print("preparing the warm-started model (cached after the first run)...", flush=True)
        else:
            print(f"checking the model in {c.model_dir}...", flush=True)
        child = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "prepare-model", "--request", request],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent(),
        )
        assert child.stdout is not None and child.stderr is not None
        # The warm start's progress goes to the terminal as it comes; a refusal of
        # the request is this stack's config error, said once as the stack's own.
        refusal = None
        for line in child.stderr:
            if line.startswith(PREPARE_REFUSAL):
                refusal = line[len(PREPARE_REFUSAL) :].strip().replace("--request ", "")
            else:
                sys.stderr.write(line)
        printed = child.stdout.read()
        if child.wait() != 0:
            if refusal is not None:
                raise ConfigError(f"stack config: {refusal}")
            raise RuntimeError("model preparation failed (see the output above)")
        path = Path(printed.strip().splitlines()[-1])
        info = path / "warmstart.json"
        if info.exists():
            meta = json.loads(info.read_text())
            print(
                f"model: {path} ({meta.get('num_parameters', 0):,} parameters, warm-start held-out "
                f"pass rate {meta.get('heldout_pass_rate', float('nan')):.3f})",
                flush=True,
            )
        return path

    def process_env(self, name: str) -> dict[str, str]:
        """The environment process ``name`` starts with: this one's, its failpoints, its GPUs (on GPUs; none
        for the services that use none) and, for a service, the run's NATS credentials."""
        # A service reads ASY_<SERVICE>__... over its config file: the caller's would change what the run
        # does behind the configs recorded under config/. The stack's own settings are in those files.
        env = {k: v for k, v in os.environ.items() if not k.startswith(SERVICE_ENV_PREFIXES)}
        env["PYTHONUNBUFFERED"] = "1"
        role = name.split("-")[0]
        if self.config.failpoints:
            env[FAILPOINTS_ENV] = self.config.failpoints
            env[FAILPOINT_DIR_ENV] = str(self.run_dir / "failpoints")
        if self.placement is not None:  # each process sees its own GPUs, numbered from 0; the others none
            env["CUDA_VISIBLE_DEVICES"] = self.placement.visible_devices(name)
        if self.nats_user and self.nats_password and role in SERVICE_ORDER:
            env[f"ASY_{role.upper()}__NATS__USER"] = self.nats_user
            env[f"ASY_{role.upper()}__NATS__PASSWORD"] = self.nats_password
        return env

    def _spawn(self, name: str, argv: list[str], cpus: set[int] | None = None, http_port: int | None = None) -> Proc:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        env = self.process_env(name)

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        fh = log_path.open("ab")
        popen = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,
            preexec_fn=die_with_parent(pin),
        )
        fh.close()
        proc = Proc(name, popen, log_path, http_port, argv=argv, cpus=cpus)
        self.procs.append(proc)
        return proc

    def supervise(self) -> tuple[list[str], list[Proc]]:
        """Restart exited processes with exponential backoff, as Kubernetes would.

        Returns (events to show, processes out of restarts). Every restart is
        appended to restarts.jsonl in the run directory.
        """
        with self._supervision:
            return ([], []) if self._stopping.is_set() else self._supervise()

    def _supervise(self) -> tuple[list[str], list[Proc]]:
        events: list[str] = []
        failed: list[Proc] = []
        now = time.monotonic()
        for p in self.procs:
            if p.popen.poll() is None:
                continue
            if p.restart_at is None:
                if now - p.started_at >= self.config.restart_backoff_reset_s:
                    p.crash_loop = 0  # it ran well: this exit is news, not a crash loop
                if p.crash_loop >= self.config.max_restarts:
                    failed.append(p)
                    continue
                delay = min(self.config.restart_backoff_s * 2.0**p.crash_loop, 30.0)
                p.restart_at = now + delay
                events.append(f"{p.name} exited with code {p.popen.returncode}; restarting in {delay:.1f}s")
                with (self.run_dir / "restarts.jsonl").open("a") as f:
                    f.write(
                        json.dumps(
                            {
                                "service": p.name,
                                "exit_code": p.popen.returncode,
                                "restart": p.restarts + 1,
                                "delay_s": delay,
                                "unix_s": time.time(),
                            }
                        )
                        + "\n"
                    )
            elif now >= p.restart_at:
                self._respawn(p)
                events.append(f"{p.name} restarted (restart {p.restarts})")
        return events, failed

    def _respawn(self, p: Proc) -> None:
        p.restarts += 1
        p.crash_loop += 1
        p.started_at = time.monotonic()
        p.restart_at = None
        p.ready = False
        if p.name == "nats-server":
            server = start_nats(self.run_dir / "nats", self.nats_port, p.log_path, self.nats_user, self.nats_password)
            self._pin_nats(server.process.pid)
            p.popen = server.process
            return
        fresh = self._spawn(p.name, p.argv, cpus=p.cpus, http_port=p.http_port)
        self.procs.remove(fresh)
        p.popen = fresh.popen

    def _pin_nats(self, pid: int) -> None:
        cpus = self.cores_for("nats")
        if cpus:
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError as exc:
                log.warning("could not pin nats-server: %s", exc)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal one process group (fault injection)."""
        self._signal(next(p for p in self.procs if p.name == name), sig)

    @property
    def nats_url(self) -> str:
        """The nats-server the run's services use: the configured one, else the run's own on loopback."""
        return self.config.nats_url or f"nats://127.0.0.1:{self.nats_port}"

    def start_nats(self) -> None:
        """Start the run's own nats-server; nothing where the config names one already running."""
        if self.config.nats_url is not None:
            return
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        server = start_nats(
            self.run_dir / "nats", self.nats_port, logs / "nats-server.log", self.nats_user, self.nats_password
        )
        self._pin_nats(server.process.pid)
        self.procs.append(Proc("nats-server", server.process, logs / "nats-server.log"))

    def resolve_placement(self, gpus: list[Gpu] | None = None) -> Placement | None:
        """The GPUs of each process (``config.gpus``; ``gpus``: the machine's, found when None); None on the CPU."""
        c = self.config
        if c.gpus == 0:
            return None
        found = visible_gpus() if gpus is None else gpus
        if c.gpus is None and not found:
            return None
        wanted = len(found) if c.gpus is None else c.gpus
        if wanted > len(found):
            raise ConfigError(f"gpus {wanted}: only {len(found)} GPUs are visible to this process")
        self.placement = placement_of(c, found[:wanted])
        return self.placement

    @property
    def num_generators(self) -> int:
        return len(self.placement.generators) if self.placement else self.config.num_generators or 1

    @property
    def learner_ranks(self) -> int:
        return len(self.placement.learner) if self.placement else self.config.learner_ranks

    def write_configs(self, model_dir: Path) -> dict[str, Path]:
        c = self.config
        # No credentials here: services get them in their environment (see _spawn).
        nats = NatsSettings(url=self.nats_url)
        cfg_dir = self.run_dir / "config"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        self.ports = {name: (free_port(), free_port()) for name in ("broker", "learner", "fitter")}
        broker = BrokerConfig(
            nats=nats,
            prefix=c.prefix,
            log_format="text",
            grpc=ListenSettings(port=self.ports["broker"][0]),
            http=ListenSettings(port=self.ports["broker"][1]),
            task=c.task,
            sampling=SamplingSettings(
                group_size=c.group_size, max_tokens=c.max_tokens, overlong_cache_tokens=c.overlong_cache_tokens
            ),
            eval=EvalSettings(
                every_versions=c.eval_every_versions, num_samples=c.eval_num_samples, num_prompts=c.eval_num_prompts
            ),
            batch_prompts=c.batch_prompts,
            mode=c.mode,
            max_staleness_versions=c.max_staleness_versions,
            zero_variance=c.zero_variance,
            seed=c.seed,
            routing_bytes_per_token=routing_bytes_per_token(model_dir),
        )
        learner = LearnerConfig(
            nats=nats,
            prefix=c.prefix,
            log_format="text",
            grpc=ListenSettings(port=self.ports["learner"][0]),
            http=ListenSettings(port=self.ports["learner"][1]),
            broker_endpoint=f"127.0.0.1:{self.ports['broker'][0]}",
            model_dir=model_dir,
            run_dir=self.run_dir,
            optimizer=OptimizerSettings(lr=c.lr, warmup_steps=c.warmup_steps),
            batch_prompts=c.batch_prompts,
            updates_per_batch=c.updates_per_batch,
            max_steps=c.max_steps,
            checkpoint_every_steps=c.checkpoint_every_steps,
            lora=c.lora,
            seed=c.seed,
        )
        if self.placement is not None:
            learner = learner_on_gpus(learner, model_dir, self.placement, c.max_tokens)
        if c.model_dir is not None:
            for warning in learner.warnings(count_stored_parameters(model_dir)):
                log.warning("%s", warning)
        fitter = FitterConfig(
            nats=nats,
            prefix=c.prefix,
            log_format="text",
            grpc=ListenSettings(port=self.ports["fitter"][0]),
            http=ListenSettings(port=self.ports["fitter"][1]),
            run_dir=self.run_dir,
            run_name=self.run_dir.name,
        )
        broker = with_section(broker, c.services.broker)
        learner = with_section(learner, c.services.learner)
        fitter = with_section(fitter, c.services.fitter)
        paths = {}
        for name, cfg in (("broker", broker), ("learner", learner), ("fitter", fitter)):
            paths[name] = cfg_dir / f"{name}.yaml"
            dump_config(cfg, paths[name])
        sandbox_pool = self.write_sandbox_pool_config(cfg_dir)
        for i in range(self.num_generators):
            gen = GeneratorConfig(
                nats=nats,
                prefix=c.prefix,
                log_format="text",
                grpc=ListenSettings(port=free_port()),
                http=ListenSettings(port=free_port()),
                engine=self.engine_settings(model_dir).model_copy(update={"seed": c.seed + i}),
                swap_mode="drain" if c.mode == "sync" else "inflight",
                # A hold within half the staleness bound: train groups sampled meanwhile stay admissible.
                eval_hold_versions=min(HOLD_VERSIONS, broker.max_staleness_versions // 2),
                task=c.task,
                lora=c.lora,
                device_kind="gpu" if self.placement else "cpu-core",
                num_devices=c.tensor_parallel_size if self.placement else 1,
                sandbox_pool=sandbox_pool,
            )
            gen = with_section(gen, c.services.generator)
            self.ports[f"generator-{i}"] = (gen.grpc.port, gen.http.port)
            paths[f"generator-{i}"] = cfg_dir / f"generator-{i}.yaml"
            dump_config(gen, paths[f"generator-{i}"])
        return paths

    def write_sandbox_pool_config(self, cfg_dir: Path) -> PoolClientSettings | None:
        """For a task that runs programs (a code verifier in it), the sandbox pool's config on loopback ports,
        with the task's own sandbox choice, and how the generators reach it; None (no pool) for any other task.

        The pool takes whatever limits the verifier asks for (this machine is the user's own) and runs on
        the generators' cores, where their scoring workers ran programs before."""
        sections = sandbox_sections(self.config.task)
        self.sandbox_pool_path = None
        if not sections:
            return None
        own = sections[0].model_copy(update={"pool": None})
        pool = SandboxPoolConfig(
            log_format="text",
            grpc=ListenSettings(port=free_port()),
            http=ListenSettings(port=free_port()),
            sandbox=own.model_copy(update={"limits": Limits()}),
            max_limits=Limits(
                timeout_s=3600.0,
                memory_mib=1 << 20,
                num_processes=4096,
                file_size_mib=1 << 14,
                open_files=1 << 16,
                output_bytes=16 << 20,
            ),
        )
        self.ports["sandbox-pool"] = (pool.grpc.port, pool.http.port)
        self.sandbox_pool_path = cfg_dir / "sandbox-pool.yaml"
        dump_config(pool, self.sandbox_pool_path)
        return PoolClientSettings(endpoint=f"127.0.0.1:{pool.grpc.port}")

    def start_sandbox_pool(self) -> None:
        """The sandbox pool's process, when write_configs wrote its config (a code task); supervised like the rest,
        so a pool that recycles itself (``max_runs``) is started again."""
        if self.sandbox_pool_path is None:
            return
        self._spawn(
            "sandbox-pool",
            [sys.executable, "-m", "services.cli", "sandbox-pool", "--config", str(self.sandbox_pool_path)],
            cpus=self.cores_for("generator"),
            http_port=self.ports["sandbox-pool"][1],
        )

    def engine_settings(self, model_dir: Path) -> EngineSettings:
        """A generator's engine: the CPU build's float32 and fixed KV cache, or on GPUs bf16 with the FP32
        head, tensor parallel as set and the KV cache by memory fraction (what the engine leaves beside
        the weights), CUDA graphs on."""
        if self.placement is None:
            return EngineSettings(model_dir=model_dir, max_num_seqs=256)
        return EngineSettings(
            model_dir=model_dir,
            max_num_seqs=256,
            dtype="bfloat16",
            tensor_parallel_size=self.config.tensor_parallel_size,
            gpu_memory_utilization=self.placement.generator_fraction,
            kv_cache_memory_bytes=None,
            enforce_eager=False,
        )

    def start_services(self, paths: dict[str, Path]) -> None:
        for name, path in sorted(paths.items(), key=lambda kv: SERVICE_ORDER.index(kv[0].split("-")[0])):
            role = name.split("-")[0]
            target = ["-m", "services.cli", role, "--config", str(path)]
            if role == "learner" and self.learner_ranks > 1:  # torchrun, its store on loopback
                cmd = torchrun.command(self.learner_ranks, *target)
            else:
                cmd = [sys.executable, *target]
            self._spawn(
                name,
                cmd,
                cpus=self.cores_for(role),
                http_port=self.ports[name][1],
            )

    def cores_for(self, role: str) -> set[int] | None:
        """Generators (with their vLLM engine processes) on every core but the
        last; the learner on the last, beside the light broker, fitter and
        nats-server, so a weight swap's hops between the generator's
        processes never wait behind another service."""
        cores = os.cpu_count() or 1
        if not self.config.pin_cores or cores < 2 or not hasattr(os, "sched_setaffinity") or self.placement:
            return None  # on GPUs the host's cores are not the bottleneck: no pinning
        return set(range(cores - 1)) if role == "generator" else {cores - 1}

    # -- running -----------------------------------------------------------

    def poll_ready(self) -> None:
        for p in self.procs:
            if p.http_port is None:
                p.ready = p.popen.poll() is None
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p.http_port}/readyz", timeout=0.5) as r:
                    p.ready = r.status == 200
                    p.extra["detail"] = ""
            except urllib.error.HTTPError as exc:
                p.ready = False
                try:
                    p.extra["detail"] = json.loads(exc.read()).get("detail", "")
                except Exception:
                    p.extra["detail"] = f"HTTP {exc.code}"
            except OSError:
                p.ready = False
                p.extra["detail"] = "loading, no health endpoint yet"

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is not None]

    def nats_settings(self, **overrides: Any) -> NatsSettings:
        """How a client on this machine reaches this run's nats-server."""
        password = SecretStr(self.nats_password) if self.nats_password is not None else None
        return NatsSettings(url=self.nats_url, user=self.nats_user, password=password, **overrides)

    def audit_ledger(self) -> dict[str, Any] | None:
        """Account for every issued task (asymptote.ledger) into ledger.json."""
        from asymptote.jetstream.connect import connect
        from asymptote.jetstream.names import Names
        from asymptote.ledger import audit

        async def run() -> dict[str, Any]:
            nc = await connect(self.nats_settings(max_reconnect_attempts=2), "audit")
            try:
                return (await audit(nc.jetstream(), Names(self.config.prefix))).as_dict()
            finally:
                await nc.close()

        try:
            result = asyncio.run(run())
        except Exception as exc:
            log.warning("ledger audit failed: %s", exc)
            return None
        (self.run_dir / "ledger.json").write_text(json.dumps(result, indent=2))
        return result

    def save_final_metrics(self) -> None:
        """Each live service's last Prometheus exposition, to metrics/<name>.prom."""
        out = self.run_dir / "metrics"
        out.mkdir(exist_ok=True)
        for p in self.procs:
            if p.http_port is None or p.popen.poll() is not None:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p.http_port}/metrics", timeout=5.0) as r:
                    (out / f"{p.name}.prom").write_bytes(r.read())
            except OSError as exc:
                log.warning("could not save %s's metrics: %s", p.name, exc)

    def stop_services(self) -> None:
        """SIGTERM to the services in STOP_PHASES, each phase waited for; nats-server stays up. Nothing is
        restarted from here on, whichever thread supervises."""
        with self._supervision:
            self._stopping.set()
        for phase in STOP_PHASES:
            procs = [p for p in self.procs if p.name.split("-")[0] in phase and p.popen.poll() is None]
            for p in reversed(procs):
                self._signal(p, signal.SIGTERM)
            self._wait_all(procs, STOP_GRACE_S)

    def stop(self) -> None:
        """Every process: the services (``stop_services``), then the rest (``stop_rest``)."""
        self.stop_services()
        self.stop_rest()

    def stop_rest(self) -> None:
        """After ``stop_services``: SIGTERM to nats-server, then SIGKILL what is left of every process group."""
        for p in self.procs:
            if p.name == "nats-server":
                self._signal(p, signal.SIGTERM)
        self._wait_all(self.procs, 10.0)
        for p in self.procs:
            if p.popen.poll() is None:
                self.killed_at_stop.append(p.name)
                log.warning("%s did not stop within %.0f s of SIGTERM: killed", p.name, STOP_GRACE_S)
            self._signal(p, signal.SIGKILL)  # the whole group: vLLM's engine processes too
        # A SIGKILL is delivered, not yet acted on: wait until each main process is gone and reaped, so that
        # the stop returns with nothing of the run still running.
        self._wait_all(self.procs, 10.0)

    @staticmethod
    def _signal(p: Proc, sig: signal.Signals) -> None:
        """As Kubernetes signals a container: SIGTERM to its main process, which
        shuts down its children itself (vLLM's engine core, torchrun's ranks);
        any other signal (SIGKILL) to the whole process group."""
        try:
            if sig == signal.SIGTERM:
                os.kill(p.popen.pid, sig)
            else:
                os.killpg(p.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _wait_all(procs: list[Proc], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    # -- the run as a whole -----------------------------------------------

    def start(self) -> None:
        """Prepare the model, then start nats-server and every service."""
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        placement = self.resolve_placement()
        if placement is not None:
            print(f"GPUs: {placement.describe()}", flush=True)
        model_dir = self.prepare_model()
        (self.run_dir / "stack.json").write_text(json.dumps(c.model_dump(mode="json"), indent=2))
        self.progress.started = time.monotonic()  # the run's clock starts once the model is ready
        self.start_nats()
        paths = self.write_configs(model_dir)
        self.start_sandbox_pool()
        self.start_services(paths)
        if c.report_to:
            self.mirror = Mirror(self.run_dir, c.report_to, self.run_dir.name, c.model_dump(mode="json"))
        print(f"run directory: {self.run_dir}\nlogs: {self.run_dir / 'logs'}", flush=True)

    def follow(self, until: Callable[[dict[str, Any]], bool] | None = None) -> int:
        """Supervise and show the run until it completes (0) or fails (1); ``until(snapshot)`` True also ends it (0),
        and a stop begun from another thread (130).

        It fails when a process is out of restarts, when the services are not
        all ready within ``startup_timeout_s`` of the learner's first step
        being due, or when the final eval round takes longer than
        ``final_eval_timeout_s``. ``progress.outcome`` says how it ended.
        """
        c, progress = self.config, self.progress
        console = progress.console
        deadline_ready = time.monotonic() + c.startup_timeout_s
        final_deadline: float | None = None
        last_print = 0.0
        live = Live(console=console, refresh_per_second=2) if console.is_terminal else None
        if live:
            live.start()
        try:
            while True:
                self.poll_ready()
                events, failed = self.supervise()
                if self._stopping.is_set():  # stopped from another thread (a signal, a test's teardown)
                    progress.outcome = "stopped"
                    return INTERRUPTED
                for event in events:
                    console.print(f"[yellow]{event}[/yellow]")
                if failed:
                    for p in failed:
                        console.print(
                            f"[red]{p.name} exited with code {p.popen.returncode} after {p.restarts} restarts"
                            f"[/red]; last log lines:\n{p.tail()}"
                        )
                    progress.outcome = f"failed: {', '.join(p.name for p in failed)} exited"
                    return 1
                snap = progress.snapshot()
                if self.mirror is not None:
                    self.mirror.poll()
                ready = {p.name: p.ready for p in self.procs}
                details = {p.name: str(p.extra.get("detail", "")) for p in self.procs}
                if progress.rl_started is None and snap["step"] > 0:
                    progress.rl_started = time.monotonic()
                if snap["step"] == 0 and time.monotonic() > deadline_ready and not all(ready.values()):
                    waiting = [f"{p.name} ({p.extra.get('detail', '')})" for p in self.procs if not p.ready]
                    console.print(f"[red]services not ready after {c.startup_timeout_s:.0f}s: {waiting}[/red]")
                    progress.outcome = "failed: startup timeout"
                    return 1
                if snap["step"] >= progress.max_steps and final_deadline is None:
                    final_deadline = time.monotonic() + c.final_eval_timeout_s
                if progress.finished(snap) or (until is not None and until(snap)):
                    progress.rl_finished = time.monotonic()
                    progress.outcome = "completed" if progress.finished(snap) else "stopped: target reached"
                    if live:
                        live.update(progress.render(snap, ready, details))
                    return 0
                if final_deadline is not None and time.monotonic() > final_deadline:
                    console.print("[red]the final eval round did not complete in time[/red]")
                    progress.outcome = "failed: final eval timeout"
                    return 1
                if live:
                    live.update(progress.render(snap, ready, details))
                elif time.monotonic() - last_print > 10.0:
                    print(progress.line(snap, ready, details), flush=True)
                    last_print = time.monotonic()
                time.sleep(0.5)
        finally:
            if live:
                live.stop()

    def close(self) -> None:
        """Save each live service's last metrics, stop the services, audit the ledger, stop nats-server, write
        the summary.

        Each step only where there is something to do it on: a stack that
        never started a process stops nothing and audits no ledger.
        """
        if self.procs:
            self.save_final_metrics()
            # Audited once the services are gone, nats-server still up: a learner stopped mid-run acks
            # the batches its final checkpoint holds as it drains, and those acks are in the ledger.
            self.stop_services()
            if self.config.nats_url is not None or any(p.name == "nats-server" for p in self.procs):
                self.audit_ledger()
            self.stop_rest()
        if self.mirror is not None:
            self.mirror.close()
        if self.run_dir.exists():
            self.progress.finish({p.name: p.restarts for p in self.procs}, self.killed_at_stop)

    def run(self, until: Callable[[dict[str, Any]], bool] | None = None) -> int:
        """Start, then follow to max_steps and the final eval (or until ``until(progress snapshot)``); the exit code."""
        with interrupt_on_sigterm(), self:
            try:
                self.start()
                return self.follow(until)
            except KeyboardInterrupt:
                print(
                    f"\ninterrupted: stopping every service (the learner checkpoints what it trained)...\n"
                    f"resume with: asymptote up --resume {self.run_dir}",
                    flush=True,
                )
                return INTERRUPTED


def routing_bytes_per_token(model_dir: Path) -> int:
    """The routing bytes a token of ``model_dir``'s model carries (its generators record routing by default when
    it is a mixture of experts, ``asymptote.routing.model_layout``); 0 for a dense model."""
    config = model_dir / "config.json"
    spec = model_layout(json.loads(config.read_text())) if config.exists() else None
    return 0 if spec is None else bytes_per_token(spec)
