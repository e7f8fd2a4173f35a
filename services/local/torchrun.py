"""``python -m services.local.torchrun ...``: torchrun whose rendezvous store listens on loopback only.

The local stack launches a data-parallel learner with torchrun. torchrun's
agent hosts the TCPStore the ranks join, and a TCPStore server binds every
interface whatever host it is given; local mode binds loopback only. So the
store is handed a socket already listening on 127.0.0.1:``--master-port``
(``master_listen_fd``, which the non-libuv server accepts). Everything else
is torchrun, with torchrun's arguments, except that stopped by a signal it
exits 128 + the signal's number rather than 1 (torchrun's failure status);
imports torch.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from typing import Any

SHUTDOWN_TIMEOUT_S = 30
"""How long torchrun lets its ranks finish after SIGTERM before SIGKILL (the stack's stop waits 40 s):
rank 0 drains, writes its final checkpoint and releases the others meanwhile."""


def command(ranks: int, *target: str, shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S) -> list[str]:
    """The command line that runs ``target`` (a script path or ``-m module``, then its arguments) on
    ``ranks`` local ranks through this launcher, its store on a free loopback port. A rank that fails
    ends the launch (``--max-restarts=0``): whoever started it restarts the group."""
    from asymptote.nats_local import free_port

    return [
        sys.executable,
        "-m",
        "services.local.torchrun",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--max-restarts=0",
        f"--shutdown-timeout={shutdown_timeout_s}",
        *target,
    ]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import TCPStore, run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    argv = sys.argv[1:] if argv is None else argv
    args = run.parse_args(argv)
    if args.master_addr != "127.0.0.1" or not args.master_port:
        raise SystemExit("services.local.torchrun needs --master-addr=127.0.0.1 and a --master-port")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.master_port))
    listener.listen(128)

    def loopback_store(
        host: str, port: int, world_size: int, is_master: bool, timeout: timedelta, **kwargs: Any
    ) -> TCPStore:
        if is_master:
            kwargs |= {"master_listen_fd": listener.fileno(), "use_libuv": False}
        return TCPStore(host, port, world_size, is_master, timeout, **kwargs)

    # torchrun's static rendezvous (the one --master-addr selects) builds its store here.
    assert static_tcp_rendezvous.TCPStore is TCPStore, "torch moved the static rendezvous store"
    static_tcp_rendezvous.TCPStore = loopback_store  # type: ignore[assignment,misc]
    try:
        run.main(argv)
    except SignalException as exc:
        # Stopped (SIGTERM, SIGINT): torchrun has let its ranks finish (rank 0 drains and checkpoints)
        # and re-raises; exit as a process ended by the signal does, not as a failure (torchrun's 1).
        raise SystemExit(128 + int(exc.sigval)) from None


if __name__ == "__main__":
    main()
