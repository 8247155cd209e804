"""Builds of the cluster index: the arrays of curated and learned clusters (``build_arrays``),
built here or in a separate process that writes them under an index directory, and saved builds
mapped again instead of rebuilt (``load_or_build``).

Both the curated index (``index.IndexHolder``) and the per-repository indexes of learned
clusters (``repo_indexes.RepoIndexes``) build through here; this module imports neither of them.
(``build.IndexBuilder`` is one repository's arrays from its clusters; this module decides which
clusters go in, where the build runs, and whether an earlier one can be reused.)

A build process is spawned, writes its arrays, and exits: the event loop never competes with it
for the GIL, and its transient memory goes back to the system when it ends. A saved build is
keyed by a version string that names its inputs and the code (``code_version``), so a restart
with unchanged inputs and code maps it instead of building again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Generic, TypeVar, cast

from bot.clusters.load import LoadReport, stream_clusters, stream_records
from bot.clusters.models import Cluster
from bot.matching.arrays import FORMAT, IndexArrays
from bot.matching.build import Extract, IndexBuilder, extract

log = logging.getLogger("dejafix.index")

# Inputs above this many bytes (cluster files, plus about 2 kB per learned cluster) are built in
# a separate process; below it a thread is quicker than starting one (~1 s).
PROCESS_BUILD_BYTES = 8 << 20
# Above this, the build process shares the per-cluster work out to worker processes (starting
# them costs about a second; 32 MB is some 18,000 clusters, several seconds of work).
PARALLEL_BUILD_BYTES = 32 << 20
LEARNED_RECORD_BYTES = 2048
_BUILD_NICENESS = 10
_MANIFEST = "manifest.json"

T = TypeVar("T")


# --- what goes in ---------------------------------------------------------------------------------


class _Curated:
    """The file and feed clusters, as far as learned clusters are judged against them: a learned
    cluster whose issues a given cluster already names is left out (the curated record wins), as
    is one whose id a given cluster of the same repository already uses, unless its fix was
    reverted or the repository closed another report as its duplicate."""

    def __init__(self) -> None:
        self._issues: dict[tuple[str, str], tuple[int, ...]] = {}
        self._sizes: dict[tuple[str, str], int] = {}
        self._named: set[tuple[str, int]] | None = None

    def note(self, key: tuple[str, str], issues: tuple[int, ...], size: int) -> None:
        self._issues[key] = issues
        self._sizes[key] = size
        self._named = None

    def admit(self, key: tuple[str, str], issues: tuple[int, ...], size: int,
              reverted: bool) -> bool:
        given = self._sizes.get(key)
        if given is not None:
            return reverted or size > given
        if self._named is None:
            self._named = {(k[0], n) for k, numbers in self._issues.items() for n in numbers}
        return not any((key[0], n) in self._named for n in issues)


class Builders:
    """One ``IndexBuilder`` per repository; clusters arrive one at a time and none is kept."""

    def __init__(self) -> None:
        self._builders: dict[str, IndexBuilder] = {}

    def insert(self, ex: Extract) -> None:
        repo = ex.key[0]
        builder = self._builders.get(repo)
        if builder is None:
            builder = self._builders[repo] = IndexBuilder()
        builder.insert(ex)

    def add(self, cluster: Cluster, raw: bytes | None = None) -> None:
        self.insert(extract(cluster, raw))

    def finish(self) -> dict[str, IndexArrays]:
        return {repo: b.finish() for repo, b in self._builders.items()}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    # A build allocates millions of small objects that all survive: with the collector on, its
    # full passes walk every one of them again and again, and each holds the GIL throughout.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_arrays(paths: list[Path], learned: Iterable[Cluster | str], *,
                 workers: int = 0, given: Iterable[str | bytes] = (),
                 given_source: str = "curated clusters"
                 ) -> tuple[dict[str, IndexArrays], LoadReport]:
    """The index of every cluster file under ``paths`` (and of ``given`` curated records, the
    JSON of clusters read from such files before) and of the learned clusters (validated
    objects, or JSON records from the store) they leave room for, per repository, with the
    loader's report. This is where learned clusters are merged with the curated ones
    (``_Curated``: the curated record wins).
    ``workers`` > 1 validates and extracts JSON Lines records and learned records in that
    many processes (each cluster's work is independent; putting it into the index is not)."""
    builders = Builders()
    curated = _Curated()
    prepare = extract

    def from_file(ex: Extract) -> None:
        curated.note(ex.key, ex.issues, len(ex.members))
        builders.insert(ex)

    def from_store(ex: Extract) -> None:
        if curated.admit(ex.key, ex.issues, len(ex.members), ex.reverted):
            builders.insert(ex)

    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn")) \
        if workers > 1 else None
    try:
        with collector_paused():
            report = stream_clusters(paths, from_file, prepare=prepare, pool=pool)
            report.errors.extend(stream_records(given, given_source, from_file,
                                                prepare=prepare, pool=pool).errors)

            def records() -> Iterator[str]:
                for item in learned:
                    if isinstance(item, Cluster):  # validated already: no JSON round trip
                        from_store(prepare(item, None))
                    else:
                        yield item

            stored = stream_records(records(), "learned clusters", from_store,
                                    prepare=prepare, pool=pool)
            report.errors.extend(stored.errors)
            return builders.finish(), report
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def build_workers() -> int:
    """Processes a build process validates and extracts clusters in: one per core it may use,
    up to four (beyond that, putting the clusters into the index is the bottleneck)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:  # a container's CPU quota (cgroup v2), which the affinity mask does not show
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return min(4, cores)


# --- which code wrote it --------------------------------------------------------------------------

# The packages, under ``bot/``, whose modules shape a saved index's arrays (the tokeniser and
# text cleaning, evidence and facet extraction, the array layout, the cluster model and loaders,
# the merge rules above) or read them back (``arrays``, ``scoring``). Every module of both is
# hashed, not a hand-kept list: one missed would let an upgrade map arrays it no longer writes.
# The fitted ``model.json`` is left out on purpose: it holds the ranker's weights, read when
# ranking, and no array is computed from them, so new weights apply to a saved index as they
# are.
CODE_PACKAGES = ("matching", "clusters")


def code_sources(package: Path = Path(__file__).parents[1]) -> list[Path]:
    """The modules ``code_version`` hashes. Fails when a package has none: the folders moved,
    and a version that hashed nothing would never change."""
    sources: list[Path] = []
    for name in CODE_PACKAGES:
        found = sorted((package / name).glob("*.py"))
        if not found:
            raise RuntimeError(f"no modules in {package / name}: code_version() would not see "
                               "the code that shapes a saved index")
        sources.extend(found)
    return sources


@cache
def code_version() -> str:
    """Changes whenever the code that shapes an index does (matching, the cluster model and
    loaders, the merge rules, numpy and pydantic): a saved index is only reused by the code that
    wrote it."""
    import numpy
    import pydantic

    digest = hashlib.sha256(f"format {FORMAT} {numpy.__version__} {pydantic.VERSION}".encode())
    package = Path(__file__).parents[1]
    for source in code_sources(package):
        # The path within the package, so a module moving between packages counts as a change.
        digest.update(source.relative_to(package).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


# The last part of a saved build's version string: one kind of index now, the name kept so that
# the version strings keep their layout.
INDEX_KIND = "lexical"


# --- saved builds ---------------------------------------------------------------------------------


@dataclass
class SavedBuild:
    """What a build process wrote: a directory per repository, under ``directory``."""

    directory: Path
    version: str
    repos: dict[str, str] = field(default_factory=dict)  # repository -> subdirectory
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_kb: int = 0
    workers: int = 0
    worker_peak_rss_kb: int = 0  # the largest of the workers'

    def manifest(self) -> str:
        return json.dumps({"version": self.version, "repos": self.repos,
                           "errors": self.errors, "seconds": self.seconds})

    @classmethod
    def read(cls, directory: Path) -> SavedBuild:
        data = json.loads((directory / _MANIFEST).read_text(encoding="utf-8"))
        return cls(directory=directory, version=str(data["version"]),
                   repos=dict(data["repos"]), errors=list(data.get("errors", [])),
                   seconds=float(data.get("seconds", 0.0)))

    def arrays(self) -> dict[str, IndexArrays]:
        """Every repository's arrays, memory-mapped from the files."""
        return {repo: IndexArrays.load(self.directory / sub) for repo, sub in self.repos.items()}


class IndexDir:
    """Where builds write their arrays: the directory given, or without one a temporary
    directory, made when first needed and removed with this object (or at exit at the latest).
    Called, it returns the directory, created if missing."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __call__(self) -> Path:
        if self.path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dejafix-index-")
            self.path = Path(self._tmp.name)
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path


def _learned_from_file(path: Path | None) -> Iterator[str]:
    """The learned records the serving process wrote for a build process, one per line."""
    if path is None:
        return
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield line


def write_learned(records: Callable[[], Iterable[str]], path: Path) -> Path:
    """Learned records into the file a build process reads them from, one per line."""
    # Opened and closed in this thread, also on an error: a store's stream holds a connection.
    stream = records()
    try:
        with path.open("w", encoding="utf-8") as fh:
            for record in stream:
                fh.write(record.replace("\n", " ") + "\n")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return path


def build_to_disk(paths: list[Path], learned_file: Path | None, version: str, out: Path,
                  workers: int = 0) -> SavedBuild:
    """Build the index and write it under ``out`` (a new directory). Runs in a build process:
    nothing here touches the serving process's state."""
    started = time.perf_counter()
    # Background work: on a machine with as many busy processes as cores, the serving process
    # must still get the CPU the moment a delivery or a timer wakes it (its workers inherit).
    with contextlib.suppress(OSError):
        os.nice(_BUILD_NICENESS)
    arrays, report = build_arrays(paths, _learned_from_file(learned_file), workers=workers)
    build = SavedBuild(directory=out, version=version,
                       errors=[str(e) for e in report.errors])
    # A directory of its own, renamed into place when complete: a build killed half-way
    # leaves only a ".build-" directory, which the next successful build removes.
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    for n, (repo, repo_arrays) in enumerate(sorted(arrays.items())):
        sub = f"{n:04d}-{re.sub(r'[^a-z0-9._-]+', '_', repo)[:60]}"
        repo_arrays.save(tmp / sub)
        build.repos[repo] = sub
    del arrays
    build.seconds = time.perf_counter() - started
    (tmp / _MANIFEST).write_text(build.manifest(), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    import resource

    build.peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    build.workers = workers if workers > 1 else 0
    build.worker_peak_rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return build


def _version_dir(root: Path, version: str) -> Path:
    return root / ("v-" + hashlib.sha256(version.encode()).hexdigest()[:20])


async def build_in_process(paths: list[Path], learned_file: Path | None, version: str,
                           root: Path, workers: int = 0) -> SavedBuild:
    """``build_to_disk`` in a fresh process (spawned: the serving process has threads, which a
    fork would copy mid-state), which exits when done and takes its memory with it. Cancelled
    (the bot stopping), the process is terminated rather than waited for."""
    out = _version_dir(root, version)
    if out.exists():  # the same inputs built before (by another run): start clean
        await asyncio.to_thread(shutil.rmtree, out, True)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    # Not a daemon: it starts worker processes of its own, which daemons may not.
    process = ctx.Process(target=_build_child, name="dejafix-index-build",
                          args=(writer, paths, learned_file, version, out, workers))
    receiving: asyncio.Future[SavedBuild | str] | None = None
    try:
        # Starting a process takes a few ms of fork and pipe work: not on the loop.
        await asyncio.to_thread(process.start)
        writer.close()
        receiving = asyncio.ensure_future(asyncio.to_thread(_receive, reader, process))
        # Shielded: cancelled, this coroutine stops waiting, but the thread goes on and is
        # waited for below (it reaps the process once the kill closes the pipe; a second join
        # racing it could leave the process listed as running).
        outcome = await asyncio.shield(receiving)
    except BaseException:
        if process.pid is not None:  # None: it never started
            _kill_group(process)
            if receiving is not None:
                await asyncio.wait([receiving], timeout=10)
            await asyncio.to_thread(process.join, 10)
        raise
    finally:
        reader.close()
    await asyncio.to_thread(process.join, 10)
    if isinstance(outcome, SavedBuild):
        return outcome
    raise RuntimeError(f"the index build process failed: {outcome}")


def _build_child(conn: Connection, paths: list[Path], learned_file: Path | None, version: str,
                 out: Path, workers: int) -> None:
    # A process group of its own, which its workers join: the serving process ends the whole
    # group at once (a signal to this process alone would leave the workers running).
    with contextlib.suppress(OSError):
        os.setsid()
    try:
        result: SavedBuild | str = build_to_disk(paths, learned_file, version, out, workers)
    except BaseException as exc:  # reported to the serving process, which logs it
        result = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    conn.send(result)
    conn.close()


def _kill_group(process: BaseProcess) -> None:
    """The build process and its workers: what they were writing is thrown away anyway."""
    assert process.pid is not None
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()  # not (yet) a group leader: the process alone


def _receive(conn: Connection, process: BaseProcess) -> SavedBuild | str:
    try:
        return cast("SavedBuild | str", conn.recv())
    except EOFError:
        process.join(10)
        return f"it exited with code {process.exitcode} without a result"


def saved_build(root: Path, version: str) -> SavedBuild | None:
    """The complete build of ``version`` under ``root``, if there is one."""
    directory = _version_dir(root, version)
    try:
        saved = SavedBuild.read(directory)
    except (OSError, ValueError, KeyError):
        return None
    return saved if saved.version == version else None


def prune(root: Path, keep: Path) -> None:
    """Every other build, finished or not (one build at a time: nothing else is writing)."""
    for entry in root.iterdir():
        if entry != keep and entry.name.startswith(("v-", ".build-")):
            shutil.rmtree(entry, ignore_errors=True)


@dataclass(frozen=True)
class Loaded(Generic[T]):
    saved: SavedBuild
    value: T  # what ``load`` made of it
    mapped: bool  # True: saved before (this run or an earlier one); False: built just now


async def load_or_build(root: Path, version: str, build: Callable[[], Awaitable[SavedBuild]],
                        load: Callable[[SavedBuild], T], *,
                        rebuild_unreadable: bool) -> Loaded[T]:
    """The build of ``version`` under ``root``, loaded by ``load`` (in a thread): the one saved
    there when it is readable, else the one ``build`` makes (``build_in_process`` with the same
    root and version). Every other build under ``root`` is removed after.

    A build that cannot be read is removed. A saved one is then built again at once with
    ``rebuild_unreadable``; without it the error is raised (the caller answers from what it
    has, and its next call builds)."""
    saved = await asyncio.to_thread(saved_build, root, version)
    if saved is not None:
        try:
            value = await asyncio.to_thread(load, saved)
        except (OSError, ValueError, KeyError) as exc:
            await asyncio.to_thread(shutil.rmtree, saved.directory, True)
            if not rebuild_unreadable:
                raise
            log.warning("clusters: the saved index in %s is unreadable (%s); rebuilding",
                        saved.directory, exc)
        else:
            await asyncio.to_thread(prune, root, saved.directory)
            return Loaded(saved, value, mapped=True)
    saved = await build()
    try:
        value = await asyncio.to_thread(load, saved)
    except (OSError, ValueError, KeyError):
        await asyncio.to_thread(shutil.rmtree, saved.directory, True)
        raise
    # Older builds go; a delivery still ranking on one keeps its mapped pages until done.
    await asyncio.to_thread(prune, root, saved.directory)
    return Loaded(saved, value, mapped=False)
