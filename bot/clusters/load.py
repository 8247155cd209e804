"""Load clusters from files: JSON (one record or a list), JSON Lines, markdown reports.

Loading never stops at the first problem. A cluster file is edited by hand or produced by a feed
that may be half-updated; one bad record must not take the other clusters out of the index, and
whoever fixes the file needs every problem with its line, not one per restart.
"""

from __future__ import annotations

import json
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from bot.clusters.markdown import MarkdownReportError, parse_cluster_markdown
from bot.clusters.models import Cluster

__all__ = [
    "SUFFIXES",
    "LoadError",
    "LoadReport",
    "load_clusters",
    "logger",
    "stream_clusters",
    "stream_records",
]

logger = logging.getLogger("dejafix.clusters")

SUFFIXES = frozenset({".json", ".jsonl", ".md"})

_JSON_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class LoadError:
    """One problem in one file. ``level`` is ``warning`` when nothing was lost (a duplicate
    cluster replaced by a later one), ``error`` when a record or a file was skipped."""

    path: str
    line: int
    field: str | None
    message: str
    level: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        if self.level == "warning":
            where += "warning: "
        return where + (f"{self.field}: {self.message}" if self.field else self.message)


@dataclass
class LoadReport:
    clusters: list[Cluster] = field(default_factory=list)
    errors: list[LoadError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was skipped; warnings alone do not count."""
        return not any(error.level == "error" for error in self.errors)

    def log_errors(self, log: logging.Logger | None = None) -> int:
        """Log one warning per entry (to ``dejafix.clusters`` by default); returns how many."""
        target = log or logger
        for error in self.errors:
            target.warning("cluster load: %s", error)
        return len(self.errors)


class _Problem(Exception):
    """A problem that makes the whole file unusable (unreadable, not JSON at all)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _Problem(1, exc.strerror or str(exc)) from None
    try:
        # utf-8-sig: files saved by some Windows editors start with a BOM.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise _Problem(line, f"not valid UTF-8: {exc.reason}") from None


def _skip_space(text: str, index: int) -> int:
    found = _JSON_SPACE.match(text, index)
    return found.end() if found else index


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _json_records(text: str) -> Iterator[tuple[int, Any]]:
    """The records of a .json file with the line each starts on."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Problem(exc.lineno, f"invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise _Problem(1, "invalid JSON: nested too deeply") from None
    start = _skip_space(text, 0)
    if isinstance(data, dict):
        yield _line_of(text, start), data
        return
    if not isinstance(data, list):
        raise _Problem(
            _line_of(text, start),
            f"expected a cluster object or a list of them, got {type(data).__name__}",
        )
    # Walk the list once more with raw_decode, only to learn where each element starts; the
    # text already parsed, so this cannot fail.
    decoder = json.JSONDecoder()
    index = start + 1
    line, counted_to = 1, 0
    for element in data:
        index = _skip_space(text, index)
        line += text.count("\n", counted_to, index)
        counted_to = index
        yield line, element
        _, index = decoder.raw_decode(text, index)
        index = _skip_space(text, index)
        if index < len(text) and text[index] == ",":
            index += 1


def _jsonl_lines(file: Path, path: str, report: LoadReport) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a .jsonl file, read one at a time (a feed of 100,000 clusters is
    never held whole). Only \n ends a record: U+2028, U+0085 and the like, which JSON allows
    unescaped inside strings, do not; a line that is not UTF-8 is reported and skipped."""
    try:
        fh = open(file, "rb")  # noqa: SIM115 - closed below; OSError must become a _Problem
    except OSError as exc:
        raise _Problem(1, exc.strerror or str(exc)) from None
    with fh:
        for number, raw in enumerate(fh, start=1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a BOM from some Windows editors
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                report.errors.append(LoadError(path, number, None,
                                               f"not valid UTF-8: {exc.reason}"))
                continue
            if text.strip():
                yield number, raw


def _chunks(items: Iterator[tuple[int, bytes]], size: int
            ) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _json_line(raw: bytes, path: str, number: int, report: LoadReport) -> Any:
    """One JSONL record parsed, or None with the problem reported."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        report.errors.append(
            LoadError(path, number, None, f"invalid JSON at column {exc.colno}: {exc.msg}")
        )
    except RecursionError:
        report.errors.append(LoadError(path, number, None, "invalid JSON: nested too deeply"))
    return None


def _validation_errors(path: str, line: int, exc: ValidationError) -> list[LoadError]:
    return [
        LoadError(path, line, ".".join(str(part) for part in error["loc"]) or None, error["msg"])
        for error in exc.errors()
    ]


# What the loader hands on for each valid cluster: ``prepare(cluster, json_or_None)``. The
# index build prepares clusters into the compact form it keeps, possibly in worker processes
# (then ``prepare`` must be a module-level function, or a partial of one).
Prepare = Callable[[Cluster, bytes | None], Any]
Sink = Callable[[Any], None]
# How many JSON Lines records a worker validates per task, and how many tasks per worker may be
# in flight: enough to keep the workers busy, few enough that the file is never all in memory.
_CHUNK_LINES = 512
_AHEAD = 3


def _keep_cluster(cluster: Cluster, raw: bytes | None) -> Cluster:
    return cluster


@dataclass
class _Valid:
    key: tuple[str, str]
    label: str  # repo#id as written, for messages
    item: Any


def _validate_line(raw: bytes, path: str, line: int, errors: list[LoadError],
                   prepare: Prepare) -> _Valid | None:
    # Straight from the bytes (several times faster than parsing, then validating); a record
    # that fails is parsed again the slow way, for the messages the report gives.
    record_json: bytes | None = raw
    try:
        cluster = Cluster.model_validate_json(raw)
    except ValidationError:
        report = LoadReport()
        record = _json_line(raw, path, line, report)
        if record is not None:
            try:
                cluster = Cluster.model_validate(record)
            except ValidationError as exc:
                report.errors.extend(_validation_errors(path, line, exc))
        errors.extend(report.errors)
        if report.errors:
            return None
        record_json = None  # valid only the slow way: its own JSON is not the record's
    return _Valid(cluster.key, f"{cluster.repo}#{cluster.public_id}",
                  prepare(cluster, record_json))


def _validate_chunk(path: str, chunk: list[tuple[int, bytes]], prepare: Prepare
                    ) -> list[tuple[int, _Valid | None, list[LoadError]]]:
    """A worker's share of a JSON Lines file."""
    out = []
    for line, raw in chunk:
        errors: list[LoadError] = []
        out.append((line, _validate_line(raw, path, line, errors, prepare), errors))
    return out


class _Loader:
    """Validates records and hands each valid cluster on to ``sink``, prepared (a later
    cluster with the same key replaces the earlier one: the sink must do so)."""

    def __init__(self, sink: Sink, prepare: Prepare = _keep_cluster,
                 pool: Executor | None = None) -> None:
        self.report = LoadReport()
        self.sink = sink
        self.prepare = prepare
        self.pool = pool
        self.where: dict[tuple[str, str], tuple[str, int]] = {}

    def add(self, valid: _Valid, path: str, line: int) -> None:
        earlier = self.where.get(valid.key)
        if earlier is not None:
            earlier_path, earlier_line = earlier
            self.report.errors.append(
                LoadError(
                    path,
                    line,
                    None,
                    f"cluster {valid.label} also defined at "
                    f"{earlier_path}:{earlier_line}; this later one is used",
                    level="warning",
                )
            )
        self.where[valid.key] = (path, line)
        self.sink(valid.item)

    def validate(self, record: Any, path: str, line: int) -> None:
        try:
            cluster = Cluster.model_validate(record)
        except ValidationError as exc:
            self.report.errors.extend(_validation_errors(path, line, exc))
            return
        self.add(_Valid(cluster.key, f"{cluster.repo}#{cluster.public_id}",
                        self.prepare(cluster, None)), path, line)

    def load_jsonl(self, file: Path, path: str) -> None:
        self.load_lines(_jsonl_lines(file, path, self.report), path)

    def load_lines(self, lines: Iterator[tuple[int, bytes]], path: str) -> None:
        if self.pool is None:
            for line, raw in lines:
                valid = _validate_line(raw, path, line, self.report.errors, self.prepare)
                if valid is not None:
                    self.add(valid, path, line)
            return
        # In order, with a bounded number of chunks in flight.
        pending: deque[Future[list[tuple[int, _Valid | None, list[LoadError]]]]] = deque()
        window = _AHEAD * getattr(self.pool, "_max_workers", 2)
        chunks = _chunks(lines, _CHUNK_LINES)
        for chunk in chunks:
            pending.append(self.pool.submit(_validate_chunk, path, chunk, self.prepare))
            if len(pending) >= window:
                self._drain(pending.popleft(), path)
        while pending:
            self._drain(pending.popleft(), path)

    def _drain(self, future: Future[list[tuple[int, _Valid | None, list[LoadError]]]],
               path: str) -> None:
        for line, valid, errors in future.result():
            self.report.errors.extend(errors)
            if valid is not None:
                self.add(valid, path, line)

    def load_file(self, file: Path) -> None:
        path = str(file)
        suffix = file.suffix.lower()
        try:
            if suffix == ".jsonl":
                self.load_jsonl(file, path)
                return
            text = _read_text(file)
            if suffix == ".md":
                self._markdown(text, path)
            else:
                for line, record in _json_records(text):
                    self.validate(record, path, line)
        except _Problem as problem:
            self.report.errors.append(LoadError(path, problem.line, None, problem.message))

    def _markdown(self, text: str, path: str) -> None:
        try:
            cluster = parse_cluster_markdown(text, path)
        except MarkdownReportError as exc:
            self.report.errors.extend(
                LoadError(path, p.line, p.field, p.message) for p in exc.problems
            )
            return
        self.add(_Valid(cluster.key, f"{cluster.repo}#{cluster.public_id}",
                        self.prepare(cluster, None)), path, 1)

    def load_path(self, given: Path) -> None:
        if given.is_dir():
            try:
                entries = sorted(given.iterdir())
            except OSError as exc:
                self.report.errors.append(LoadError(str(given), 1, None, exc.strerror or str(exc)))
                return
            for entry in entries:
                # Dot-files are editor swap and lock files, not clusters.
                if entry.name.startswith(".") or entry.suffix.lower() not in SUFFIXES:
                    continue
                if entry.is_file():
                    self.load_file(entry)
        elif not given.exists():
            self.report.errors.append(LoadError(str(given), 1, None, "no such file or directory"))
        elif given.suffix.lower() not in SUFFIXES:
            # Named explicitly, so skipping it silently would hide a typo in the config.
            self.report.errors.append(
                LoadError(
                    str(given),
                    1,
                    None,
                    f"unknown cluster file type {given.suffix or '(none)'!r}: "
                    "expected .json, .jsonl or .md",
                )
            )
        else:
            self.load_file(given)


def load_clusters(paths: Iterable[str | Path]) -> LoadReport:
    """Load every cluster under ``paths`` (files, or directories read non-recursively for
    ``*.json``, ``*.jsonl`` and ``*.md``, in name order). Problems are collected in the report's
    ``errors``, never raised; a cluster defined twice keeps the later definition."""
    by_key: dict[tuple[str, str], Cluster] = {}

    def keep(cluster: Cluster) -> None:
        by_key[cluster.key] = cluster

    report = stream_clusters(paths, keep)
    report.clusters = list(by_key.values())
    return report


def stream_clusters(paths: Iterable[str | Path], sink: Sink, *,
                    prepare: Prepare = _keep_cluster, pool: Executor | None = None
                    ) -> LoadReport:
    """Like ``load_clusters``, but each cluster goes to ``sink(prepare(cluster, json))`` as it
    is validated (``json`` is its record's bytes when the file gave them, else None), and none
    is kept: what an index build of 100,000 clusters needs. With ``pool``, JSON Lines records
    are validated and prepared in its workers, and still reach ``sink`` in file order. A
    cluster defined again is passed again (with a warning in the report); the later one must
    win."""
    if isinstance(paths, str | Path):
        # A lone string is an Iterable[str] too, and would be read one character at a time.
        paths = [paths]
    loader = _Loader(sink, prepare, pool)
    for given in paths:
        loader.load_path(Path(given))
    return loader.report


def stream_records(records: Iterable[str | bytes], source: str, sink: Sink, *,
                   prepare: Prepare = _keep_cluster, pool: Executor | None = None
                   ) -> LoadReport:
    """``stream_clusters`` for records that are not in a file (the learned clusters in the
    store): each is JSON; ``source`` names them in the report, with the record's position."""
    loader = _Loader(sink, prepare, pool)
    numbered = ((n, r.encode("utf-8", "surrogatepass") if isinstance(r, str) else r)
                for n, r in enumerate(records, start=1))
    loader.load_lines(numbered, source)
    return loader.report


def validate_line(raw: bytes, source: str, line: int) -> tuple[Cluster | None, list[LoadError]]:
    """One JSON Lines record: the cluster, or None with its problems (``source:line: field:
    message``), as a cluster file's loader reports them."""
    errors: list[LoadError] = []
    valid = _validate_line(raw, source, line, errors, _keep_cluster)
    return (valid.item if valid is not None else None), errors
