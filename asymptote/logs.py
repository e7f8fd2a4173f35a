"""Logging setup, called only from a service's ``main()``.

JSON lines in pods (one object per record, what log shippers expect),
human-readable lines on a terminal or under the local stack.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Literal

LogFormat = Literal["auto", "json", "text"]


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, fmt: LogFormat = "auto", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    if use_json:
        handler.setFormatter(JsonFormatter(service))
    else:
        text = logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        text.converter = time.localtime
        handler.setFormatter(text)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter that drowns the service's own lines at INFO.
    for noisy in ("nats", "vllm", "asyncio", "aiohttp.access", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
