"""The embedded backend: one SQLite file (WAL) under ``DEJAFIX_DATA_DIR``, one worker process.

SQLite has one writer at a time, so every claim and cap check is serialised by the write lock
itself; notifications go to this process's listeners after the commit. A second worker on the
same directory is refused (``lock_data_dir``): with no leases to trust across processes,
``recover`` requeues every job left running at start.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from bot.db import legacy, schema
from bot.db.store import Rows, Store, StoreVersionError, issue_key

log = logging.getLogger("dejafix.store")

DB_FILENAME = "dejafix.sqlite3"
LOCK_FILENAME = "dejafix.lock"
# Held while a process sets the file up (WAL mode, migrations): see ``_opening``.
OPEN_LOCK_FILENAME = "dejafix.open.lock"
# Seconds a process waits for another one's setup (a migration of a large file included).
OPEN_WAIT_SECONDS = 120.0


@contextmanager
def _opening(data_dir: Path, timeout: float = OPEN_WAIT_SECONDS) -> Iterator[None]:
    """One process at a time sets a store file up: ``PRAGMA journal_mode = WAL`` fails with
    "database is locked" at once, without SQLite's busy wait, while another connection is
    switching the file to WAL. The kernel drops the lock with its process, however it ends."""
    if sys.platform == "win32":  # no flock
        yield
        return
    import fcntl

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
            except OSError as exc:  # a file system without flock: open as before, untaken
                log.debug("store: %s cannot be locked (%s)", OPEN_LOCK_FILENAME, exc)
                break
        yield
    finally:
        os.close(fd)


def _owner_only(path: Path) -> None:
    """The database file, made 0600 before SQLite opens it (its -wal and -shm files take the
    main file's mode), or tightened to 0600 if an earlier version left it readable by others:
    it holds delivery payloads."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        with suppress(FileNotFoundError):
            if side.stat().st_mode & 0o077:
                side.chmod(0o600)


class DataDirInUse(RuntimeError):
    """Another live process runs jobs from this data directory."""


def lock_data_dir(data_dir: Path) -> IO[str] | None:
    """Take the data directory's jobs for this process, for as long as the returned file stays
    open. ``recover`` requeues every running job because it assumes their process is dead; a
    second live worker would run the first one's jobs again. The kernel drops an flock when its
    process dies, even by SIGKILL, so a restart after a crash is never refused."""
    if sys.platform == "win32":
        return None
    import fcntl

    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = (data_dir / LOCK_FILENAME).open("a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise DataDirInUse(
            f"{data_dir} is in use by another Dejafix worker (pid {holder}); stop it first, "
            "or its unfinished deliveries would be run twice (several processes need "
            "PostgreSQL: DATABASE_URL)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class _Tx:
    __slots__ = ("conn", "notes")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.notes: list[tuple[str, str]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, params: list[Sequence[Any]]) -> None:
        self.conn.executemany(sql, params)

    def serialise(self, key: str) -> None:
        pass  # BEGIN IMMEDIATE: one writer at a time already

    def notify(self, channel: str, payload: str) -> None:
        self.notes.append((channel, payload))


class SQLiteStore(Store):
    backend = "sqlite"
    unavailable = (sqlite3.OperationalError, OSError)
    unstorable = (UnicodeError,)
    # jobs.payload is a column of schema step 1, always empty since step 4 (dropping a column
    # needs SQLite 3.35).
    _job_insert = ("INSERT INTO jobs (delivery_id, repo, issue_key, state, available_at,"
                   " payload) VALUES (?, ?, ?, 'queued', ?, X'')")

    def __init__(self, data_dir: Path, *, max_attempts: int = 5,
                 clock: Callable[[], float] = time.time, busy_timeout_ms: int = 5000) -> None:
        super().__init__(max_attempts=max_attempts, clock=clock)
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.path: Path = data_dir / DB_FILENAME
        _owner_only(self.path)
        # isolation_level=None: every write opens its own BEGIN IMMEDIATE, so the write lock is
        # taken before anything is read.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            with _opening(data_dir):
                self._conn.execute("PRAGMA journal_mode = WAL")
                # NORMAL in WAL mode loses no committed transaction when the process dies,
                # only possibly the last ones on power loss.
                self._conn.execute("PRAGMA synchronous = NORMAL")
                self._conn.execute("PRAGMA foreign_keys = ON")
                self._migrate()
        except BaseException:
            self._conn.close()
            raise

    def describe(self) -> str:
        return f"SQLite {self.path}"

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _write(self) -> Iterator[_Tx]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            tx = _Tx(self._conn)
            try:
                yield tx
            except BaseException:
                # Some errors (disk full, I/O) make SQLite roll back by itself; a second
                # ROLLBACK would then raise and hide the original error.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        for channel, payload in tx.notes:
            self._deliver(channel, payload)

    @contextmanager
    def _read(self) -> Iterator[_Tx]:
        with self._lock:
            yield _Tx(self._conn)

    def _migrate(self) -> None:
        latest = schema.check(schema.SQLITE)
        with self._write() as tx:
            # Read inside the write transaction: two processes opening a fresh file at once must
            # not both apply step 1.
            current = int(tx.execute("PRAGMA user_version").fetchone()[0])
            if current > latest:
                raise StoreVersionError(
                    f"{self.path}: schema version {current} is newer than this Dejafix supports "
                    f"(version {latest}); upgrade Dejafix or point it at another data directory")
            for version, script in schema.SQLITE[current:]:
                if version == 6 and current > 0:
                    legacy.copy_bodies(self._conn, self.data_dir)
                for statement in schema.statements(script):
                    tx.execute(statement)
                tx.execute(f"PRAGMA user_version = {version}")
            if 0 < current < 6:
                self._upgrade_jobs(tx)
        if 0 < current < 6:
            legacy.retire(self.data_dir)

    def _upgrade_jobs(self, tx: _Tx) -> None:
        """After step 6 on a file of an earlier version: the deliveries its journal accepted
        and never recorded are recorded, and every unfinished job gets its issue key."""
        now = self._clock()
        recorded = 0
        for delivery_id, event, action, repo, installation_id, body in \
                legacy.unrecorded(self._conn, self.data_dir):
            if not tx.execute(
                    "INSERT INTO deliveries (delivery_id, event, action, repo, installation_id,"
                    " received_at, updated_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued')"
                    " ON CONFLICT (delivery_id) DO NOTHING",
                    (delivery_id, event, action, repo, installation_id, now, now)).rowcount:
                continue
            tx.execute(self._job_insert, (delivery_id, repo.lower() if repo else None, None, now))
            tx.execute("INSERT INTO payloads (delivery_id, body) VALUES (?, ?)",
                       (delivery_id, body))
            recorded += 1
        if recorded:
            log.info("store: %d delivery(ies) accepted by the earlier version's journal and "
                     "never recorded are queued now", recorded)
        rows = tx.execute(
            "SELECT j.id, j.repo, p.body FROM jobs j JOIN payloads p"
            " ON p.delivery_id = j.delivery_id WHERE j.state IN ('queued', 'running')"
            " AND j.issue_key IS NULL").fetchall()
        for job_id, repo, body in rows:
            key = issue_key(repo, legacy.issue_number(bytes(body)))
            if key is not None:
                tx.execute("UPDATE jobs SET issue_key = ? WHERE id = ?", (key, job_id))

    def schema_version(self) -> int:
        with self._read() as tx:
            return int(tx.execute("PRAGMA user_version").fetchone()[0])

    def recover(self) -> int:
        """Every running job belonged to a dead process: this one holds the directory's lock."""
        return self._requeue_running()

    def learned_records(self, repo: str | None = None) -> Generator[str, None, None]:
        # A connection of its own, read-only: in WAL mode it reads a consistent snapshot while
        # the bot keeps writing, and the rows are streamed, not fetched at once.
        uri = self.path.resolve().as_uri() + "?mode=ro"
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
