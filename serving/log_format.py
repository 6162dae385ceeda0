"""How a front end's log lines look (``kvguard proxy``, ``kvguard epp``, ``kvguard engine``): ``--log-format
text|json``, always with a UTC timestamp.

``text``: ``2026-12-06T02:05:00.123Z WARNING guard.replicas.poller: replica r0: ...``.
``json``: one object per line, ``{"ts", "level", "logger", "message"}`` plus the fields a line
carries in ``extra={"fields": {...}}`` (the access log's, :mod:`guard.observe.access_log`).
In text the same fields follow the message as ``key=value``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["LOG_FORMATS", "configure_logging", "JsonFormatter", "TextFormatter"]

LOG_FORMATS = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """``TS LEVEL logger: message key=value ...`` (a value with a space is quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        for key, value in _fields(record).items():
            text = "-" if value is None else str(value)
            line += f" {key}={json.dumps(text) if ' ' in text or not text else text}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage(), **_fields(record)}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger: ``level`` (a name such as ``info``), lines to stderr in
    ``log_format``; ValueError naming the flag for anything else."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format: must be one of {LOG_FORMATS}, got {log_format!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level: unknown level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
