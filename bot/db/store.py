"""The durable store, as both backends serve it: the delivery ledger and job queue, the comment
ledger, learned clusters, maintainers' feedback, pauses and backfill cursors.

A delivery accepted is a delivery processed: the receiver records it and its job in one
transaction before answering 202; a worker claims a job with a lease, counts an attempt when it
starts it, and records it done or failed. A job whose worker died is taken over by the next claim
when the backend can tell (PostgreSQL: the worker's database session ended, and the advisory lock
it held with it), else when its lease runs out; a job whose worker is alive is taken from it only
when its lease runs out, and then its attempt is ended first (the late worker's result is refused:
every change names the claim). The claim runs at most one job per issue and at most ``per_repo``
per repository at a time, over every process that shares the database.

The SQL is written once, with ``?`` parameters, for both backends (``bot.db.sqlite``,
``bot.db.postgres``); a backend supplies transactions, its row locking and its notifications.
Every method is synchronous and thread-safe: async code calls it through ``asyncio.to_thread``.
Nothing here knows about GitHub or HTTP.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from bot.clusters.models import Cluster

log = logging.getLogger("dejafix.store")

# A traceback can be arbitrarily long; the ledger keeps enough to diagnose, not a log.
MAX_ERROR_CHARS = 8000
# A daily-cap slot reserved before posting and not turned into a comment (the post failed, the
# worker died) is given back after this long.
SLOT_SECONDS = 600.0
# A pause announcement claimed and not finished is claimable again after this long.
ANNOUNCE_SECONDS = 300.0
# Below SQLite's oldest limit of 999 parameters per statement.
_IN_CHUNK = 500

# The notification channels (PostgreSQL: LISTEN/NOTIFY; SQLite: within the process).
JOBS = "jobs"  # a job was queued: wake a worker
CHANGES = "changes"  # "learned:<repo>" or "config:<repo>": drop what was cached

Listener = Callable[[str, str], None]


class StoreVersionError(RuntimeError):
    """The database was written by a newer Dejafix; opening it could corrupt data that code
    knows."""


class StoreUnavailable(RuntimeError):
    """The database cannot be reached or used right now (a timeout, a lost connection)."""


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed job. ``attempts`` counts the runs started before this one."""

    id: int
    delivery_id: str
    event: str
    action: str | None
    repo: str | None
    installation_id: int | None
    payload: bytes
    attempts: int
    # Which claim of the job this is: every later change of the job names it, so a worker that
    # lost the job (its lease ran out, another claimed it) changes nothing.
    claim: int = 0
    # The owner key it was claimed under (PostgreSQL: this process's session lock), or None.
    owner: int | None = None


# Why a running job was taken from its worker: its worker's database session ended (the process
# died), or its lease ran out (the worker is alive but stuck, or the backend cannot tell).
DEAD = "dead"
LEASE = "lease"
TAKEOVER_REASONS = (DEAD, LEASE)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to queue: a delivery's (``accept_delivery``) or one the bot makes itself."""

    delivery_id: str
    event: str
    repo: str | None
    installation_id: int | None
    payload: bytes
    # The key the claim runs one job at a time of (``issue_key``), or None.
    issue: str | None = None
    # When it may run (the store's clock); None: now.
    due_at: float | None = None
    action: str | None = None


@dataclass(frozen=True, slots=True)
class QueueHealth:
    """The queue as /healthz and /metrics show it, over the whole store."""

    pending: int
    failed: int
    # How long the longest-waiting due job has waited to be claimed (0: none waits).
    oldest_due_seconds: float
    # Jobs taken from their worker since the store was created, by reason (DEAD, LEASE).
    taken_over: dict[str, int]


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
class Suggestion:
    repo: str
    issue: int
    cluster: str
    score: float
    mode: str
    body: str
    evidence: str
    created_at: float
    updated_at: float
    # Why the match may be a regression of its fix, or None.
    regression: str | None = None


@dataclass(frozen=True, slots=True)
class Feed:
    """A cluster feed's last good version: its valid lines (``body``), how many clusters they
    hold, the problems of the lines left out (one per line), the ETag to send next, and the
    last poll's error (the good version is kept through it)."""

    url: str
    etag: str | None
    body: str
    clusters: int
    problems: str
    error: str | None
    fetched_at: float
    changed_at: float


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


class Rows(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Tx(Protocol):
    """One transaction of a backend, with ``?`` parameters."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows: ...

    def executemany(self, sql: str, params: list[Sequence[Any]]) -> None: ...

    def serialise(self, key: str) -> None:
        """Hold ``key`` until the transaction ends: a second transaction serialising on it
        waits. (SQLite needs nothing: it has one writer at a time.)"""

    def notify(self, channel: str, payload: str) -> None:
        """Tell every process, once the transaction commits."""


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _ours(claim: int | None) -> str:
    return "" if claim is None else " AND claim = ?"


def _claim_param(claim: int | None) -> tuple[int, ...]:
    return () if claim is None else (claim,)


def _turn_state(value: Any) -> tuple[str | None, list[str]]:
    """An installation's backfill line as stored: (running repository, waiting ones)."""
    try:
        data = json.loads(value) if value else {}
    except ValueError:
        data = {}
    active = data.get("active") if isinstance(data, dict) else None
    waiting = data.get("waiting") if isinstance(data, dict) else None
    return (str(active) if isinstance(active, str) else None,
            [str(w) for w in waiting if isinstance(w, str)] if isinstance(waiting, list) else [])


def issue_key(repo: str | None, number: int | None) -> str | None:
    """What the claim serialises a delivery's job on: its issue (or pull request)."""
    if not repo or number is None:
        return None
    return f"{repo.lower()}#{number}"


class Store:
    """The interface and its SQL; a backend subclass supplies ``_write``, ``_read`` and the
    rest marked as its own."""

    backend = "?"
    # Raised by the backend when the database is out of reach (the receiver answers 503).
    unavailable: tuple[type[BaseException], ...] = (StoreUnavailable,)
    # Raised for a value the database cannot hold (the receiver answers 400).
    unstorable: tuple[type[BaseException], ...] = (UnicodeError,)
    # Appended to the claim's SELECT: PostgreSQL skips rows another transaction holds.
    _skip_locked = ""

    def __init__(self, *, max_attempts: int, clock: Callable[[], float]) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self._clock = clock
        self._listeners: list[Listener] = []
        # Jobs this process's claims took from their worker, by reason (for /metrics).
        self.taken_over: collections.Counter[str] = collections.Counter()

    # -- the backend's part ---------------------------------------------------------------

    def _write(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Tx]:
        raise NotImplementedError

    def describe(self) -> str:
        """Where the data is, for the start-up line (no password)."""
        raise NotImplementedError

    def schema_version(self) -> int:
        raise NotImplementedError

    def learned_records(self, repo: str | None = None) -> Generator[str, None, None]:
        """The raw JSON ``record`` of each learned cluster, in ``learned_clusters`` order,
        streamed (at 100k clusters the records alone are hundreds of MB)."""
        raise NotImplementedError

    def recover(self) -> int:
        """At start: jobs left running by a dead process of this store. Only a backend that
        knows no other process can hold them (SQLite's one worker per directory) requeues them
        here; PostgreSQL's claims take over a dead worker's jobs at any time."""
        return 0

    # What the database says about the liveness of the workers holding jobs: the keys of the
    # owners alive, or None when the backend cannot tell (leases alone decide).
    def _live_owners(self, tx: Tx) -> set[int] | None:
        return None

    def _now(self, tx: Tx) -> float:
        """The time the queue is run by (leases, due times): the backend's clock."""
        return self._clock()

    @contextlib.contextmanager
    def _claiming(self) -> Iterator[tuple[Tx, int | None]]:
        """The claim's transaction and the owner key to record on what it claims."""
        with self._write() as tx:
            yield tx, None

    def check_owner(self) -> int | None:
        """The owner key this process's running jobs are held under, if the database still
        holds them for it; None when it holds none (or cannot tell: SQLite). A job claimed
        under another key may have been taken over: its worker must drop it."""
        return None

    # Whether the notification connection is up: None when the backend has none to lose.
    listening: bool | None = None

    async def listen(self) -> None:
        """Deliver other processes' notifications to the listeners until cancelled."""
        import asyncio

        await asyncio.Event().wait()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- notifications --------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        """``listener(channel, payload)`` for every notification, from any thread."""
        self._listeners.append(listener)

    def _deliver(self, channel: str, payload: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(channel, payload)
            except Exception:
                log.exception("store: a listener of %s failed", channel)

    def notify(self, channel: str, payload: str = "") -> None:
        with self._write() as tx:
            tx.notify(channel, payload)

    # -- delivery ledger and job queue ----------------------------------------------------

    def accept_delivery(self, delivery_id: str, event: str, action: str | None,
                        repo: str | None, installation_id: int | None, payload: bytes,
                        issue: str | None = None) -> bool:
        """Record a delivery and queue its job; False if the id was already recorded.
        ``issue``: the job's ``issue_key``."""
        with self._write() as tx:
            return self._queue(tx, NewJob(delivery_id, event, repo, installation_id, payload,
                                          issue, action=action))

    def queue_job(self, job: NewJob) -> bool:
        """A job the bot makes itself (a backfill's next slice), recorded and queued as a
        delivery is, due at ``job.due_at``; False when its id is already recorded (a retried
        slice queues its successor once)."""
        with self._write() as tx:
            return self._queue(tx, job)

    def _queue(self, tx: Tx, job: NewJob) -> bool:
        now = self._clock()
        inserted = tx.execute(
            "INSERT INTO deliveries (delivery_id, event, action, repo, installation_id,"
            " received_at, updated_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued')"
            " ON CONFLICT (delivery_id) DO NOTHING",
            (job.delivery_id, job.event, job.action, job.repo, job.installation_id, now, now),
        ).rowcount
        if not inserted:
            return False
        due = now if job.due_at is None else max(now, job.due_at)
        tx.execute(self._job_insert,
                   (job.delivery_id, job.repo.lower() if job.repo else None, job.issue, due))
        tx.execute("INSERT INTO payloads (delivery_id, body) VALUES (?, ?)",
                   (job.delivery_id, job.payload))
        tx.notify(JOBS, "")
        return True

    _job_insert = ("INSERT INTO jobs (delivery_id, repo, issue_key, state, available_at)"
                   " VALUES (?, ?, ?, 'queued', ?)")

    def claim_jobs(self, lease_seconds: float, limit: int, *, per_repo: int = 0) -> list[Job]:
        """Lease up to ``limit`` runnable jobs, oldest first: queued and due, or taken over
        from their worker (``_take_over``). Never a second job of an issue that has one
        running, nor more than ``per_repo`` (0: no bound) running jobs of one repository.
        Claiming counts no attempt: ``start_job`` does."""
        if limit <= 0:
            return []
        taken: dict[str, int] = {}
        with self._claiming() as (tx, owner):
            # One claim at a time over the whole database, so that what it reads as running
            # is what every other claim has committed (held for the few ms of the claim).
            tx.serialise("claim")
            now = self._now(tx)
            running = self._take_over(tx, now, taken)
            busy = {key for _, key in running if key is not None}
            per: dict[str | None, int] = {}
            for repo, _ in running:
                per[repo] = per.get(repo, 0) + 1
            # Jobs of a busy issue, and of a repository at its bound, are left out before the
            # LIMIT: a repository with a long backlog must not fill the window and starve the
            # others.
            candidates = tx.execute(
                "SELECT id, repo, issue_key FROM jobs j WHERE state = 'queued'"
                " AND available_at <= ?"
                " AND (issue_key IS NULL OR NOT EXISTS (SELECT 1 FROM jobs r"
                " WHERE r.state = 'running' AND r.issue_key = j.issue_key))"
                " AND (? = 0 OR repo IS NULL OR (SELECT count(*) FROM jobs r"
                " WHERE r.state = 'running' AND r.repo = j.repo) < ?)"
                " ORDER BY id LIMIT ?" + self._skip_locked,
                (now, per_repo, per_repo, limit * 4 + 32)).fetchall()
            chosen: list[int] = []
            for job_id, repo, key in candidates:
                if len(chosen) >= limit:
                    break
                if key is not None and key in busy:
                    continue
                if per_repo and repo is not None and per.get(repo, 0) >= per_repo:
                    continue
                chosen.append(int(job_id))
                if key is not None:
                    busy.add(key)
                per[repo] = per.get(repo, 0) + 1
            rows = []
            if chosen:
                marks = _marks(len(chosen))
                tx.execute(f"UPDATE jobs SET state = 'running', lease_until = ?,"
                           f" claim = claim + 1, owner = ? WHERE id IN ({marks})",
                           (now + lease_seconds, owner, *chosen))
                tx.execute(
                    "UPDATE deliveries SET state = 'running', updated_at = ? WHERE delivery_id IN"
                    f" (SELECT delivery_id FROM jobs WHERE id IN ({marks}))", (now, *chosen))
                rows = tx.execute(
                    "SELECT j.id, j.delivery_id, d.event, d.action, d.repo, d.installation_id,"
                    " p.body, j.attempts, j.claim FROM jobs j JOIN deliveries d"
                    " ON d.delivery_id = j.delivery_id LEFT JOIN payloads p"
                    f" ON p.delivery_id = j.delivery_id WHERE j.id IN ({marks}) ORDER BY j.id",
                    tuple(chosen)).fetchall()
        for reason, n in taken.items():
            self.taken_over[reason] += n
        return [Job(int(r[0]), r[1], r[2], r[3], r[4], r[5], bytes(r[6] or b""), int(r[7]),
                    int(r[8]), owner) for r in rows]

    def _take_over(self, tx: Tx, now: float, taken: dict[str, int]
                   ) -> list[tuple[str | None, str | None]]:
        """In the claim's transaction: end the runs whose worker is gone (its owner's lock is
        free) or whose lease ran out, and queue their jobs again, due now (or keep them as
        failed, once they have started ``max_attempts`` runs). The claim number moves on, so
        the late worker's start, failure, completion or release changes nothing. Returns
        (repo, issue_key) of the runs that stay."""
        live = self._live_owners(tx)
        rows = tx.execute(
            "SELECT id, delivery_id, repo, issue_key, owner, lease_until, attempts, claim"
            " FROM jobs WHERE state = 'running'").fetchall()
        stay: list[tuple[str | None, str | None]] = []
        ended: list[tuple[str, bool, str]] = []
        for job_id, delivery_id, repo, key, owner, lease_until, attempts, claim in rows:
            runs = int(attempts)
            if live is not None and owner is not None and int(owner) not in live:
                reason = DEAD
                why = (f"its worker's database session ended (the process died) during "
                       f"attempt {runs}" if runs else "its worker died before starting it")
            elif lease_until is None or float(lease_until) < now:
                reason = LEASE
                why = (f"attempt {runs} ended: its worker held it past its lease"
                       if runs else "its worker held it past its lease without starting it")
            else:
                stay.append((repo, key))
                continue
            last = runs >= self.max_attempts
            state = "failed" if last else "queued"
            if last:
                why = (f"its worker died in each of its {self.max_attempts} runs"
                       if reason == DEAD else
                       f"its worker held it past its lease in its last run ({why})")
            # Guarded by the claim read above: a completion committed meanwhile stays done.
            if tx.execute(
                    "UPDATE jobs SET state = ?, lease_until = NULL, owner = NULL,"
                    " claim = claim + 1, available_at = ?, last_error = ?"
                    " WHERE id = ? AND state = 'running' AND claim = ? RETURNING id",
                    (state, now, why, job_id, claim)).fetchall():
                tx.execute("UPDATE deliveries SET state = ?, updated_at = ?"
                           " WHERE delivery_id = ?", (state, now, delivery_id))
                ended.append((str(delivery_id), last, why))
                taken[reason] = taken.get(reason, 0) + 1
        for delivery_id, last, why in ended:
            if last:
                log.error("delivery %s: given up on: %s", delivery_id, why)
            else:
                log.warning("delivery %s: taken over from its worker: %s", delivery_id, why)
        if taken:
            tx.executemany(
                "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name)"
                " DO UPDATE SET value = counters.value + excluded.value",
                [("taken_over:" + reason, n) for reason, n in sorted(taken.items())])
        return stay

    def start_job(self, job_id: int, claim: int | None = None) -> int:
        """The job's run starts: count the attempt. Returns the attempts so far (this one
        included), 0 when the job is not running under ``claim`` (any claim: None)."""
        with self._write() as tx:
            row = tx.execute("UPDATE jobs SET attempts = attempts + 1 WHERE id = ?"
                             " AND state = 'running'" + _ours(claim) + " RETURNING attempts",
                             (job_id, *_claim_param(claim))).fetchall()
        return int(row[0][0]) if row else 0

    def _set_state(self, tx: Tx, ids: list[int], state: str, error: str | None,
                   now: float) -> None:
        # The delivery's state mirrors its job's.
        marks = _marks(len(ids))
        tx.execute(
            "UPDATE jobs SET state = ?, lease_until = NULL, owner = NULL,"
            f" last_error = coalesce(?, last_error) WHERE id IN ({marks})",
            (state, None if error is None else error[:MAX_ERROR_CHARS], *ids))
        tx.execute(
            "UPDATE deliveries SET state = ?, updated_at = ? WHERE delivery_id IN"
            f" (SELECT delivery_id FROM jobs WHERE id IN ({marks}))", (state, now, *ids))

    def complete_job(self, job_id: int, claim: int | None = None) -> bool:
        """Mark a running job done. False if it is unknown, not running, or no longer under
        ``claim``."""
        with self._write() as tx:
            row = tx.execute("SELECT state, claim FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row[0] != "running" or (claim is not None and row[1] != claim):
                return False
            self._set_state(tx, [job_id], "done", None, self._clock())
            return True

    def fail_job(self, job_id: int, error: str, retry_in: float | None = None,
                 claim: int | None = None) -> bool:
        """Record a failed run: retry after ``retry_in`` seconds, or keep the job as failed
        (without ``retry_in``, or once it has started ``max_attempts`` times). False if the job
        is not running (under ``claim``)."""
        with self._write() as tx:
            now = self._now(tx)
            row = tx.execute("SELECT state, attempts, claim FROM jobs WHERE id = ?",
                             (job_id,)).fetchone()
            if row is None or row[0] != "running" or (claim is not None and row[2] != claim):
                return False
            if retry_in is None or int(row[1]) >= self.max_attempts:
                self._set_state(tx, [job_id], "failed", error, now)
            else:
                self._set_state(tx, [job_id], "queued", error, now)
                tx.execute("UPDATE jobs SET available_at = ? WHERE id = ?",
                           (now + max(retry_in, 0.0), job_id))
            return True

    def gives_up(self, attempts: int) -> bool:
        """Whether a failure of a run with these attempts is the last one."""
        return attempts >= self.max_attempts

    def release_jobs(self, jobs: Sequence[int | Job]) -> int:
        """Give leased jobs back to the queue at once (a worker stopping): another worker, or
        the next start, takes them without waiting for their leases. A ``Job`` is given back
        only while it is still under its claim."""
        released = 0
        with self._write() as tx:
            now = self._now(tx)
            ids = []
            for job in jobs:
                job_id, claim = (job.id, job.claim) if isinstance(job, Job) else (job, None)
                if tx.execute("SELECT 1 FROM jobs WHERE id = ? AND state = 'running'"
                              + _ours(claim), (job_id, *_claim_param(claim))).fetchone():
                    ids.append(job_id)
            for i in range(0, len(ids), _IN_CHUNK):
                chunk = ids[i:i + _IN_CHUNK]
                self._set_state(tx, chunk, "queued", None, now)
                tx.execute(f"UPDATE jobs SET available_at = ? WHERE id IN ({_marks(len(chunk))})",
                           (now, *chunk))
            if ids:
                tx.notify(JOBS, "")
            released = len(ids)
        return released

    def _requeue_running(self) -> int:
        """Every running job's worker is known to be dead: queue them again (counted as taken
        over from a dead worker)."""
        now = self._clock()
        with self._write() as tx:
            ids = [int(r[0]) for r in tx.execute(
                "SELECT id FROM jobs WHERE state = 'running'").fetchall()]
            for i in range(0, len(ids), _IN_CHUNK):
                self._set_state(tx, ids[i:i + _IN_CHUNK], "queued", None, now)
            if ids:
                tx.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name)"
                           " DO UPDATE SET value = counters.value + excluded.value",
                           ("taken_over:" + DEAD, len(ids)))
        self.taken_over[DEAD] += len(ids)
        return len(ids)

    def queue_health(self) -> QueueHealth:
        """Pending and failed jobs, how long the oldest due job has waited (by the queue's
        clock) and how many jobs were taken from their worker."""
        with self._read() as tx:
            now = self._now(tx)
            pending, failed, oldest = tx.execute(
                "SELECT (SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')),"
                " (SELECT count(*) FROM jobs WHERE state = 'failed'),"
                " (SELECT min(available_at) FROM jobs WHERE state = 'queued'"
                " AND available_at <= ?)", (now,)).fetchone()
            counts = dict(tx.execute(
                "SELECT name, value FROM counters WHERE name IN (?, ?)",
                tuple("taken_over:" + r for r in TAKEOVER_REASONS)).fetchall())
        return QueueHealth(
            int(pending), int(failed), max(0.0, now - float(oldest)) if oldest is not None
            else 0.0, {r: int(counts.get("taken_over:" + r, 0)) for r in TAKEOVER_REASONS})

    def pending_count(self) -> int:
        """Jobs not finished yet: queued (due or later) and running."""
        with self._read() as tx:
            return int(tx.execute("SELECT count(*) FROM jobs WHERE state IN"
                                  " ('queued', 'running')").fetchone()[0])

    def failed_count(self) -> int:
        """Deliveries given up on, kept with their reason for inspection."""
        with self._read() as tx:
            return int(tx.execute("SELECT count(*) FROM jobs WHERE state = 'failed'"
                                  ).fetchone()[0])

    def job_state(self, delivery_id: str) -> tuple[str, int, str | None] | None:
        """(state, attempts, last error) of a delivery's job."""
        with self._read() as tx:
            row = tx.execute("SELECT state, attempts, last_error FROM jobs WHERE"
                             " delivery_id = ?", (delivery_id,)).fetchone()
        return None if row is None else (str(row[0]), int(row[1]), row[2])

    def prune(self, older_than_seconds: float) -> int:
        """Delete done deliveries (and their jobs) finished more than that long ago.

        Failed ones stay for inspection; comments are never pruned, since the comment ledger is
        what stops a second comment on an old issue. A pruned delivery id is forgotten, so a
        redelivery of it after that would be processed again.
        """
        cutoff = self._clock() - older_than_seconds
        with self._write() as tx:
            return tx.execute("DELETE FROM deliveries WHERE state = 'done' AND updated_at < ?",
                              (cutoff,)).rowcount

    # -- comment ledger and the daily cap -------------------------------------------------

    _comment_columns = ("repo, issue, comment_id, cluster, score, body_hash, created_at,"
                        " updated_at")

    def get_comment(self, repo: str, issue: int) -> CommentRecord | None:
        with self._read() as tx:
            row = tx.execute(f"SELECT {self._comment_columns} FROM comments WHERE repo = ?"
                             " AND issue = ?", (repo.lower(), issue)).fetchone()
        return None if row is None else CommentRecord(*row)

    def comments_for_cluster(self, repo: str, cluster: str) -> list[CommentRecord]:
        """Every issue where the bot named this cluster (to correct them if its fix is
        reverted)."""
        with self._read() as tx:
            rows = tx.execute(f"SELECT {self._comment_columns} FROM comments WHERE repo = ?"
                              " AND cluster = ? ORDER BY issue",
                              (repo.lower(), cluster)).fetchall()
        return [CommentRecord(*row) for row in rows]

    def record_comment(self, repo: str, issue: int, comment_id: int, cluster: str | None,
                       score: float | None, body_hash: str) -> None:
        """Write the ledger row (and use up the issue's reserved slot, if any)."""
        now = self._clock()
        repo = repo.lower()
        with self._write() as tx:
            tx.execute(
                f"INSERT INTO comments ({self._comment_columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (repo, issue) DO UPDATE SET comment_id = excluded.comment_id,"
                " cluster = excluded.cluster, score = excluded.score,"
                " body_hash = excluded.body_hash, updated_at = excluded.updated_at",
                (repo, issue, comment_id, cluster, score, body_hash, now, now))
            tx.execute("DELETE FROM comment_slots WHERE repo = ? AND issue = ?", (repo, issue))

    def comments_in_last(self, repo: str, seconds: float) -> int:
        """New comments (ledger rows first written) in this repository in the last seconds."""
        with self._read() as tx:
            return int(tx.execute("SELECT count(*) FROM comments WHERE repo = ? AND"
                                  " created_at >= ?",
                                  (repo.lower(), self._clock() - seconds)).fetchone()[0])

    def reserve_comment(self, repo: str, issue: int, cap: int, window: float) -> bool:
        """Take one of the repository's ``cap`` new comments per ``window`` seconds for this
        issue, before posting it; False when they are all used (comments made, or slots held
        by posts under way). Atomic over every process: two workers cannot both take the last
        one. The slot is used up by ``record_comment``; one never used is freed after
        ``SLOT_SECONDS``. The same issue asking again keeps its slot."""
        now = self._clock()
        repo = repo.lower()
        with self._write() as tx:
            tx.serialise("cap:" + repo)
            tx.execute("DELETE FROM comment_slots WHERE repo = ? AND reserved_at < ?",
                       (repo, now - SLOT_SECONDS))
            if tx.execute("UPDATE comment_slots SET reserved_at = ? WHERE repo = ? AND issue = ?",
                          (now, repo, issue)).rowcount:
                return True
            # One statement, one snapshot: a comment recorded meanwhile (its row written and
            # its slot deleted in one commit) is counted once, never as neither.
            used = int(tx.execute(
                "SELECT (SELECT count(*) FROM comments WHERE repo = ? AND created_at >= ?)"
                " + (SELECT count(*) FROM comment_slots WHERE repo = ?)",
                (repo, now - window, repo)).fetchone()[0])
            if used >= cap:
                return False
            tx.execute("INSERT INTO comment_slots (repo, issue, reserved_at) VALUES (?, ?, ?)",
                       (repo, issue, now))
            return True

    # -- suggestions (posted or shadow) ---------------------------------------------------

    def record_suggestion(self, repo: str, issue: int, cluster: str, score: float, mode: str,
                          body: str, evidence: str, regression: str | None = None) -> None:
        """The latest suggestion on an issue: ``mode`` ``comment`` (posted), ``shadow``
        (recorded only) or ``label`` (a possible regression, labelled); ``evidence`` is its
        JSON; ``regression`` why it may be a regression of its fix."""
        now = self._clock()
        with self._write() as tx:
            tx.execute(
                "INSERT INTO suggestions (repo, issue, cluster, score, mode, body, evidence,"
                " created_at, updated_at, regression) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (repo, issue) DO UPDATE SET cluster = excluded.cluster,"
                " score = excluded.score, mode = excluded.mode, body = excluded.body,"
                " evidence = excluded.evidence, updated_at = excluded.updated_at,"
                " regression = excluded.regression",
                (repo.lower(), issue, cluster, score, mode, body, evidence, now, now,
                 regression))

    _SUGGESTION = ("SELECT repo, issue, cluster, score, mode, body, evidence, created_at,"
                   " updated_at, regression FROM suggestions")

    def suggestions(self, repo: str, limit: int = 50) -> list[Suggestion]:
        """A repository's latest suggestions, newest first."""
        with self._read() as tx:
            rows = tx.execute(
                self._SUGGESTION + " WHERE repo = ? ORDER BY updated_at DESC, issue DESC"
                " LIMIT ?", (repo.lower(), limit)).fetchall()
        return [Suggestion(*row) for row in rows]

    def suggestion_marks(self, repo: str, limit: int = 5000
                         ) -> list[tuple[int, str, float, str | None]]:
        """(issue, cluster, created_at, regression) of a repository's latest suggestions,
        newest first: what "fixes that look incomplete" counts, without bodies or evidence."""
        with self._read() as tx:
            rows = tx.execute(
                "SELECT issue, cluster, created_at, regression FROM suggestions WHERE repo = ?"
                " ORDER BY created_at DESC, issue DESC LIMIT ?", (repo.lower(), limit)).fetchall()
        return [(int(i), str(c), float(t), r) for i, c, t, r in rows]

    def suggestion_repos(self, limit: int = 500) -> list[str]:
        """Repositories with a suggestion, the most recently active first."""
        with self._read() as tx:
            rows = tx.execute("SELECT repo FROM suggestions GROUP BY repo"
                              " ORDER BY max(updated_at) DESC LIMIT ?", (limit,)).fetchall()
        return [str(r[0]) for r in rows]

    def comments_on(self, repo: str, issues: Sequence[int]) -> dict[int, CommentRecord]:
        """The comment ledger rows of ``issues`` on ``repo``."""
        if not issues:
            return {}
        with self._read() as tx:
            rows = tx.execute(
                "SELECT repo, issue, comment_id, cluster, score, body_hash, created_at,"
                f" updated_at FROM comments WHERE repo = ? AND issue IN ({_marks(len(issues))})",
                (repo.lower(), *issues)).fetchall()
        return {int(r[1]): CommentRecord(*r) for r in rows}

    def feedback_on(self, repo: str, issues: Sequence[int]
                    ) -> dict[int, list[tuple[str, str, str | None]]]:
        """Maintainers' answers on ``issues``: issue -> [(cluster, kind, login)]."""
        if not issues:
            return {}
        out: dict[int, list[tuple[str, str, str | None]]] = {}
        with self._read() as tx:
            rows = tx.execute(
                "SELECT issue, cluster, kind, login FROM feedback WHERE repo = ?"
                f" AND issue IN ({_marks(len(issues))}) ORDER BY created_at",
                (repo.lower(), *issues)).fetchall()
        for issue, cluster, kind, login in rows:
            out.setdefault(int(issue), []).append((str(cluster), str(kind), login))
        return out

    # -- cluster feeds --------------------------------------------------------------------

    def get_feed(self, url: str) -> Feed | None:
        with self._read() as tx:
            row = tx.execute("SELECT url, etag, body, clusters, problems, error, fetched_at,"
                             " changed_at FROM feeds WHERE url = ?", (url,)).fetchone()
        return None if row is None else Feed(*row)

    def put_feed(self, url: str, etag: str | None, body: str, clusters: int,
                 problems: str) -> None:
        """A new good version of the feed; every process is told (``feed:URL``)."""
        now = self._clock()
        with self._write() as tx:
            tx.execute(
                "INSERT INTO feeds (url, etag, body, clusters, problems, error, fetched_at,"
                " changed_at) VALUES (?, ?, ?, ?, ?, NULL, ?, ?) ON CONFLICT (url) DO UPDATE"
                " SET etag = excluded.etag, body = excluded.body,"
                " clusters = excluded.clusters, problems = excluded.problems, error = NULL,"
                " fetched_at = excluded.fetched_at, changed_at = excluded.changed_at",
                (url, etag, body, clusters, problems, now, now))
            # The URL's digest, not the URL: it may carry a tracker's token.
            tx.notify(CHANGES, "feed:" + hashlib.sha256(url.encode()).hexdigest()[:16])

    def feed_polled(self, url: str, error: str | None) -> None:
        """A poll that changed nothing: unchanged (304), or failed (``error``; the last good
        version stays). A feed never fetched well gets an empty version carrying the error."""
        now = self._clock()
        with self._write() as tx:
            tx.execute(
                "INSERT INTO feeds (url, etag, body, clusters, problems, error, fetched_at,"
                " changed_at) VALUES (?, NULL, '', 0, '', ?, ?, 0) ON CONFLICT (url) DO UPDATE"
                " SET error = excluded.error, fetched_at = excluded.fetched_at",
                (url, error, now))

    def feeds_under(self, prefix: str) -> list[Feed]:
        """Every stored version whose key starts with ``prefix`` (a repository's own
        ``clusters:`` sources are kept beside the feeds, keyed ``repo:<owner/name>:<entry>``)."""
        # Not LIKE (``_`` and ``%`` are common in repository names and paths) nor a range
        # (PostgreSQL orders text by its collation, not by code point).
        with self._read() as tx:
            rows = tx.execute("SELECT url, etag, body, clusters, problems, error, fetched_at,"
                              " changed_at FROM feeds WHERE substr(url, 1, ?) = ?",
                              (len(prefix), prefix)).fetchall()
        return sorted((Feed(*row) for row in rows), key=lambda f: f.url)

    def drop_feed(self, url: str) -> bool:
        """Forget a stored version (a source no longer configured); every process is told."""
        with self._write() as tx:
            gone = tx.execute("DELETE FROM feeds WHERE url = ?", (url,)).rowcount > 0
            if gone:
                tx.notify(CHANGES, "feed:" + hashlib.sha256(url.encode()).hexdigest()[:16])
        return gone

    # -- learned clusters -----------------------------------------------------------------

    def put_learned(self, cluster: Cluster) -> None:
        """Store (or replace) a learned cluster and index its members, so that a later PR or
        issue finds the cluster it belongs to; every process is told."""
        repo = cluster.repo.lower()
        now = self._clock()
        with self._write() as tx:
            tx.execute(
                "INSERT INTO learned_clusters (repo, public_id, record, updated_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (repo, public_id) DO UPDATE SET"
                " record = excluded.record, updated_at = excluded.updated_at",
                (repo, cluster.public_id, cluster.model_dump_json(exclude_none=True), now))
            tx.execute("DELETE FROM learned_members WHERE repo = ? AND public_id = ?",
                       (repo, cluster.public_id))
            members = {(m.kind, m.number) for m in cluster.members}
            if members:
                tx.executemany(
                    "INSERT INTO learned_members (repo, kind, number, public_id)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (repo, kind, number) DO UPDATE SET"
                    " public_id = excluded.public_id",
                    [(repo, kind, number, cluster.public_id) for kind, number in members])
            # Per repository: its index is rebuilt, no other (``learned_state``).
            tx.execute("INSERT INTO counters (name, value) VALUES (?, 1) ON CONFLICT (name)"
                       " DO UPDATE SET value = counters.value + 1", ("learned:" + repo,))
            tx.notify(CHANGES, "learned:" + repo)

    def find_learned(self, repo: str, kind: str, number: int) -> Cluster | None:
        """The learned cluster that has this issue or PR as a member."""
        with self._read() as tx:
            row = tx.execute(
                "SELECT c.record FROM learned_members m JOIN learned_clusters c"
                " ON c.repo = m.repo AND c.public_id = m.public_id"
                " WHERE m.repo = ? AND m.kind = ? AND m.number = ?",
                (repo.lower(), kind, number)).fetchone()
        return None if row is None else Cluster.model_validate_json(row[0])

    def learned_clusters(self, repo: str | None = None) -> list[Cluster]:
        # Closed here, in the caller's thread, also when a record fails to parse: the stream
        # holds a connection (and, on PostgreSQL, a transaction) until it is closed.
        with contextlib.closing(self.learned_records(repo)) as records:
            return [Cluster.model_validate_json(r) for r in records]

    def learned_count(self, repo: str | None = None) -> int:
        """How many learned clusters there are (of ``repo``), without reading any of them."""
        with self._read() as tx:
            if repo is None:
                return int(tx.execute("SELECT count(*) FROM learned_clusters").fetchone()[0])
            return int(tx.execute("SELECT count(*) FROM learned_clusters WHERE repo = ?",
                                  (repo.lower(),)).fetchone()[0])

    def learned_counts(self) -> dict[str, int]:
        """How many learned clusters each repository (lower case) has."""
        with self._read() as tx:
            rows = tx.execute(
                "SELECT repo, count(*) FROM learned_clusters GROUP BY repo").fetchall()
        return {str(repo): int(n) for repo, n in rows}

    def learned_state(self, repo: str) -> tuple[int, str]:
        """How many learned clusters ``repo`` has, and a version of them that changes whenever
        one is written (by any process; none is ever deleted): its index is rebuilt on a new
        value. One read of the primary key's range."""
        with self._read() as tx:
            count, latest, writes = tx.execute(
                "SELECT count(*), max(updated_at), (SELECT value FROM counters WHERE name = ?)"
                " FROM learned_clusters WHERE repo = ?",
                ("learned:" + repo.lower(), repo.lower())).fetchone()
        return int(count), f"{int(count)}@{latest!r}@{writes or 0}"

    # -- cursors (resumable backfills) ----------------------------------------------------

    def get_cursor(self, name: str) -> str | None:
        with self._read() as tx:
            row = tx.execute("SELECT value FROM cursors WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def cursors(self, prefix: str) -> list[tuple[str, str, float]]:
        """Every cursor whose name starts with ``prefix``: (name, value, updated_at)."""
        with self._read() as tx:
            # substr, not LIKE: a prefix with "_" or "%" is taken as written.
            rows = tx.execute("SELECT name, value, updated_at FROM cursors"
                              " WHERE substr(name, 1, ?) = ?", (len(prefix), prefix)).fetchall()
        return [(str(n), str(v), float(t)) for n, v, t in rows]

    def set_cursor(self, name: str, value: str | None) -> None:
        with self._write() as tx:
            if value is None:
                tx.execute("DELETE FROM cursors WHERE name = ?", (name,))
            else:
                tx.execute(
                    "INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET value = excluded.value,"
                    " updated_at = excluded.updated_at", (name, value, self._clock()))

    def backfill_turn(self, group: str, *, add: Sequence[str] = (),
                      finished: str | None = None,
                      job: Callable[[str], NewJob] | None = None) -> str | None:
        """The backfills of one installation (``group``) run one repository at a time, in the
        order they were asked for. In one transaction: ``finished`` leaves the running slot,
        ``add`` join the waiting line (once each), and when the slot is free the first waiting
        repository takes it and its first job, ``job(repo)``, is queued. A repository whose
        backfill has no queued or running job any more (given up after its attempts) frees the
        slot too, so one failure never stalls the others. Returns the repository started, or
        None."""
        name = "backfill-turn:" + group
        with self._write() as tx:
            tx.serialise(name)
            row = tx.execute("SELECT value FROM cursors WHERE name = ?", (name,)).fetchone()
            state = _turn_state(row[0] if row else None)
            active, waiting = state[0], list(state[1])
            if finished is not None and active == finished.lower():
                active = None
            for repo in add:
                repo = repo.lower()
                if repo != active and repo not in waiting:
                    waiting.append(repo)
            if active is not None and job is not None and not tx.execute(
                    "SELECT 1 FROM jobs WHERE state IN ('queued', 'running') AND repo = ?"
                    " AND issue_key = ? LIMIT 1", (active, job(active).issue)).fetchone():
                log.warning("backfill of %s has no job left (given up); the next repository "
                            "of its installation starts", active)
                active = None
            started = None
            if active is None and waiting and job is not None:
                active = started = waiting.pop(0)
                self._queue(tx, job(active))
            value = json.dumps({"active": active, "waiting": waiting})
            if (active, waiting) != state or row is None:
                tx.execute(
                    "INSERT INTO cursors (name, value, updated_at) VALUES (?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET value = excluded.value,"
                    " updated_at = excluded.updated_at", (name, value, self._clock()))
        return started

    # -- feedback and pauses (maintainers' commands) --------------------------------------

    def record_feedback(self, repo: str, issue: int, cluster: str, kind: str,
                        login: str | None) -> None:
        """``dismissed``: never suggest this cluster on this issue again; ``confirmed``: a
        maintainer said the issue belongs to it. The latest word on a pair wins."""
        with self._write() as tx:
            tx.execute(
                "INSERT INTO feedback (repo, issue, cluster, kind, login, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (repo, issue, cluster) DO UPDATE SET"
                " kind = excluded.kind, login = excluded.login, created_at = excluded.created_at",
                (repo.lower(), issue, cluster, kind, login, self._clock()))

    def feedback_for(self, repo: str, issue: int) -> dict[str, str]:
        """cluster -> ``dismissed`` | ``confirmed`` for one issue."""
        with self._read() as tx:
            return self._feedback(tx, repo, issue)

    @staticmethod
    def _feedback(tx: Tx, repo: str, issue: int) -> dict[str, str]:
        rows = tx.execute("SELECT cluster, kind FROM feedback WHERE repo = ? AND issue = ?",
                          (repo.lower(), issue)).fetchall()
        return {str(c): str(k) for c, k in rows}

    def dismissal_rate(self, repo: str, window: int, since: float = 0.0) -> tuple[int, int]:
        """(dismissed, suggestions) over the latest ``window`` suggestions (comment ledger
        rows with a match score, i.e. made by the matcher, not by a maintainer's ``same-as``)
        first made after ``since``; a suggestion counts as dismissed when its issue has a
        dismissal of the cluster it names."""
        with self._read() as tx:
            rows = tx.execute(
                "SELECT EXISTS (SELECT 1 FROM feedback f WHERE f.repo = c.repo"
                " AND f.issue = c.issue AND f.cluster = c.cluster AND f.kind = 'dismissed')"
                " FROM comments c WHERE c.repo = ? AND c.created_at > ?"
                " AND c.cluster IS NOT NULL AND c.score IS NOT NULL"
                " ORDER BY c.created_at DESC, c.issue DESC LIMIT ?",
                (repo.lower(), since, window)).fetchall()
        return sum(int(r[0]) for r in rows), len(rows)

    def get_pause(self, repo: str) -> Pause | None:
        with self._read() as tx:
            return self._pause(tx, repo)

    @staticmethod
    def _pause(tx: Tx, repo: str) -> Pause | None:
        row = tx.execute(
            "SELECT repo, paused, reason, config_hash, issue, announced, paused_at,"
            " resumed_at, resumed_by FROM pauses WHERE repo = ?", (repo.lower(),)).fetchone()
        if row is None:
            return None
        return Pause(row[0], bool(row[1]), row[2], row[3], row[4], bool(row[5]), row[6],
                     row[7], row[8])

    def issue_facts(self, repo: str, issue: int) -> tuple[dict[str, str], Pause | None]:
        """``feedback_for`` and ``get_pause`` in one call: what the known-fix handler reads
        before it matches, for one thread hop instead of two."""
        with self._read() as tx:
            return self._feedback(tx, repo, issue), self._pause(tx, repo)

    def pause(self, repo: str, reason: str, config_hash: str) -> bool:
        """Pause the repository; False when it already was. One statement, so that of two
        processes pausing at once exactly one is told True."""
        with self._write() as tx:
            row = tx.execute(
                "INSERT INTO pauses (repo, paused, reason, config_hash, issue, announced,"
                " paused_at, resumed_at, resumed_by) VALUES (?, 1, ?, ?, NULL, 0, ?, NULL, NULL)"
                " ON CONFLICT (repo) DO UPDATE SET paused = 1, reason = excluded.reason,"
                " config_hash = excluded.config_hash, issue = NULL, announced = 0,"
                " paused_at = excluded.paused_at, announcing_until = NULL"
                " WHERE pauses.paused = 0 RETURNING repo",
                (repo.lower(), reason, config_hash, self._clock())).fetchall()
        return bool(row)

    def claim_announcement(self, repo: str) -> bool:
        """Whether this caller announces the repository's pause: True for one caller at a
        time, until ``mark_pause_announced`` (or ``ANNOUNCE_SECONDS`` if it never does)."""
        now = self._clock()
        with self._write() as tx:
            return tx.execute(
                "UPDATE pauses SET announcing_until = ? WHERE repo = ? AND paused = 1"
                " AND announced = 0 AND (announcing_until IS NULL OR announcing_until < ?)",
                (now + ANNOUNCE_SECONDS, repo.lower(), now)).rowcount > 0

    def release_announcement(self, repo: str) -> None:
        """The announcement claimed could not be made: claimable again at once."""
        with self._write() as tx:
            tx.execute("UPDATE pauses SET announcing_until = NULL WHERE repo = ?"
                       " AND announced = 0", (repo.lower(),))

    def mark_pause_announced(self, repo: str, issue: int | None) -> None:
        with self._write() as tx:
            tx.execute("UPDATE pauses SET announced = 1, issue = ? WHERE repo = ?",
                       (issue, repo.lower()))

    def resume(self, repo: str, by: str) -> bool:
        """Lift a pause; False when the repository was not paused. The dismissal window starts
        afresh from now."""
        with self._write() as tx:
            return tx.execute(
                "UPDATE pauses SET paused = 0, resumed_at = ?, resumed_by = ?"
                " WHERE repo = ? AND paused = 1", (self._clock(), by, repo.lower())).rowcount > 0

