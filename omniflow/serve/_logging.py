"""The server's logs: text or one JSON object per line, and the node errors of served calls.

>>> configure("info", "json")     # what `omniflow serve --log-format json` does  # doctest: +SKIP
>>> log_call_end(call)            # each node error, with its traceback  # doctest: +SKIP

JSON lines carry ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, then ``call_id``,
``graph``, ``node`` when the record has them, and ``traceback`` for a node error or an
exception. Text lines are ``TIME LEVEL LOGGER: MSG [call_id=.. graph=.. node=..]`` with the
traceback below. Loggers set up: ``omniflow`` (the runtime and the server) and uvicorn's.
HTTP clients get a node error's message, never its traceback: that stays in this log.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omniflow.runtime import Call

__all__ = ["LOG_FORMATS", "JsonFormatter", "TextFormatter", "configure", "log_call_end"]

LOG_FORMATS = ("text", "json")
_CONTEXT = ("call_id", "graph", "node")
_LOGGERS = ("omniflow", "uvicorn", "uvicorn.error", "uvicorn.access")

log = logging.getLogger("omniflow.serve")


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k in _CONTEXT if (v := getattr(record, k, None)) is not None}


def _traceback(record: logging.LogRecord, fmt: logging.Formatter) -> str | None:
    tb = getattr(record, "traceback", None)
    if tb is None and record.exc_info:
        tb = fmt.formatException(record.exc_info)
    return tb.rstrip("\n") if tb else None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_context(record),
        }
        tb = _traceback(record, self)
        if tb is not None:
            out["traceback"] = tb
        return json.dumps(out, ensure_ascii=False, default=repr)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MSG [call_id=.. graph=.. node=..]``, then the traceback."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = self._line(record)
        ctx = _context(record)
        if ctx:
            line += " [" + " ".join(f"{k}={v}" for k, v in ctx.items()) + "]"
        tb = _traceback(record, self)
        return f"{line}\n{tb}" if tb else line

    def _line(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        return self.formatMessage(record)


def configure(level: str, fmt: str = "text") -> None:
    """Send the server's and uvicorn's logs to stderr at ``level`` in ``fmt``."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    numeric = 5 if level.lower() == "trace" else logging.getLevelName(level.upper())
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = False
        logger.setLevel(numeric)
        if name in ("omniflow", "uvicorn"):
            logger.addHandler(handler)
        else:  # children of "uvicorn": let them propagate to its handler
            logger.propagate = True
            logger.setLevel(logging.NOTSET)


def log_call_end(call: Call, *, disconnected: bool = False) -> None:
    """Log what went wrong in a finished served call: node errors (with their tracebacks) at
    error level, timeouts at warning level, and one line when the client went away."""
    base = {"call_id": call.call_id, "graph": call.graph}
    if disconnected:
        log.info("client disconnected: call %s cancelled", call.call_id, extra=base)
        return
    for err in call.errors:
        extra = {**base, "node": err.node, "traceback": getattr(err, "traceback", None)}
        if err.kind == "error":
            log.error("call %s: %s", call.call_id, err, extra=extra)
        elif err.kind != "cancel":
            log.warning("call %s: %s", call.call_id, err, extra=extra)
