"""The durable store: delivery ledger, job queue and comment ledger in one SQLite file.

A delivery accepted is a delivery processed: the receiver records it and its job in one
transaction before answering 202, workers lease jobs, and a job whose worker died is handed out
again. Every method is synchronous and thread-safe so that async code can call it through
``asyncio.to_thread``. Nothing here knows about GitHub or HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from bot.clusters.models import Cluster

T = TypeVar("T")

log = logging.getLogger("dejafix.store")

DB_FILENAME = "dejafix.sqlite3"
LOCK_FILENAME = "dejafix.lock"
# Held while a process sets the file up (WAL mode, migrations): see ``_opening``.
OPEN_LOCK_FILENAME = "dejafix.open.lock"
# Seconds a process waits for another one's setup (a migration of a large file included).
OPEN_WAIT_SECONDS = 120.0

# Each step runs in its own transaction together with the ``user_version`` bump, so a file is
# always at exactly one version. Never edit a released step; append a new one.
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE deliveries (
            delivery_id     TEXT PRIMARY KEY,
            event           TEXT NOT NULL,
            action          TEXT,
            repo            TEXT,
            installation_id INTEGER,
            received_at     REAL NOT NULL,
            updated_at      REAL NOT NULL,
            state           TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed'))
        );
        CREATE INDEX deliveries_state_updated ON deliveries (state, updated_at);
        CREATE TABLE jobs (
            id           INTEGER PRIMARY KEY AUTOINCREMENT,
            delivery_id  TEXT NOT NULL UNIQUE
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            payload      BLOB NOT NULL,
            attempts     INTEGER NOT NULL DEFAULT 0,
            state        TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed')),
            lease_until  REAL,
            available_at REAL NOT NULL,
            last_error   TEXT
        );
        CREATE INDEX jobs_state_available ON jobs (state, available_at);
        CREATE TABLE comments (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            comment_id INTEGER NOT NULL,
            cluster    TEXT,
            score      REAL,
            body_hash  TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        """,
    ),
    (
        2,
        """
        CREATE TABLE learned_clusters (
            repo       TEXT NOT NULL,
            public_id  TEXT NOT NULL,
            record     TEXT NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (repo, public_id)
        );
        CREATE TABLE learned_members (
            repo      TEXT NOT NULL,
            kind      TEXT NOT NULL,
            number    INTEGER NOT NULL,
            public_id TEXT NOT NULL,
            PRIMARY KEY (repo, kind, number)
        );
        CREATE TABLE cursors (
            name       TEXT PRIMARY KEY,
            value      TEXT NOT NULL,
            updated_at REAL NOT NULL
        );
        """,
    ),
    (
        3,
        """
        CREATE TABLE feedback (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            cluster    TEXT NOT NULL,
            kind       TEXT NOT NULL CHECK (kind IN ('dismissed', 'confirmed')),
            login      TEXT,
            created_at REAL NOT NULL,
            PRIMARY KEY (repo, issue, cluster)
        );
        CREATE TABLE pauses (
            repo         TEXT PRIMARY KEY,
            paused       INTEGER NOT NULL,
            reason       TEXT NOT NULL,
            config_hash  TEXT NOT NULL,
            issue        INTEGER,
            announced    INTEGER NOT NULL DEFAULT 0,
            paused_at    REAL NOT NULL,
            resumed_at   REAL,
            resumed_by   TEXT
        );
        """,
    ),
    (
        4,
        # The claim takes the oldest due jobs: with (state, available_at) SQLite had to sort
        # every queued job to find them, so a backlog made each claim slower (15 ms at 6,000
        # queued, under the lock the receiver's commits wait for). In id order with
        # available_at covered, it reads only the rows it returns.
        #
        # Payloads move to a table of their own: a job row is rewritten whole at every state
        # change (leased, done), and with its 10-20 kB payload inside that was most of the
        # bytes the store wrote. jobs.payload stays (dropping a column needs SQLite 3.35),
        # always empty.
        """
        DROP INDEX jobs_state_available;
        CREATE INDEX jobs_state_id ON jobs (state, id, available_at);
        CREATE TABLE payloads (
            delivery_id TEXT PRIMARY KEY
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            body        BLOB NOT NULL
        );
        INSERT INTO payloads (delivery_id, body) SELECT delivery_id, payload FROM jobs;
        UPDATE jobs SET payload = X'';
        """,
    ),
    (
        5,
        # A receiver's deliveries keep their bodies in its journal (bot/journal.py): the
        # payload row says where ("<slot>/<segment>:<offset>:<length>") and its body is
        # empty, until the job is done (the segment is then deleted) or has waited long
        # enough that the body is copied here. Copying every body into SQLite wrote each one
        # twice more (the log, then the checkpoint), which the receiver paid for in CPU.
        """
        ALTER TABLE payloads ADD COLUMN ref TEXT;
        CREATE INDEX payloads_ref ON payloads (ref) WHERE ref IS NOT NULL;
        """,
    ),
]

# A traceback can be arbitrarily long; the ledger keeps enough to diagnose, not a log.
_MAX_ERROR_CHARS = 8000


@contextmanager
def _opening(data_dir: Path, timeout: float = OPEN_WAIT_SECONDS) -> Iterator[None]:
    """One process at a time sets a store file up. Two processes that open a new file at once
    (a receiver and a worker started together) raced: ``PRAGMA journal_mode = WAL`` fails with
    "database is locked" at once, without SQLite's busy wait, while another connection is
    switching the file to WAL. The kernel drops the lock with its process, however it ends."""
    if sys.platform == "win32":  # no flock: as before
        yield
        return
    import fcntl

    # Read-only is enough for flock, and lets a process of another user take turns too.
    fd = os.open(data_dir / OPEN_LOCK_FILENAME, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise sqlite3.OperationalError(
                        f"{data_dir}: another process has been setting up the store for "
                        f"{timeout:g} s") from None
                time.sleep(0.01)
            except OSError as exc:
                # A file system without flock (ENOLCK, EOPNOTSUPP): open as before, untaken.
                log.debug("store: %s cannot be locked (%s)", OPEN_LOCK_FILENAME, exc)
                break
        yield
    finally:
        os.close(fd)  # releases the lock


class DataDirInUse(RuntimeError):
    """Another live process serves from this data directory."""


def lock_data_dir(data_dir: Path) -> IO[str] | None:
    """Take the data directory for this process, for as long as the returned file stays open.

    ``Store.recover`` requeues every running job because it assumes their process is dead; a
    second live process on the same directory would run the first one's jobs again (and post a
    second comment). The kernel drops an flock when its process dies, even by SIGKILL, so a
    restart after a crash is never refused.
    """
    if sys.platform == "win32":  # no flock: no guard against a second process
        return None
    import fcntl

    data_dir.mkdir(parents=True, exist_ok=True)
    handle = (data_dir / LOCK_FILENAME).open("a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise DataDirInUse(
            f"{data_dir} is in use by another Dejafix process (pid {holder}); stop it first, "
            "or its unfinished deliveries would be run twice"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class StoreVersionError(RuntimeError):
    """The file was written by a newer Dejafix; opening it could corrupt data that code knows."""


@dataclass(frozen=True, slots=True)
class Job:
    """A leased job. ``attempts`` counts this run too, so the first run sees 1."""

    id: int
    delivery_id: str
    event: str
    action: str | None
    repo: str | None
    installation_id: int | None
    payload: bytes
    attempts: int


@dataclass(frozen=True, slots=True)
class Pause:
    """A repository's pause: in force while ``paused``; ``resumed_at`` starts a fresh window."""

    repo: str
    paused: bool
    reason: str
    config_hash: str
    issue: int | None
    announced: bool
    paused_at: float
    resumed_at: float | None
    resumed_by: str | None


@dataclass(frozen=True, slots=True)
class CommentRecord:
    repo: str
    issue: int
    comment_id: int
    cluster: str | None
    score: float | None
    body_hash: str
    created_at: float
    updated_at: float


# A delivery to record: (id, event, action, repo, installation id, the JSON payload).
Delivery = tuple[str, str, str | None, str | None, int | None, bytes]

# Under the data directory: the receivers' journals (bot/journal.py).
JOURNAL_DIR = "journal"


def segment_file(data_dir: Path, slot: int | str, segment: int | str) -> Path:
    """A journal segment's file."""
    return data_dir / JOURNAL_DIR / str(slot) / f"{int(segment):012d}.log"


def read_journal_body(data_dir: Path, ref: str) -> bytes:
    """A body kept in a journal segment: ``ref`` is "<slot>/<segment>:<offset>:<length>".
    Raises OSError (FileNotFoundError: the segment is gone) or ValueError (a bad ref)."""
    where, offset, length = ref.rsplit(":", 2)
    slot, segment = where.split("/")
    with open(segment_file(data_dir, slot, segment), "rb") as fh:
        body = os.pread(fh.fileno(), int(length), int(offset))
    if len(body) != int(length):
        raise ValueError(f"journal {ref}: the segment ends before the body does")
    return body

# Bytes the write-ahead log file is cut back to when it restarts (disable_autocheckpoint).
WAL_SIZE_LIMIT = 64 * 1024 * 1024

# How often a spinning store (``spin_on_busy``) asks again for the write lock.
SPIN_SECONDS = 0.0002

# Prepared statements kept per connection (sqlite3's default: 128).
STATEMENT_CACHE = 1024

# Below SQLite's oldest limit of 999 parameters per statement.
_IN_CHUNK = 500
_INSERT_CHUNK = 100


@dataclass(frozen=True, slots=True)
class Claim:
    """Jobs to lease (``Store.claim_jobs``): up to ``limit`` of any kind, plus up to
    ``fresh_extra`` never run before; never one of ``exclude``."""

    lease_seconds: float
    limit: int
    fresh_extra: int = 0
    exclude: frozenset[int] = frozenset()


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _json_list(cursor: sqlite3.Cursor) -> list[Any]:
    """The JSON array in the single row and column of ``cursor`` (NULL: empty)."""
    value = cursor.fetchone()[0]
    return list(json.loads(value)) if value else []


def read_learned_records(db_path: Path, repo: str | None = None) -> Iterator[str]:
    """The raw JSON ``record`` of each learned cluster, in ``Store.learned_clusters`` order.

    For another process (the index builder): it opens its own read-only connection, so it needs
    neither a ``Store`` nor the data directory's lock, and in WAL mode it reads a consistent
    snapshot while the bot keeps writing. Rows are streamed, not fetched at once: at 100k
    clusters the records alone are hundreds of MB. The connection closes when the generator is
    exhausted or closed.
    """
    uri = db_path.resolve().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout = 5000")
        if repo is None:
            rows = conn.execute("SELECT record FROM learned_clusters ORDER BY repo, public_id")
        else:
            rows = conn.execute(
                "SELECT record FROM learned_clusters WHERE repo = ? ORDER BY public_id",
                (repo.lower(),))
        for (record,) in rows:
            yield str(record)
    finally:
        conn.close()


def _statements(script: str) -> Iterator[str]:
    # executescript() would commit our open transaction (Python 3.11), so a step is split into
    # statements; complete_statement() keeps a ';' inside a trigger body or a string intact.
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                yield pending
            pending = ""
    if pending.strip(" \t\r\n;"):
        raise ValueError(f"incomplete SQL statement in migration: {pending!r}")


class Store:
    def __init__(
        self,
        data_dir: Path,
        *,
        max_attempts: int = 5,
        clock: Callable[[], float] = time.time,
        busy_timeout_ms: int = 5000,
        spin_on_busy: bool = False,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self._clock = clock
        data_dir.mkdir(parents=True, exist_ok=True)
        # Public: ``read_learned_records`` and other processes open this file read-only.
        self.path: Path = data_dir / DB_FILENAME
        # isolation_level=None: the module's implicit transactions are off, every write below
        # opens its own BEGIN IMMEDIATE so that the write lock is taken before anything is read.
        # The hot path's statements are written for each batch size (one "?" per row), so a
        # round's dozen statements come in hundreds of texts; sqlite3's default cache of 128
        # prepared statements kept evicting them, and each re-prepare costs CPU and a GIL
        # round trip in the writer thread.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                     cached_statements=STATEMENT_CACHE)
        self._lock = threading.Lock()
        # SQLite's own wait for a lock held by another process sleeps 1, 2, 5, 10 ms... in
        # turn: a receiver's round that finds a worker's short transaction in the way would
        # sleep 8 ms for 3 ms of it. A process that only writes (bot/round_writer.py) asks
        # again every SPIN_SECONDS instead, up to the same timeout.
        self._spin_seconds = busy_timeout_ms / 1000 if spin_on_busy else 0.0
        try:
            self._conn.execute(
                f"PRAGMA busy_timeout = {0 if spin_on_busy else int(busy_timeout_ms)}")
            with _opening(data_dir):
                self._conn.execute("PRAGMA journal_mode = WAL")
                # NORMAL in WAL mode loses no committed transaction when the process dies,
                # only possibly the last ones on power loss; the fsync per commit is not worth
                # that.
                self._conn.execute("PRAGMA synchronous = NORMAL")
                self._conn.execute("PRAGMA foreign_keys = ON")
                self._migrate()
        except BaseException:
            self._conn.close()
            raise

    # -- plumbing ---------------------------------------------------------------------------

    def disable_autocheckpoint(self) -> None:
        """This connection's commits stop checkpointing the log (another connection must:
        ``bot.round_writer.Checkpointer``)."""
        with self._lock:
            self._conn.execute("PRAGMA wal_autocheckpoint = 0")
            # A log that has restarted is cut back to this size (it may have grown in a burst).
            self._conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _begin(self) -> None:
        if not self._spin_seconds:
            self._conn.execute("BEGIN IMMEDIATE")
            return
        deadline = time.monotonic() + self._spin_seconds
        while True:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                # The extended code (SQLITE_BUSY_RECOVERY, ...) in its low byte is BUSY.
                busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
                if not busy or time.monotonic() > deadline:
                    raise
            time.sleep(SPIN_SECONDS)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._begin()
            try:
                yield self._conn
            except BaseException:
                # Some errors (disk full, I/O) make SQLite roll back by itself; a second
                # ROLLBACK would then raise and hide the original error.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _version_error(self, found: int, supported: int) -> StoreVersionError:
        return StoreVersionError(
            f"{self.path}: schema version {found} is newer than this Dejafix supports "
            f"(version {supported}); upgrade Dejafix or point it at another data directory"
        )

    def _migrate(self) -> None:
        steps = MIGRATIONS
        versions = [v for v, _ in steps]
        if versions != list(range(1, len(versions) + 1)):
            raise ValueError(f"migration versions must be 1, 2, 3...; got {versions}")
        latest = versions[-1]
        with self._write() as conn:
            # Read inside the write transaction: two processes opening a fresh file at once must
            # not both apply step 1.
            current = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if current > latest:
                raise self._version_error(current, latest)
            for version, script in steps[current:]:
                for statement in _statements(script):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version}")

    def schema_version(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    # -- delivery ledger and job queue ------------------------------------------------------

    def accept_delivery(
        self,
        delivery_id: str,
        event: str,
        action: str | None,
        repo: str | None,
        installation_id: int | None,
        payload: bytes,
    ) -> bool:
        """Record a delivery and enqueue its job; False if the id was already recorded."""
        now = self._clock()
        with self._write() as conn:
            inserted = conn.execute(
                "INSERT INTO deliveries (delivery_id, event, action, repo, installation_id,"
                " received_at, updated_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued')"
                " ON CONFLICT (delivery_id) DO NOTHING",
                (delivery_id, event, action, repo, installation_id, now, now),
            ).rowcount
            if not inserted:
                return False
            conn.execute(
                "INSERT INTO jobs (delivery_id, payload, state, available_at)"
                " VALUES (?, X'', 'queued', ?)",
                (delivery_id, now),
            )
            conn.execute("INSERT INTO payloads (delivery_id, body) VALUES (?, ?)",
                         (delivery_id, payload))
            return True

    def accept_deliveries(self, deliveries: list[Delivery]) -> list[bool]:
        """``accept_delivery`` for many, in ONE transaction (group commit): under load the
        receiver's deliveries share a commit instead of paying one each. The same id twice in
        one batch is accepted once."""
        with self._write() as conn:
            return self._insert(conn, deliveries, self._clock())[0]

    def claim_job(self, lease_seconds: float) -> Job | None:
        """Lease the oldest runnable job: queued and due, or running with an expired lease."""
        jobs = self.claim_jobs(lease_seconds, 1)
        return jobs[0] if jobs else None

    def claim_jobs(self, lease_seconds: float, limit: int, *, fresh_extra: int = 0,
                   exclude: Collection[int] = ()) -> list[Job]:
        """Lease up to ``limit`` of the oldest runnable jobs, oldest first, in one transaction,
        plus up to ``fresh_extra`` more among them that have never been run: a busy worker pays
        one commit for many jobs. Jobs that have run before (retries, and jobs requeued after
        a crash) come only within ``limit``, so a job that kills the process takes no more
        jobs down with it, attempt after attempt, than when they were claimed one by one.
        ``exclude``: jobs the caller holds itself, never handed to it twice even when their
        lease has run out."""
        with self._write() as conn:
            jobs, unread = self._claim(conn, Claim(lease_seconds, limit, fresh_extra,
                                                   frozenset(exclude)), self._clock(), {})
        return self._with_bodies(jobs, unread)

    def commit_round(self, deliveries: list[Delivery], completed: list[int],
                     claim: Claim | None) -> tuple[list[bool], list[bool], list[Job]]:
        """The hot path's writes in ONE transaction: record ``deliveries`` (as
        ``accept_deliveries``), mark ``completed`` jobs done (as ``complete_jobs``), then lease
        jobs for ``claim`` (as ``claim_jobs``), the deliveries just recorded included. Under
        load the receiver and the worker share one commit instead of taking turns at the
        lock. A job claimed here whose delivery was recorded here carries the very ``bytes``
        object it was given (``is``), so the caller can pair it with what it parsed."""
        now = self._clock()
        with self._write() as conn:
            accepted, inserted = self._insert(conn, deliveries, now)
            done = self._complete(conn, completed, now)
            jobs, unread = (self._claim(conn, claim, now, inserted) if claim is not None
                            else ([], []))
        return accepted, done, self._with_bodies(jobs, unread)

    # Each helper below runs inside the caller's write transaction and steps SQLite as few times
    # as it can, whatever the batch size: every step releases the GIL and takes it back, and
    # taking it back waits for the event loop's thread, which is busy exactly when batches are
    # large. Lists of ids and rows come back as one JSON value, not as one row each.

    def ingest(self, deliveries: list[Delivery], received_at: list[float],
               cursor: tuple[str, str], refs: list[str] | None = None) -> list[bool]:
        """Record deliveries read from a receiver's journal (``bot/journal.py``), each with the
        time it was received, and move that journal's cursor (name, value) past them, in one
        transaction: a journal read again after a crash records nothing twice. ``refs``: where
        each body is in the journal, to be read from there (``read_journal_body``) instead of
        being stored here."""
        if len(received_at) != len(deliveries) or (refs is not None and
                                                   len(refs) != len(deliveries)):
            raise ValueError("one received_at (and ref) per delivery")
        now = self._clock()
        with self._write() as conn:
            accepted = self._insert(conn, deliveries, now, received_at, refs)[0]
            conn.execute(
                "INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET value = excluded.value,"
                " updated_at = excluded.updated_at", (*cursor, now))
        return accepted

    def _insert(self, conn: sqlite3.Connection, deliveries: list[Delivery], now: float,
                received_at: list[float] | None = None, refs: list[str] | None = None
                ) -> tuple[list[bool], dict[str, bytes]]:
        """Record new deliveries and their jobs; (new or not for each, id -> body of the
        new). ``received_at``: when each was received, if not ``now``."""
        first: dict[str, int] = {}
        for i, delivery in enumerate(deliveries):
            first.setdefault(delivery[0], i)
        known: set[str] = set()
        for ids in _chunks(list(first), _IN_CHUNK):
            known.update(_json_list(conn.execute(
                "SELECT json_group_array(delivery_id) FROM deliveries WHERE delivery_id IN"
                f" ({_marks(len(ids))})", ids)))
        # The same id twice in one batch: the first is new, the second a redelivery.
        fresh = {i for i in first.values() if deliveries[i][0] not in known}
        order = sorted(fresh)
        new = [deliveries[i] for i in order]
        times = [received_at[i] for i in order] if received_at is not None else [now] * len(new)
        kept = [refs[i] for i in order] if refs is not None else None
        for start in range(0, len(new), _INSERT_CHUNK):
            chunk = new[start:start + _INSERT_CHUNK]
            conn.execute(
                "INSERT INTO deliveries (delivery_id, event, action, repo, installation_id,"
                " received_at, updated_at, state) VALUES "
                + ",".join(["(?, ?, ?, ?, ?, ?, ?, 'queued')"] * len(chunk)),
                [v for d, t in zip(chunk, times[start:start + _INSERT_CHUNK], strict=True)
                 for v in (d[0], d[1], d[2], d[3], d[4], t, now)])
            conn.execute(
                "INSERT INTO jobs (delivery_id, payload, state, available_at) VALUES "
                + ",".join(["(?, X'', 'queued', ?)"] * len(chunk)),
                [v for d in chunk for v in (d[0], now)])
            if kept is None:
                conn.execute(
                    "INSERT INTO payloads (delivery_id, body) VALUES "
                    + ",".join(["(?, ?)"] * len(chunk)),
                    [v for d in chunk for v in (d[0], d[5])])
            else:
                conn.execute(
                    "INSERT INTO payloads (delivery_id, body, ref) VALUES "
                    + ",".join(["(?, X'', ?)"] * len(chunk)),
                    [v for d, ref in zip(chunk, kept[start:start + _INSERT_CHUNK], strict=True)
                     for v in (d[0], ref)])
        return [i in fresh for i in range(len(deliveries))], {d[0]: d[5] for d in new}

    def _complete(self, conn: sqlite3.Connection, job_ids: list[int], now: float
                  ) -> list[bool]:
        unique = list(dict.fromkeys(job_ids))
        open_ids: set[int] = set()
        for chunk_ids in _chunks(unique, _IN_CHUNK):
            # A dead-lettered job may still complete if its slow worker finally succeeds:
            # the work was done, so the ledger should say so.
            open_ids.update(_json_list(conn.execute(
                "SELECT json_group_array(id) FROM jobs WHERE state != 'done' AND id IN"
                f" ({_marks(len(chunk_ids))})", chunk_ids)))
        self._finish(conn, [i for i in unique if i in open_ids], "done", now)
        results: list[bool] = []
        for job_id in job_ids:
            # The same id twice: the first completes it, the second finds it done.
            results.append(job_id in open_ids)
            open_ids.discard(job_id)
        return results

    def _finish(self, conn: sqlite3.Connection, job_ids: list[int], state: str, now: float
                ) -> None:
        for chunk in _chunks(job_ids, _IN_CHUNK):
            marks = _marks(len(chunk))
            conn.execute(f"UPDATE jobs SET state = ?, lease_until = NULL WHERE id IN ({marks})",
                         (state, *chunk))
            conn.execute(
                "UPDATE deliveries SET state = ?, updated_at = ? WHERE delivery_id IN"
                f" (SELECT delivery_id FROM jobs WHERE id IN ({marks}))", (state, now, *chunk))

    def _claim(self, conn: sqlite3.Connection, claim: Claim, now: float,
               inserted: dict[str, bytes]) -> tuple[list[Job], list[int]]:
        """The jobs leased, and the ids of those whose body is still to be read (b"" in
        them): see ``_with_bodies``."""
        if claim.lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        if claim.limit < 0 or claim.fresh_extra < 0 or claim.limit + claim.fresh_extra < 1:
            raise ValueError("limit and fresh_extra must not be negative, nor both zero")
        while True:
            # One statement for the candidates (each search walks jobs_state_id in id order
            # and stops after the rows it needs, whatever the backlog): the oldest due jobs
            # and expired leases, for ``limit``; the oldest never run, for the rest.
            row = conn.execute(
                "SELECT (SELECT json_group_array(id) FROM (SELECT id FROM jobs"
                "  WHERE state = 'queued' AND available_at <= :now ORDER BY id LIMIT :any)),"
                " (SELECT json_group_array(id) FROM (SELECT id FROM jobs"
                "  WHERE state = 'running' AND lease_until <= :now ORDER BY id LIMIT :expired)),"
                " (SELECT json_group_array(id) FROM (SELECT id FROM jobs WHERE state = 'queued'"
                "  AND available_at <= :now AND attempts = 0 ORDER BY id LIMIT :fresh))",
                {"now": now, "any": claim.limit,
                 "expired": claim.limit + len(claim.exclude) if claim.limit else 0,
                 "fresh": claim.limit + claim.fresh_extra if claim.fresh_extra else 0},
            ).fetchone()
            due, expired, fresh = (json.loads(v) if v else [] for v in row)
            first = sorted([*due, *(i for i in expired if i not in claim.exclude)])
            first = first[:claim.limit]
            chosen = set(first)
            ahead = [i for i in fresh if i not in chosen][:claim.fresh_extra]
            if not first and not ahead:
                return [], []
            runnable: list[list[Any]] = []
            gave_up = False
            for job in self._job_rows(conn, [*first, *ahead]):
                if job[6] >= self.max_attempts:
                    # Only a run that never reported back gets here (fail_job stops retries
                    # itself). A payload that kills the worker every time must not do so
                    # forever.
                    self._set_state(job[0], "failed",
                                    f"gave up after {job[6]} attempts that never finished")
                    gave_up = True
                else:
                    runnable.append(job)
            if gave_up:
                # Their places go to the next ones: look again (they are failed now).
                continue
            return self._lease(conn, runnable, claim.lease_seconds, now, inserted)

    @staticmethod
    def _job_rows(conn: sqlite3.Connection, ids: list[int]) -> list[list[Any]]:
        """[id, delivery id, event, action, repo, installation id, attempts] per job, by id."""
        return sorted(_json_list(conn.execute(
            "SELECT json_group_array(json_array(j.id, j.delivery_id, d.event, d.action,"
            " d.repo, d.installation_id, j.attempts)) FROM jobs j JOIN deliveries d"
            f" USING (delivery_id) WHERE j.id IN ({_marks(len(ids))})", ids)))

    @staticmethod
    def _lease(conn: sqlite3.Connection, rows: list[list[Any]], lease_seconds: float,
               now: float, inserted: dict[str, bytes]) -> tuple[list[Job], list[int]]:
        if not rows:
            return [], []
        ids = [row[0] for row in rows]
        marks = _marks(len(ids))
        conn.execute("UPDATE jobs SET state = 'running', attempts = attempts + 1,"
                     f" lease_until = ? WHERE id IN ({marks})", (now + lease_seconds, *ids))
        conn.execute("UPDATE deliveries SET state = 'running', updated_at = ? WHERE delivery_id"
                     f" IN (SELECT delivery_id FROM jobs WHERE id IN ({marks}))", (now, *ids))
        # Bodies recorded in this transaction are in hand; the others are read after it.
        unread = [row[0] for row in rows if row[1] not in inserted]
        return [Job(job_id, delivery_id, event, action, repo, inst,
                    inserted.get(delivery_id, b""), attempts + 1)
                for job_id, delivery_id, event, action, repo, inst, attempts in rows], unread

    def _with_bodies(self, jobs: list[Job], unread: list[int]) -> list[Job]:
        """``jobs`` with the bodies of ``unread`` read, outside the transaction that leased
        them: a backlog's bodies are hundreds of kB, and another process (a receiver beside
        this worker) waits for the write lock as long as it is held. A leased job's body does
        not change or go (``prune`` takes only finished deliveries)."""
        if not unread:
            return jobs
        stored: dict[int, bytes] = {}
        try:
            refs: list[tuple[int, str, str]] = []
            with self._lock:
                for chunk in _chunks(unread, _IN_CHUNK):
                    for job_id, delivery_id, body, ref in self._conn.execute(
                            "SELECT j.id, j.delivery_id, COALESCE(p.body, j.payload), p.ref"
                            " FROM jobs j LEFT JOIN payloads p USING (delivery_id)"
                            f" WHERE j.id IN ({_marks(len(chunk))})", chunk):
                        if ref is None:
                            stored[job_id] = body
                        else:
                            refs.append((job_id, delivery_id, ref))
            for job_id, delivery_id, ref in refs:
                stored[job_id] = self._journal_body(delivery_id, ref)
        except sqlite3.Error as exc:
            # The lease is committed: raising now would have the caller write the round again
            # and report its new deliveries as redeliveries. Those jobs go back to the queue
            # instead (or, if even that fails, come back when their lease runs out).
            log.warning("store: could not read the bodies of %d leased job(s) (%s); given back",
                        len(unread), exc)
            with contextlib.suppress(sqlite3.Error):
                self.release_jobs(unread)
            missing = set(unread)
            return [job for job in jobs if job.id not in missing]
        return [dataclasses.replace(job, payload=stored[job.id]) if job.id in stored else job
                for job in jobs]

    def _journal_body(self, delivery_id: str, ref: str) -> bytes:
        try:
            return read_journal_body(self.path.parent, ref)
        except FileNotFoundError:
            # Copied here and its segment deleted since the row was read: read it again.
            with self._lock:
                row = self._conn.execute("SELECT body, ref FROM payloads WHERE delivery_id = ?",
                                         (delivery_id,)).fetchone()
            if row is not None and row[1] is None:
                return bytes(row[0])
            log.error("store: the body of delivery %s is gone (journal %s deleted); its job "
                      "fails", delivery_id, ref)
            return b""
        except (OSError, ValueError) as exc:
            log.error("store: the body of delivery %s could not be read from journal %s (%s); "
                      "its job fails", delivery_id, ref, exc)
            return b""

    def journal_waiting(self, slot: int, segment: int) -> list[tuple[str, str]]:
        """(delivery id, ref) of the bodies kept in a journal segment whose job is not done:
        what must be copied here before the segment may go."""
        prefix = f"{slot}/{segment}:"
        with self._lock:
            return [(str(d), str(r)) for d, r in self._conn.execute(
                "SELECT p.delivery_id, p.ref FROM payloads p JOIN jobs j USING (delivery_id)"
                " WHERE p.ref >= ? AND p.ref < ? AND j.state != 'done'",
                (prefix, prefix[:-1] + ";"))]

    def journal_waits(self, slot: int, segment: int) -> bool:
        """Whether some job not done has its body in that journal segment."""
        prefix = f"{slot}/{segment}:"
        with self._lock:
            return bool(self._conn.execute(
                "SELECT EXISTS (SELECT 1 FROM payloads p JOIN jobs j USING (delivery_id)"
                " WHERE p.ref >= ? AND p.ref < ? AND j.state != 'done')",
                (prefix, prefix[:-1] + ";")).fetchone()[0])

    def keep_bodies(self, bodies: list[tuple[str, str, bytes]]) -> int:
        """Store bodies read from the journal, (delivery id, ref, body), where the row still
        points at that ref; how many were stored."""
        stored = 0
        with self._write() as conn:
            for delivery_id, ref, body in bodies:
                stored += conn.execute(
                    "UPDATE payloads SET body = ?, ref = NULL WHERE delivery_id = ? AND ref = ?",
                    (body, delivery_id, ref)).rowcount
        return stored

    def release_jobs(self, job_ids: list[int]) -> int:
        """Give back leased jobs that were never started (a worker stopping with jobs in hand):
        queued again at once, their attempt not counted. Returns how many were released."""
        if not job_ids:
            return 0
        now = self._clock()
        with self._write() as conn:
            marks = ",".join("?" * len(job_ids))
            ids = [r[0] for r in conn.execute(
                f"SELECT id FROM jobs WHERE state = 'running' AND id IN ({marks})", job_ids)]
            if ids:
                marks = ",".join("?" * len(ids))
                conn.execute(
                    "UPDATE jobs SET state = 'queued', attempts = max(attempts - 1, 0),"
                    f" lease_until = NULL, available_at = ? WHERE id IN ({marks})", (now, *ids))
                conn.execute(
                    "UPDATE deliveries SET state = 'queued', updated_at = ? WHERE delivery_id"
                    f" IN (SELECT delivery_id FROM jobs WHERE id IN ({marks}))", (now, *ids))
            return len(ids)

    def _set_state(self, job_id: int, state: str, error: str | None) -> None:
        # Caller holds the write transaction; the delivery's state mirrors its job's.
        now = self._clock()
        self._conn.execute(
            "UPDATE jobs SET state = ?, lease_until = NULL, last_error = coalesce(?, last_error)"
            " WHERE id = ?",
            (state, error if error is None else error[:_MAX_ERROR_CHARS], job_id),
        )
        self._conn.execute(
            "UPDATE deliveries SET state = ?, updated_at = ?"
            " WHERE delivery_id = (SELECT delivery_id FROM jobs WHERE id = ?)",
            (state, now, job_id),
        )

    def complete_job(self, job_id: int) -> bool:
        """Mark a job done. False if it is unknown or already done."""
        return self.complete_jobs([job_id])[0]

    def complete_jobs(self, job_ids: list[int]) -> list[bool]:
        """``complete_job`` for many, in one transaction."""
        if not job_ids:
            return []
        with self._write() as conn:
            return self._complete(conn, job_ids, self._clock())

    def fail_job(self, job_id: int, error: str, retry_in: float | None = None) -> bool:
        """Record a failed run: retry after ``retry_in`` seconds, or dead-letter the job.

        The job is dead (``failed``) without ``retry_in`` or once it has used ``max_attempts``.
        Returns False if the job is not running (unknown, or already finished).
        """
        with self._write() as conn:
            row = conn.execute(
                "SELECT state, attempts FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None or row[0] != "running":
                return False
            if retry_in is None or row[1] >= self.max_attempts:
                self._set_state(job_id, "failed", error)
            else:
                self._set_state(job_id, "queued", error)
                conn.execute(
                    "UPDATE jobs SET available_at = ? WHERE id = ?",
                    (self._clock() + max(retry_in, 0.0), job_id),
                )
            return True

    def recover(self) -> int:
        """At startup: every running job belonged to a dead process; queue them again."""
        with self._write() as conn:
            ids = [r[0] for r in conn.execute("SELECT id FROM jobs WHERE state = 'running'")]
            for job_id in ids:
                self._set_state(job_id, "queued", None)
            return len(ids)

    def pending_count(self) -> int:
        """Jobs not finished yet: queued (due or later) and running."""
        with self._lock:
            row = self._conn.execute(
                "SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')"
            ).fetchone()
            return int(row[0])

    def failed_count(self) -> int:
        """Deliveries given up on, kept with their reason for inspection."""
        with self._lock:
            row = self._conn.execute(
                "SELECT COUNT(*) FROM jobs WHERE state = 'failed'"
            ).fetchone()
        return int(row[0])

    def prune(self, older_than_seconds: float) -> int:
        """Delete done deliveries (and their jobs) finished more than that long ago.

        Failed ones stay for inspection; comments are never pruned, since the comment ledger is
        what stops a second comment on an old issue. A pruned delivery id is forgotten, so a
        redelivery of it after that would be processed again.
        """
        cutoff = self._clock() - older_than_seconds
        with self._write() as conn:
            return conn.execute(
                "DELETE FROM deliveries WHERE state = 'done' AND updated_at < ?", (cutoff,)
            ).rowcount

    # -- comment ledger ---------------------------------------------------------------------

    def get_comment(self, repo: str, issue: int) -> CommentRecord | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT repo, issue, comment_id, cluster, score, body_hash, created_at, updated_at"
                " FROM comments WHERE repo = ? AND issue = ?",
                (repo.lower(), issue),
            ).fetchone()
        return None if row is None else CommentRecord(*row)

    def comments_for_cluster(self, repo: str, cluster: str) -> list[CommentRecord]:
        """Every issue where the bot named this cluster (to correct them if its fix is reverted)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT repo, issue, comment_id, cluster, score, body_hash, created_at, updated_at"
                " FROM comments WHERE repo = ? AND cluster = ? ORDER BY issue",
                (repo.lower(), cluster),
            ).fetchall()
        return [CommentRecord(*row) for row in rows]

    def record_comment(
        self,
        repo: str,
        issue: int,
        comment_id: int,
        cluster: str | None,
        score: float | None,
        body_hash: str,
    ) -> None:
        now = self._clock()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO comments (repo, issue, comment_id, cluster, score, body_hash,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (repo, issue) DO UPDATE SET comment_id = excluded.comment_id,"
                " cluster = excluded.cluster, score = excluded.score,"
                " body_hash = excluded.body_hash, updated_at = excluded.updated_at",
                (repo.lower(), issue, comment_id, cluster, score, body_hash, now, now),
            )

    # -- learned clusters -------------------------------------------------------------------

    def put_learned(self, cluster: Cluster) -> None:
        """Store (or replace) a learned cluster and index its members, so that a later PR or
        issue finds the cluster it belongs to."""
        repo = cluster.repo.lower()
        now = self._clock()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO learned_clusters (repo, public_id, record, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (repo, public_id) DO UPDATE SET"
                " record = excluded.record, updated_at = excluded.updated_at",
                (repo, cluster.public_id, cluster.model_dump_json(exclude_none=True), now),
            )
            conn.execute("DELETE FROM learned_members WHERE repo = ? AND public_id = ?",
                         (repo, cluster.public_id))
            conn.executemany(
                "INSERT OR REPLACE INTO learned_members (repo, kind, number, public_id)"
                " VALUES (?, ?, ?, ?)",
                [(repo, m.kind, m.number, cluster.public_id) for m in cluster.members],
            )

    def find_learned(self, repo: str, kind: str, number: int) -> Cluster | None:
        """The learned cluster that has this issue or PR as a member."""
        with self._lock:
            row = self._conn.execute(
                "SELECT c.record FROM learned_members m JOIN learned_clusters c"
                " ON c.repo = m.repo AND c.public_id = m.public_id"
                " WHERE m.repo = ? AND m.kind = ? AND m.number = ?",
                (repo.lower(), kind, number),
            ).fetchone()
        return None if row is None else Cluster.model_validate_json(row[0])

    def learned_clusters(self, repo: str | None = None) -> list[Cluster]:
        with self._lock:
            if repo is None:
                rows = self._conn.execute(
                    "SELECT record FROM learned_clusters ORDER BY repo, public_id").fetchall()
            else:
                rows = self._conn.execute(
                    "SELECT record FROM learned_clusters WHERE repo = ? ORDER BY public_id",
                    (repo.lower(),)).fetchall()
        return [Cluster.model_validate_json(r[0]) for r in rows]

    def learned_count(self) -> int:
        """How many learned clusters there are, without parsing any of them."""
        with self._lock:
            row = self._conn.execute("SELECT COUNT(*) FROM learned_clusters").fetchone()
        return int(row[0])

    def learned_version(self) -> str:
        """Changes whenever a learned cluster is written: the index rebuilds on a new value."""
        with self._lock:
            row = self._conn.execute(
                "SELECT COUNT(*), COALESCE(MAX(updated_at), 0) FROM learned_clusters"
            ).fetchone()
        return f"{row[0]}:{row[1]}"

    # -- cursors (resumable backfills) ------------------------------------------------------

    def get_cursor(self, name: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM cursors WHERE name = ?",
                                     (name,)).fetchone()
        return None if row is None else str(row[0])

    def set_cursor(self, name: str, value: str | None) -> None:
        with self._write() as conn:
            if value is None:
                conn.execute("DELETE FROM cursors WHERE name = ?", (name,))
            else:
                conn.execute(
                    "INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET value = excluded.value,"
                    " updated_at = excluded.updated_at", (name, value, self._clock()))

    # -- feedback and pauses (maintainers' commands) ----------------------------------------

    def comments_in_last(self, repo: str, seconds: float) -> int:
        """New comments (ledger rows first written) in this repository in the last seconds."""
        since = self._clock() - seconds
        with self._lock:
            row = self._conn.execute(
                "SELECT COUNT(*) FROM comments WHERE repo = ? AND created_at >= ?",
                (repo.lower(), since),
            ).fetchone()
        return int(row[0])

    def record_feedback(self, repo: str, issue: int, cluster: str, kind: str,
                        login: str | None) -> None:
        """``dismissed``: never suggest this cluster on this issue again; ``confirmed``: a
        maintainer said the issue belongs to it. The latest word on a pair wins."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO feedback (repo, issue, cluster, kind, login, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (repo, issue, cluster) DO UPDATE SET"
                " kind = excluded.kind, login = excluded.login, created_at = excluded.created_at",
                (repo.lower(), issue, cluster, kind, login, self._clock()),
            )

    def feedback_for(self, repo: str, issue: int) -> dict[str, str]:
        """cluster -> ``dismissed`` | ``confirmed`` for one issue."""
        with self._lock:
            return self._feedback(repo, issue)

    def _feedback(self, repo: str, issue: int) -> dict[str, str]:
        rows = self._conn.execute(
            "SELECT cluster, kind FROM feedback WHERE repo = ? AND issue = ?",
            (repo.lower(), issue),
        ).fetchall()
        return {str(c): str(k) for c, k in rows}

    def dismissal_rate(self, repo: str, window: int, since: float = 0.0) -> tuple[int, int]:
        """(dismissed, suggestions) over the latest ``window`` suggestions (comment ledger
        rows with a match score, i.e. made by the matcher, not by a maintainer's ``same-as``)
        first made after ``since``; a suggestion counts as dismissed when its issue has a
        dismissal of the cluster it names."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT EXISTS (SELECT 1 FROM feedback f WHERE f.repo = c.repo"
                " AND f.issue = c.issue AND f.cluster = c.cluster AND f.kind = 'dismissed')"
                " FROM comments c WHERE c.repo = ? AND c.created_at > ?"
                " AND c.cluster IS NOT NULL AND c.score IS NOT NULL"
                " ORDER BY c.created_at DESC, c.issue DESC LIMIT ?",
                (repo.lower(), since, window),
            ).fetchall()
        return sum(int(r[0]) for r in rows), len(rows)

    def get_pause(self, repo: str) -> Pause | None:
        with self._lock:
            return self._pause(repo)

    def _pause(self, repo: str) -> Pause | None:
        row = self._conn.execute(
            "SELECT repo, paused, reason, config_hash, issue, announced, paused_at,"
            " resumed_at, resumed_by FROM pauses WHERE repo = ?", (repo.lower(),),
        ).fetchone()
        if row is None:
            return None
        return Pause(row[0], bool(row[1]), row[2], row[3], row[4], bool(row[5]), row[6],
                     row[7], row[8])

    def issue_facts(self, repo: str, issue: int) -> tuple[dict[str, str], Pause | None]:
        """``feedback_for`` and ``get_pause`` in one call: what the known-fix handler reads
        before it matches, for one thread hop instead of two."""
        with self._lock:
            return self._feedback(repo, issue), self._pause(repo)

    def pause(self, repo: str, reason: str, config_hash: str) -> bool:
        """Pause the repository; False when it already was (so a pause is announced once)."""
        now = self._clock()
        with self._write() as conn:
            row = conn.execute("SELECT paused FROM pauses WHERE repo = ?",
                               (repo.lower(),)).fetchone()
            if row is not None and row[0]:
                return False
            conn.execute(
                "INSERT INTO pauses (repo, paused, reason, config_hash, issue, announced,"
                " paused_at, resumed_at, resumed_by) VALUES (?, 1, ?, ?, NULL, 0, ?, NULL, NULL)"
                " ON CONFLICT (repo) DO UPDATE SET paused = 1, reason = excluded.reason,"
                " config_hash = excluded.config_hash, issue = NULL, announced = 0,"
                " paused_at = excluded.paused_at",
                (repo.lower(), reason, config_hash, now),
            )
            return True

    def mark_pause_announced(self, repo: str, issue: int | None) -> None:
        with self._write() as conn:
            conn.execute("UPDATE pauses SET announced = 1, issue = ? WHERE repo = ?",
                         (issue, repo.lower()))

    def resume(self, repo: str, by: str) -> bool:
        """Lift a pause; False when the repository was not paused. The dismissal window starts
        afresh from now."""
        with self._write() as conn:
            return conn.execute(
                "UPDATE pauses SET paused = 0, resumed_at = ?, resumed_by = ?"
                " WHERE repo = ? AND paused = 1", (self._clock(), by, repo.lower()),
            ).rowcount > 0
