"""The backfill's progress on the command line: a bar per phase (rich) on a terminal, a plain
line every few pages otherwise (a log file, CI, a pipe), both drawn from the run's
``BackfillProgress`` and nothing else."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from bot.features.backfill import BackfillProgress

# What each phase counts, as the bar and the lines name it.
_READS = {"pulls": "pull requests", "duplicates": "closed issues", "diffs": "fixes' diffs"}
# A plain line every this many pages (100 PRs or issues a page, 32 fixes a batch).
PLAIN_EVERY = 10


def clock_time(epoch: float) -> str:
    return time.strftime("%H:%M", time.localtime(epoch))


def status(progress: BackfillProgress, now: float) -> str:
    """Clusters, calls and the time left (or the wait), the same words on a bar and a line."""
    parts = [f"{progress.clusters} clusters", f"{progress.calls} calls"]
    if progress.waiting_until is not None:
        parts.append(f"waiting for the rate limit until {clock_time(progress.waiting_until)}")
    else:
        left = progress.seconds_left(now)
        if left:
            parts.append(f"~{left / 60:.1f} min left" if left >= 60
                         else f"~{max(1, round(left))} s left")
    return ", ".join(parts)


def line(progress: BackfillProgress, now: float) -> str:
    done, total = progress.done_and_total()
    if progress.phase == "done":
        return (f"{progress.repo}: done: {progress.clusters} clusters, {progress.calls} calls, "
                f"{(now - progress.started_at) / 60:.1f} min")
    of = f"/{total}" if total is not None else ""
    return f"{progress.repo}: {_READS[progress.phase]} {done}{of} read, {status(progress, now)}"


class BackfillView:
    """Called with the run's progress whenever it changes. On a terminal it keeps a bar per
    phase; elsewhere it writes a line after the first page, when a phase starts, every
    ``every`` pages, when a wait starts, when every cluster is learned and at the end."""

    def __init__(self, stream: TextIO, *, every: int = PLAIN_EVERY,
                 clock: Callable[[], float] = time.time) -> None:
        self.stream = stream
        self.every = max(1, every)
        self.clock = clock
        self.tty = stream.isatty()
        self._bars: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._phase: str | None = None
        self._pages_at_line = 0
        self._waiting: float | None = None
        self._said = 0
        if self.tty:
            self._bars = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                                  MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                                  console=Console(file=stream), transient=False)

    def __enter__(self) -> BackfillView:
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bars is not None:
            self._bars.stop()

    def __call__(self, progress: BackfillProgress) -> None:
        now = self.clock()
        if self._bars is not None:
            self._draw(self._bars, progress, now)
        else:
            self._write(progress, now)

    def _draw(self, bars: Progress, progress: BackfillProgress, now: float) -> None:
        if progress.phase == "done":
            for task in self._tasks.values():
                bars.update(task, status=status(progress, now), refresh=True)
            return
        done, total = progress.done_and_total()
        if progress.phase not in self._tasks:
            self._tasks[progress.phase] = bars.add_task(
                f"{progress.repo} {_READS[progress.phase]}", total=total, status="")
        # Drawn now, not at the next tick: a wait or a phase's end stays on screen as it is.
        bars.update(self._tasks[progress.phase], completed=done, total=total,
                    status=status(progress, now), refresh=True)

    def _write(self, progress: BackfillProgress, now: float) -> None:
        say: list[str] = []
        if self._phase is None and not progress.calls and not progress.pages:
            # Nothing done yet: a run that cannot reach GitHub says only why, in one line.
            self._phase = progress.phase
        elif progress.phase != self._phase:
            if progress.phase in ("diffs", "done") and progress.clusters_at is not None and \
                    self._phase in ("pulls", "duplicates"):
                say.append(f"{progress.repo}: every cluster learned: {progress.clusters} "
                           f"clusters, {progress.calls_to_clusters} calls, "
                           f"{(progress.clusters_at - progress.started_at) / 60:.1f} min")
            self._phase = progress.phase
            self._pages_at_line = progress.pages
            say.append(line(progress, now))
        elif progress.waiting_until is not None and progress.waiting_until != self._waiting:
            say.append(line(progress, now))
        elif progress.pages - self._pages_at_line >= self.every:
            self._pages_at_line = progress.pages
            say.append(line(progress, now))
        elif progress.pages and not self._said:
            say.append(line(progress, now))
        self._waiting = progress.waiting_until
        self._said += len(say)
        for text in say:
            self.stream.write(text + "\n")
        if say:
            self.stream.flush()
