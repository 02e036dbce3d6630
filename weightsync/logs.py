"""Logging set-up: human-readable text, or one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: time, level, logger, message, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) +
                 f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                 "message": record.getMessage(), "pid": record.process}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configures the root logger on stderr (``fmt``: text | json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


__all__ = ["configure_logging", "JsonFormatter"]
