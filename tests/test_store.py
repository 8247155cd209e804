"""The durable store's contract, run against both backends (SQLite files under tmp_path and a
fresh PostgreSQL schema per test), plus what only one backend does: SQLite's data-directory lock
and in-process notifications, PostgreSQL's LISTEN/NOTIFY and schema-scoped channels. Includes
real process crashes (SIGKILL) and real concurrency (threads, one store instance each)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bot.clusters.models import Cluster, Member
from bot.db import schema
from bot.db.postgres import OWNER_SPACE, PostgresStore, redact
from bot.db.sqlite import DataDirInUse, SQLiteStore, lock_data_dir
from bot.db.store import (
    ANNOUNCE_SECONDS,
    CHANGES,
    JOBS,
    MAX_ERROR_CHARS,
    SLOT_SECONDS,
    Job,
    QueueHealth,
    Store,
    StoreVersionError,
)
from tests.conftest import fresh_schema

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "store_crash_child.py"
REPO = "Acme/Widgets"
DAY = 86_400.0
T0 = 1_700_000_000.0


class Clock:
    """A clock the test moves by hand: leases, retries and slots expire exactly when told."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# Every store a test opens is closed after it, whatever the test did (a PostgreSQL pool left
# open would keep its connections, and its threads, past the test).
_OPENED: list[Store] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def open_(backend: str | None, tmp_path: Path, *, clock: Callable[[], float] | None = None,
          max_attempts: int = 5) -> Store:
    """The store under test: SQLite under ``tmp_path/data`` or PostgreSQL at the URL. Opening
    it twice gives two instances on the same data (two processes, as far as the contract
    goes). Without ``clock``: the host's (SQLite) or the database's (PostgreSQL)."""
    store: Store
    if backend is None:
        store = SQLiteStore(tmp_path / "data", clock=clock or time.time,
                            max_attempts=max_attempts)
    else:
        store = PostgresStore(backend, clock=clock, max_attempts=max_attempts)
    _OPENED.append(store)
    return store


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(backend: str | None, tmp_path: Path, clock: Clock) -> Store:
    return open_(backend, tmp_path, clock=clock)


@pytest.fixture
def other_pg_url(pg_server: str) -> Iterator[str]:
    """A second fresh schema in the same database (a second deployment beside the first)."""
    with fresh_schema(pg_server) as url:
        yield url


def raw(store: Store, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """What is in the database, read over a connection of its own: what is committed, not what
    the store object believes."""
    if isinstance(store, SQLiteStore):
        conn = sqlite3.connect(store.path)
        try:
            return conn.execute(query, params).fetchall()
        finally:
            conn.close()
    assert isinstance(store, PostgresStore)
    with psycopg.connect(store.url) as pg:
        return pg.execute(query.replace("?", "%s"), params).fetchall()


def accept(store: Store, delivery_id: str, *, repo: str | None = REPO, issue: str | None = None,
           payload: bytes = b"{}") -> None:
    assert store.accept_delivery(delivery_id, "issues", "opened", repo, 77, payload, issue)


def claim(store: Store, lease: float = 60.0, limit: int = 10, per_repo: int = 0) -> list[str]:
    """The delivery ids of what a claim hands out, in its order."""
    return [job.delivery_id for job in store.claim_jobs(lease, limit, per_repo=per_repo)]


def job_id(store: Store, delivery_id: str) -> int:
    rows = raw(store, "SELECT id FROM jobs WHERE delivery_id = ?", (delivery_id,))
    assert len(rows) == 1, rows
    return int(rows[0][0])


def make_cluster(public_id: str, members: Sequence[tuple[str, int]], *,
                 repo: str = REPO) -> Cluster:
    """A learned cluster of invented issues and PRs."""
    return Cluster(
        repo=repo, public_id=public_id, display_label=f"Widget crash {public_id}",
        summary="the widget crashes on resize",
        members=[Member(kind=kind, number=number, title=f"{kind} {number}",
                        merged=kind == "pr" or None, files_changed=["src/widget.py"])
                 for kind, number in members])


def run_in_threads(n: int, target: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """``target(i)`` in ``n`` threads released at once; their results, or the first error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# -- delivery ledger ----------------------------------------------------------------------------


def test_a_delivery_is_recorded_once(store: Store) -> None:
    assert store.accept_delivery("d1", "issues", "opened", REPO, 77, b"first")
    # A redelivery (GitHub's retry, a manual redeliver) is recognised, whatever it carries.
    assert not store.accept_delivery("d1", "pull_request", "edited", "acme/other", 8, b"second")
    assert store.pending_count() == 1
    assert raw(store, "SELECT count(*) FROM jobs") == [(1,)]
    jobs = store.claim_jobs(60, 10)
    assert [(j.delivery_id, j.event, j.action, j.repo, j.installation_id, j.payload, j.attempts)
            for j in jobs] == [("d1", "issues", "opened", REPO, 77, b"first", 0)]
    assert store.claim_jobs(60, 10) == []


@pytest.mark.parametrize("payload", [
    bytes(range(256)) * 4096,  # every byte value, NULs and invalid UTF-8 included; 1 MiB
    b"",
    '{"title": "Widget \u00e9cras\u00e9 \U0001f4a5"}'.encode(),
], ids=["binary-1MiB", "empty", "utf8"])
def test_payload_bytes_round_trip_exactly(store: Store, payload: bytes) -> None:
    accept(store, "d1", payload=payload)
    [job] = store.claim_jobs(60, 1)
    assert type(job.payload) is bytes
    assert job.payload == payload


def test_concurrent_accepts_of_one_delivery_record_it_once(backend: str | None,
                                                           tmp_path: Path) -> None:
    # The receiver runs in several processes; GitHub may deliver the same id to two of them.
    stores = [open_(backend, tmp_path) for _ in range(4)]
    results = run_in_threads(4, lambda i: stores[i].accept_delivery(
        "d1", "issues", "opened", REPO, 77, f"body {i}".encode()))
    assert sorted(results) == [False, False, False, True]
    assert raw(stores[0], "SELECT count(*) FROM jobs") == [(1,)]
    assert raw(stores[0], "SELECT count(*) FROM payloads") == [(1,)]


# -- the job queue ------------------------------------------------------------------------------


def test_claims_oldest_first_and_never_hands_out_a_leased_job(store: Store) -> None:
    for d in ("d1", "d2", "d3"):
        accept(store, d)
    assert store.claim_jobs(60, 0) == []
    assert claim(store, limit=2) == ["d1", "d2"]
    assert store.job_state("d1") == ("running", 0, None)
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'd1'") == [("running",)]
    assert claim(store) == ["d3"]
    assert claim(store) == []
    assert store.pending_count() == 3


def test_an_expired_lease_is_claimed_again_and_only_start_counts_an_attempt(
        store: Store, clock: Clock) -> None:
    accept(store, "d1")
    [first] = store.claim_jobs(10, 1)
    assert first.attempts == 0  # a claim counts nothing
    clock.advance(10)
    assert claim(store, lease=10) == []  # the lease runs to its last instant
    clock.advance(0.5)
    [again] = store.claim_jobs(10, 1)  # its worker died: anyone may take it
    assert (again.id, again.attempts) == (first.id, 0)
    assert store.start_job(again.id) == 1
    # The run it took over is ended, and says why.
    assert store.job_state("d1") == ("running", 1,
                                     "its worker held it past its lease without starting it")
    clock.advance(11)
    [third] = store.claim_jobs(10, 1)
    assert third.attempts == 1  # the runs started before this one
    assert store.start_job(third.id) == 2
    assert store.complete_job(third.id)
    assert store.job_state("d1") == ("done", 2,
                                     "attempt 1 ended: its worker held it past its lease")


def test_start_job_counts_only_running_jobs(store: Store) -> None:
    accept(store, "d1")
    queued = job_id(store, "d1")
    assert store.start_job(queued) == 0  # not leased yet
    assert store.start_job(987_654) == 0  # unknown
    [job] = store.claim_jobs(60, 1)
    assert store.start_job(job.id) == 1
    assert store.complete_job(job.id)
    assert store.start_job(job.id) == 0  # finished
    assert store.job_state("d1") == ("done", 1, None)


def test_complete_job_marks_done_once(store: Store) -> None:
    accept(store, "d1")
    assert not store.complete_job(job_id(store, "d1"))  # queued: not running
    [job] = store.claim_jobs(60, 1)
    assert store.start_job(job.id) == 1
    assert store.complete_job(job.id)
    assert not store.complete_job(job.id)
    assert not store.complete_job(987_654)
    assert store.job_state("d1") == ("done", 1, None)
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'd1'") == [("done",)]
    assert (store.pending_count(), store.failed_count()) == (0, 0)
    assert claim(store) == []


def test_a_failed_run_is_retried_after_retry_in(store: Store, clock: Clock) -> None:
    accept(store, "d1")
    accept(store, "d2")
    [job, _] = store.claim_jobs(60, 2)
    assert store.start_job(job.id) == 1
    assert store.fail_job(job.id, "GitHub said 502", retry_in=30)
    failed_at = clock.now
    assert store.job_state("d1") == ("queued", 1, "GitHub said 502")
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'd1'") == [("queued",)]
    assert store.pending_count() == 2 and store.failed_count() == 0
    clock.now = failed_at + 29.9
    assert claim(store) == []
    clock.now = failed_at + 30
    [again] = store.claim_jobs(60, 10)
    assert (again.id, again.attempts) == (job.id, 1)
    assert store.start_job(again.id) == 2
    assert store.complete_job(again.id)
    # The last error stays on record after a later success, for inspection.
    assert store.job_state("d1") == ("done", 2, "GitHub said 502")


def test_fail_without_retry_in_is_dead_at_once(store: Store, clock: Clock) -> None:
    accept(store, "d1")
    [job] = store.claim_jobs(60, 1)
    assert store.start_job(job.id) == 1
    long_error = "x" * (MAX_ERROR_CHARS + 500)
    assert store.fail_job(job.id, long_error)
    state = store.job_state("d1")
    assert state is not None
    assert state[:2] == ("failed", 1)
    assert state[2] == long_error[:MAX_ERROR_CHARS]  # bounded, but what it kept is exact
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'd1'") == [("failed",)]
    assert (store.pending_count(), store.failed_count()) == (0, 1)
    clock.advance(10 * DAY)
    assert claim(store) == []
    assert not store.fail_job(job.id, "again", retry_in=1)  # not running any more
    assert not store.complete_job(job.id)
    assert store.job_state("d1") == ("failed", 1, long_error[:MAX_ERROR_CHARS])


def test_dead_after_max_attempts_started_runs(backend: str | None, tmp_path: Path,
                                              clock: Clock) -> None:
    store = open_(backend, tmp_path, clock=clock, max_attempts=3)
    accept(store, "d1")
    # A claim that never started (its worker stopped in between) does not use up a run.
    [job] = store.claim_jobs(60, 1)
    assert store.fail_job(job.id, "never started", retry_in=0)
    assert store.job_state("d1") == ("queued", 0, "never started")
    for run in (1, 2, 3):
        [job] = store.claim_jobs(60, 1)
        assert job.attempts == run - 1
        attempts = store.start_job(job.id)
        assert attempts == run
        assert store.gives_up(attempts) == (run == 3)
        assert store.fail_job(job.id, f"boom {run}", retry_in=0)
        expected = "failed" if run == 3 else "queued"
        assert store.job_state("d1") == (expected, run, f"boom {run}")
    assert claim(store) == []
    assert (store.pending_count(), store.failed_count()) == (0, 1)


def test_gives_up_follows_max_attempts(backend: str | None, tmp_path: Path) -> None:
    store = open_(backend, tmp_path, max_attempts=2)
    assert [store.gives_up(n) for n in (0, 1, 2, 3)] == [False, False, True, True]
    with pytest.raises(ValueError):
        open_(backend, tmp_path, max_attempts=0)


def test_a_job_whose_runs_all_die_is_not_started_past_max_attempts(
        backend: str | None, tmp_path: Path, clock: Clock) -> None:
    store = open_(backend, tmp_path, clock=clock, max_attempts=2)
    accept(store, "d1")
    for run in (1, 2):
        [job] = store.claim_jobs(10, 1)
        assert store.start_job(job.id) == run
        clock.advance(11)  # the worker died mid-run: its lease runs out
    # Two started runs out of two: a third must not start.
    again = store.claim_jobs(10, 1)
    started = [store.start_job(j.id) for j in again]
    assert started in ([], [0])
    state = store.job_state("d1")
    assert state is not None and state[0] == "failed"


def test_release_jobs_requeues_at_once_without_counting(store: Store) -> None:
    for d in ("d1", "d2", "d3"):
        accept(store, d)
    j1, j2, j3 = store.claim_jobs(3600, 3)
    assert store.start_job(j1.id) == 1
    assert store.complete_job(j2.id)
    assert store.release_jobs([]) == 0
    # A finished job and an unknown id are not given back.
    assert store.release_jobs([j1.id, j2.id, j3.id, 987_654]) == 2
    assert store.job_state("d1") == ("queued", 1, None)
    assert store.job_state("d2") == ("done", 0, None)
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'd3'") == [("queued",)]
    # No waiting for the hour-long leases; attempts as they were.
    again = store.claim_jobs(3600, 10)
    assert [(j.id, j.attempts) for j in again] == [(j1.id, 1), (j3.id, 0)]
    assert store.release_jobs([j1.id]) == 1
    assert store.release_jobs([j1.id]) == 0  # queued now, not running


def test_counts_and_job_state(store: Store) -> None:
    assert (store.pending_count(), store.failed_count()) == (0, 0)
    assert store.job_state("nope") is None
    for d in ("d1", "d2", "d3", "d4"):
        accept(store, d)
    j1, j2, _ = store.claim_jobs(60, 3)
    assert store.complete_job(j1.id)
    assert store.fail_job(j2.id, "bad payload")
    # Queued (d4) and running (d3) are pending; done and failed are not.
    assert (store.pending_count(), store.failed_count()) == (2, 1)
    assert [store.job_state(d) for d in ("d1", "d2", "d3", "d4")] == [
        ("done", 0, None), ("failed", 0, "bad payload"), ("running", 0, None),
        ("queued", 0, None)]


# -- a real crash -------------------------------------------------------------------------------


def crash_child(target: str, delivery_id: str, lease: float, *, start: bool) -> dict[str, Any]:
    """Run tests/store_crash_child.py; what it held when it was killed."""
    child = subprocess.run(
        [sys.executable, str(CHILD), target, delivery_id, str(lease),
         *(["start"] if start else [])],
        env=child_env(), capture_output=True, text=True, timeout=60)
    expected_rc = -signal.SIGKILL if hasattr(signal, "SIGKILL") else 1
    assert child.returncode == expected_rc, child.stderr
    held: dict[str, Any] = json.loads(child.stdout)
    return held


@pytest.mark.parametrize("started", [False, True], ids=["claimed", "started"])
def test_sqlite_a_killed_claimer_s_job_is_claimed_again_after_its_lease(
        tmp_path: Path, started: bool) -> None:
    """Without ``recover`` (which the one worker of a data directory runs at its start) only the
    lease tells SQLite that the job is abandoned."""
    lease = 30.0
    target = str(tmp_path / "data")
    held = crash_child(target, "d-crash", lease, start=started)
    runs = 1 if started else 0
    assert held["attempts"] == runs
    # The parent's clock starts at the real time (the child's lease still runs) and then
    # jumps past the lease, so the test needs no sleep.
    clock = Clock(time.time())
    store = open_(None, tmp_path, clock=clock)
    assert store.job_state("d-crash") == ("running", runs, None)
    assert store.claim_jobs(60, 10) == []  # the dead child's lease still holds it
    clock.advance(lease + 1)
    [job] = store.claim_jobs(60, 10)
    assert (job.id, job.delivery_id, job.attempts) == (held["id"], "d-crash", runs)
    assert (job.repo, job.installation_id, job.payload) == ("Acme/Widgets", 7, b'{"n": 1}')
    assert store.start_job(job.id) == runs + 1
    assert store.complete_job(job.id)
    assert store.pending_count() == 0


def claim_within(store: Store, seconds: float) -> list[Job]:
    """Claim until something is handed out, for up to ``seconds`` (the database ends a killed
    process's session a moment after the kernel closed its socket)."""
    deadline = time.monotonic() + seconds
    while not (jobs := store.claim_jobs(60, 10)):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing to claim within {seconds} s")
        time.sleep(0.02)
    return jobs


@pytest.mark.parametrize("started", [False, True], ids=["claimed", "started"])
def test_postgres_a_killed_claimer_s_job_is_taken_over_at_once(
        pg_url: str, tmp_path: Path, started: bool) -> None:
    """The child claims with an hour-long lease and is SIGKILLed: its database session ends
    with it, and with the session the lock that said it was alive, so the next claim takes
    the job over, lease or not. Both stores run by the database's clock."""
    held = crash_child(pg_url, "d-crash", 3600, start=started)
    runs = 1 if started else 0
    store = open_(pg_url, tmp_path)
    [job] = claim_within(store, 10.0)
    assert (job.id, job.delivery_id, job.attempts) == (held["id"], "d-crash", runs)
    assert (job.repo, job.installation_id, job.payload) == ("Acme/Widgets", 7, b'{"n": 1}')
    why = ("its worker's database session ended (the process died) during attempt 1"
           if started else "its worker died before starting it")
    assert store.job_state("d-crash") == ("running", runs, why)
    assert store.queue_health().taken_over == {"dead": 1, "lease": 0}
    assert store.taken_over == Counter({"dead": 1})
    assert store.start_job(job.id, job.claim) == runs + 1
    assert store.complete_job(job.id, job.claim)
    assert store.pending_count() == 0


def test_sqlite_recover_requeues_a_dead_claimer_s_job_at_once(tmp_path: Path) -> None:
    held = crash_child(str(tmp_path / "data"), "d-crash", 3600, start=False)
    store = open_(None, tmp_path)
    assert store.claim_jobs(60, 10) == []  # an hour-long lease
    # The data directory's lock says no other process runs its jobs: they are requeued now.
    assert store.recover() == 1
    assert store.job_state("d-crash") == ("queued", 0, None)
    assert store.queue_health().taken_over == {"dead": 1, "lease": 0}
    [job] = store.claim_jobs(60, 10)
    assert (job.id, job.attempts) == (held["id"], 0)
    assert store.recover() == 1 and store.recover() == 0  # the job claimed just now, then none


def test_postgres_recover_leaves_a_dead_claimer_s_job_to_the_next_claim(
        pg_url: str, tmp_path: Path) -> None:
    crash_child(pg_url, "d-crash", 3600, start=False)
    store = open_(pg_url, tmp_path)
    # Another host may be running its jobs: a start requeues nothing; a claim asks the
    # database who is alive.
    assert store.recover() == 0
    [job] = claim_within(store, 10.0)
    assert job.delivery_id == "d-crash"


def owner_pid(store: PostgresStore) -> int:
    """The backend pid of the store's owner session (the one holding its lock)."""
    key = store.check_owner()
    assert key is not None
    rows = raw(store, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                      " AND classid = ?::oid AND objid = ?::oid AND objsubid = 2",
               (OWNER_SPACE, key))
    assert len(rows) == 1, rows
    return int(rows[0][0])


def test_postgres_a_live_worker_keeps_its_job_until_its_lease_then_its_run_is_ended(
        pg_url: str, tmp_path: Path) -> None:
    """A worker alive (its session open) keeps its job however slow it is, until the lease:
    then the job's attempt is ended first, and the slow worker's late result is refused."""
    clock = Clock(time.time())
    slow = open_(pg_url, tmp_path, clock=clock)
    other = open_(pg_url, tmp_path, clock=clock)
    accept(slow, "d1", issue="acme/widgets#1")
    [a] = slow.claim_jobs(10, 1)
    assert slow.start_job(a.id, a.claim) == 1
    clock.advance(9)
    assert other.claim_jobs(10, 10) == []  # alive and within its lease: never taken
    clock.advance(2)
    [b] = other.claim_jobs(10, 10)
    assert (b.id, b.attempts) == (a.id, 1) and b.owner != a.owner
    assert other.job_state("d1") == ("running", 1,
                                     "attempt 1 ended: its worker held it past its lease")
    assert other.queue_health().taken_over == {"dead": 0, "lease": 1}
    # The slow worker comes back: nothing it says is recorded.
    assert not slow.complete_job(a.id, a.claim)
    assert not slow.fail_job(a.id, "late", 0.0, a.claim)
    assert slow.release_jobs([a]) == 0
    assert slow.check_owner() == a.owner  # its session is fine: only the job moved on
    assert other.start_job(b.id, b.claim) == 2 and other.complete_job(b.id, b.claim)


def test_postgres_a_worker_whose_session_ends_loses_its_jobs_at_once(
        pg_url: str, tmp_path: Path) -> None:
    """The session is ended under a live worker (a network cut, an administrator): its jobs
    are taken over at once, and the worker learns it from ``check_owner``; its next claim
    holds them under a new session and key."""
    lost = open_(pg_url, tmp_path)
    other = open_(pg_url, tmp_path)
    accept(lost, "d1")
    accept(lost, "d2")
    [a] = lost.claim_jobs(3600, 1)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (owner_pid(lost),))
    [b, c] = claim_within(other, 10.0)
    assert (b.delivery_id, c.delivery_id) == ("d1", "d2") and b.id == a.id
    assert lost.check_owner() is None  # its jobs are no longer its own
    assert not lost.complete_job(a.id, a.claim)
    assert other.complete_job(b.id, b.claim)
    accept(lost, "d3")
    [d] = lost.claim_jobs(3600, 1)  # a new session, a new key
    assert d.delivery_id == "d3" and d.owner not in (None, a.owner)
    assert lost.check_owner() == d.owner


def test_postgres_the_queue_runs_by_the_database_clock(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose clock is an hour ahead (or behind) queues and leases by the database's
    clock all the same: due at once, leased for exactly the lease."""
    real = time.time
    for skew in (3600.0, -3600.0):
        # Skewed before the store is opened: a store that fell back to the host's clock would
        # take the skewed one.
        monkeypatch.setattr(time, "time", lambda skew=skew: real() + skew)
        store = open_(pg_url, tmp_path)  # no clock given: the database's
        delivery = f"skew-{skew:+.0f}"
        accept(store, delivery)
        [job] = store.claim_jobs(30, 1)
        assert job.delivery_id == delivery
        [(lease_until, received, db_now)] = raw(
            store, "SELECT j.lease_until, d.received_at, extract(epoch FROM clock_timestamp())"
                   " FROM jobs j JOIN deliveries d USING (delivery_id) WHERE j.id = ?",
            (job.id,))
        assert abs(float(db_now) - float(received)) < 60
        assert abs(float(lease_until) - float(db_now) - 30) < 60
        assert store.complete_job(job.id, job.claim)


def test_queue_health_oldest_due_job_and_takeovers(store: Store, clock: Clock) -> None:
    assert store.queue_health() == QueueHealth(0, 0, 0.0, {"dead": 0, "lease": 0})
    accept(store, "old")
    clock.advance(30)
    accept(store, "new")
    accept(store, "later")
    [later] = [j for j in store.claim_jobs(60, 10) if j.delivery_id == "later"]
    assert store.start_job(later.id, later.claim) == 1
    for job_id_ in (job_id(store, "old"), job_id(store, "new")):
        store.release_jobs([job_id_])
    # "later" fails and waits for its retry: not waiting to be claimed yet.
    assert store.fail_job(later.id, "boom", 100.0, later.claim)
    clock.advance(5)
    health = store.queue_health()
    assert (health.pending, health.failed) == (3, 0)
    assert health.oldest_due_seconds == pytest.approx(5.0)


# -- per-issue and per-repository bounds --------------------------------------------------------


def test_one_running_job_per_issue(store: Store, clock: Clock) -> None:
    accept(store, "a1", issue="acme/widgets#1")
    accept(store, "a2", issue="acme/widgets#1")
    accept(store, "b1", issue="acme/widgets#2")
    accept(store, "n1", issue=None)  # no issue: never serialised
    accept(store, "n2", issue=None)
    assert claim(store, lease=10) == ["a1", "b1", "n1", "n2"]
    assert claim(store, lease=10) == []  # a2 waits for a1
    # a1's lease runs out: a1 itself is taken again, still not alongside a2.
    clock.advance(11)
    jobs = store.claim_jobs(10, 10)
    assert [j.delivery_id for j in jobs] == ["a1", "b1", "n1", "n2"]
    assert store.complete_job(jobs[0].id)
    assert claim(store, lease=10) == ["a2"]


def test_per_repo_bounds_running_jobs_of_each_repository(store: Store) -> None:
    # The repository is compared without case: these are three jobs of one repository.
    accept(store, "w1", repo="Acme/Widgets")
    accept(store, "w2", repo="acme/widgets")
    accept(store, "w3", repo="ACME/WIDGETS")
    accept(store, "g1", repo="acme/gadgets")
    accept(store, "x1", repo=None)  # no repository: not bounded
    accept(store, "x2", repo=None)
    jobs = store.claim_jobs(60, 10, per_repo=2)
    assert [j.delivery_id for j in jobs] == ["w1", "w2", "g1", "x1", "x2"]
    assert claim(store, per_repo=2) == []
    assert store.complete_job(jobs[0].id)
    assert claim(store, per_repo=2) == ["w3"]
    # 0: no bound.
    accept(store, "w4", repo="acme/widgets")
    assert claim(store, per_repo=0) == ["w4"]


def test_concurrent_claims_never_share_a_job(backend: str | None, tmp_path: Path) -> None:
    jobs, threads = 200, 4
    stores = [open_(backend, tmp_path) for _ in range(threads)]
    for i in range(jobs):
        accept(stores[0], f"d{i}")

    def worker(i: int) -> list[int]:
        mine: list[int] = []
        while batch := stores[i].claim_jobs(3600, 3):
            mine.extend(j.id for j in batch)
        return mine

    claimed = Counter(job for mine in run_in_threads(threads, worker) for job in mine)
    assert len(claimed) == jobs
    assert set(claimed.values()) == {1}
    assert stores[0].pending_count() == jobs  # all running, none finished


def test_concurrent_claims_never_run_two_jobs_of_one_issue(backend: str | None,
                                                           tmp_path: Path) -> None:
    jobs, threads, issues = 200, 4, 8
    stores = [open_(backend, tmp_path) for _ in range(threads)]
    key_of = {f"d{i}": f"acme/widgets#{i % issues}" for i in range(jobs)}
    for delivery, key in key_of.items():
        accept(stores[0], delivery, issue=key)
    lock = threading.Lock()
    running: set[str] = set()
    overlaps: list[str] = []
    done: list[str] = []

    def worker(i: int) -> None:
        store = stores[i]
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            batch = store.claim_jobs(3600, 3)
            if not batch:
                if store.pending_count() == 0:
                    return
                continue  # the remaining issues are busy in other threads: ask again
            with lock:
                for job in batch:
                    key = key_of[job.delivery_id]
                    if key in running:
                        overlaps.append(key)
                    running.add(key)
            for job in batch:
                assert store.start_job(job.id) == 1
                # Out of the set before the commit that lets the next job of the issue go.
                with lock:
                    running.discard(key_of[job.delivery_id])
                assert store.complete_job(job.id)
                done.append(job.delivery_id)
        raise AssertionError("the queue did not drain")

    run_in_threads(threads, worker)
    assert overlaps == []
    assert sorted(done) == sorted(key_of)


# -- pruning ------------------------------------------------------------------------------------


def test_prune_removes_only_old_done_deliveries(store: Store, clock: Clock) -> None:
    for d in ("old-done", "old-failed", "old-queued"):
        accept(store, d, payload=d.encode())
    done, failed = store.claim_jobs(60, 2)
    assert store.complete_job(done.id)
    assert store.fail_job(failed.id, "dead")
    store.record_comment(REPO, 1, 1, None, None, "h")
    clock.advance(100)
    accept(store, "new-done")
    new = store.claim_jobs(60, 10)
    assert [j.delivery_id for j in new] == ["old-queued", "new-done"]
    assert store.complete_job(new[1].id)
    assert store.prune(older_than_seconds=50) == 1
    assert store.job_state("old-done") is None
    assert raw(store, "SELECT count(*) FROM payloads WHERE delivery_id = 'old-done'") == [(0,)]
    left = raw(store, "SELECT delivery_id FROM payloads ORDER BY delivery_id")
    assert left == [("new-done",), ("old-failed",), ("old-queued",)]
    assert store.job_state("old-failed") == ("failed", 0, "dead")  # kept for inspection
    assert store.get_comment(REPO, 1) is not None  # comments are never pruned
    assert store.prune(older_than_seconds=50) == 0
    # Once forgotten, the id is accepted again: pruning bounds how long redeliveries are caught.
    assert store.accept_delivery("old-done", "issues", "opened", REPO, 77, b"{}")


# -- comment ledger and the daily cap -----------------------------------------------------------


def test_record_comment_upserts_and_keeps_created_at(store: Store, clock: Clock) -> None:
    assert store.get_comment(REPO, 7) is None
    store.record_comment("Acme/Widgets", 7, 111, "c-1", 0.95, "hash-1")
    first = store.get_comment("ACME/widgets", 7)
    assert first is not None
    assert (first.repo, first.issue, first.comment_id, first.cluster, first.score,
            first.body_hash, first.created_at, first.updated_at) == (
        "acme/widgets", 7, 111, "c-1", 0.95, "hash-1", T0, T0)
    clock.advance(50)
    store.record_comment("acme/WIDGETS", 7, 222, None, None, "hash-2")
    second = store.get_comment("acme/widgets", 7)
    assert second is not None
    assert (second.comment_id, second.cluster, second.score, second.body_hash,
            second.created_at, second.updated_at) == (222, None, None, "hash-2", T0, T0 + 50)
    assert store.get_comment(REPO, 8) is None
    assert store.get_comment("acme/gadgets", 7) is None


def test_comments_for_cluster_and_comments_in_last(store: Store, clock: Clock) -> None:
    for issue, cluster in [(9, "c-a"), (3, "c-a"), (4, "c-b"), (5, "c-a")]:
        store.record_comment(REPO, issue, 1000 + issue, cluster, 0.9, f"h{issue}")
        clock.advance(100)
    store.record_comment("acme/gadgets", 1, 2000, "c-a", 0.9, "h")
    found = store.comments_for_cluster("ACME/widgets", "c-a")
    assert [(c.issue, c.comment_id) for c in found] == [(3, 1003), (5, 1005), (9, 1009)]
    assert store.comments_for_cluster(REPO, "c-z") == []
    # Comments were first written at T0, +100, +200, +300; now is T0 + 400.
    assert store.comments_in_last(REPO, 150) == 1
    assert store.comments_in_last(REPO, 250) == 2
    assert store.comments_in_last(REPO, DAY) == 4
    assert store.comments_in_last("acme/gadgets", DAY) == 1
    # An edit of an old comment is not a new comment.
    store.record_comment(REPO, 9, 1009, "c-a", 0.9, "edited")
    assert store.comments_in_last(REPO, 150) == 1


def test_reserve_comment_holds_the_cap(store: Store, clock: Clock) -> None:
    cap = 2
    assert store.reserve_comment(REPO, 1, cap, DAY)
    assert store.reserve_comment(REPO, 2, cap, DAY)
    assert not store.reserve_comment(REPO, 3, cap, DAY)  # both taken by posts under way
    assert store.reserve_comment(REPO, 1, cap, DAY)  # the same issue keeps its slot
    assert store.reserve_comment("acme/gadgets", 1, cap, DAY)  # caps are per repository
    # Issue 1's post succeeded: its slot becomes a comment, which counts the same.
    clock.advance(10)
    store.record_comment(REPO, 1, 501, "c-a", 0.9, "h")
    assert not store.reserve_comment(REPO, 3, cap, DAY)
    # Issue 2's post never happened: its slot is given back after SLOT_SECONDS.
    clock.advance(SLOT_SECONDS - 11)
    assert not store.reserve_comment("acme/widgets", 3, cap, DAY)
    clock.advance(2)
    assert store.reserve_comment(REPO, 3, cap, DAY)
    assert not store.reserve_comment(REPO, 4, cap, DAY)
    # A day after the comment, only the slot of issue 3 (refreshed below) still counts.
    clock.advance(DAY)
    assert store.reserve_comment(REPO, 4, cap, DAY)
    assert store.reserve_comment(REPO, 5, cap, DAY)
    assert not store.reserve_comment(REPO, 6, cap, DAY)


def test_reserve_comment_is_atomic(backend: str | None, tmp_path: Path) -> None:
    # Eight workers (separate store instances) reach the cap at once: exactly cap of them
    # may post. Repeated on fresh repositories to give a race several chances.
    stores = [open_(backend, tmp_path) for _ in range(8)]
    for round_ in range(3):
        repo = f"acme/widgets-{round_}"

        def reserve(i: int, repo: str = repo) -> bool:
            return stores[i].reserve_comment(repo, 100 + i, 3, DAY)

        granted = run_in_threads(8, reserve)
        assert sum(granted) == 3
        assert raw(stores[0], "SELECT count(*) FROM comment_slots WHERE repo = ?",
                   (repo,)) == [(3,)]


class _Interleaved:
    """A transaction that runs ``before`` once, just ahead of the first statement starting with
    ``prefix``: another process's write landing between two reads of one transaction."""

    def __init__(self, tx: Any, prefix: str, before: Callable[[], None]) -> None:
        self._tx = tx
        self._prefix = prefix
        self._before: Callable[[], None] | None = before

    def execute(self, query: str, params: Sequence[Any] = ()) -> Any:
        if self._before is not None and query.startswith(self._prefix):
            before, self._before = self._before, None
            before()
        return self._tx.execute(query, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)


def test_postgres_reserve_comment_counts_a_comment_recorded_meanwhile(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = open_(pg_url, tmp_path), open_(pg_url, tmp_path)
    assert b.reserve_comment(REPO, 1, 1, DAY)  # b holds the only slot and is posting
    real_write = a._write

    @contextmanager
    def write() -> Iterator[Any]:
        with real_write() as tx:
            # b's post succeeds and is recorded inside a's reservation, just before a counts
            # what the day has used (comments made, slots held): counted once, as a comment.
            yield _Interleaved(tx, "SELECT (SELECT count(*) FROM comments",
                               lambda: b.record_comment(REPO, 1, 501, "c-a", 0.9, "h"))

    monkeypatch.setattr(a, "_write", write)
    granted = a.reserve_comment(REPO, 2, 1, DAY)
    assert b.comments_in_last(REPO, DAY) == 1
    assert not granted  # the one comment of the day is made


# -- pauses and feedback ------------------------------------------------------------------------


def test_pause_announce_and_resume(store: Store, clock: Clock) -> None:
    assert store.get_pause(REPO) is None
    assert not store.claim_announcement(REPO)  # nothing to announce
    assert not store.resume(REPO, "maintainer")
    assert store.pause("Acme/Widgets", "too many dismissals", "cfg-1")
    assert not store.pause("acme/widgets", "again", "cfg-2")  # already paused
    pause = store.get_pause("ACME/widgets")
    assert pause is not None
    assert (pause.repo, pause.paused, pause.reason, pause.config_hash, pause.issue,
            pause.announced, pause.paused_at, pause.resumed_at, pause.resumed_by) == (
        "acme/widgets", True, "too many dismissals", "cfg-1", None, False, T0, None, None)
    # One announcer at a time; an announcer that vanished is replaced after ANNOUNCE_SECONDS.
    assert store.claim_announcement(REPO)
    assert not store.claim_announcement(REPO)
    clock.advance(ANNOUNCE_SECONDS - 1)
    assert not store.claim_announcement(REPO)
    clock.advance(2)
    assert store.claim_announcement(REPO)
    store.mark_pause_announced(REPO, 4242)
    clock.advance(ANNOUNCE_SECONDS + 1)
    assert not store.claim_announcement(REPO)  # announced: never again for this pause
    pause = store.get_pause(REPO)
    assert pause is not None and (pause.announced, pause.issue) == (True, 4242)
    resumed_at = clock.now
    assert store.resume("acme/WIDGETS", "maintainer")
    assert not store.resume(REPO, "maintainer")
    assert not store.claim_announcement(REPO)
    pause = store.get_pause(REPO)
    assert pause is not None
    assert (pause.paused, pause.resumed_at, pause.resumed_by) == (False, resumed_at, "maintainer")
    # Paused again: a fresh pause to announce.
    clock.advance(10)
    assert store.pause(REPO, "dismissed again", "cfg-3")
    pause = store.get_pause(REPO)
    assert pause is not None
    assert (pause.paused, pause.reason, pause.config_hash, pause.issue, pause.announced,
            pause.paused_at) == (True, "dismissed again", "cfg-3", None, False, clock.now)
    assert store.claim_announcement(REPO)


def test_concurrent_pauses_tell_exactly_one_caller(backend: str | None, tmp_path: Path) -> None:
    stores = [open_(backend, tmp_path) for _ in range(6)]
    for round_ in range(3):
        repo = f"acme/widgets-{round_}"

        def pause(i: int, repo: str = repo) -> bool:
            return stores[i].pause(repo, f"by {i}", "cfg")

        def announce(i: int, repo: str = repo) -> bool:
            return stores[i].claim_announcement(repo)

        told = run_in_threads(6, pause)
        assert sum(told) == 1
        announcers = run_in_threads(6, announce)
        assert sum(announcers) == 1


def test_feedback_latest_word_wins_and_issue_facts(store: Store) -> None:
    assert store.feedback_for(REPO, 1) == {}
    assert store.issue_facts(REPO, 1) == ({}, None)
    store.record_feedback("Acme/Widgets", 1, "c-a", "dismissed", "alice")
    store.record_feedback("acme/widgets", 1, "c-b", "confirmed", None)
    store.record_feedback(REPO, 2, "c-a", "confirmed", "bob")
    assert store.feedback_for("ACME/WIDGETS", 1) == {"c-a": "dismissed", "c-b": "confirmed"}
    store.record_feedback(REPO, 1, "c-a", "confirmed", "carol")
    assert store.feedback_for(REPO, 1) == {"c-a": "confirmed", "c-b": "confirmed"}
    assert store.feedback_for("acme/gadgets", 1) == {}
    assert store.pause(REPO, "r", "cfg")
    feedback, pause = store.issue_facts(REPO, 2)
    assert feedback == {"c-a": "confirmed"}
    assert pause is not None and pause.paused and pause.reason == "r"


def test_dismissal_rate(store: Store, clock: Clock) -> None:
    # Suggestions (cluster and score) at T0+1..; a same-as comment (no score) and a comment
    # naming no cluster are not suggestions.
    comments: list[tuple[int, str | None, float | None]] = [
        (1, "c-a", 0.9), (2, "c-a", 0.8), (3, "c-b", 0.7), (4, "c-a", None), (5, "c-b", 0.95),
        (6, None, None)]
    for issue, cluster, score in comments:
        clock.advance(1)
        store.record_comment(REPO, issue, 100 + issue, cluster, score, "h")
    store.record_feedback(REPO, 2, "c-a", "dismissed", "m")  # counts
    store.record_feedback(REPO, 3, "c-a", "dismissed", "m")  # another cluster than suggested
    store.record_feedback(REPO, 4, "c-a", "dismissed", "m")  # not a suggestion
    store.record_feedback(REPO, 5, "c-b", "confirmed", "m")
    store.record_feedback(REPO, 1, "c-a", "dismissed", "m")
    store.record_feedback(REPO, 1, "c-a", "confirmed", "m")  # taken back
    assert store.dismissal_rate("ACME/widgets", 10) == (1, 4)
    assert store.dismissal_rate(REPO, 2) == (0, 2)  # the latest two: issues 5 and 3
    assert store.dismissal_rate(REPO, 3) == (1, 3)
    assert store.dismissal_rate(REPO, 10, since=T0 + 2) == (0, 2)  # first made after since
    assert store.dismissal_rate(REPO, 10, since=T0 + 1) == (1, 3)
    assert store.dismissal_rate("acme/gadgets", 10) == (0, 0)


# -- learned clusters ---------------------------------------------------------------------------


def test_learned_clusters_are_stored_found_by_member_and_versioned(
        backend: str | None, tmp_path: Path) -> None:
    store, other = open_(backend, tmp_path), open_(backend, tmp_path)
    versions = {store.learned_state(REPO)}
    assert store.learned_count() == 0 and store.learned_clusters() == []
    fix = make_cluster("fix-50", [("issue", 10), ("issue", 11), ("pr", 50)])
    store.put_learned(fix)
    versions.add(store.learned_state(REPO))
    assert other.learned_state(REPO) == store.learned_state(REPO)  # another process sees it
    assert store.learned_state(REPO)[0] == 1
    assert store.find_learned("acme/widgets", "pr", 50) == fix
    assert store.find_learned("ACME/Widgets", "issue", 11) == fix
    assert store.find_learned(REPO, "issue", 50) is None  # the kind matters
    assert store.find_learned("acme/gadgets", "pr", 50) is None
    # Replaced: its members are indexed afresh, and the version moves again (the count not).
    store.put_learned(make_cluster("fix-50", [("issue", 10), ("pr", 50)]))
    versions.add(store.learned_state(REPO))
    assert store.find_learned(REPO, "issue", 11) is None
    assert store.learned_count() == 1
    # A member can move to another cluster.
    other.put_learned(make_cluster("fix-60", [("issue", 10), ("pr", 60)]))
    versions.add(store.learned_state(REPO))
    moved = store.find_learned(REPO, "issue", 10)
    assert moved is not None and moved.public_id == "fix-60"
    assert len(versions) == 4  # every put of this repository changed its version
    # Another repository's clusters leave this one's version as it was.
    before = store.learned_state(REPO)
    other.put_learned(make_cluster("a-1", [("pr", 1)], repo="Zeta/Lib"))
    other.put_learned(make_cluster("b-2", [("pr", 2)], repo="acme/gadgets"))
    assert store.learned_state(REPO) == before
    assert store.learned_state("zeta/lib")[0] == 1
    assert store.learned_counts() == {"acme/widgets": 2, "zeta/lib": 1, "acme/gadgets": 1}
    assert store.learned_count() == 4
    # learned_clusters: by repository (lowercased), then id; or one repository's.
    assert [c.key for c in store.learned_clusters()] == [
        ("acme/gadgets", "b-2"), ("acme/widgets", "fix-50"), ("acme/widgets", "fix-60"),
        ("zeta/lib", "a-1")]
    assert [c.public_id for c in store.learned_clusters("ACME/WIDGETS")] == ["fix-50", "fix-60"]
    assert store.learned_clusters("nobody/else") == []


def test_learned_records_are_raw_json_in_a_consistent_snapshot(store: Store) -> None:
    clusters = [make_cluster(f"fix-{n}", [("pr", n)]) for n in (3, 1, 2)]
    for c in clusters:
        store.put_learned(c)
    records = list(store.learned_records(REPO))
    assert all(isinstance(r, str) for r in records)
    assert [json.loads(r)["public_id"] for r in records] == ["fix-1", "fix-2", "fix-3"]
    assert [Cluster.model_validate_json(r) for r in records] == sorted(
        clusters, key=lambda c: c.public_id)
    assert list(store.learned_records("acme/gadgets")) == []
    # A read under way keeps what it started with while the bot goes on writing.
    reader = store.learned_records()
    try:
        first = next(reader)
        store.put_learned(make_cluster("fix-0", [("pr", 99)]))
        rest = list(reader)
    finally:
        # Let go of the read (PostgreSQL: its transaction and cursor) whatever happened.
        close = getattr(reader, "close", None)
        if close is not None:
            close()
    assert [json.loads(r)["public_id"] for r in [first, *rest]] == ["fix-1", "fix-2", "fix-3"]
    assert len(list(store.learned_records())) == 4


# -- cursors ------------------------------------------------------------------------------------


def test_cursors_set_get_delete_and_survive_a_reopen(backend: str | None, tmp_path: Path,
                                                     clock: Clock) -> None:
    store = open_(backend, tmp_path, clock=clock)
    assert store.get_cursor("backfill:acme/widgets") is None
    store.set_cursor("backfill:acme/widgets", "page=2")
    store.set_cursor("backfill:acme/widgets", "page=3")
    store.set_cursor("backfill:acme/gadgets", "page=9")
    store.set_cursor("backfill:nobody", None)  # deleting what is not there is fine
    store.close()
    store = open_(backend, tmp_path, clock=clock)
    assert store.get_cursor("backfill:acme/widgets") == "page=3"
    store.set_cursor("backfill:acme/widgets", None)
    assert store.get_cursor("backfill:acme/widgets") is None
    assert store.get_cursor("backfill:acme/gadgets") == "page=9"


# -- unstorable input ---------------------------------------------------------------------------


def test_a_lone_surrogate_is_unstorable(store: Store) -> None:
    # A JSON payload may decode to a string no UTF-8 database can hold.
    with pytest.raises(store.unstorable):
        store.accept_delivery("d1", "issues", "\udc80", REPO, 77, b"{}")
    assert store.job_state("d1") is None  # nothing of it was written
    assert store.accept_delivery("d1", "issues", "opened", REPO, 77, b"{}")  # still usable


def test_postgres_rejects_a_nul_in_text_as_unstorable(pg_url: str, tmp_path: Path) -> None:
    store = open_(pg_url, tmp_path)
    with pytest.raises(store.unstorable):
        store.accept_delivery("d1", "issues", "a\x00b", REPO, 77, b"{}")
    assert store.job_state("d1") is None
    assert store.pending_count() == 0
    assert store.accept_delivery("d1", "issues", "opened", REPO, 77, b"\x00")


def test_sqlite_keeps_a_nul_in_text(tmp_path: Path) -> None:
    store = open_(None, tmp_path)
    assert store.accept_delivery("d1", "issues", "a\x00b", REPO, 77, b"{}")
    [job] = store.claim_jobs(60, 1)
    assert job.action == "a\x00b"


# -- notifications ------------------------------------------------------------------------------


def test_sqlite_notifications_are_delivered_after_commit(tmp_path: Path, clock: Clock) -> None:
    store = open_(None, tmp_path, clock=clock)
    reader = open_(None, tmp_path, clock=clock)  # another connection: sees only what committed
    heard: list[tuple[str, str, int, int]] = []

    def broken(channel: str, payload: str) -> None:
        raise RuntimeError("a listener's bug must not undo the write")

    store.subscribe(broken)
    store.subscribe(lambda channel, payload: heard.append(
        (channel, payload, reader.pending_count(), reader.learned_count())))
    accept(store, "d1")
    assert heard == [(JOBS, "", 1, 0)]
    assert not store.accept_delivery("d1", "issues", "opened", REPO, 77, b"{}")
    with pytest.raises(store.unstorable):
        store.accept_delivery("d2", "issues", "\udc80", REPO, 77, b"{}")
    assert len(heard) == 1  # a redelivery or a failed write tells nobody
    store.put_learned(make_cluster("fix-1", [("pr", 1)]))
    store.notify(CHANGES, "config:x")
    [job] = store.claim_jobs(60, 1)
    assert store.release_jobs([job.id]) == 1  # a job queued again wakes a worker too
    assert heard[1:] == [(CHANGES, "learned:acme/widgets", 1, 1), (CHANGES, "config:x", 1, 1),
                         (JOBS, "", 1, 1)]


async def test_sqlite_listen_waits_until_cancelled(tmp_path: Path) -> None:
    store = open_(None, tmp_path)
    task = asyncio.create_task(store.listen())
    done, _ = await asyncio.wait([task], timeout=0.05)
    assert not done
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def until_heard(sender: Store, heard: list[tuple[str, str]], timeout: float = 10.0) -> None:
    """Notify through ``sender`` until ``heard`` gets one: the listener's LISTEN is in place
    (what is notified before it is lost, by design)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    n = 0
    while True:
        n += 1
        mark = (CHANGES, f"config:ping-{n}")
        await asyncio.to_thread(sender.notify, *mark)
        with suppress(AssertionError):
            await wait_until(lambda: mark in heard, "a ping", timeout=0.2)  # noqa: B023
            return
        if loop.time() > deadline:
            raise AssertionError(f"no notification heard in {timeout}s")


def _recorder(got: list[tuple[str, str]]) -> Callable[[str, str], None]:
    def listener(channel: str, payload: str) -> None:
        got.append((channel, payload))

    return listener


@contextmanager
def listening(*stores: Store) -> Iterator[list[list[tuple[str, str]]]]:
    """Each store's ``listen()`` as a task, and what each one's listener heard."""
    heard: list[list[tuple[str, str]]] = []
    for s in stores:
        got: list[tuple[str, str]] = []
        s.subscribe(_recorder(got))
        heard.append(got)
    tasks = [asyncio.create_task(s.listen()) for s in stores]
    try:
        yield heard
    finally:
        for task in tasks:
            task.cancel()


async def test_postgres_notifications_reach_other_stores_of_the_schema_only(
        pg_url: str, other_pg_url: str, tmp_path: Path) -> None:
    a, b = open_(pg_url, tmp_path), open_(pg_url, tmp_path)
    elsewhere = open_(other_pg_url, tmp_path)  # another deployment in the same database
    assert isinstance(b, PostgresStore) and isinstance(elsewhere, PostgresStore)
    assert b.channel(JOBS) != elsewhere.channel(JOBS)
    with listening(b, elsewhere) as (heard_b, heard_elsewhere):
        await until_heard(a, heard_b)
        await until_heard(elsewhere, heard_elsewhere)
        heard_b.clear()
        heard_elsewhere.clear()
        await asyncio.to_thread(accept, a, "d1")
        await asyncio.to_thread(a.put_learned, make_cluster("fix-1", [("pr", 1)]))
        await asyncio.to_thread(a.notify, CHANGES, "config:acme/widgets")
        await wait_until(lambda: len(heard_b) >= 3, "a's three notifications")
        assert heard_b == [(JOBS, ""), (CHANGES, "learned:acme/widgets"),
                           (CHANGES, "config:acme/widgets")]
        # The other schema's listener: its own note arrives after where a's would have
        # (notifications come in commit order), and a's never came.
        await asyncio.to_thread(elsewhere.notify, CHANGES, "config:mine")
        await wait_until(lambda: bool(heard_elsewhere), "the other schema's own note")
        assert heard_elsewhere == [(CHANGES, "config:mine")]
        assert (CHANGES, "config:mine") not in heard_b


async def test_postgres_listener_reconnects_after_losing_its_connection(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bot.db.postgres

    monkeypatch.setattr(bot.db.postgres, "LISTEN_RETRY", 0.05)
    a, b = open_(pg_url, tmp_path), open_(pg_url, tmp_path)
    assert isinstance(b, PostgresStore)
    assert b.listening is False  # /healthz's "listen": nothing yet
    with listening(b) as (heard,):
        await until_heard(a, heard)
        assert b.listening is True
        channel = b.channel(CHANGES)
        killed = await asyncio.to_thread(raw, a, (
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE left(query, 7) = 'LISTEN ' AND position(? in query) > 0"), (channel,))
        assert killed == [(True,)]
        # What was notified meanwhile is lost: the listeners are told to drop their caches.
        await wait_until(lambda: ("reconnected", "") in heard, "the reconnection")
        await until_heard(a, heard)
        assert b.listening is True
    await wait_until(lambda: b.listening is False, "the cancelled listener to say so")
    assert open_(None, tmp_path).listening is None  # SQLite: no connection to lose


# -- schema and migrations ----------------------------------------------------------------------


def test_sqlite_fresh_directory_migrates_to_the_latest_version(tmp_path: Path) -> None:
    store = open_(None, tmp_path)
    assert isinstance(store, SQLiteStore)
    assert store.schema_version() == schema.check(schema.SQLITE)
    assert raw(store, "PRAGMA user_version") == [(schema.check(schema.SQLITE),)]
    assert raw(store, "PRAGMA journal_mode") == [("wal",)]
    tables = {r[0] for r in raw(store, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"deliveries", "jobs", "payloads", "comments", "comment_slots", "learned_clusters",
            "learned_members", "cursors", "feedback", "pauses", "counters"} <= tables
    store.close()
    assert open_(None, tmp_path).schema_version() == schema.check(schema.SQLITE)  # reopened


def test_sqlite_version_5_file_is_upgraded_in_place(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    conn = sqlite3.connect(data_dir / "dejafix.sqlite3")
    for _, script in schema.SQLITE[:5]:
        for statement in schema.statements(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    # What version 5 wrote: bodies in payloads, some of them (ref set, body empty) in a journal
    # file of that version; a body with a ref that was also copied in stays readable.
    for delivery, body, ref in [("journal", b"", "journal/0001.bin"), ("normal", b'{"n": 1}', None),
                                ("both", b'{"n": 2}', "journal/0002.bin")]:
        conn.execute("INSERT INTO deliveries VALUES (?, 'issues', 'opened', 'Acme/Widgets', 7,"
                     " 0, 0, 'queued')", (delivery,))
        conn.execute("INSERT INTO jobs (delivery_id, payload, state, available_at)"
                     " VALUES (?, X'', 'queued', 0)", (delivery,))
        conn.execute("INSERT INTO payloads (delivery_id, body, ref) VALUES (?, ?, ?)",
                     (delivery, body, ref))
    conn.commit()
    conn.close()

    store = open_(None, tmp_path, clock=Clock())
    assert store.schema_version() == schema.check(schema.SQLITE)
    state = store.job_state("journal")
    assert state is not None and state[:2] == ("failed", 0)
    assert state[2] is not None and "journal" in state[2]
    assert raw(store, "SELECT state FROM deliveries WHERE delivery_id = 'journal'") == [
        ("failed",)]
    assert (store.pending_count(), store.failed_count()) == (2, 1)
    jobs = store.claim_jobs(60, 10, per_repo=5)
    assert [(j.delivery_id, j.repo, j.payload) for j in jobs] == [
        ("normal", "Acme/Widgets", b'{"n": 1}'), ("both", "Acme/Widgets", b'{"n": 2}')]
    assert raw(store, "SELECT DISTINCT repo FROM jobs") == [("acme/widgets",)]
    assert store.learned_state(REPO) == (0, "0@None@0")


def test_sqlite_file_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    open_(None, tmp_path).close()
    path = tmp_path / "data" / "dejafix.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreVersionError, match="99"):
        open_(None, tmp_path)
    with sqlite3.connect(path) as conn:  # refused, not downgraded
        assert conn.execute("PRAGMA user_version").fetchone() == (99,)


def test_postgres_fresh_schema_migrates_and_reopening_is_a_no_op(pg_url: str,
                                                                 tmp_path: Path) -> None:
    store = open_(pg_url, tmp_path)
    assert isinstance(store, PostgresStore)
    latest = schema.check(schema.POSTGRES)
    assert store.schema_version() == latest
    assert store.schema.startswith("t_")  # the test's own schema, not public
    tables = {r[0] for r in raw(store, "SELECT table_name FROM information_schema.tables"
                                       " WHERE table_schema = ?", (store.schema,))}
    assert {"deliveries", "jobs", "payloads", "comments", "comment_slots", "learned_clusters",
            "learned_members", "cursors", "feedback", "pauses", "counters",
            "dejafix_schema"} <= tables
    accept(store, "d1")
    store.close()
    again = open_(pg_url, tmp_path)
    assert again.schema_version() == latest
    # One row per step applied, each once.
    assert raw(again, "SELECT version FROM dejafix_schema ORDER BY version") == [
        (v,) for v in range(1, latest + 1)]
    assert again.pending_count() == 1
    assert again.learned_state(REPO) == (0, "0@None@0")


def test_postgres_stores_opened_at_once_all_succeed(pg_url: str, tmp_path: Path) -> None:
    stores = run_in_threads(4, lambda i: open_(pg_url, tmp_path))
    latest = schema.check(schema.POSTGRES)
    assert [s.schema_version() for s in stores] == [latest] * 4
    assert raw(stores[0], "SELECT version FROM dejafix_schema ORDER BY version") == [
        (v,) for v in range(1, latest + 1)]


def test_postgres_schema_from_a_newer_version_is_refused(pg_url: str, tmp_path: Path) -> None:
    store = open_(pg_url, tmp_path)
    store.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO dejafix_schema (version) VALUES (99)")
    with pytest.raises(StoreVersionError, match="99"):
        open_(pg_url, tmp_path)
    # The refusal let go of the migration lock: once the row is gone, it opens again.
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM dejafix_schema WHERE version = 99")
    assert open_(pg_url, tmp_path).schema_version() == schema.check(schema.POSTGRES)


def test_postgres_describe_hides_the_password_wherever_it_is_given() -> None:
    for url in ("postgresql://bot:s3cret@db.example:5432/dejafix",
                "postgresql://bot@db.example:5432/dejafix?password=s3cret",
                "postgres://bot:s3cret@db.example/dejafix?options=-csearch_path%3Dx",
                "host=db.example user=bot password=s3cret dbname=dejafix"):
        assert redact(url) == "postgresql://bot@db.example:5432/dejafix", url
    assert "s3cret" not in redact("not a url password=s3cret '")


# -- SQLite: one worker per data directory ------------------------------------------------------

_HOLD_LOCK = """
import sys
from pathlib import Path
from bot.db.sqlite import lock_data_dir
handle = lock_data_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_sqlite_data_dir_lock_refuses_a_second_process_until_it_dies(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    child = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(data_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(DataDirInUse, match=f"pid {child.pid}"):
            lock_data_dir(data_dir)
    finally:
        child.kill()  # SIGKILL: the kernel drops the lock with the process
        child.wait(timeout=30)
    handle = lock_data_dir(data_dir)
    assert handle is not None
    try:
        assert (data_dir / "dejafix.lock").read_text().strip() == str(os.getpid())
    finally:
        handle.close()


# Processes that open one fresh data directory at the same moment: a receiver and a worker
# started together by a deploy. Each child says it is ready (a file), waits for the parent's go
# (another file), then opens the store at once.
_OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from bot.db.sqlite import SQLiteStore
data_dir, barrier, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
(barrier / f"ready-{me}").touch()
deadline = time.monotonic() + 60
while not (barrier / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go")
    time.sleep(0.001)
with SQLiteStore(data_dir) as store:
    print(store.schema_version())
"""


def test_sqlite_processes_opening_a_fresh_store_at_once_all_succeed(tmp_path: Path) -> None:
    """A worker started beside its receiver on a new data directory once died with "database
    is locked" from ``PRAGMA journal_mode = WAL``, which SQLite answers without waiting while
    another connection is switching the file to WAL; and two must not both apply step 1."""
    failures: list[str] = []
    latest = str(schema.check(schema.SQLITE))
    for attempt in range(3):
        data_dir, barrier = tmp_path / f"data-{attempt}", tmp_path / f"barrier-{attempt}"
        barrier.mkdir()
        children = [subprocess.Popen([sys.executable, "-c", _OPEN_AT_ONCE, str(data_dir),
                                      str(barrier), str(n)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=child_env())
                    for n in range(4)]
        deadline = time.monotonic() + 60
        while len(list(barrier.glob("ready-*"))) < len(children):
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.01)
        (barrier / "go").touch()
        for child in children:
            out, err = child.communicate(timeout=60)
            if child.returncode != 0 or out.strip() != latest:
                failures.append(f"attempt {attempt}: exit {child.returncode}: "
                                f"{err.strip().splitlines()[-1:] if err.strip() else out}")
    assert failures == []


def _journal_record(delivery_id: str, body: bytes, *, number: int) -> bytes:
    """One record as the journal of versions before schema step 6 wrote it: a header (magic,
    version, metadata length, body length, CRC-32), the metadata as a JSON array, the body."""
    import struct
    import zlib

    meta = json.dumps([delivery_id, "issues", "opened", "Acme/Widgets", 7, 1.0]).encode()
    crc = zlib.crc32(body, zlib.crc32(meta))
    return struct.pack("<3sBIII", b"DJF", 1, len(meta), len(body), crc) + meta + body


def test_sqlite_upgrade_reads_the_earlier_versions_journal(tmp_path: Path) -> None:
    """A data directory of the version before: a delivery recorded with its body still in a
    journal segment, and one the journal accepted (202) after the ingester's cursor and never
    recorded. Both are queued after the upgrade, with their bodies and issue keys; the journal
    is moved aside, never read again."""
    data_dir = tmp_path / "data"
    (data_dir / "journal" / "0").mkdir(parents=True)
    recorded_body = json.dumps({"issue": {"number": 11}}).encode()
    unrecorded_body = json.dumps({"issue": {"number": 12}}).encode()
    first = _journal_record("recorded", recorded_body, number=11)
    segment = first + _journal_record("unrecorded", unrecorded_body, number=12)
    (data_dir / "journal" / "0" / f"{1:012d}.log").write_bytes(segment)
    offset = len(first) - len(recorded_body)
    conn = sqlite3.connect(data_dir / "dejafix.sqlite3")
    for _, script in schema.SQLITE[:5]:
        for statement in schema.statements(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 5")
    conn.execute("INSERT INTO deliveries VALUES ('recorded', 'issues', 'opened', 'Acme/Widgets',"
                 " 7, 0, 0, 'queued')")
    conn.execute("INSERT INTO jobs (delivery_id, payload, state, available_at)"
                 " VALUES ('recorded', X'', 'queued', 0)")
    conn.execute("INSERT INTO payloads (delivery_id, body, ref) VALUES ('recorded', X'', ?)",
                 (f"0/1:{offset}:{len(recorded_body)}",))
    # The ingester had read the segment up to the end of the first record.
    conn.execute("INSERT INTO cursors VALUES ('journal:0', ?, 0)", (f"1:{len(first)}",))
    conn.commit()
    conn.close()

    store = open_(None, tmp_path, clock=Clock())
    assert store.failed_count() == 0 and store.pending_count() == 2
    jobs = store.claim_jobs(60, 10)
    assert [(j.delivery_id, j.payload) for j in jobs] == [("recorded", recorded_body),
                                                          ("unrecorded", unrecorded_body)]
    assert raw(store, "SELECT delivery_id, issue_key FROM jobs ORDER BY id") == [
        ("recorded", "acme/widgets#11"), ("unrecorded", "acme/widgets#12")]
    assert not (data_dir / "journal").exists() and (data_dir / "journal.imported").is_dir()
    store.close()
    # Opened again: nothing is imported twice.
    again = open_(None, tmp_path, clock=Clock())
    assert again.pending_count() == 2


def test_a_worker_that_lost_its_claim_changes_nothing(store: Store, clock: Clock) -> None:
    """A's lease runs out while A still runs (a slow thread, a clock ahead); B claims the job.
    A's late failure or completion must not requeue or finish B's run."""
    accept(store, "d1", issue="acme/widgets#1")
    [a] = store.claim_jobs(10, 1)
    assert store.start_job(a.id, a.claim) == 1
    clock.advance(11)
    [b] = store.claim_jobs(10, 1)
    assert b.id == a.id and b.claim > a.claim
    assert store.start_job(a.id, a.claim) == 0
    assert store.start_job(b.id, b.claim) == 2
    assert not store.fail_job(a.id, "late", 0.0, a.claim)
    assert not store.complete_job(a.id, a.claim)
    assert store.release_jobs([a]) == 0
    assert store.claim_jobs(10, 1) == []  # still B's, and its issue is busy
    assert store.complete_job(b.id, b.claim)
    assert store.job_state("d1") == ("done", 2,
                                     "attempt 1 ended: its worker held it past its lease")


def test_a_long_backlog_of_one_repository_does_not_hide_another(store: Store) -> None:
    """100 due jobs of one repository, then one of another: with the first at its bound, the
    next claim finds the other repository's job however far back it is."""
    for i in range(100):
        accept(store, f"slow-{i}", repo="slow/a", issue=f"slow/a#{i}")
    accept(store, "fast-0", repo="fast/b", issue="fast/b#0")
    first = store.claim_jobs(60, 8, per_repo=2)
    assert [j.delivery_id for j in first] == ["slow-0", "slow-1"]
    second = store.claim_jobs(60, 8, per_repo=2)
    assert [j.delivery_id for j in second] == ["fast-0"]


def test_a_failed_announcement_is_claimable_again_at_once(store: Store) -> None:
    assert store.pause(REPO, "too many dismissals", "cfg")
    assert store.claim_announcement(REPO)
    assert not store.claim_announcement(REPO)  # another process is announcing
    store.release_announcement(REPO)  # its issue could not be opened
    assert store.claim_announcement(REPO)
    store.mark_pause_announced(REPO, 7)
    store.release_announcement(REPO)  # too late: announced is announced
    assert not store.claim_announcement(REPO)


def test_postgres_schema_of_an_earlier_version_is_upgraded(pg_url: str, tmp_path: Path) -> None:
    """A database left at version 1 (written by the first release with PostgreSQL) gets the
    later steps, its data kept."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE dejafix_schema (version INTEGER NOT NULL)")
        for statement in schema.statements(schema.POSTGRES[0][1]):
            conn.execute(statement)  # type: ignore[arg-type]
        conn.execute("INSERT INTO dejafix_schema VALUES (1)")
        conn.execute("INSERT INTO cursors VALUES ('kept', 'v', 0)")
    store = open_(pg_url, tmp_path)
    assert store.schema_version() == schema.check(schema.POSTGRES) > 1
    assert store.get_cursor("kept") == "v"
    store.record_suggestion(REPO, 1, "c", 0.9, "shadow", "body", "{}")
    assert [s.mode for s in store.suggestions(REPO)] == ["shadow"]


def test_sqlite_version_7_suggestions_survive_the_copy_of_step_8(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    conn = sqlite3.connect(data_dir / "dejafix.sqlite3")
    for _, script in schema.SQLITE[:7]:
        for statement in schema.statements(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 7")
    conn.execute("INSERT INTO suggestions VALUES ('acme/widgets', 4, 'c1', 0.8, 'shadow',"
                 " 'body', '{}', 10, 20)")
    conn.commit()
    conn.close()
    store = open_(None, tmp_path, clock=Clock())
    assert store.schema_version() == schema.check(schema.SQLITE)
    [kept] = store.suggestions(REPO)
    assert (kept.issue, kept.cluster, kept.mode, kept.body, kept.created_at, kept.updated_at,
            kept.regression) == (4, "c1", "shadow", "body", 10, 20, None)
    store.record_suggestion(REPO, 5, "c1", 0.9, "label", "b", "{}", regression="why")
    assert {s.issue: s.mode for s in store.suggestions(REPO)} == {4: "shadow", 5: "label"}


def test_postgres_version_2_suggestions_get_the_regression_column(pg_url: str,
                                                                  tmp_path: Path) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE dejafix_schema (version INTEGER NOT NULL)")
        for _, script in schema.POSTGRES[:2]:
            for statement in schema.statements(script):
                conn.execute(statement)  # type: ignore[arg-type]
        conn.execute("INSERT INTO dejafix_schema VALUES (2)")
        conn.execute("INSERT INTO suggestions VALUES ('acme/widgets', 4, 'c1', 0.8, 'shadow',"
                     " 'body', '{}', 10, 20)")
    store = open_(pg_url, tmp_path)
    assert store.schema_version() == schema.check(schema.POSTGRES)
    [kept] = store.suggestions(REPO)
    assert (kept.issue, kept.mode, kept.regression) == (4, "shadow", None)
    store.record_suggestion(REPO, 5, "c1", 0.9, "label", "b", "{}", regression="why")
    with pytest.raises(Exception, match="suggestions_mode_check"):
        store.record_suggestion(REPO, 6, "c1", 0.9, "loud", "b", "{}")


def test_the_pages_reads(store: Store, clock: Clock) -> None:
    store.record_suggestion(REPO, 1, "c1", 0.9, "comment", "b1", "{}")
    clock.now += 10
    store.record_suggestion(REPO, 2, "c2", 0.8, "label", "b2", "{}", regression="why")
    clock.now += 10
    store.record_suggestion("other/repo", 3, "c3", 0.7, "shadow", "b3", "{}")
    assert store.suggestion_marks(REPO) == [(2, "c2", clock.now - 10, "why"),
                                            (1, "c1", clock.now - 20, None)]
    assert store.suggestion_repos() == ["other/repo", REPO.lower()]
    store.record_comment(REPO, 1, 501, "c1", 0.9, "h")
    assert set(store.comments_on(REPO, [1, 2])) == {1}
    assert store.comments_on(REPO, []) == {}
    store.record_feedback(REPO, 1, "c1", "dismissed", "maint")
    assert store.feedback_on(REPO, [1, 2]) == {1: [("c1", "dismissed", "maint")]}
    # A prefix is taken as written: "_" and "%" are not wildcards.
    store.set_cursor("backfill:a_b:", "done:0")
    store.set_cursor("backfill:axb:", "pulls:2")
    assert [c[:2] for c in store.cursors("backfill:a_b:")] == [("backfill:a_b:", "done:0")]
    assert store.cursors("backfill:a%") == []
    assert store.learned_count(REPO) == 0


def test_a_feeds_version_is_kept_through_a_failed_poll(store: Store, clock: Clock) -> None:
    url = "https://tracker.example/feed.jsonl"
    assert store.get_feed(url) is None
    store.feed_polled(url, "HTTP 502")  # never fetched well: an empty version with the error
    first = store.get_feed(url)
    assert first is not None and (first.body, first.clusters, first.error) == ("", 0, "HTTP 502")
    clock.now += 5
    store.put_feed(url, '"e1"', "{}\n", 1, "feed:2: bad")
    good = store.get_feed(url)
    assert good is not None
    assert (good.etag, good.body, good.clusters, good.error, good.changed_at) == (
        '"e1"', "{}\n", 1, None, clock.now)
    clock.now += 5
    store.feed_polled(url, "timeout")
    kept = store.get_feed(url)
    assert kept is not None and (kept.body, kept.etag, kept.error) == ("{}\n", '"e1"', "timeout")
    assert (kept.fetched_at, kept.changed_at) == (clock.now, clock.now - 5)


def test_a_repositorys_sources_are_listed_by_prefix_exactly(store: Store) -> None:
    """``repo:<name>:`` keys, whatever ``_`` or ``%`` the names hold (no LIKE), in code-point
    order on both backends; a dropped one is gone and another repository's stays."""
    keys = ["repo:a_b/c:bugs", "repo:a_b/c:docs/known%.md", "repo:aXb/c:bugs",
            "repo:a_b/cd:bugs", "https://tracker.example/a_b.jsonl"]
    for key in keys:
        store.put_feed(key, "v", "", 0, "")
    assert [f.url for f in store.feeds_under("repo:a_b/c:")] == [
        "repo:a_b/c:bugs", "repo:a_b/c:docs/known%.md"]
    assert len(store.feeds_under("repo:")) == 4
    assert store.drop_feed("repo:a_b/c:bugs") and not store.drop_feed("repo:a_b/c:bugs")
    assert [f.url for f in store.feeds_under("repo:a_b/c")] == [
        "repo:a_b/c:docs/known%.md", "repo:a_b/cd:bugs"]
