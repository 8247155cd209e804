"""Load clusters from files: JSON (one record or a list), JSON Lines, markdown reports.

Loading never stops at the first problem. A cluster file is edited by hand or produced by a feed
that may be half-updated; one bad record must not take the other clusters out of the index, and
whoever fixes the file needs every problem with its line, not one per restart.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from bot.clusters.markdown import MarkdownReportError, parse_cluster_markdown
from bot.clusters.models import Cluster

__all__ = ["SUFFIXES", "LoadError", "LoadReport", "load_clusters", "logger", "stream_clusters"]

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
        where = f"{self.path}:{self.line}: "
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


Sink = Callable[[Cluster, bytes | None], None]


class _Loader:
    """Validates records and hands each cluster to ``sink`` with its JSON when it has it (a
    later cluster with the same key replaces the earlier one: the sink must do so)."""

    def __init__(self, sink: Sink) -> None:
        self.report = LoadReport()
        self.sink = sink
        self.where: dict[tuple[str, str], tuple[str, int]] = {}

    def add(self, cluster: Cluster, path: str, line: int, raw: bytes | None = None) -> None:
        earlier = self.where.get(cluster.key)
        if earlier is not None:
            earlier_path, earlier_line = earlier
            self.report.errors.append(
                LoadError(
                    path,
                    line,
                    None,
                    f"cluster {cluster.repo}#{cluster.public_id} also defined at "
                    f"{earlier_path}:{earlier_line}; this later one is used",
                    level="warning",
                )
            )
        self.where[cluster.key] = (path, line)
        self.sink(cluster, raw)

    def validate(self, record: Any, path: str, line: int) -> None:
        try:
            cluster = Cluster.model_validate(record)
        except ValidationError as exc:
            self.report.errors.extend(_validation_errors(path, line, exc))
            return
        self.add(cluster, path, line)

    def validate_line(self, raw: bytes, path: str, line: int) -> None:
        # Straight from the bytes (several times faster than parsing, then validating); a
        # record that fails is parsed again the slow way, for the messages the report gives.
        try:
            cluster = Cluster.model_validate_json(raw)
        except ValidationError:
            record = _json_line(raw, path, line, self.report)
            if record is not None:
                self.validate(record, path, line)
            return
        self.add(cluster, path, line, raw)

    def load_file(self, file: Path) -> None:
        path = str(file)
        suffix = file.suffix.lower()
        try:
            if suffix == ".jsonl":
                for line, raw in _jsonl_lines(file, path, self.report):
                    self.validate_line(raw, path, line)
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
        self.add(cluster, path, 1)

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

    def keep(cluster: Cluster, raw: bytes | None) -> None:
        by_key[cluster.key] = cluster

    report = stream_clusters(paths, keep)
    report.clusters = list(by_key.values())
    return report


def stream_clusters(paths: Iterable[str | Path], sink: Sink) -> LoadReport:
    """Like ``load_clusters``, but each cluster goes to ``sink(cluster, json_or_None)`` as it is
    validated, and none is kept: what an index build of 100,000 clusters needs. A cluster
    defined again is passed again (with a warning in the report); the later one must win."""
    if isinstance(paths, str | Path):
        # A lone string is an Iterable[str] too, and would be read one character at a time.
        paths = [paths]
    loader = _Loader(sink)
    for given in paths:
        loader.load_path(Path(given))
    return loader.report
