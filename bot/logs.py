"""The log context (delivery, repository, issue) every record carries, and the two log formats.

The context lives in a ``ContextVar``: a ``log_context`` block sets it for the task that enters
it, and asyncio copies it into the tasks that task creates and into the threads it starts with
``asyncio.to_thread`` (which runs its function in ``contextvars.copy_context()``). A
``ContextFilter`` on the handler reads it in the thread that logs and puts the fields on the
record; the JSON format (python-json-logger) writes a record's extra attributes as keys, so
they appear in every line that has them, and a text format may name them (``%(repo)s``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from pythonjsonlogger.json import JsonFormatter

_LOG_CONTEXT: ContextVar[Mapping[str, Any] | None] = ContextVar("dejafix_log_context",
                                                                default=None)
CONTEXT_FIELDS = ("delivery", "repo", "issue")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The JSON line's keys: time (ISO 8601, UTC), level, logger, message, the context fields when
# known, ``exc`` for a traceback, ``stack`` for stack_info.
JSON_FIELDS = "%(levelname)s %(name)s %(message)s"
JSON_RENAMES = {"levelname": "level", "name": "logger", "exc_info": "exc",
                "stack_info": "stack"}


def _merged(fields: Mapping[str, Any]) -> dict[str, Any]:
    base = _LOG_CONTEXT.get()
    current = dict(base) if base else {}
    for k, v in fields.items():
        if v is not None and v != "":
            current[k] = v
    return current


class log_context:
    """Within the block (and the tasks and threads it starts), log records carry these fields
    (delivery, repo, issue); ``bind`` adds more inside it. A class rather than a generator
    context manager: it is entered for every delivery and every job."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _LOG_CONTEXT.set(_merged(self._fields))

    def __exit__(self, *exc: object) -> None:
        _LOG_CONTEXT.reset(self._token)


def bind(**fields: Any) -> None:
    """Add fields to the current log context (inside a ``log_context`` block, which undoes it)."""
    _LOG_CONTEXT.set(_merged(fields))


def current_context() -> Mapping[str, Any]:
    return _LOG_CONTEXT.get() or {}


def issue_number(payload: Mapping[str, Any]) -> int | None:
    """The issue or pull request a payload is about, when it names one."""
    for key in ("issue", "pull_request"):
        item = payload.get(key)
        if isinstance(item, dict):
            number = item.get("number")
            if isinstance(number, int) and not isinstance(number, bool):
                return number
    number = payload.get("number")
    return number if isinstance(number, int) and not isinstance(number, bool) else None


class ContextFilter(logging.Filter):
    """Copies the log context onto each record (as ``delivery``, ``repo``, ``issue``), on the
    handler, so every logger's records get it, read in the thread and task that logged. A field
    the call passed itself (``extra=``) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = current_context()
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name) and name in context:
                setattr(record, name, context[name])
        return True


def text_formatter() -> logging.Formatter:
    return logging.Formatter(TEXT_FORMAT)


def json_formatter() -> JsonFormatter:
    """One JSON object per line. Besides the fixed keys, any attribute a call put on the record
    (``extra=``, the ``ContextFilter``'s fields) becomes a key of its own."""
    return JsonFormatter(JSON_FIELDS, rename_fields=JSON_RENAMES, timestamp="time",
                         json_ensure_ascii=False)


class BadRequestFilter(logging.Filter):
    """aiohttp logs every malformed HTTP request (a bad request line, a bad header) at ERROR
    with a full traceback: on a public port that is noise anyone can send, and it buries real
    errors. Such a record becomes one WARNING line naming the client and what was wrong; any
    other error aiohttp logs is left as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            # The exception's text, cut short: it may quote the bytes the client sent, an
            # operator link's token among them (redacted before the cut, which could leave
            # half a token unmatched).
            reason = " ".join(str(getattr(exc, "message", "") or type(exc).__name__).split())
            record.msg = "bad HTTP request from %s: %s (%d)"
            record.args = (remote, redact_tokens(reason)[:200], getattr(exc, "code", 400))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


_TOKEN_PARAM = re.compile(r"([?&]token=)[^&\s\"]+")


def redact_tokens(text: str) -> str:
    """``text`` with each URL's ``token=`` value shown as ``***``."""
    return _TOKEN_PARAM.sub(r"\1***", text) if "token=" in text else text


class TokenRedactFilter(logging.Filter):
    """An access log line (aiohttp's, where one is enabled) shows a URL's ``token=`` value as
    ``***``: the operator link's token belongs in the start-up line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_tokens(record.msg)
        for name, value in list(vars(record).items()):
            if name not in ("msg", "args") and isinstance(value, str) and "token=" in value:
                setattr(record, name, redact_tokens(value))
        return True


def quiet_bad_requests() -> None:
    """Install ``BadRequestFilter`` on aiohttp's server logger and ``TokenRedactFilter`` on its
    access logger, once per process."""
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadRequestFilter) for f in server.filters):
        server.addFilter(BadRequestFilter())
    access = logging.getLogger("aiohttp.access")
    if not any(isinstance(f, TokenRedactFilter) for f in access.filters):
        access.addFilter(TokenRedactFilter())
