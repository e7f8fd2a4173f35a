"""A bare NATS protocol session for security tests.

nats-py stops at a refused connection; an intruder need not. This client
sends its whole script (CONNECT, PUB, SUB, ...) without waiting for the
server's verdict and returns everything the server sent back, so a test
can show that nothing it published was stored and nothing was delivered.
"""

from __future__ import annotations

import socket
import time


def session(port: int, lines: list[str], until: str | None = None, timeout_s: float = 3.0) -> str:
    """Send ``lines`` (CRLF-terminated) after the server's INFO; the server's replies as text.

    Reads until the server closes the connection, ``until`` appears, or ``timeout_s`` passes.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        received = b""
        while b"\r\n" not in received:  # INFO first
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        sock.sendall("".join(f"{line}\r\n" for line in lines).encode())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (until and until in received.decode(errors="replace")):
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
    return received.decode(errors="replace")
