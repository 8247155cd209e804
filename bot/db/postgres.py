"""The shared backend: PostgreSQL, for any number of web and worker processes on any hosts.

Claims lock the rows they take (``FOR UPDATE SKIP LOCKED``, so a claim never waits for a job
being completed) and serialise with each other on a transaction-scoped advisory lock, so that
what a claim reads as running is what every other claim committed: one job per issue and the
per-repository bound hold across hosts. The daily cap serialises on an advisory lock per
repository.

Who is alive is the database's word, not a clock's: a worker process claims over a session of its
own, kept for its life, which holds a session advisory lock on a random key (its owner key); the
key is written on every job it claims. PostgreSQL drops the lock when the session ends, and the
session ends with the process (the kernel closes its socket; a host that vanishes is found by
TCP keepalives within seconds), so the next claim anywhere sees the lock free (``pg_locks``) and
takes the job over at once. A worker that is alive but stopped or stuck keeps its session and
its lock: its jobs are taken only when their lease runs out (the attempt is ended first, and the
claim number moves on, so its late result is refused). Leases and due times are read from the
database's clock, so the hosts' clocks do not matter.
``LISTEN``/``NOTIFY`` wakes workers when a job is queued and tells every process that learned
clusters or a repository's config changed. Migrations run under a session advisory lock, one
process at a time.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg_pool
from psycopg import sql

from bot.db import schema
from bot.db.store import (
    CHANGES,
    JOBS,
    Rows,
    Store,
    StoreUnavailable,
    StoreVersionError,
    Tx,
)

log = logging.getLogger("dejafix.store")

# The first key of every advisory lock Dejafix takes (the second is a hash of what it guards).
LOCK_SPACE = 0x0DE7A
MIGRATE_KEY = 1
# The first key of a worker's owner lock (the second is its random owner key): a space of its
# own, so that no hash of another lock's name can pass for a live worker.
OWNER_SPACE = 0x0DE7B
# The owner session's TCP settings, both ends: a peer that vanished (a host powered off, a
# network cut) is found within some 10 s instead of the systems' default of two hours. The
# server's side is what frees a dead worker's lock; the client's is what tells a live worker
# that its session, and so its jobs, may be gone.
OWNER_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5,
                                    "keepalives_interval": 2, "keepalives_count": 3,
                                    "tcp_user_timeout": 10_000}
OWNER_SERVER_SETTINGS = {"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2",
                         "tcp_keepalives_count": "3", "tcp_user_timeout": "10000",
                         # A stopped worker's session must not be ended as idle: it is how
                         # the database knows the worker is alive.
                         "idle_in_transaction_session_timeout": "0",
                         "idle_session_timeout": "0"}
# Seconds between attempts to listen again after the connection was lost.
LISTEN_RETRY = 1.0
# Seconds of silence after which the listening connection is checked with a query: a half-open
# connection (a NAT timeout, a failover without a reset) would otherwise wait for ever.
LISTEN_CHECK = 30.0
# TCP keepalives on the listening connection, for the same reason.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
              "keepalives_count": 3}


def redact(url: str) -> str:
    """The URL (or key=value conninfo) without its password, wherever it is given, for logs."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(an unreadable database URL)"
    params.pop("password", None)
    host = params.get("host") or "localhost"
    where = f"{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"
    user = params.get("user")
    return f"postgresql://{f'{user}@' if user else ''}{where}"


class _Tx:
    __slots__ = ("conn", "store")

    def __init__(self, conn: psycopg.Connection[Any], store: PostgresStore) -> None:
        self.conn = conn
        self.store = store

    def execute(self, query: str, params: Sequence[Any] = ()) -> Rows:
        return self.conn.execute(query.replace("?", "%s"), params)

    def executemany(self, query: str, params: list[Sequence[Any]]) -> None:
        with self.conn.cursor() as cur:
            cur.executemany(query.replace("?", "%s"), params)

    def serialise(self, key: str) -> None:
        self.conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (LOCK_SPACE, key))

    def notify(self, channel: str, payload: str) -> None:
        self.conn.execute("SELECT pg_notify(%s, %s)", (self.store.channel(channel), payload))


class PostgresStore(Store):
    backend = "postgresql"
    unavailable = (psycopg.OperationalError, psycopg_pool.PoolTimeout, StoreUnavailable, OSError)
    unstorable = (UnicodeError, psycopg.DataError)
    _skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, *, max_attempts: int = 5,
                 clock: Callable[[], float] | None = None, pool_size: int = 10,
                 connect_timeout: float = 30.0) -> None:
        # Without a clock (tests move one by hand) the queue runs by the database's.
        super().__init__(max_attempts=max_attempts, clock=clock or time.time)
        self._database_clock = clock is None
        self.url = url
        self._connect_timeout = connect_timeout
        # The owner session (``_owner_session``): opened by the first claim, one per store.
        self._owner_lock = threading.Lock()
        self._owner_conn: psycopg.Connection[Any] | None = None
        self._owner_key: int | None = None
        self.listening: bool | None = False
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=pool_size, open=False, timeout=connect_timeout,
            kwargs={"autocommit": True}, name="dejafix")
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except psycopg_pool.PoolTimeout as exc:
            self._pool.close()
            raise StoreUnavailable(f"PostgreSQL at {redact(url)}: no connection within "
                                   f"{connect_timeout:g} s") from exc
        try:
            with self._pool.connection() as conn:
                found = conn.execute("SELECT current_schema()").fetchone()
                self.schema = str(found[0]) if found and found[0] else "public"
                self._migrate(conn)
        except BaseException:
            self._pool.close()
            raise
        # Channels are per database, schemas are not: a schema of its own gets channels of
        # its own (tests, or two deployments in one database).
        suffix = "" if self.schema == "public" else "_" + re.sub(r"\W", "_", self.schema)[:40]
        self._channels = {name: f"dejafix_{name}{suffix}" for name in (JOBS, CHANGES)}

    def accept_delivery(self, delivery_id: str, event: str, action: str | None,
                        repo: str | None, installation_id: int | None, payload: bytes,
                        issue: str | None = None) -> bool:
        """As the base class's, in one statement (so one round trip, its own transaction): the
        receiver's cost on PostgreSQL was the five round trips of the transaction."""
        now = None if self._database_clock else self._clock()
        with self._pool.connection() as conn:
            rows = conn.execute(
                "WITH t AS (SELECT coalesce(%s::float8,"
                " extract(epoch FROM statement_timestamp())::float8) AS now),"
                " d AS (INSERT INTO deliveries (delivery_id, event, action, repo,"
                " installation_id, received_at, updated_at, state)"
                " SELECT %s, %s, %s, %s, %s, t.now, t.now, 'queued' FROM t"
                " ON CONFLICT (delivery_id) DO NOTHING RETURNING delivery_id, received_at),"
                " j AS (INSERT INTO jobs (delivery_id, repo, issue_key, state, available_at)"
                " SELECT delivery_id, %s, %s, 'queued', received_at FROM d RETURNING id),"
                " p AS (INSERT INTO payloads (delivery_id, body) SELECT delivery_id, %s FROM d"
                " RETURNING 1)"
                " SELECT pg_notify(%s, '') FROM d, j, p",
                (now, delivery_id, event, action, repo, installation_id,
                 repo.lower() if repo else None, issue, payload,
                 self.channel(JOBS))).fetchall()
        return bool(rows)

    def channel(self, name: str) -> str:
        return self._channels[name]

    def describe(self) -> str:
        return f"PostgreSQL {redact(self.url)} (schema {self.schema})"

    def close(self) -> None:
        with self._owner_lock:
            self._drop_owner()
        self._pool.close()

    # -- who is alive -----------------------------------------------------------------------

    def _now(self, tx: Tx) -> float:
        if not self._database_clock:
            return self._clock()
        # clock_timestamp, not now(): the claim may have waited for another claim's lock.
        return float(tx.execute("SELECT extract(epoch FROM clock_timestamp())::float8"
                                ).fetchone()[0])

    def _live_owners(self, tx: Tx) -> set[int] | None:
        rows = tx.execute(
            "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = ?::oid AND objsubid = 2"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (OWNER_SPACE,)).fetchall()
        return {int(r[0]) for r in rows}

    def _owner_session(self) -> tuple[psycopg.Connection[Any], int]:
        """This process's owner session and key, opened on first use (under ``_owner_lock``).
        Its lock is what tells every other process that this one is alive."""
        if self._owner_conn is not None and not self._owner_conn.closed \
                and self._owner_key is not None:
            return self._owner_conn, self._owner_key
        self._drop_owner()
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=max(
            1, int(self._connect_timeout)), **OWNER_KEEPALIVES)
        try:
            # Settings an older server lacks (idle_session_timeout: 14) are left out.
            known = {str(r[0]) for r in conn.execute(
                "SELECT name FROM pg_settings WHERE name = ANY(%s)",
                (list(OWNER_SERVER_SETTINGS),)).fetchall()}
            for name in sorted(known):
                conn.execute("SELECT set_config(%s, %s, false)",
                             (name, OWNER_SERVER_SETTINGS[name]))
            while True:
                # Random, and checked free: two stores (schemas) of one database never share
                # a key, and a key is never used twice (a new session gets a new one).
                key = secrets.randbelow(2**31 - 2) + 1
                got = conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                                   (OWNER_SPACE, key)).fetchone()
                if got and got[0]:
                    break
        except BaseException:
            conn.close()
            raise
        self._owner_conn, self._owner_key = conn, key
        log.info("store: jobs claimed by this process are held by database session %d "
                 "(owner %d)", conn.info.backend_pid, key)
        return conn, key

    def _drop_owner(self) -> None:
        conn, self._owner_conn, self._owner_key = self._owner_conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # already broken: nothing to close
                log.debug("store: closing the owner session: %s", exc)

    @contextmanager
    def _claiming(self) -> Iterator[tuple[Tx, int | None]]:
        # The claim runs over the owner session itself: if that session is gone the claim
        # fails, so no job is ever recorded under an owner that is already dead.
        with self._owner_lock:
            conn, key = self._owner_session()
            try:
                with conn.transaction():
                    yield _Tx(conn, self), key
            except psycopg.OperationalError:
                self._drop_owner()
                raise

    def check_owner(self) -> int | None:
        with self._owner_lock:
            conn, key = self._owner_conn, self._owner_key
            if conn is None:
                return None
            try:
                conn.execute("SELECT 1")
            except psycopg.Error as exc:
                log.warning("store: the session holding this process's jobs was lost (%s); "
                            "they are other workers' to take now", exc)
                self._drop_owner()
                return None
            return key

    @contextmanager
    def _write(self) -> Iterator[_Tx]:
        with self._pool.connection() as conn, conn.transaction():
            yield _Tx(conn, self)

    @contextmanager
    def _read(self) -> Iterator[_Tx]:
        with self._pool.connection() as conn:
            yield _Tx(conn, self)

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        latest = schema.check(schema.POSTGRES)
        # A session lock: held across the steps' own transactions, one process at a time.
        conn.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_SPACE, MIGRATE_KEY))
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS dejafix_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT max(version) FROM dejafix_schema").fetchone()
            current = int(row[0]) if row and row[0] is not None else 0
            if current > latest:
                raise StoreVersionError(
                    f"{self.describe()}: schema version {current} is newer than this Dejafix "
                    f"supports (version {latest}); upgrade Dejafix")
            for version, script in schema.POSTGRES[current:]:
                with conn.transaction():
                    for statement in schema.statements(script):
                        conn.execute(statement)
                    conn.execute("INSERT INTO dejafix_schema (version) VALUES (%s)", (version,))
                log.info("store: PostgreSQL schema migrated to version %d", version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (LOCK_SPACE, MIGRATE_KEY))

    def schema_version(self) -> int:
        with self._read() as tx:
            row = tx.execute("SELECT max(version) FROM dejafix_schema").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def learned_records(self, repo: str | None = None) -> Generator[str, None, None]:
        # A server-side cursor: the rows come in batches, not all at once.
        with self._pool.connection() as conn, conn.transaction(), \
                conn.cursor(name="dejafix_learned") as cur:
            if repo is None:
                cur.execute("SELECT record FROM learned_clusters ORDER BY repo, public_id")
            else:
                cur.execute("SELECT record FROM learned_clusters WHERE repo = %s"
                            " ORDER BY public_id", (repo.lower(),))
            for (record,) in cur:
                yield str(record)

    async def listen(self) -> None:
        """LISTEN on the channels and hand every notification to the listeners. Each time the
        LISTEN is in place (at start too) the listeners are told ``("reconnected", "")``: what
        was notified before is lost to this process, so they drop what they cached."""
        names = {v: k for k, v in self._channels.items()}
        while True:
            try:
                aconn = await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                              **KEEPALIVES)
            except Exception as exc:
                self.listening = False
                log.warning("store: cannot listen for notifications (%s); retrying", exc)
                await asyncio.sleep(LISTEN_RETRY)
                continue
            try:
                async with aconn:
                    for channel in self._channels.values():
                        await aconn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self.listening = True
                    self._deliver("reconnected", "")
                    while True:
                        async for note in aconn.notifies(timeout=LISTEN_CHECK):
                            self._deliver(names.get(note.channel, note.channel), note.payload)
                        async with asyncio.timeout(LISTEN_CHECK):
                            await aconn.execute("SELECT 1")
            except asyncio.CancelledError:
                self.listening = False
                raise
            except Exception as exc:
                self.listening = False
                log.warning("store: the notification connection was lost (%s: %s); listening "
                            "again", type(exc).__name__, exc)
                await asyncio.sleep(LISTEN_RETRY)
