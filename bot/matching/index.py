"""The live cluster index of the curated clusters (cluster files and feeds): one matcher per
repository, built off the event loop from one version of the files, and swapped in whole when
they change. Learned clusters are indexed per repository, when needed (``repo_indexes``);
``IndexHolder.view`` gives a delivery the index of the repositories it asks about.

Per repository, because IDF is a property of a repository's vocabulary (a word rare in one
project is everyday in another) and a change to one repository's clusters need not rebuild the
others'. Immutable once built, so a delivery ranks against one consistent version even while the
next one is being built.

Where it is built depends on its size. A few thousand clusters index in a worker thread in well
under a second. A large set (100,000 clusters take seconds of CPU) is built in a separate process,
which writes the index as arrays under the index directory; this process memory-maps them. The
event loop then never competes with the build for the GIL, the build's transient memory goes back
to the system when its process ends, and a restart with unchanged inputs maps the saved index
instead of building it again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
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
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import cast

from bot.clusters.load import SUFFIXES, LoadReport, stream_clusters, stream_records
from bot.clusters.models import Cluster
from bot.matching import Boilerplate, IssueText, Match, Matcher, MatchPolicy
from bot.matching.arrays import FORMAT, IndexArrays
from bot.matching.build import Extract, IndexBuilder, extract
from bot.matching.scoring import cluster_semantic_text, resolve_encoder

log = logging.getLogger("dejafix.index")

# Inputs above this many bytes (cluster files, plus about 2 kB per learned cluster) are built in
# a separate process; below it a thread is quicker than starting one (~1 s).
PROCESS_BUILD_BYTES = 8 << 20
# Above this, the build process shares the per-cluster work out to worker processes (starting
# them costs about a second; 32 MB is some 18,000 clusters, several seconds of work).
PARALLEL_BUILD_BYTES = 32 << 20
_LEARNED_RECORD_BYTES = 2048
_BUILD_NICENESS = 10
_MANIFEST = "manifest.json"


class ClusterIndex:
    def __init__(self, clusters: Iterable[Cluster] = (), *, version: str = "",
                 reuse: ClusterIndex | None = None, semantic: bool = False) -> None:
        """An index of ``clusters``, built here (tests and tools; the bot uses ``build_index``)."""
        builders = _Builders(semantic)
        with _collector_paused():
            for cluster in clusters:
                builders.add(cluster)
            arrays = builders.finish()
        self._init(arrays, version=version, reuse=reuse, semantic=semantic)

    @classmethod
    def from_arrays(cls, arrays: dict[str, IndexArrays], *, version: str = "",
                    reuse: ClusterIndex | None = None, semantic: bool = False) -> ClusterIndex:
        index = cls.__new__(cls)
        index._init(arrays, version=version, reuse=reuse, semantic=semantic)
        return index

    def _init(self, arrays: dict[str, IndexArrays], *, version: str,
              reuse: ClusterIndex | None, semantic: bool) -> None:
        self.version = version
        self.size = sum(a.n for a in arrays.values())
        self._matchers: dict[str, Matcher] = {}
        for repo, repo_arrays in arrays.items():
            old = reuse._matchers.get(repo) if reuse is not None else None
            if old is not None and old.arrays.fingerprint == repo_arrays.fingerprint:
                self._matchers[repo] = old  # unchanged repository: keep its index (and caches)
            else:
                self._matchers[repo] = Matcher(arrays=repo_arrays, semantic=semantic)

    @classmethod
    def of(cls, matchers: dict[str, Matcher], *, version: str) -> ClusterIndex:
        """An index of matchers built already (``IndexHolder.view``)."""
        index = cls.__new__(cls)
        index.version = version
        index.size = sum(len(m) for m in matchers.values())
        index._matchers = dict(matchers)
        return index

    def matcher(self, repo: str) -> Matcher | None:
        return self._matchers.get(repo.lower())

    @property
    def repos(self) -> list[str]:
        return sorted(self._matchers)

    def count(self, repo: str) -> int:
        matcher = self._matchers.get(repo.lower())
        return len(matcher) if matcher is not None else 0

    def clusters(self, repo: str) -> list[Cluster]:
        """Every cluster of a repository, rebuilt from the index: for tools and tests."""
        matcher = self._matchers.get(repo.lower())
        return matcher.clusters if matcher is not None else []

    def find(self, repo: str, public_id: str | None = None, kind: str | None = None,
             number: int | None = None) -> Cluster | None:
        """A repository's cluster by id, or the first with issue/PR ``number`` as a member (or
        a PR as its landed fix)."""
        matcher = self._matchers.get(repo.lower())
        if matcher is None:
            return None
        i = matcher.find(public_id, kind, number)
        return matcher.cluster(i) if i is not None else None

    def rank(self, issue: IssueText, repos: Collection[str], *, limit: int = 5,
             policy: MatchPolicy | None = None, boilerplate: Boilerplate | None = None
             ) -> list[Match]:
        """Candidates from each named repository's index, best first."""
        found: list[Match] = []
        for repo in dict.fromkeys(r.lower() for r in repos):
            matcher = self._matchers.get(repo)
            if matcher is not None:
                found.extend(matcher.rank(issue, None, limit=limit, policy=policy,
                                          boilerplate=boilerplate))
        found.sort(key=lambda m: -m.score)
        return found[:limit]


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


def _issues_of(cluster: Cluster) -> tuple[int, ...]:
    return tuple(m.number for m in cluster.members if m.kind == "issue")


def merge_learned(given: list[Cluster], learned: Iterable[Cluster]) -> list[Cluster]:
    """File and feed clusters, plus the learned ones that fill the gaps (see ``_Curated``)."""
    curated = _Curated()
    for cluster in given:
        curated.note(cluster.key, _issues_of(cluster), len(cluster.members))
    merged = {c.key: c for c in given}
    for cluster in learned:
        if curated.admit(cluster.key, _issues_of(cluster), len(cluster.members),
                         cluster.landed_fix.reverted):
            merged[cluster.key] = cluster
    return list(merged.values())


class _Builders:
    """One ``IndexBuilder`` per repository; clusters arrive one at a time and none is kept."""

    def __init__(self, semantic: bool) -> None:
        self._encoder = resolve_encoder(semantic)
        self.text = cluster_semantic_text if self._encoder is not None else None
        self._builders: dict[str, IndexBuilder] = {}

    def insert(self, ex: Extract) -> None:
        repo = ex.key[0]
        builder = self._builders.get(repo)
        if builder is None:
            builder = self._builders[repo] = IndexBuilder(semantic_text=self.text)
        builder.insert(ex)

    def add(self, cluster: Cluster, raw: bytes | None = None) -> None:
        self.insert(extract(cluster, raw, self.text))

    def finish(self) -> dict[str, IndexArrays]:
        encoder = self._encoder
        encode = (lambda texts: encoder.encode(texts, memo=True)) if encoder is not None \
            else None
        return {repo: b.finish(encode) for repo, b in self._builders.items()}


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    # A build allocates millions of small objects that all survive: with the collector on, its
    # full passes walk every one of them again and again, and each holds the GIL throughout.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_arrays(paths: list[Path], learned: Iterable[Cluster | str], semantic: bool, *,
                 workers: int = 0, given: Iterable[str | bytes] = (),
                 given_source: str = "curated clusters"
                 ) -> tuple[dict[str, IndexArrays], LoadReport]:
    """The index of every cluster file under ``paths`` (and of ``given`` curated records, the
    JSON of clusters read from such files before) and of the learned clusters (validated
    objects, or JSON records from the store) they leave room for, per repository, with the
    loader's report.
    ``workers`` > 1 validates and extracts JSON Lines records and learned records in that
    many processes (each cluster's work is independent; putting it into the index is not)."""
    builders = _Builders(semantic)
    curated = _Curated()
    prepare = functools.partial(extract, semantic_text=builders.text)

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
        with _collector_paused():
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


def files_version(paths: Iterable[Path]) -> str:
    """A cheap version of the cluster files: names, sizes and modification times."""
    entries: list[str] = []
    for file, st in _cluster_files(paths):
        entries.append(f"{file}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def files_bytes(paths: Iterable[Path]) -> int:
    return sum(st.st_size for _, st in _cluster_files(paths))


def _cluster_files(paths: Iterable[Path]) -> Iterator[tuple[Path, os.stat_result]]:
    for path in paths:
        try:
            candidates = sorted(path.iterdir()) if path.is_dir() else [path]
        except OSError:
            continue
        for file in candidates:
            if file.suffix in SUFFIXES and not file.name.startswith("."):
                try:
                    yield file, os.stat(file)
                except OSError:
                    continue


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


@cache
def code_version() -> str:
    """Changes whenever the code that shapes an index does (matching, the cluster model and
    loaders, this module's merge rules, numpy and pydantic): a saved index is only reused by
    the code that wrote it."""
    import numpy
    import pydantic

    digest = hashlib.sha256(f"format {FORMAT} {numpy.__version__} {pydantic.VERSION}".encode())
    here = Path(__file__).parent
    sources = [*(here / "matching").glob("*.py"), *(here / "clusters").glob("*.py"),
               Path(__file__)]
    for source in sorted(sources):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def build_index(paths: list[Path], reuse: ClusterIndex | None = None,
                semantic: bool = False) -> ClusterIndex:
    """Load and index every cluster file, here. CPU-bound: run it in a thread, never on the
    loop; large inputs go to ``build_in_process`` instead."""
    version = files_version(paths)
    arrays, report = build_arrays(paths, (), semantic)
    for error in report.errors:
        log.warning("clusters: %s", error)
    index = ClusterIndex.from_arrays(arrays, version=version, reuse=reuse, semantic=semantic)
    log.info("clusters: %d loaded for %d repositories (version %s)", index.size,
             len(index.repos), version)
    return index


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

    def load(self, reuse: ClusterIndex | None, semantic: bool) -> ClusterIndex:
        arrays = {repo: IndexArrays.load(self.directory / sub) for repo, sub in self.repos.items()}
        return ClusterIndex.from_arrays(arrays, version=self.version, reuse=reuse,
                                        semantic=semantic)


def _learned_from_file(path: Path | None) -> Iterator[str]:
    """The learned records the serving process wrote for a build process, one per line."""
    if path is None:
        return
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield line


def _write_learned(records: Callable[[], Iterable[str]], path: Path) -> Path:
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


def build_to_disk(paths: list[Path], learned_file: Path | None, semantic: bool, version: str,
                  out: Path, workers: int = 0) -> SavedBuild:
    """Build the index and write it under ``out`` (a new directory). Runs in a build process:
    nothing here touches the serving process's state."""
    started = time.perf_counter()
    # Background work: on a machine with as many busy processes as cores, the serving process
    # must still get the CPU the moment a delivery or a timer wakes it (its workers inherit).
    with contextlib.suppress(OSError):
        os.nice(_BUILD_NICENESS)
    arrays, report = build_arrays(paths, _learned_from_file(learned_file), semantic,
                                  workers=workers)
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


async def build_in_process(paths: list[Path], learned_file: Path | None, semantic: bool,
                           version: str, root: Path, workers: int = 0) -> SavedBuild:
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
                          args=(writer, paths, learned_file, semantic, version, out, workers))
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


def _build_child(conn: Connection, paths: list[Path], learned_file: Path | None, semantic: bool,
                 version: str, out: Path, workers: int) -> None:
    # A process group of its own, which its workers join: the serving process ends the whole
    # group at once (a signal to this process alone would leave the workers running).
    with contextlib.suppress(OSError):
        os.setsid()
    try:
        result: SavedBuild | str = build_to_disk(paths, learned_file, semantic, version, out,
                                                 workers)
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


class IndexHolder:
    """The curated index in use (cluster files and feeds), its replacement when they change, and
    the per-repository indexes of learned clusters (``RepoIndexes``). Readers take ``view`` of
    the repositories they need once per delivery; a swap is one attribute assignment, atomic
    for them.

    ``index_dir`` is where large builds write their arrays (a temporary directory when not
    given). ``learned_state`` and ``learned_records`` read a repository's learned clusters from
    the store; without them only the curated clusters are matched. The holder knows nothing of
    the store: the app hands it these callables."""

    def __init__(self, paths: list[Path], builder: Callable[..., ClusterIndex] = build_index,
                 semantic: bool = False, *, index_dir: Path | None = None,
                 learned_state: Callable[[str], tuple[int, str]] | None = None,
                 learned_records: Callable[[str], Iterable[str]] | None = None,
                 memory_bytes: int = 1 << 30,
                 on_build: Callable[[], object] | None = None,
                 on_evict: Callable[[], object] | None = None,
                 process_above: int = PROCESS_BUILD_BYTES,
                 parallel_above: int = PARALLEL_BUILD_BYTES) -> None:
        from bot.matching.repo_indexes import RepoIndexes

        self.paths = paths
        self.semantic = semantic
        self.builder = builder
        self.process_above = process_above
        self.parallel_above = parallel_above
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.index_dir = index_dir
        self.current = ClusterIndex([], version="empty")
        self.saved: SavedBuild | None = None
        self._lock = asyncio.Lock()
        self.learned = RepoIndexes(learned_state, learned_records, budget_bytes=memory_bytes,
                                   semantic=semantic, root=self._root,
                                   process_above=process_above, on_build=on_build,
                                   on_evict=on_evict) \
            if learned_state is not None and learned_records is not None else None

    async def view(self, repos: Iterable[str]) -> ClusterIndex:
        """The index of ``repos`` as it stands: each one's curated clusters, and its learned
        ones when it has any (its own index, built now when it is not resident or is out of
        date). Take it once per delivery: it is immutable."""
        base = self.current
        wanted = list(dict.fromkeys(r.lower() for r in repos))
        if self.learned is None:
            found = [base.matcher(r) for r in wanted]
        else:
            learned = self.learned
            found = list(await asyncio.gather(*(learned.matcher(r, base.matcher(r))
                                                for r in wanted)))
        matchers = {r: m for r, m in zip(wanted, found, strict=True) if m is not None}
        digest = hashlib.sha256(base.version.encode())
        for repo, matcher in sorted(matchers.items()):
            digest.update(f"{repo}:{matcher.arrays.fingerprint}".encode())
        return ClusterIndex.of(matchers, version=digest.hexdigest()[:16])

    async def learned_changed(self, repo: str) -> None:
        """A cluster of ``repo`` was learned: a resident index of it is rebuilt now, so the
        next issue does not wait for it (one not resident is built when next needed)."""
        if self.learned is not None and self.learned.resident(repo):
            await self.view([repo])

    def _root(self) -> Path:
        if self.index_dir is None:
            # Removed with the holder (the object's finaliser), or at exit at the latest.
            self._tmp = tempfile.TemporaryDirectory(prefix="dejafix-index-")
            self.index_dir = Path(self._tmp.name)
        self.index_dir.mkdir(parents=True, exist_ok=True)
        return self.index_dir

    async def refresh(self, *, force: bool = False) -> bool:
        """Rebuild the curated index off the loop if its files changed; True when a new one
        was swapped in. One build at a time; the event loop only awaits it."""
        async with self._lock:
            version = await asyncio.to_thread(files_version, self.paths)
            if not force and version == self.current.version:
                return False
            size = await asyncio.to_thread(files_bytes, self.paths)
            if size > self.process_above and self.builder is build_index:
                workers = build_workers() if size > self.parallel_above else 0
                index = await self._build_elsewhere(version, workers)
            else:
                index = await asyncio.to_thread(self.builder, self.paths, self.current,
                                                self.semantic)
            self.current = index
            return True

    async def _build_elsewhere(self, version: str, workers: int) -> ClusterIndex:
        root = await asyncio.to_thread(self._root)
        full = f"{version}/{code_version()}/{'semantic' if self.semantic else 'lexical'}"
        saved = await asyncio.to_thread(_saved, root, full)
        index: ClusterIndex | None = None
        if saved is not None:
            try:
                index = await asyncio.to_thread(saved.load, self.current, self.semantic)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("clusters: the saved index in %s is unreadable (%s); rebuilding",
                            saved.directory, exc)
                await asyncio.to_thread(shutil.rmtree, saved.directory, True)
                saved = None
            else:
                log.info("clusters: version %s already built in %s; mapped, not rebuilt",
                         version, saved.directory)
        if saved is None:
            started = time.perf_counter()
            saved = await build_in_process(self.paths, None, self.semantic, full, root, workers)
            log.info("clusters: built in a separate process in %.1fs (peak memory %d MB, and"
                     " %d MB in each of %d workers)", time.perf_counter() - started,
                     saved.peak_rss_kb // 1024, saved.worker_peak_rss_kb // 1024, saved.workers)
        for error in saved.errors:
            log.warning("clusters: %s", error)
        if index is None:
            index = await asyncio.to_thread(saved.load, self.current, self.semantic)
        index.version = version
        log.info("clusters: %d loaded for %d repositories (version %s)", index.size,
                 len(index.repos), version)
        self.saved = saved
        # Older builds go; a delivery still ranking on one keeps its mapped pages until done.
        await asyncio.to_thread(_prune, root, keep=saved.directory)
        return index

    async def watch(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.refresh()
            except Exception:
                log.exception("clusters: reload failed; the previous index stays in use")


def _saved(root: Path, version: str) -> SavedBuild | None:
    directory = _version_dir(root, version)
    try:
        saved = SavedBuild.read(directory)
    except (OSError, ValueError, KeyError):
        return None
    return saved if saved.version == version else None


def _prune(root: Path, keep: Path) -> None:
    """Every other build, finished or not (one build at a time: nothing else is writing)."""
    for entry in root.iterdir():
        if entry != keep and entry.name.startswith(("v-", ".build-")):
            shutil.rmtree(entry, ignore_errors=True)
