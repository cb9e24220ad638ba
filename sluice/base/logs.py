"""Logging for every process: plain lines, or one JSON object a line (--log-format json) for journald
and log shippers. Structured fields ride on the record as `extra={"fields": {...}}`."""
from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "stage": self.stage,
               "logger": record.name, "msg": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, stage: str) -> None:
        super().__init__(f"%(asctime)s {stage} %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return line + "".join(f" {k}={v}" for k, v in fields.items()) if fields else line


def setup_logging(stage: str, fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(stage) if fmt == "json" else TextFormatter(stage))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
