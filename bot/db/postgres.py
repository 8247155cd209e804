"""The shared backend: PostgreSQL, for any number of web and worker processes on any hosts.

Claims lock the rows they take (``FOR UPDATE SKIP LOCKED``, so a claim never waits for a job
being completed) and serialise with each other on a transaction-scoped advisory lock, so that
what a claim reads as running is what every other claim committed: one job per issue and the
per-repository bound hold across hosts. A job whose worker died is claimed again when its lease
runs out, never before. The daily cap serialises on an advisory lock per repository.
``LISTEN``/``NOTIFY`` wakes workers when a job is queued and tells every process that learned
clusters or a repository's config changed. Migrations run under a session advisory lock, one
process at a time.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg_pool
from psycopg import sql

from bot.db import schema
from bot.db.store import CHANGES, JOBS, Rows, Store, StoreUnavailable, StoreVersionError

log = logging.getLogger("dejafix.store")

# The first key of every advisory lock Dejafix takes (the second is a hash of what it guards).
LOCK_SPACE = 0x0DE7A
MIGRATE_KEY = 1
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
                 clock: Callable[[], float] = time.time, pool_size: int = 10,
                 connect_timeout: float = 30.0) -> None:
        super().__init__(max_attempts=max_attempts, clock=clock)
        self.url = url
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
        now = self._clock()
        with self._pool.connection() as conn:
            rows = conn.execute(
                "WITH d AS (INSERT INTO deliveries (delivery_id, event, action, repo,"
                " installation_id, received_at, updated_at, state)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, 'queued')"
                " ON CONFLICT (delivery_id) DO NOTHING RETURNING delivery_id),"
                " j AS (INSERT INTO jobs (delivery_id, repo, issue_key, state, available_at)"
                " SELECT delivery_id, %s, %s, 'queued', %s FROM d RETURNING id),"
                " p AS (INSERT INTO payloads (delivery_id, body) SELECT delivery_id, %s FROM d"
                " RETURNING 1)"
                " SELECT pg_notify(%s, '') FROM d, j, p",
                (delivery_id, event, action, repo, installation_id, now, now,
                 repo.lower() if repo else None, issue, now, payload,
                 self.channel(JOBS))).fetchall()
        return bool(rows)

    def channel(self, name: str) -> str:
        return self._channels[name]

    def describe(self) -> str:
        return f"PostgreSQL {redact(self.url)} (schema {self.schema})"

    def close(self) -> None:
        self._pool.close()

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
                log.warning("store: cannot listen for notifications (%s); retrying", exc)
                await asyncio.sleep(LISTEN_RETRY)
                continue
            try:
                async with aconn:
                    for channel in self._channels.values():
                        await aconn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self._deliver("reconnected", "")
                    while True:
                        async for note in aconn.notifies(timeout=LISTEN_CHECK):
                            self._deliver(names.get(note.channel, note.channel), note.payload)
                        async with asyncio.timeout(LISTEN_CHECK):
                            await aconn.execute("SELECT 1")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("store: the notification connection was lost (%s: %s); listening "
                            "again", type(exc).__name__, exc)
                await asyncio.sleep(LISTEN_RETRY)
