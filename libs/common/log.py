"""Structured logging (structlog) for every service.

JSON lines when stderr is not a TTY or `--log-format json`; a readable console otherwise.
Each line carries the service name and id. Code that works on a request wraps it in
`request_context(request_id)`, and every line logged inside (in this task and the tasks it
creates) carries `request_id`: structlog's contextvars follow asyncio tasks. With tracing
on, a line logged inside a request's trace carries its `trace_id` too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from libs.common import tracing

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR


def setup_logging(level: str = "info", fmt: str = "auto", **static: str) -> None:
    """Configure structlog (and the stdlib logging that libraries use) once per process.

    `static` key/values (service, service_id) are bound to every line.
    """
    numeric = _LEVELS.get(level, logging.INFO)
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        tracing.log_ids,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            _bind(static),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Library loggers (nats, aiohttp) go through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, _bind(static)],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def _bind(static: dict[str, str]):
    def processor(_logger, _name, event_dict):
        for key, value in static.items():
            event_dict.setdefault(key, value)
        return event_dict

    return processor


@contextmanager
def request_context(request_id: str, **extra: str) -> Iterator[None]:
    """Every log line inside carries `request_id` (and `extra`)."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **extra):
        yield


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
