"""Observability without another dependency: Prometheus metrics written in the text exposition
format (version 0.0.4) by hand, and the log context (delivery, repository, issue) that the JSON
log format adds to every line.

One ``Metrics`` per application (``create_app`` makes it), so test apps share nothing. Label
values are always bounded words (event names from a fixed list, outcome words, HTTP status
classes), never repository names or text from a payload, so the series count stays small.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

# GitHub webhook events a label may name; any other X-GitHub-Event header (it is sender-chosen
# until the signature is checked) is counted as "other".
KNOWN_EVENTS = frozenset({
    "check_run", "check_suite", "create", "delete", "installation",
    "installation_repositories", "installation_target", "issue_comment", "issues", "label",
    "meta", "ping", "pull_request", "pull_request_review", "pull_request_review_comment",
    "pull_request_review_thread", "push", "release", "repository", "status", "workflow_job",
    "workflow_run",
})

RECEIVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0)
JOB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 150.0)


def event_label(event: str | None) -> str:
    return event if event in KNOWN_EVENTS else "other"


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        # Counters, gauges and histograms are touched from the event loop and from threads
        # (asyncio.to_thread); one lock per metric keeps each update whole.
        self._lock = threading.Lock()

    def _key(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        # The hot path (every delivery and every job) names the labels in declaration order:
        # one tuple comparison instead of two sets.
        if tuple(labels) == self.labelnames:
            return tuple([str(v) for v in labels.values()])
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {list(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [*self.header(),
                *(f"{self.name}{_labels(self.labelnames, k)} {_number(v)}" for k, v in items)]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def render(self) -> list[str]:
        with self._lock:
            value = self._value
        return [*self.header(), f"{self.name} {_number(value)}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or len(set(bounds)) != len(bounds) or math.isinf(bounds[-1]):
            raise ValueError(f"{name}: buckets must be distinct and finite")
        self.buckets = (*bounds, math.inf)
        # Per label set: a count per bucket (not cumulative), the sum, the count.
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        if not labelnames:
            self._series[()] = ([0] * len(self.buckets), [0.0])

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        # The first bucket whose bound is >= value (the last is +inf, so there always is one).
        slot = bisect_left(self.buckets, value)
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
            counts[slot] += 1
            total[0] += value

    def render(self) -> list[str]:
        with self._lock:
            series = sorted((k, (list(c), t[0])) for k, (c, t) in self._series.items())
        lines = self.header()
        for key, (counts, total) in series:
            running = 0
            for bound, count in zip(self.buckets, counts, strict=True):
                running += count
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {running}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_number(total)}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {running}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> Any:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        metric: Counter = self._add(Counter(name, help, labelnames))
        return metric

    def gauge(self, name: str, help: str) -> Gauge:
        metric: Gauge = self._add(Gauge(name, help))
        return metric

    def histogram(self, name: str, help: str, buckets: Sequence[float],
                  labelnames: Sequence[str] = ()) -> Histogram:
        metric: Histogram = self._add(Histogram(name, help, buckets, labelnames))
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Dejafix's metrics, in one registry per application."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.deliveries = r.counter(
            "dejafix_deliveries_total",
            "Webhook deliveries received, by event and what the receiver did (queued, "
            "duplicate, ignored, ping, unauthorized, bad_request, too_large, "
            "unsupported_media_type, error: not recorded, answered 503).", ("event", "outcome"))
        self.jobs = r.counter(
            "dejafix_jobs_total",
            "Queued deliveries processed by the worker: done, retried (failed, run again "
            "later) or failed (given up).", ("event", "outcome"))
        self.matches = r.counter(
            "dejafix_matches_total",
            "Issues answered by the known-fix handler, by outcome (commented, edited, "
            "unchanged, labelled, silent, skipped).", ("outcome",))
        self.regressions = r.counter(
            "dejafix_regressions_total",
            "Matches that were possible regressions of their fix (never answered 'already "
            "fixed'), by kind (caused_by_fix, version_contains_fix) and by what was done "
            "(labelled, commented, edited, unchanged, silent, skipped).", ("kind", "action"))
        self.comments = r.counter(
            "dejafix_comments_total",
            "Suggestion comments written on GitHub (created or edited).", ("action",))
        self.dismissals = r.counter(
            "dejafix_dismissals_total", "Suggestions dismissed with /dejafix not-this.")
        self.github_errors = r.counter(
            "dejafix_github_errors_total",
            "GitHub API calls that failed (each attempt), by HTTP status class, or transport "
            "for connection errors and timeouts. Includes expected 404s (a missing config "
            "file).", ("status",))
        self.github_retries = r.counter(
            "dejafix_github_retries_total",
            "GitHub API calls sent again within a job, by reason.", ("reason",))
        self.queue_depth = r.gauge(
            "dejafix_queue_depth", "Deliveries queued or running (read at scrape time).")
        self.failed_jobs = r.gauge(
            "dejafix_failed_jobs", "Deliveries given up on, kept for inspection.")
        self.clusters = r.gauge("dejafix_clusters_loaded", "Clusters in the index in use.")
        self.receiver_seconds = r.histogram(
            "dejafix_webhook_duration_seconds",
            "Time the receiver took to answer a delivery.", RECEIVER_BUCKETS)
        self.job_seconds = r.histogram(
            "dejafix_job_duration_seconds",
            "Time the worker took to process one delivery (one attempt).", JOB_BUCKETS)

    def render(self) -> str:
        return self.registry.render()


# The application's metrics while a job runs, for the handlers, which see only their Context:
# set by the worker around each job, so two apps in one process (tests) never mix counts.
_METRICS: ContextVar[Metrics | None] = ContextVar("dejafix_metrics", default=None)


def current_metrics() -> Metrics | None:
    return _METRICS.get()


@contextmanager
def metrics_scope(metrics: Metrics) -> Iterator[None]:
    token = _METRICS.set(metrics)
    try:
        yield
    finally:
        _METRICS.reset(token)


# -- log context ---------------------------------------------------------------------------

_LOG_CONTEXT: ContextVar[Mapping[str, Any] | None] = ContextVar("dejafix_log_context",
                                                                default=None)
CONTEXT_FIELDS = ("delivery", "repo", "issue")


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
    handler, so every logger's records get it, read in the thread and task that logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = current_context()
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name) and name in context:
                setattr(record, name, context[name])
        return True


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, the same lines as ``logging.Formatter(TEXT_FORMAT)`` writes, for less:
    the receiver logs a line for every delivery. The format is built with an f-string and the
    time's seconds part is formatted once per second, not per record; a record with a
    traceback or stack goes the standard way."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        # (whole second, its text): one attribute, so that a thread reads a matching pair.
        self._cached: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None or self.datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached_second, text = self._cached
        if second != cached_second:
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._cached = (second, text)
        # logging.Formatter.default_msec_format, "%s,%03d": the milliseconds truncated.
        return f"{text},{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        return f"{record.asctime} {record.levelname} {record.name}: {record.message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the context fields when known,
    and the traceback as ``exc`` when there is one."""

    def __init__(self) -> None:
        super().__init__()
        # (whole second, its ISO text up to the seconds): one attribute, read as a pair.
        self._cached: tuple[int, str] = (-1, "")

    def _time(self, created: float) -> str:
        """``datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")``, with
        the date and time of day formatted once a second (every line has one)."""
        if created < 0:
            return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
        # datetime's own rounding: to the microsecond, half to even, then milliseconds cut.
        frac, whole = math.modf(created)
        micros = round(frac * 1e6)
        if micros >= 1_000_000:
            whole += 1
            micros -= 1_000_000
        second = int(whole)
        cached_second, text = self._cached
        if second != cached_second:
            text = datetime.fromtimestamp(second, UTC).isoformat()[:-6]  # without "+00:00"
            self._cached = (second, text)
        return f"{text}.{micros // 1000:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = current_context()
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, context.get(name))
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)
