"""Structured logging: one JSON object per line on stderr (or readable text).

Use `log.info("message", extra={"fields": {...}})` or the helper `event(logger, msg, **fields)`.
Every line carries the server name and role, so the logs of a cluster can be merged.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STATIC: dict[str, Any] = {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_STATIC,
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return base


def setup(level: str = "INFO", fmt: str = "json", **static: Any) -> None:
    """Configure the root logger once per process."""
    _STATIC.clear()
    _STATIC.update(static)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("kazoo").setLevel(max(logging.WARNING, root.level))


def event(logger: logging.Logger, message: str, level: int = logging.INFO, /,
          **fields: Any) -> None:
    """Log `message` with structured `fields` (positional-only parameters, so a field may
    be called message, level or logger)."""
    logger.log(level, message, extra={"fields": fields})
