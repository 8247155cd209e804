"""The intake's writer process (bot/round_writer.py) against real SQLite files: a real child
process (forkserver), killed for real with SIGKILL, and a real checkpointer thread beside a
writer whose commits no longer checkpoint. Nothing of ours is mocked: the writer's results are
compared with ``Store.commit_round`` on a second data directory, and every table is read back
from disk with a plain sqlite3 connection."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bot.intake import Intake
from bot.round_writer import Checkpointer, RoundWriter, WriterGone
from bot.store import DB_FILENAME, Claim, Delivery, Job, Store

T = TypeVar("T")

# Seconds any single call on the writer may take here before the test says it hung.
CALL_TIMEOUT = 20.0
WAL_HEADER_BYTES = 32
WAL_FRAME_HEADER_BYTES = 24


def body(tag: str, n: int = 0) -> bytes:
    """A payload built at run time: a new bytes object at each call, even for equal values
    (literals would be shared constants, and ``is`` would prove nothing)."""
    return json.dumps({"tag": tag, "n": n, "pad": "x" * 40}).encode()


def delivery(delivery_id: str, payload: bytes, installation: int | None = 7) -> Delivery:
    return (delivery_id, "issues", "opened", "Owner/Repo", installation, payload)


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()`` in a daemon thread: a writer that never answers fails the test instead of
    hanging the run."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not return within {seconds}s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


def rows(data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    """What is on disk, through a connection of this test's own."""
    conn = sqlite3.connect(data_dir / DB_FILENAME)
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


def ledger(data_dir: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the hot path writes, without the timestamps (two stores, two clocks)."""
    return {
        "deliveries": rows(data_dir, "SELECT delivery_id, event, action, repo, installation_id,"
                                     " state FROM deliveries ORDER BY delivery_id"),
        "jobs": rows(data_dir, "SELECT id, delivery_id, payload, attempts, state,"
                               " lease_until IS NULL, last_error FROM jobs ORDER BY id"),
        "payloads": rows(data_dir, "SELECT delivery_id, body FROM payloads ORDER BY delivery_id"),
    }


def process_gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[RoundWriter]:
    w = RoundWriter(tmp_path / "writer", max_attempts=5)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def reference(tmp_path: Path) -> Iterator[Store]:
    """A store written in this process, on a data directory of its own."""
    s = Store(tmp_path / "reference", max_attempts=5)
    try:
        yield s
    finally:
        s.close()


# -- the same rounds, the same results -------------------------------------------------------


def test_rounds_written_by_the_child_match_store_commit_round(
        writer: RoundWriter, reference: Store, tmp_path: Path) -> None:
    both: list[Callable[..., tuple[list[bool], list[bool], list[Job]]]] = [
        lambda *a: within(CALL_TIMEOUT, lambda: writer.commit_round(*a)),
        reference.commit_round,
    ]

    def commit(deliveries: list[Delivery], completed: list[int], claim: Claim | None
               ) -> tuple[list[bool], list[bool], list[Job]]:
        """One round on both; each gets its own (equal) copies of the bodies, and the results
        must be equal. The writer's result is returned."""
        theirs = [(d[0], d[1], d[2], d[3], d[4], bytes(bytearray(d[5]))) for d in deliveries]
        got = both[0](deliveries, completed, claim)
        expected = both[1](theirs, completed, claim)
        assert got == expected
        return got

    # 1. New deliveries, one of them twice (an equal body, another object), one lease.
    a1, a2, b1 = body("a"), body("a"), body("b")
    assert a1 == a2 and a1 is not a2
    accepted, done, jobs = commit([delivery("a", a1), delivery("b", b1), delivery("a", a2)],
                                  [], Claim(60, 1))
    assert (accepted, done) == ([True, True, False], [])
    [job_a] = jobs
    assert (job_a.delivery_id, job_a.attempts, job_a.installation_id) == ("a", 1, 7)
    assert job_a.payload is a1  # the first delivery under the id, the very object

    # 2. A redelivery with another body, a new id twice with different bodies, the finished
    # job reported twice and an unknown one; a claim that leases the oldest due job (b, from
    # round 1) and, ahead, the new one.
    b2, c1, c2 = body("b", 2), body("c"), body("c", 2)
    accepted, done, jobs = commit(
        [delivery("c", c1), delivery("b", b2), delivery("c", c2)],
        [job_a.id, job_a.id, 10_000], Claim(60, 1, fresh_extra=5))
    assert (accepted, done) == ([True, False, False], [True, False, False])
    job_b, job_c = jobs
    assert (job_b.delivery_id, job_c.delivery_id) == ("b", "c")
    assert job_b.payload == b1 and job_b.payload is not b1  # read back from the database
    assert job_c.payload is c1

    # 3. A new delivery recorded without a claim; a completion.
    d1 = body("d")
    assert commit([delivery("d", d1)], [job_c.id], None) == ([True], [True], [])

    # 4. A claim alone, with a short lease: the delivery of round 3, its body from the database.
    _, _, [job_d] = commit([], [], Claim(0.05, 4))
    assert (job_d.delivery_id, job_d.attempts) == ("d", 1)
    assert job_d.payload == d1 and job_d.payload is not d1
    time.sleep(0.15)  # the lease runs out, on both

    # 5. The expired job is held by the caller (exclude): not handed out again.
    assert commit([], [], Claim(60, 4, exclude=frozenset({job_d.id}))) == ([], [], [])
    # 6. Not excluded, it is leased again: a second attempt.
    _, _, [again] = commit([], [], Claim(60, 4))
    assert (again.id, again.attempts, again.payload) == (job_d.id, 2, d1)

    # 7. A bad row fails the whole round on both, with the same error, and writes nothing;
    # the child goes on writing the next rounds.
    bad = [delivery("e", body("e")), delivery("f", body("f"), installation=2**70)]
    errors = []
    for write in both:
        with pytest.raises(OverflowError) as caught:
            write(bad, [job_b.id], Claim(60, 4))
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert rows(tmp_path / "writer", "SELECT count(*) FROM deliveries WHERE delivery_id"
                                     " IN ('e', 'f')") == [(0,)]
    assert rows(tmp_path / "writer", "SELECT state FROM jobs WHERE delivery_id = 'b'") == [
        ("running",)]

    # 8. After the error: record, finish and lease in one round.
    g1 = body("g")
    accepted, done, jobs = commit([delivery("g", g1)], [job_b.id, again.id], Claim(60, 4))
    assert (accepted, done) == ([True], [True, True])
    [job_g] = jobs
    assert job_g.payload is g1

    # The child's file and the reference file hold the same rows.
    on_disk = ledger(tmp_path / "writer")
    assert on_disk == ledger(tmp_path / "reference")
    assert [r[0] for r in on_disk["deliveries"]] == ["a", "b", "c", "d", "g"]
    assert dict((r[0], r[5]) for r in on_disk["deliveries"]) == {
        "a": "done", "b": "done", "c": "done", "d": "done", "g": "running"}
    assert dict(on_disk["payloads"]) == {"a": a1, "b": b1, "c": c1, "d": d1, "g": g1}
    assert {r[2] for r in on_disk["jobs"]} == {b""}  # bodies live in payloads only


@pytest.mark.parametrize("implementation", ["writer", "store"])
def test_a_job_leased_in_its_deliverys_round_carries_that_very_body(
        implementation: str, tmp_path: Path) -> None:
    """Many deliveries in a round (more than one insert chunk), duplicates among them: every
    job leased in that round carries the body object of the first delivery under its id; the
    jobs leased in a later round carry equal bytes, read from the database (not the body of a
    redelivery in that round)."""
    data_dir = tmp_path / "data"
    target: RoundWriter | Store = (RoundWriter(data_dir, max_attempts=5)
                                   if implementation == "writer" else Store(data_dir))
    try:
        firsts = {f"id-{i:03}": body("first", i) for i in range(130)}
        seconds = {f"id-{i:03}": body("first", i) for i in range(0, 130, 7)}  # equal bodies
        deliveries: list[Delivery] = []
        for i, (k, v) in enumerate(firsts.items()):
            deliveries.append(delivery(k, v))
            earlier = f"id-{i - 3:03}"
            if earlier in seconds:  # a redelivery, a few places after the first
                deliveries.append(delivery(earlier, seconds[earlier]))
        assert len(deliveries) == len(firsts) + len(seconds)
        accepted, _, jobs = within(CALL_TIMEOUT, lambda: target.commit_round(
            deliveries, [], Claim(60, 10, fresh_extra=60)))
        assert sum(accepted) == len(firsts)
        for (delivery_id, *_, payload), new in zip(deliveries, accepted, strict=True):
            assert new == (payload is firsts[delivery_id])
        assert len(jobs) == 70
        for job in jobs:
            assert job.payload is firsts[job.delivery_id], job.delivery_id
            assert job.payload is not seconds.get(job.delivery_id)

        leased = {job.delivery_id for job in jobs}
        waiting = [k for k in firsts if k not in leased]
        # Later: redeliveries of waiting ones with other bodies, one new delivery, and a claim
        # for everything.
        redelivered = {k: body("forged", i) for i, k in enumerate(waiting[:20])}
        new = body("new")
        accepted, _, jobs = within(CALL_TIMEOUT, lambda: target.commit_round(
            [*(delivery(k, v) for k, v in redelivered.items()), delivery("late", new)],
            [], Claim(60, 200)))
        assert accepted == [False] * len(redelivered) + [True]
        assert sorted(job.delivery_id for job in jobs) == sorted([*waiting, "late"])
        for job in jobs:
            if job.delivery_id == "late":
                assert job.payload is new
            else:
                original = firsts[job.delivery_id]
                assert job.payload == original and job.payload is not original
    finally:
        target.close()


# -- the child dies ---------------------------------------------------------------------------


def test_a_killed_child_makes_commit_round_raise_writer_gone(writer: RoundWriter,
                                                              tmp_path: Path) -> None:
    data_dir = tmp_path / "writer"
    before = body("before")
    assert within(CALL_TIMEOUT, lambda: writer.commit_round(
        [delivery("before", before)], [], None)) == ([True], [], [])
    assert writer.alive
    pid = writer.pid
    assert pid is not None and pid != os.getpid()

    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WriterGone):
        within(CALL_TIMEOUT, lambda: writer.commit_round(
            [delivery("after", body("after"))], [], Claim(60, 1)))
    assert not writer.alive
    # Once gone, always gone, without waiting on anything.
    started = time.monotonic()
    with pytest.raises(WriterGone, match="gone"):
        writer.commit_round([delivery("later", body("later"))], [], None)
    assert time.monotonic() - started < 1.0

    wait_for(lambda: process_gone(pid), "the killed child to be gone")
    # It died without closing its connections: the write-ahead log of an open database is
    # still on disk (looked at before this test opens one of its own: the last connection to
    # close deletes it).
    assert (data_dir / f"{DB_FILENAME}-wal").exists()
    # What it committed before it died is there; nothing after.
    assert rows(data_dir, "SELECT delivery_id, state FROM deliveries") == [("before", "queued")]
    assert rows(data_dir, "SELECT body FROM payloads") == [(before,)]
    within(CALL_TIMEOUT, writer.close)  # closing a dead writer returns at once


async def test_the_intake_writes_its_rounds_itself_once_the_child_is_killed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    store = Store(data_dir)
    writer = await asyncio.to_thread(RoundWriter, data_dir, store.max_attempts)
    intake = Intake(store, writer=writer)
    try:
        first = body("one")
        assert await asyncio.wait_for(intake.accept(delivery("one", first)), CALL_TIMEOUT)
        assert intake.writer is writer and writer.alive  # written by the child

        pid = writer.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level(logging.INFO, logger="dejafix.intake"):
            fresh = await asyncio.wait_for(asyncio.gather(
                intake.accept(delivery("two", body("two"))),
                intake.accept(delivery("three", body("three"))),
                intake.accept(delivery("one", body("one", 2)))), CALL_TIMEOUT)
            assert fresh == [True, True, False]
            # The next rounds too, without the child.
            assert await asyncio.wait_for(intake.accept(delivery("four", body("four"))),
                                          CALL_TIMEOUT) is True
            assert await asyncio.wait_for(intake.accept(delivery("two", body("two"))),
                                          CALL_TIMEOUT) is False
        assert intake.writer is None and not writer.alive
        assert any("this process writes the rounds from now on" in r.getMessage()
                   for r in caplog.records)
        await intake.flush()
        assert rows(data_dir, "SELECT delivery_id, state FROM deliveries"
                              " ORDER BY delivery_id") == [
            ("four", "queued"), ("one", "queued"), ("three", "queued"), ("two", "queued")]
        assert rows(data_dir, "SELECT body FROM payloads WHERE delivery_id = 'one'") == [
            (first,)]
        assert store.pending_count() == 4
    finally:
        await asyncio.to_thread(writer.close)
        store.close()


def test_a_child_that_cannot_open_the_store_is_writer_gone(tmp_path: Path) -> None:
    data_dir = tmp_path / "newer"
    Store(data_dir).close()
    conn = sqlite3.connect(data_dir / DB_FILENAME)
    conn.execute("PRAGMA user_version = 999")
    conn.close()
    with pytest.raises(WriterGone, match=r"could not open the store.*schema version 999"):
        within(CALL_TIMEOUT, lambda: RoundWriter(data_dir, max_attempts=5))


def test_close_ends_the_child_after_it_closed_the_store(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    writer = RoundWriter(data_dir, max_attempts=5)
    pid = writer.pid
    assert pid is not None and not process_gone(pid)
    within(CALL_TIMEOUT, lambda: writer.commit_round([delivery("x", body("x"))], [], None))
    wal = data_dir / f"{DB_FILENAME}-wal"
    assert wal.exists()  # the child's connection is open

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dejafix.intake"):
        within(CALL_TIMEOUT, writer.close)
    # It left on its own when told to (not killed after the timeout) ...
    assert time.monotonic() - started < 5.0
    assert not any("did not stop" in r.getMessage() for r in caplog.records)
    wait_for(lambda: process_gone(pid), "the child to be gone")
    assert not writer.alive
    # ... having closed its connections: the last one to close checkpoints the log and
    # deletes it (a killed child leaves it behind, see above).
    assert not wal.exists()
    assert rows(data_dir, "SELECT delivery_id FROM deliveries") == [("x",)]
    with pytest.raises(WriterGone):
        writer.commit_round([delivery("y", body("y"))], [], None)


# -- the checkpointer -------------------------------------------------------------------------

# Deliveries per round, their size, and the pause after each round: the writer writes at most
# one round's pages per PAUSE seconds.
ROUND_DELIVERIES = 2
ROUND_BODY_BYTES = 64 * 1024
PAUSE = 0.002
ROUNDS = 500
INTERVAL = 0.02
RESTART_FRAMES = 256
# What a checkpoint pass may take besides its interval (copying pages back, the fsyncs, the
# thread being scheduled): the log may grow by what the writer writes in that time too.
PASS_SLACK = 0.2


def _write_rounds(store: Store, prefix: str, count: int, payload: bytes,
                  wal: Path | None = None) -> int:
    """``count`` rounds of ROUND_DELIVERIES new deliveries, paced; the log's largest size."""
    largest = 0
    for r in range(count):
        store.commit_round([delivery(f"{prefix}-{r}-{i}", payload)
                            for i in range(ROUND_DELIVERIES)], [], None)
        if wal is not None:
            largest = max(largest, wal.stat().st_size)
        time.sleep(PAUSE)
    return largest


def _frames_per_round(data_dir: Path, payload: bytes) -> tuple[int, int]:
    """(pages a round appends to the log, page size), from PRAGMA wal_checkpoint: the log is
    emptied, one round written, and the next checkpoint says how many frames it holds."""
    store = Store(data_dir)
    store.disable_autocheckpoint()
    conn = sqlite3.connect(store.path, isolation_level=None)
    try:
        _write_rounds(store, "warm", 20, payload)
        frames = []
        for r in range(3):
            assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
            _write_rounds(store, f"probe{r}", 1, payload)
            busy, log_frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            assert busy == 0 and copied == log_frames > 0
            frames.append(log_frames)
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
        store.close()
    return max(frames), int(page_size)


def test_the_checkpointer_keeps_the_log_from_growing_without_bound(tmp_path: Path) -> None:
    payload = os.urandom(ROUND_BODY_BYTES)
    frames, page_size = _frames_per_round(tmp_path / "probe", payload)
    # Between two restarts of the log: up to RESTART_FRAMES before a pass restarts it, plus
    # what the writer can write while a pass waits for its turn and does its work.
    rounds_per_pass = math.ceil((INTERVAL + PASS_SLACK) / PAUSE)
    bound = WAL_HEADER_BYTES + (RESTART_FRAMES + frames * rounds_per_pass) * (
        page_size + WAL_FRAME_HEADER_BYTES)
    written = ROUNDS * frames * (page_size + WAL_FRAME_HEADER_BYTES)
    assert written > 3 * bound, "the test would write too little to show anything"

    results = {}
    for name, with_checkpointer in (("without", False), ("with", True)):
        data_dir = tmp_path / name
        store = Store(data_dir, spin_on_busy=True)
        store.disable_autocheckpoint()
        wal = Path(f"{store.path}-wal")
        checkpointer = (Checkpointer(store.path, interval=INTERVAL,
                                     restart_frames=RESTART_FRAMES)
                        if with_checkpointer else None)
        try:
            largest = _write_rounds(store, name, ROUNDS, payload, wal)
        finally:
            if checkpointer is not None:
                checkpointer.stop()
        results[name] = max(largest, wal.stat().st_size)
        # Nothing lost on the way, whatever the log went through.
        assert rows(data_dir, "SELECT count(*) FROM deliveries") == [
            (ROUNDS * ROUND_DELIVERIES,)]
        assert rows(data_dir, "SELECT count(*) FROM payloads WHERE length(body) = "
                              f"{ROUND_BODY_BYTES}") == [(ROUNDS * ROUND_DELIVERIES,)]
        store.close()
        for leftover in data_dir.iterdir():  # tens of MB each
            leftover.unlink()

    mb = {k: round(v / 1e6, 1) for k, v in results.items()}
    assert results["with"] <= bound, (mb, bound / 1e6)
    # The contrast: with autocheckpoint off and nothing else checkpointing, the log holds
    # every round written.
    assert results["without"] > bound, (mb, bound / 1e6)
    assert results["without"] >= 0.9 * written, (mb, written / 1e6)


def test_the_child_outlives_a_sigterm_to_its_process_group(writer: RoundWriter) -> None:
    # systemd and Ctrl-C signal the whole group: the parent finishes its last rounds through
    # the child, then tells it to stop.
    assert writer.pid is not None
    os.kill(writer.pid, signal.SIGTERM)
    os.kill(writer.pid, signal.SIGINT)
    time.sleep(0.3)
    accepted, _, _ = within(10, lambda: writer.commit_round(
        [delivery("after-signals", body("s"))], [], None))
    assert accepted == [True]
    assert writer.alive


def test_a_stuck_child_is_given_up_and_killed(writer: RoundWriter,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import bot.round_writer as round_writer

    monkeypatch.setattr(round_writer, "ROUND_TIMEOUT", 0.5)
    assert writer.pid is not None
    os.kill(writer.pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(WriterGone, match="did not answer"):
        within(10, lambda: writer.commit_round([delivery("stuck", body("x"))], [], None))
    assert time.monotonic() - started < 5
    assert not writer.alive
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and writer._process.is_alive():
        time.sleep(0.05)
    assert not writer._process.is_alive(), "the stuck child was not killed"
