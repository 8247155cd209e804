"""The durable store against real SQLite files, including a real process crash."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import bot.db.sqlite as store_mod
from bot.db.sqlite import (
    DB_FILENAME,
    MIGRATIONS,
    Claim,
    Delivery,
    Store,
    StoreVersionError,
    lock_data_dir,
    read_learned_records,
)

ROOT = Path(__file__).resolve().parents[1]
LATEST = MIGRATIONS[-1][0]


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    s = Store(tmp_path, clock=clock)
    yield s
    s.close()


def raw(data_dir: Path) -> sqlite3.Connection:
    """A second, independent connection: what is on disk, not what the Store object believes."""
    return sqlite3.connect(data_dir / DB_FILENAME)


def accept(store: Store, delivery_id: str, payload: bytes = b"{}") -> None:
    assert store.accept_delivery(delivery_id, "issues", "opened", "o/r", 42, payload)


def states(data_dir: Path, delivery_id: str) -> tuple[str, str]:
    with raw(data_dir) as conn:
        row = conn.execute(
            "SELECT d.state, j.state FROM deliveries d JOIN jobs j USING (delivery_id)"
            " WHERE delivery_id = ?",
            (delivery_id,),
        ).fetchone()
    return row[0], row[1]


# -- schema and migrations --------------------------------------------------------------------


def test_fresh_directory_is_created_and_migrated(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "b"
    with Store(data_dir) as s:
        assert s.schema_version() == LATEST
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert s._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert s._conn.execute("PRAGMA busy_timeout").fetchone()[0] > 0
    with raw(data_dir) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"deliveries", "jobs", "comments"} <= tables


def test_reopen_keeps_data(tmp_path: Path) -> None:
    with Store(tmp_path) as s:
        accept(s, "d1", b"payload")
        s.record_comment("o/r", 5, 900, "c-1", 0.93, "h")
    with Store(tmp_path) as s:
        assert s.schema_version() == LATEST
        assert s.pending_count() == 1
        job = s.claim_job(60)
        assert job is not None and job.payload == b"payload"
        comment = s.get_comment("o/r", 5)
        assert comment is not None and comment.comment_id == 900


def test_older_file_is_upgraded_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store(tmp_path) as s:
        accept(s, "d1")
    step = (LATEST + 1, "ALTER TABLE deliveries ADD COLUMN note TEXT; CREATE TABLE extra (x);")
    monkeypatch.setattr(store_mod, "MIGRATIONS", [*MIGRATIONS, step])
    with Store(tmp_path) as s:
        assert s.schema_version() == LATEST + 1
        assert s.pending_count() == 1
        cols = {r[1] for r in s._conn.execute("PRAGMA table_info(deliveries)")}
        assert "note" in cols


def test_failed_migration_step_leaves_file_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Store(tmp_path).close()
    step = (LATEST + 1, "CREATE TABLE extra (x); INSERT INTO no_such_table VALUES (1);")
    monkeypatch.setattr(store_mod, "MIGRATIONS", [*MIGRATIONS, step])
    with pytest.raises(sqlite3.OperationalError):
        Store(tmp_path)
    with raw(tmp_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST
        assert (
            conn.execute("SELECT count(*) FROM sqlite_master WHERE name='extra'").fetchone()[0] == 0
        )


def test_file_from_newer_version_is_refused(tmp_path: Path) -> None:
    Store(tmp_path).close()
    with raw(tmp_path) as conn:
        conn.execute(f"PRAGMA user_version = {LATEST + 7}")
    with pytest.raises(StoreVersionError) as err:
        Store(tmp_path)
    message = str(err.value)
    assert str(tmp_path / DB_FILENAME) in message
    assert str(LATEST + 7) in message and f"version {LATEST})" in message
    with raw(tmp_path) as conn:  # refused, not downgraded
        assert conn.execute("PRAGMA user_version").fetchone()[0] == LATEST + 7


# -- delivery ledger and queue ----------------------------------------------------------------


def test_redelivery_is_recorded_once(store: Store, tmp_path: Path) -> None:
    assert store.accept_delivery("d1", "issues", "opened", "o/r", 1, b"first")
    assert not store.accept_delivery("d1", "issues", "edited", "o/x", 2, b"second")
    assert store.pending_count() == 1
    with raw(tmp_path) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 1
        row = conn.execute("SELECT action, repo FROM deliveries").fetchone()
    assert row == ("opened", "o/r")
    job = store.claim_job(60)
    assert job is not None and job.payload == b"first"
    assert store.claim_job(60) is None


def test_claim_then_complete(store: Store, tmp_path: Path) -> None:
    accept(store, "d1", b'{"a": 1}')
    assert states(tmp_path, "d1") == ("queued", "queued")
    job = store.claim_job(60)
    assert job is not None
    assert (job.delivery_id, job.event, job.action, job.repo, job.installation_id) == (
        "d1",
        "issues",
        "opened",
        "o/r",
        42,
    )
    assert (job.payload, job.attempts) == (b'{"a": 1}', 1)
    assert states(tmp_path, "d1") == ("running", "running")
    assert store.claim_job(60) is None  # leased, not handed out twice
    assert store.pending_count() == 1
    assert store.complete_job(job.id)
    assert states(tmp_path, "d1") == ("done", "done")
    assert store.pending_count() == 0
    assert not store.complete_job(job.id)
    assert store.claim_job(60) is None


def test_claims_oldest_first(store: Store) -> None:
    for d in ("d1", "d2", "d3"):
        accept(store, d)
    claimed = [store.claim_job(60) for _ in range(3)]
    assert [j.delivery_id for j in claimed if j] == ["d1", "d2", "d3"]


def test_fail_with_retry_comes_back_later(store: Store, clock: Clock, tmp_path: Path) -> None:
    accept(store, "d1")
    job = store.claim_job(60)
    assert job is not None
    assert store.fail_job(job.id, "GitHub said 502", retry_in=30)
    assert states(tmp_path, "d1") == ("queued", "queued")
    clock.now += 29.9
    assert store.claim_job(60) is None
    clock.now += 0.1
    again = store.claim_job(60)
    assert again is not None and (again.id, again.attempts) == (job.id, 2)
    with raw(tmp_path) as conn:
        assert conn.execute("SELECT last_error FROM jobs").fetchone()[0] == "GitHub said 502"
    assert store.complete_job(again.id)
    assert states(tmp_path, "d1") == ("done", "done")


def test_fail_without_retry_is_dead_lettered(store: Store, clock: Clock, tmp_path: Path) -> None:
    accept(store, "d1")
    job = store.claim_job(60)
    assert job is not None
    assert store.fail_job(job.id, "x" * 100_000, retry_in=None)
    assert states(tmp_path, "d1") == ("failed", "failed")
    clock.now += 10_000
    assert store.claim_job(60) is None
    assert store.pending_count() == 0
    assert not store.fail_job(job.id, "again", retry_in=1)  # not running any more
    with raw(tmp_path) as conn:  # kept for inspection, error bounded
        (error,) = conn.execute("SELECT last_error FROM jobs WHERE id = ?", (job.id,)).fetchone()
    assert 0 < len(error) < 100_000


def test_dead_after_max_attempts(tmp_path: Path, clock: Clock) -> None:
    with Store(tmp_path, clock=clock, max_attempts=3) as s:
        accept(s, "d1")
        for attempt in (1, 2, 3):
            job = s.claim_job(60)
            assert job is not None and job.attempts == attempt
            assert s.fail_job(job.id, f"boom {attempt}", retry_in=0)
        # Dead at once, by fail_job itself, with the real error kept (not left for claim_job).
        assert states(tmp_path, "d1") == ("failed", "failed")
        with raw(tmp_path) as conn:
            assert conn.execute("SELECT last_error FROM jobs").fetchone()[0] == "boom 3"
        assert s.claim_job(60) is None


def test_expired_lease_is_reclaimed(store: Store, clock: Clock) -> None:
    accept(store, "d1")
    first = store.claim_job(lease_seconds=10)
    assert first is not None
    clock.now += 9.9
    assert store.claim_job(10) is None
    clock.now += 0.1
    second = store.claim_job(10)
    assert second is not None and (second.id, second.attempts) == (first.id, 2)


def test_job_that_never_finishes_is_dead_lettered(tmp_path: Path, clock: Clock) -> None:
    with Store(tmp_path, clock=clock, max_attempts=2) as s:
        accept(s, "d1")
        for _ in range(2):
            assert s.claim_job(10) is not None
            clock.now += 10
        assert s.claim_job(10) is None
        assert s.pending_count() == 0
    assert states(tmp_path, "d1") == ("failed", "failed")
    with raw(tmp_path) as conn:
        assert "never finished" in conn.execute("SELECT last_error FROM jobs").fetchone()[0]


def test_recover_requeues_running_jobs(store: Store, tmp_path: Path) -> None:
    for d in ("d1", "d2", "d3"):
        accept(store, d)
    j1, j2 = store.claim_job(3600), store.claim_job(3600)
    assert j1 is not None and j2 is not None
    assert store.complete_job(j2.id)
    assert store.recover() == 1
    assert states(tmp_path, "d1") == ("queued", "queued")
    assert states(tmp_path, "d2") == ("done", "done")
    again = store.claim_job(3600)  # no need to wait for the hour-long lease
    assert again is not None and (again.id, again.attempts) == (j1.id, 2)
    assert store.recover() == 1 and store.recover() == 0


def test_batch_claim_leases_new_jobs_ahead_but_retries_only_within_the_limit(
        store: Store, tmp_path: Path) -> None:
    for d in ("d1", "d2", "d3", "d4"):
        accept(store, d)
    first = store.claim_job(60)
    assert first is not None and first.delivery_id == "d1"
    assert store.fail_job(first.id, "502", retry_in=0)  # d1 is due again, as a retry
    # No free lane (limit 0): only jobs never run before are leased ahead, the retry waits.
    ahead = store.claim_jobs(60, 0, fresh_extra=2)
    assert [(j.delivery_id, j.attempts) for j in ahead] == [("d2", 1), ("d3", 1)]
    assert states(tmp_path, "d1") == ("queued", "queued")
    # A free lane takes the oldest due job, the retry; new ones come along, oldest first.
    batch = store.claim_jobs(60, 1, fresh_extra=5)
    assert [(j.delivery_id, j.attempts) for j in batch] == [("d1", 2), ("d4", 1)]
    assert store.claim_jobs(60, 4, fresh_extra=4) == []
    assert [states(tmp_path, d) for d in ("d1", "d2", "d3", "d4")] == [("running", "running")] * 4


def test_batch_claim_never_hands_back_a_job_its_caller_holds(store: Store, clock: Clock) -> None:
    accept(store, "d1")
    job = store.claim_job(10)
    assert job is not None
    clock.now += 60  # the lease has run out, but the job is still in the caller's hands
    assert store.claim_jobs(10, 1, exclude={job.id}) == []
    again = store.claim_jobs(10, 1)  # anyone else: a job whose holder went silent
    assert [(j.id, j.attempts) for j in again] == [(job.id, 2)]


def test_released_jobs_are_queued_again_without_counting_the_attempt(
        store: Store, tmp_path: Path) -> None:
    for d in ("d1", "d2"):
        accept(store, d)
    j1, j2 = store.claim_jobs(60, 2)
    assert store.complete_job(j2.id)
    assert store.release_jobs([j1.id, j2.id]) == 1  # a finished job is not given back
    assert states(tmp_path, "d1") == ("queued", "queued")
    assert states(tmp_path, "d2") == ("done", "done")
    again = store.claim_job(60)
    assert again is not None and (again.id, again.attempts) == (j1.id, 1)


def test_commit_round_records_finishes_and_leases_in_one_transaction(
        store: Store, tmp_path: Path) -> None:
    accept(store, "old")
    old = store.claim_job(60)
    assert old is not None
    bodies = [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    deliveries: list[Delivery] = [
        ("new-1", "issues", "opened", "o/r", 7, bodies[0]),
        ("new-2", "issues", "opened", "o/r", 7, bodies[1]),
        ("new-1", "issues", "opened", "o/r", 7, bodies[2]),  # a redelivery in the same batch
        ("old", "issues", "opened", "o/r", 7, b'{"other": 1}'),  # and of an earlier one
    ]
    accepted, done, jobs = store.commit_round(deliveries, [old.id, old.id, 999],
                                              Claim(60, 1, fresh_extra=5))
    assert accepted == [True, True, False, False]
    assert done == [True, False, False]  # the same id twice, and an unknown one
    assert [j.delivery_id for j in jobs] == ["new-1", "new-2"]
    # A job recorded in this round carries its delivery's very body object.
    assert jobs[0].payload is bodies[0] and jobs[1].payload is bodies[1]
    assert states(tmp_path, "old") == ("done", "done")
    assert states(tmp_path, "new-1") == ("running", "running")
    # Read back from the file, the payload is the first body recorded under the id.
    store.release_jobs([jobs[0].id])
    again = store.claim_job(60)
    assert again is not None and again.payload == bodies[0] and again.payload is not bodies[0]


def test_a_bad_row_fails_the_whole_round(store: Store) -> None:
    bad: Delivery = ("d2", "issues", "opened", "o/r", 2**70, b"{}")  # beyond SQLite INTEGER
    with pytest.raises(OverflowError):
        store.commit_round([("d1", "issues", "opened", "o/r", 1, b"{}"), bad], [], None)
    assert store.pending_count() == 0  # nothing of it was written


def test_version_3_file_keeps_its_queued_payloads(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "MIGRATIONS", MIGRATIONS[:3])
    with Store(tmp_path) as old:
        assert old.schema_version() == 3
        with raw(tmp_path) as conn:  # what version 3 wrote: the payload inside the job row
            conn.execute("INSERT INTO deliveries VALUES ('d1', 'issues', 'opened', 'o/r', 1,"
                         " 0, 0, 'queued')")
            conn.execute("INSERT INTO jobs (delivery_id, payload, state, available_at)"
                         " VALUES ('d1', X'7B7D', 'queued', 0)")
    monkeypatch.setattr(store_mod, "MIGRATIONS", MIGRATIONS)
    with Store(tmp_path) as new:
        assert new.schema_version() == LATEST
        job = new.claim_job(60)
        assert job is not None and job.payload == b"{}"
    with raw(tmp_path) as conn:
        assert conn.execute("SELECT payload FROM jobs").fetchone()[0] == b""
        assert conn.execute("SELECT body FROM payloads").fetchone()[0] == b"{}"


def test_pruning_a_delivery_drops_its_payload(store: Store, clock: Clock,
                                              tmp_path: Path) -> None:
    accept(store, "d1", b'{"big": true}')
    job = store.claim_job(60)
    assert job is not None and store.complete_job(job.id)
    clock.now += 100
    assert store.prune(50) == 1
    with raw(tmp_path) as conn:
        assert conn.execute("SELECT count(*) FROM payloads").fetchone()[0] == 0


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_concurrent_claims_never_share_a_job(tmp_path: Path, shared: bool) -> None:
    jobs, threads = 120, 6
    with Store(tmp_path) as s:
        for i in range(jobs):
            accept(s, f"d{i}")
    stores = [Store(tmp_path)] * threads if shared else [Store(tmp_path) for _ in range(threads)]
    claimed: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(s: Store) -> None:
        try:
            barrier.wait()
            while (job := s.claim_job(3600)) is not None:
                claimed.append(job.id)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(s,)) for s in stores]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    for s in set(stores):
        s.close()
    assert errors == []
    assert len(claimed) == jobs
    assert len(set(claimed)) == jobs


# -- comment ledger and pruning ---------------------------------------------------------------


def test_comment_ledger_upsert(store: Store, clock: Clock) -> None:
    assert store.get_comment("Owner/Repo", 7) is None
    store.record_comment("Owner/Repo", 7, 111, "cluster-1", 0.95, "hash-1")
    first = store.get_comment("owner/REPO", 7)
    assert first is not None
    assert (first.repo, first.issue, first.comment_id, first.cluster, first.score) == (
        "owner/repo",
        7,
        111,
        "cluster-1",
        0.95,
    )
    assert first.created_at == first.updated_at == clock.now
    clock.now += 50
    store.record_comment("OWNER/repo", 7, 222, None, None, "hash-2")
    second = store.get_comment("owner/repo", 7)
    assert second is not None
    assert (second.comment_id, second.cluster, second.score, second.body_hash) == (
        222,
        None,
        None,
        "hash-2",
    )
    assert (second.created_at, second.updated_at) == (first.created_at, clock.now)
    assert store.get_comment("owner/repo", 8) is None
    assert store.get_comment("owner/other", 7) is None


def test_prune_removes_only_old_done_deliveries(store: Store, clock: Clock, tmp_path: Path) -> None:
    for d in ("old-done", "old-failed", "old-queued"):
        accept(store, d)
    done, failed = store.claim_job(60), store.claim_job(60)
    assert done is not None and failed is not None
    store.complete_job(done.id)
    store.fail_job(failed.id, "dead")
    store.record_comment("o/r", 1, 1, None, None, "h")
    clock.now += 100
    accept(store, "new-done")
    new = store.claim_job(60)
    assert new is not None and new.delivery_id == "old-queued"
    store.complete_job(new.id)
    new = store.claim_job(60)
    assert new is not None and new.delivery_id == "new-done"
    store.complete_job(new.id)
    clock.now += 1
    assert store.prune(older_than_seconds=50) == 1
    with raw(tmp_path) as conn:
        left = {r[0] for r in conn.execute("SELECT delivery_id FROM deliveries")}
        jobs_left = {r[0] for r in conn.execute("SELECT delivery_id FROM jobs")}
    assert left == jobs_left == {"old-failed", "old-queued", "new-done"}
    assert store.get_comment("o/r", 1) is not None
    # Once forgotten, the id is accepted again: pruning bounds how long redeliveries are caught.
    assert store.accept_delivery("old-done", "issues", "opened", "o/r", 42, b"{}")


# -- a real crash -----------------------------------------------------------------------------


def test_job_survives_a_killed_process(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "store_crash_child.py"), str(tmp_path), "d-crash"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected_rc = -signal.SIGKILL if hasattr(signal, "SIGKILL") else 1
    assert child.returncode == expected_rc, child.stderr
    in_flight = json.loads(child.stdout)
    assert in_flight["attempts"] == 1

    with Store(tmp_path) as s:
        assert s.claim_job(60) is None  # the dead child's hour-long lease still holds it
        assert s.recover() == 1
        job = s.claim_job(60)
        assert job is not None
        assert (job.id, job.delivery_id, job.attempts) == (in_flight["id"], "d-crash", 2)
        assert (job.repo, job.installation_id, job.payload) == ("Owner/Repo", 7, b'{"n": 1}')
        assert s.complete_job(job.id)
        assert s.pending_count() == 0


def test_learned_clusters_are_stored_found_by_member_and_versioned(tmp_path: Path) -> None:
    from bot.clusters.learning import cluster_from_fix

    store = Store(tmp_path)
    v0 = store.learned_version()
    assert store.learned_count() == 0
    pr = {"number": 50, "title": "fix: x", "merged_at": "2026-01-01T00:00:00Z"}
    cluster = cluster_from_fix("Octo/App", pr, [{"number": 10, "title": "x broken"}],
                               [{"filename": "a.py"}])
    store.put_learned(cluster)
    assert store.learned_version() != v0
    assert store.learned_count() == 1
    found = store.find_learned("octo/app", "pr", 50)
    assert found is not None and found.public_id == "10" and found.files_changed == ["a.py"]
    assert store.find_learned("octo/app", "issue", 10) == found
    assert store.find_learned("octo/app", "issue", 11) is None
    # Replacing the record re-indexes its members.
    bigger = cluster.model_copy(update={"members": cluster.members[:1]})
    store.put_learned(bigger)
    assert store.learned_count() == 1
    assert store.find_learned("octo/app", "pr", 50) is None
    assert [c.public_id for c in store.learned_clusters("OCTO/app")] == ["10"]
    store.close()
    reopened = Store(tmp_path)
    assert len(reopened.learned_clusters()) == 1
    reopened.close()


def test_learned_records_are_read_by_another_reader_without_the_store(tmp_path: Path) -> None:
    from bot.clusters.models import Cluster
    from bot.clusters.learning import cluster_from_fix

    def learned(repo: str, issue: int) -> Cluster:
        pr = {"number": issue + 1000, "title": f"fix {issue}", "merged_at": "2026-01-01T00:00:00Z"}
        return cluster_from_fix(repo, pr, [{"number": issue, "title": f"bug {issue}"}],
                                [{"filename": f"f{issue}.py"}])

    lock = lock_data_dir(tmp_path)  # the bot's process holds the directory
    store = Store(tmp_path)
    for repo, issue in [("Zed/app", 3), ("octo/app", 20), ("octo/app", 7), ("Alpha/lib", 5)]:
        store.put_learned(learned(repo, issue))
    expected_all = store.learned_clusters()
    expected_octo = store.learned_clusters("octo/app")
    assert len(expected_all) == 4 and len(expected_octo) == 2

    def parsed(records: Iterator[str]) -> list[Cluster]:
        return [Cluster.model_validate_json(r) for r in records]

    assert parsed(read_learned_records(store.path)) == expected_all
    assert parsed(read_learned_records(store.path, "OCTO/App")) == expected_octo
    assert list(read_learned_records(store.path, "nobody/else")) == []

    # Half-way through a read, the bot still writes (WAL: the reader keeps its snapshot).
    reader = read_learned_records(store.path)
    first = next(reader)
    store.put_learned(learned("octo/app", 99))
    assert parsed(iter([first, *reader])) == expected_all
    assert len(list(read_learned_records(store.path))) == 5

    # With the bot stopped (WAL checkpointed and removed), the file still reads.
    store.close()
    assert lock is not None
    lock.close()
    records = list(read_learned_records(tmp_path / DB_FILENAME, "octo/app"))
    assert [json.loads(r)["public_id"] for r in records] == ["20", "7", "99"]


def test_cursors_survive_a_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path)
    assert store.get_cursor("backfill:o/r") is None
    store.set_cursor("backfill:o/r", "page=3")
    store.close()
    store = Store(tmp_path)
    assert store.get_cursor("backfill:o/r") == "page=3"
    store.set_cursor("backfill:o/r", None)
    assert store.get_cursor("backfill:o/r") is None
    store.close()


def test_bodies_that_cannot_be_read_after_the_lease_go_back_to_the_queue(tmp_path: Path) -> None:
    # The lease is committed before the bodies of a backlog are read: if that read fails, the
    # round must not be reported failed (it would be written again and its new deliveries
    # answered as redeliveries); the jobs whose bodies are missing are given back instead.
    store = Store(tmp_path)
    try:
        assert store.accept_deliveries([("d1", "issues", "opened", "o/r", 1, b'{"a": 1}'),
                                        ("d2", "issues", "opened", "o/r", 1, b'{"a": 2}')])
        store._conn.execute("ALTER TABLE payloads RENAME TO payloads_gone")
        accepted, done, jobs = store.commit_round([], [7], Claim(300, 10))
        assert (accepted, done, jobs) == ([], [False], [])
        rows = store._conn.execute("SELECT delivery_id, state, attempts FROM jobs").fetchall()
        assert sorted(rows) == [("d1", "queued", 0), ("d2", "queued", 0)]
        # Readable again: the same jobs, leased now with their bodies.
        store._conn.execute("ALTER TABLE payloads_gone RENAME TO payloads")
        again = store.claim_jobs(300, 10)
        assert [(job.delivery_id, job.payload, job.attempts) for job in again] == [
            ("d1", b'{"a": 1}', 1), ("d2", b'{"a": 2}', 1)]
    finally:
        store.close()


# Processes that open one fresh data directory at the same moment: a receiver and a worker
# started together by a deploy. Each child says it is ready (a file), waits for the parent's go
# (another file), then opens the store at once.
_OPEN_AT_ONCE = """
import os, sys, time
from pathlib import Path
from bot.db.sqlite import Store
data_dir, barrier, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
(barrier / f"ready-{me}").touch()
deadline = time.monotonic() + 60
while not (barrier / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("no go")
    time.sleep(0.001)
with Store(data_dir) as store:
    print(store.schema_version())
"""


def test_processes_opening_a_fresh_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Found by bench/webhook.py: a worker started beside its receiver on a new data directory
    died with "database is locked" from ``PRAGMA journal_mode = WAL``, which SQLite answers
    without waiting while another connection is switching the file to WAL."""
    failures: list[str] = []
    for attempt in range(6):
        data_dir, barrier = tmp_path / f"data-{attempt}", tmp_path / f"barrier-{attempt}"
        barrier.mkdir()
        children = [subprocess.Popen([sys.executable, "-c", _OPEN_AT_ONCE, str(data_dir),
                                      str(barrier), str(n)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=str(ROOT))
                    for n in range(4)]
        deadline = time.monotonic() + 60
        while len(list(barrier.glob("ready-*"))) < len(children):
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.01)
        (barrier / "go").touch()
        for child in children:
            out, err = child.communicate(timeout=60)
            if child.returncode != 0 or out.strip() != str(len(store_mod.MIGRATIONS)):
                failures.append(f"attempt {attempt}: exit {child.returncode}: "
                                f"{err.strip().splitlines()[-1:] if err.strip() else out}")
    assert failures == []
