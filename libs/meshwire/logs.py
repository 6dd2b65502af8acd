"""Logging set-up shared by every service: readable lines by default, JSON lines on request.

`MESHNET_LOG_FORMAT=json` makes every record one JSON object per line (time,
level, logger, message, and any `extra=` fields), for log shippers;
`MESHNET_LOG_LEVEL` sets the level. Services call `configure_logging()` once
when their app is created; calling it again changes nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import orjson

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}
QUIET_LOGGERS = ("httpx", "httpcore")
_configured = False


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the record's extra fields kept."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


def configure_logging(level: str | None = None, fmt: LogFormat | None = None) -> None:
    """Install one stderr handler on the root logger (once per process)."""
    global _configured
    if _configured:
        return
    level = (level or os.environ.get("MESHNET_LOG_LEVEL") or "info").upper()
    fmt = fmt or ("json" if os.environ.get("MESHNET_LOG_FORMAT", "text").lower() == "json" else "text")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT, "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for chatty in QUIET_LOGGERS:  # one INFO line per HTTP request (every heartbeat) drowns what matters
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
    _configured = True
