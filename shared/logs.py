"""Structured logs: one JSON object per line, carrying the request's id, tenant and model.

Every line has `ts` (unix s), `level`, `logger` and `message`; then the fields a call site
passes with `extra=` and those bound to the current request with `bind_request` (a
contextvar, so they follow the request through its handler and its streaming task,
uvicorn's access line included); `exc` holds a traceback. Call sites pass ids and counts
only: no prompt or output text and no keys are ever logged. `LLMFLEET_LOG_FORMAT=text`
gives plain one-line records for reading in a terminal.
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.config

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord's own attributes; anything else on a record came from `extra=`.
_RECORD_FIELDS = {*vars(logging.makeLogRecord({})), "message", "asctime", "color_message"}
_request_fields: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "llmfleet_log_request", default=None
)


def bind_request(request_id: str, tenant_id: str, model: str) -> None:
    """Tag every later record of the current request (task and the tasks it starts)."""
    _request_fields.set({"request_id": request_id, "tenant_id": tenant_id, "model": model})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_request_fields.get() or {})
        entry.update(_access_fields(record))
        entry.update(
            (k, v) for k, v in vars(record).items() if k not in _RECORD_FIELDS and k[0] != "_"
        )
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _access_fields(record: logging.LogRecord) -> dict[str, object]:
    """uvicorn's access line as fields: its args are (client, method, path, http, status)."""
    if record.name != "uvicorn.access" or not isinstance(record.args, tuple):
        return {}
    if len(record.args) != 5:
        return {}
    _client, method, path, _http, status = record.args
    return {"method": method, "path": path, "status": status}


def logging_config(level: str = "INFO", fmt: str = "json") -> dict:
    """A `logging.config.dictConfig` dict; uvicorn takes it as `log_config` and applies it in
    each of its worker processes."""
    formatter = {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["default"], "level": level},
        # uvicorn's loggers pass their records up to the root's handler.
        "loggers": {
            name: {"level": level, "handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


def setup(level: str = "INFO", fmt: str = "json") -> None:
    logging.config.dictConfig(logging_config(level, fmt))
