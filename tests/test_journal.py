"""The receiver's journal (``bot/journal.py``): the record format, the ``Journal`` a receiver
appends to, the ``SlotReader`` that reads it into SQLite, and ``serve --role receiver`` as real
processes killed with SIGKILL. Nothing is faked: real files and flocks, a real SQLite file, the
real forkserver ingester; the process tests signal real ``python -m bot serve`` processes.

Every wait polls a condition with ``wait_until``; no sleep stands in for an assertion."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sqlite3
import struct
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bot.journal import (
    JOURNAL_DIR,
    MAX_SLOTS,
    Journal,
    JournalInUse,
    ReceiverIntake,
    SlotReader,
    cursor_name,
    encode,
    ingest_free_slots,
    ingest_slot,
    read_records,
)
from bot.store import DB_FILENAME, Delivery, Store
from tests.conftest import REPO, issue_payload
from tests.fault_support import BotProcess, wait_until
from tests.test_roles import Processes, ledger, signed

# Seconds for the ingester (or a new receiver) to bring a delivery into the ledger.
INGEST_TIMEOUT = 15.0
HEADER = struct.Struct("<3sBIII")  # the record header: magic, version, lengths, CRC-32

requires_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                   reason="finds the ingester process through /proc")


def delivery(name: str, body: bytes | None = None, *, action: str | None = "opened",
             installation_id: int | None = 77, repo: str | None = REPO) -> Delivery:
    if body is None:
        body = json.dumps({"action": action, "name": name}).encode()
    return (name, "issues", action, repo, installation_id, body)


def log_files(slot_dir: Path) -> list[Path]:
    return sorted(slot_dir.glob("*.log"))


def segment_path(slot_dir: Path, number: int) -> Path:
    return slot_dir / f"{number:012d}.log"


def ids_in(path: Path) -> list[str]:
    records, end, error = read_records(path.read_bytes())
    assert (end, error) == (path.stat().st_size, None), (path, end, error)
    return [r.delivery[0] for r in records]


def journal_logs(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "dejafix.journal" and r.levelno == level]


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path) -> Iterator[Store]:
    """The store, created before any Journal (a Journal reads the ledger it makes)."""
    with Store(data_dir) as opened:
        yield opened


@pytest.fixture
def journals(data_dir: Path, store: Store) -> Iterator[list[Journal]]:
    """Journals a test opens; each closed (its slot released) at the end."""
    opened: list[Journal] = []
    yield opened
    for journal in opened:
        journal.close()


def open_journal(journals: list[Journal], data_dir: Path, **options: Any) -> Journal:
    journal = Journal(data_dir, data_dir / DB_FILENAME, **options)
    journals.append(journal)
    journal.open()
    return journal


# -- the record format -------------------------------------------------------------------------


ROUND_TRIP = {
    "plain": delivery("d-plain"),
    "action None": delivery("d-no-action", action=None),
    "installation None": delivery("d-no-installation", installation_id=None),
    "repo None": delivery("d-no-repo", repo=None),
    "largest installation id": delivery("d-big-installation", installation_id=2**63 - 1),
    "unicode": ("d-ünïcødé-✓-😀", "issues", "opened", "ówner/répo-日本",
                7, "{\"title\": \"crash in 😀 ✓ ü\"}".encode()),
    "empty body": delivery("d-empty", b""),
    "large body": delivery("d-large", os.urandom(3 * 1024 * 1024 + 17)),
    "binary body": delivery("d-binary", bytes(range(256)) * 4),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_a_record_reads_back_as_written(case: str) -> None:
    item = ROUND_TRIP[case]
    received_at = 1795990442.1141045  # a float whose every digit must survive
    first = encode(delivery("d-first"), 1.5)
    data = first + encode(item, received_at)

    records, end, error = read_records(data)
    assert error is None and end == len(data)
    assert [(r.delivery, r.received_at, r.end) for r in records] == [
        (delivery("d-first"), 1.5, len(first)), (item, received_at, len(data))]
    assert type(records[1].delivery[5]) is bytes
    # Read from the middle of a segment: offsets are the segment's, not the buffer's.
    records, end, error = read_records(data[len(first):], base=len(first))
    assert error is None and end == len(data)
    assert [(r.delivery, r.end) for r in records] == [(item, len(data))]


def test_an_incomplete_last_record_is_left_for_later_at_every_cut() -> None:
    whole = [encode(delivery(f"d-{i}"), 100.0 + i) for i in range(2)]
    last = encode(delivery("d-cut", b"x" * 300), 200.0)
    prefix = b"".join(whole)
    # Cut anywhere: in the header, the metadata or the body.
    for cut in range(len(last)):
        records, end, error = read_records(prefix + last[:cut], base=40)
        assert error is None, (cut, error)
        assert end == 40 + len(prefix), cut
        assert [r.delivery[0] for r in records] == ["d-0", "d-1"], cut
    assert read_records(b"") == ([], 0, None)


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x5A]) + data[index + 1:]


def _corrupt_magic(record: bytes) -> bytes:
    return _flip(record, 0)


def _corrupt_version(record: bytes) -> bytes:
    return record[:3] + bytes([99]) + record[4:]


def _corrupt_length(record: bytes) -> bytes:
    magic, version, meta_len, _, crc = HEADER.unpack_from(record)
    return HEADER.pack(magic, version, meta_len, 2**31, crc) + record[HEADER.size:]


def _corrupt_body(record: bytes) -> bytes:
    return _flip(record, len(record) - 3)


def _corrupt_metadata(record: bytes) -> bytes:
    return _flip(record, HEADER.size + 2)


def _corrupt_crc(record: bytes) -> bytes:
    return _flip(record, HEADER.size - 1)


def _zeros(record: bytes) -> bytes:
    return bytes(len(record))  # what a crash can leave at the end of a file


def _metadata_not_json(record: bytes) -> bytes:
    meta, body = b"[not json", b"{}"
    return HEADER.pack(b"DJF", 1, len(meta), len(body),
                       zlib.crc32(body, zlib.crc32(meta))) + meta + body


CORRUPTIONS = {
    "magic": (_corrupt_magic, "not a record header"),
    "version": (_corrupt_version, "not a record header"),
    "length past any record": (_corrupt_length, "not a record header"),
    "zeros": (_zeros, "not a record header"),
    "body": (_corrupt_body, "checksum does not match"),
    "metadata": (_corrupt_metadata, "checksum does not match"),
    "crc": (_corrupt_crc, "checksum does not match"),
    "metadata not JSON, CRC right": (_metadata_not_json, "bad metadata"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_record_ends_the_read_with_its_offset(case: str) -> None:
    corrupt, why = CORRUPTIONS[case]
    good = encode(delivery("d-good"), 1.0) + encode(delivery("d-good-2"), 2.0)
    bad = corrupt(encode(delivery("d-bad", b"{\"x\": 1}"), 3.0))
    after = encode(delivery("d-after"), 4.0)
    base = 1000

    records, end, error = read_records(good + bad + after, base=base)
    assert [r.delivery[0] for r in records] == ["d-good", "d-good-2"]
    assert end == base + len(good)
    assert error is not None
    assert error.startswith(f"offset {base + len(good)}: {why}"), error


WRONG_SHAPES = {"null": b"null", "a number": b"5", "a short array": b"[\"d\", \"issues\"]",
                "an object": b"{\"id\": \"d\"}",
                "received_at not a number": b"[\"d\", \"issues\", null, null, null, \"x\"]"}


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_metadata_of_the_wrong_shape_is_an_error_not_an_exception(case: str) -> None:
    """JSON with a right CRC, but not the six fields: an error to report (the record is set
    aside), not an exception (which failed every ingester pass at that record, for ever;
    fixed in c8e0dc6)."""
    meta, body = WRONG_SHAPES[case], b"{}"
    bad = HEADER.pack(b"DJF", 1, len(meta), len(body),
                      zlib.crc32(body, zlib.crc32(meta))) + meta + body
    good = encode(delivery("d-good"), 1.0)
    records, end, error = read_records(good + bad)
    assert [r.delivery[0] for r in records] == ["d-good"]
    assert end == len(good)
    assert error is not None and error.startswith(f"offset {len(good)}: bad metadata")


# -- the Journal: slots, dedupe, writes, segments ----------------------------------------------


def test_each_journal_on_a_data_dir_takes_its_own_slot(
        data_dir: Path, journals: list[Journal]) -> None:
    first = open_journal(journals, data_dir)
    second = open_journal(journals, data_dir)
    assert (first.slot, first.segment) == (0, 1)
    assert (second.slot, second.segment) == (1, 1)
    root = data_dir / JOURNAL_DIR
    assert log_files(root / "0") == [segment_path(root / "0", 1)]
    assert log_files(root / "1") == [segment_path(root / "1", 1)]

    # A slot let go of is taken again, with a new segment: the old one is never appended to.
    first.close()
    third = open_journal(journals, data_dir)
    assert (third.slot, third.segment) == (0, 2)
    assert log_files(root / "0") == [segment_path(root / "0", n) for n in (1, 2)]
    # The slots still held are passed over.
    fourth = open_journal(journals, data_dir)
    assert fourth.slot == 2


def test_a_journal_is_refused_when_every_slot_is_held(
        data_dir: Path, journals: list[Journal]) -> None:
    held = [open_journal(journals, data_dir) for _ in range(MAX_SLOTS)]
    assert [j.slot for j in held] == list(range(MAX_SLOTS))
    extra = Journal(data_dir, data_dir / DB_FILENAME)
    with pytest.raises(JournalInUse, match=f"all {MAX_SLOTS} slots are held"):
        extra.open()
    held[5].close()
    journals.remove(held[5])
    assert open_journal(journals, data_dir).slot == 5


async def test_accept_journals_a_delivery_once(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    assert store.accept_delivery("in-ledger", "issues", "opened", REPO, 77, b"{}")
    journal = open_journal(journals, data_dir)
    segment = segment_path(journal.slot_dir, 1)

    assert await journal.accept(delivery("new")) is True
    assert ids_in(segment) == ["new"]  # written when accept returns
    assert await journal.accept(delivery("new")) is False  # remembered
    assert await journal.accept(delivery("in-ledger")) is False  # found in the ledger
    assert ids_in(segment) == ["new"]


async def test_an_id_the_journal_forgot_is_found_in_the_ledger(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir, remember=1)
    assert await journal.accept(delivery("a")) is True
    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == 1
    assert await journal.accept(delivery("b")) is True  # "a" leaves the journal's memory
    assert await journal.accept(delivery("a")) is False
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["a", "b"]


async def test_the_same_id_twice_in_one_pass_is_written_once(
        data_dir: Path, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir)
    results = await asyncio.gather(journal.accept(delivery("twice")),
                                   journal.accept(delivery("other")),
                                   journal.accept(delivery("twice")))
    assert results == [True, True, False]
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["twice", "other"]


async def test_a_delivery_json_cannot_hold_is_refused_alone(
        data_dir: Path, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir)
    writes: list[None] = []
    journal.on_write = lambda: writes.append(None)
    bad = delivery("bad", action="opened\ud800")  # a lone surrogate: not UTF-8
    results = await asyncio.gather(journal.accept(delivery("good-1")), journal.accept(bad),
                                   journal.accept(delivery("good-2")),
                                   return_exceptions=True)
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], ValueError)
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["good-1", "good-2"]
    assert len(writes) == 1


async def test_what_one_loop_pass_accepts_goes_out_in_one_write(
        data_dir: Path, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir)
    writes: list[int] = []
    journal.on_write = lambda: writes.append(segment_path(journal.slot_dir, 1).stat().st_size)
    names = [f"batch-{i:02d}" for i in range(25)]

    results = await asyncio.gather(*(journal.accept(delivery(n)) for n in names))
    assert results == [True] * len(names)
    segment = segment_path(journal.slot_dir, 1)
    assert len(writes) == 1 and writes[0] == segment.stat().st_size
    assert ids_in(segment) == names
    assert log_files(journal.slot_dir) == [segment]

    more = await asyncio.gather(journal.accept(delivery("later-1")),
                                journal.accept(delivery("later-2")))
    assert more == [True, True] and len(writes) == 2
    assert ids_in(segment) == [*names, "later-1", "later-2"]


async def test_a_segment_that_reaches_its_size_is_followed_by_a_new_one(
        data_dir: Path, journals: list[Journal]) -> None:
    size = len(encode(delivery("rot-0"), 5.0))  # every record below is this long
    journal = open_journal(journals, data_dir, segment_bytes=2 * size, clock=lambda: 5.0)
    for i in range(5):  # one loop pass each
        assert await journal.accept(delivery(f"rot-{i}"))
    slot_dir = journal.slot_dir
    assert journal.segment == 3
    assert [ids_in(p) for p in log_files(slot_dir)] == [
        ["rot-0", "rot-1"], ["rot-2", "rot-3"], ["rot-4"]]

    # A record is never split: one pass's write larger than a segment stays in one.
    big = await asyncio.gather(*(journal.accept(delivery(f"big-{i}")) for i in range(5)))
    assert big == [True] * 5
    assert journal.segment == 4
    assert ids_in(segment_path(slot_dir, 3)) == ["rot-4", *(f"big-{i}" for i in range(5))]
    assert segment_path(slot_dir, 4).stat().st_size == 0


async def test_a_reopened_journal_starts_a_segment_above_the_cursor(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    first = open_journal(journals, data_dir)
    assert await first.accept(delivery("before-1"))
    first.close()
    second = open_journal(journals, data_dir)
    assert (second.slot, second.segment) == (0, 2)
    assert await second.accept(delivery("before-2"))
    second.close()
    slot_dir = data_dir / JOURNAL_DIR / "0"
    # Read and deleted, as when the receiver is gone: the cursor points past them.
    assert ingest_slot(store, slot_dir, 0, owned=False) == 2
    assert log_files(slot_dir) == []
    assert store.get_cursor(cursor_name(0)) == "3:0"

    third = open_journal(journals, data_dir)
    assert third.slot == 0 and third.segment is not None and third.segment > 3
    assert await third.accept(delivery("after"))
    # Neither skipped as read already nor deleted unread.
    assert ingest_slot(store, slot_dir, 0, owned=True) == 1
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("after",), ("before-1",), ("before-2",)]
    assert log_files(slot_dir) == [segment_path(slot_dir, third.segment)]


@pytest.mark.parametrize("name", ["data#1", "data?x=1", "data%41"])
async def test_a_data_dir_with_uri_characters_in_its_path(tmp_path: Path, name: str) -> None:
    """The ledger is read through a SQLite URI: a path with '#', '?' or '%' in it must be
    escaped. Unescaped (before f2d1dd3), '#' cut the path and mode=ro off, SQLite created an
    empty database at <tmp>/data, and the receiver could not start ('no such table')."""
    data_dir = tmp_path / name
    with Store(data_dir) as store:
        assert store.accept_delivery("old", "issues", "opened", REPO, 77, b"{}")
    journal = Journal(data_dir, data_dir / DB_FILENAME)
    try:
        journal.open()
        assert await journal.accept(delivery("old")) is False
        assert await journal.accept(delivery("new")) is True
    finally:
        journal.close()
    assert not (tmp_path / "data").exists(), "a stray database beside the data dir"


# -- reading the journal into the store --------------------------------------------------------


def write_segment(slot_dir: Path, number: int, data: bytes) -> Path:
    slot_dir.mkdir(parents=True, exist_ok=True)
    path = segment_path(slot_dir, number)
    with path.open("ab") as fh:
        fh.write(data)
    return path


async def test_ingest_records_deliveries_jobs_and_payloads_once(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    times = iter([1700000000.25, 1700000001.5, 1700000002.125])
    journal = open_journal(journals, data_dir, clock=lambda: next(times))
    items = [delivery("i-1"), delivery("i-2", action=None, installation_id=None),
             ("i-3-ü", "issues", "opened", REPO, 9, "{\"t\": \"😀\"}".encode())]
    for item in items:
        assert await journal.accept(item)
    segment = segment_path(journal.slot_dir, 1)

    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == 3
    rows = ledger(data_dir, "SELECT delivery_id, event, action, repo, installation_id,"
                            " received_at, state FROM deliveries ORDER BY received_at")
    assert rows == [
        ("i-1", "issues", "opened", REPO, 77, 1700000000.25, "queued"),
        ("i-2", "issues", None, REPO, None, 1700000001.5, "queued"),
        ("i-3-ü", "issues", "opened", REPO, 9, 1700000002.125, "queued")]
    assert ledger(data_dir, "SELECT delivery_id, state, attempts FROM jobs ORDER BY id") == [
        ("i-1", "queued", 0), ("i-2", "queued", 0), ("i-3-ü", "queued", 0)]
    assert dict(ledger(data_dir, "SELECT delivery_id, body FROM payloads")) == {
        item[0]: item[5] for item in items}
    assert store.get_cursor(cursor_name(0)) == f"1:{segment.stat().st_size}"
    assert log_files(journal.slot_dir) == [segment]  # its receiver may still write there

    # Done and pruned from the ledger: only the cursor keeps them from being read again.
    jobs = store.claim_jobs(lease_seconds=60, limit=10)
    assert store.complete_jobs([j.id for j in jobs]) == [True] * 3
    assert store.prune(-60) == 3
    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == 0
    reader = SlotReader(store, journal.slot_dir, 0)
    try:
        assert reader.read(owned=True) == 0
    finally:
        reader.close()
    assert ledger(data_dir, "SELECT count(*) FROM deliveries") == [(0,)]


async def test_an_owned_segment_keeps_its_incomplete_tail_for_the_next_pass(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    whole = encode(delivery("t-1"), 1.0) + encode(delivery("t-2"), 2.0)
    torn = encode(delivery("t-3", b"{\"body\": \"" + b"z" * 5000 + b"\"}"), 3.0)
    segment = write_segment(slot_dir, 1, whole + torn[:HEADER.size + 20])

    caplog.set_level(logging.WARNING, logger="dejafix.journal")
    reader = SlotReader(store, slot_dir, 0)
    try:
        assert reader.read(owned=True) == 2
        assert store.get_cursor(cursor_name(0)) == f"1:{len(whole)}"
        assert segment.exists()
        write_segment(slot_dir, 1, torn[HEADER.size + 20:])  # the receiver's write completes
        assert reader.read(owned=True) == 1
    finally:
        reader.close()
    assert store.get_cursor(cursor_name(0)) == f"1:{len(whole) + len(torn)}"
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("t-1",), ("t-2",), ("t-3",)]
    assert segment.exists()
    # A fresh reader (a restarted ingester) starts at the cursor, with the same tail.
    write_segment(slot_dir, 1, encode(delivery("t-4"), 4.0)[:30])
    assert ingest_slot(store, slot_dir, 0, owned=True) == 0
    assert store.get_cursor(cursor_name(0)) == f"1:{len(whole) + len(torn)}"
    assert journal_logs(caplog, logging.WARNING) == []
    assert journal_logs(caplog, logging.ERROR) == []


async def test_a_finished_segment_with_a_torn_tail_is_read_and_deleted(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    whole = encode(delivery("f-1"), 1.0) + encode(delivery("f-2"), 2.0)
    torn = encode(delivery("f-3"), 3.0)[:-5]
    segment = write_segment(slot_dir, 4, whole + torn)

    caplog.set_level(logging.WARNING, logger="dejafix.journal")
    assert ingest_slot(store, slot_dir, 0, owned=False) == 2
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("f-1",), ("f-2",)]
    warnings = journal_logs(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert str(segment) in warnings[0] and f"{len(torn)} bytes" in warnings[0]
    assert journal_logs(caplog, logging.ERROR) == []
    assert not segment.exists() and log_files(slot_dir) == []
    assert store.get_cursor(cursor_name(0)) == "5:0"


async def test_a_corrupt_record_in_a_finished_segment_is_kept_aside(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    good = encode(delivery("c-1"), 1.0) + encode(delivery("c-2"), 2.0)
    bad = _corrupt_body(encode(delivery("c-bad"), 3.0))
    first = write_segment(slot_dir, 1, good + bad + encode(delivery("c-after"), 4.0))
    original = first.read_bytes()
    newest = encode(delivery("c-next"), 5.0)
    second = write_segment(slot_dir, 2, newest)

    caplog.set_level(logging.WARNING, logger="dejafix.journal")
    # Segment 1 is finished (2 exists); 2 is its receiver's, still being written.
    assert ingest_slot(store, slot_dir, 0, owned=True) == 3
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("c-1",), ("c-2",), ("c-next",)]
    errors = journal_logs(caplog, logging.ERROR)
    assert len(errors) == 1
    assert str(first) in errors[0] and f"offset {len(good)}: checksum does not match" in (
        errors[0])
    kept = first.with_name(first.name + ".corrupt")
    assert kept.read_bytes() == original
    assert not first.exists()
    assert log_files(slot_dir) == [second]
    assert store.get_cursor(cursor_name(0)) == f"2:{len(newest)}"
    # Read again: nothing more, nothing logged again.
    assert ingest_slot(store, slot_dir, 0, owned=True) == 0
    assert len(journal_logs(caplog, logging.ERROR)) == 1


def _meta_record(meta: list[Any], body: bytes = b"{}") -> bytes:
    """A record as a writer other than ``encode`` could make it (the CRC is right)."""
    raw = json.dumps(meta).encode()
    return HEADER.pack(b"DJF", 1, len(raw), len(body),
                       zlib.crc32(body, zlib.crc32(raw))) + raw + body


UNRECORDABLE = {
    "event null": ["r-bad", None, "opened", REPO, 77, 3.0],
    "event a list": ["r-bad", ["issues"], "opened", REPO, 77, 3.0],
}


@pytest.mark.parametrize("case", list(UNRECORDABLE))
async def test_a_record_the_ledger_cannot_take_is_skipped(
        case: str, data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    data = (encode(delivery("r-1"), 1.0) + encode(delivery("r-2"), 2.0)
            + _meta_record(UNRECORDABLE[case]) + encode(delivery("r-3"), 4.0))
    write_segment(slot_dir, 1, data)

    caplog.set_level(logging.WARNING, logger="dejafix.journal")
    assert ingest_slot(store, slot_dir, 0, owned=True) == 3
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("r-1",), ("r-2",), ("r-3",)]
    errors = journal_logs(caplog, logging.ERROR)
    assert len(errors) == 1 and "cannot be recorded; skipped" in errors[0]
    assert store.get_cursor(cursor_name(0)) == f"1:{len(data)}"
    assert ingest_slot(store, slot_dir, 0, owned=True) == 0
    assert len(journal_logs(caplog, logging.ERROR)) == 1


async def test_free_slots_are_read_and_held_ones_are_not(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    live = open_journal(journals, data_dir)  # slot 0, its receiver running
    gone = open_journal(journals, data_dir)  # slot 1, its receiver gone
    other = open_journal(journals, data_dir)  # slot 2, the caller's own
    assert [live.slot, gone.slot, other.slot] == [0, 1, 2]
    assert await live.accept(delivery("live-1"))
    assert await gone.accept(delivery("gone-1"))
    assert await other.accept(delivery("own-1"))
    gone.close()
    other.close()
    root = data_dir / JOURNAL_DIR

    assert ingest_free_slots(store, root, own=2) == 1
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries") == [("gone-1",)]
    assert log_files(root / "1") == []
    assert store.get_cursor(cursor_name(1)) == "2:0"
    assert len(log_files(root / "0")) == 1 and len(log_files(root / "2")) == 1
    # The reader let go of the slot it read: a new receiver can take it.
    assert open_journal(journals, data_dir).slot == 1

    live.close()
    assert ingest_free_slots(store, root, own=None) == 2
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("gone-1",), ("live-1",), ("own-1",)]
    assert log_files(root / "0") == [] and log_files(root / "2") == []


@requires_proc
async def test_a_clean_stop_reads_everything_into_the_ledger(
        data_dir: Path, store: Store) -> None:
    """The stop note and the end of the pipe reach the ingester together: it must read them as
    "stop" (a last read, everything deleted), not as "my receiver is gone" (the slot's lock,
    still held by the stopping receiver, then says a new receiver has it, and it would leave
    without reading). Before b59dc5f it did the latter, on 4 SIGTERM stops out of 5."""
    intake = ReceiverIntake(data_dir, data_dir / DB_FILENAME, max_attempts=5)
    await intake.start()
    stopping: asyncio.Task[None] | None = None
    try:
        assert await intake.accept(delivery("s-0"))
        await wait_until(lambda: bool(ledger(data_dir, "SELECT 1 FROM deliveries")),
                         "the ingester to record s-0", timeout=INGEST_TIMEOUT)
        ingester = intake.ingester
        assert ingester is not None and ingester.pid is not None
        # The ingester is busy elsewhere (descheduled) while the last deliveries come in and
        # the receiver stops.
        os.kill(ingester.pid, signal.SIGSTOP)
        try:
            names = [f"s-{i}" for i in range(1, 6)]
            assert await asyncio.gather(*(intake.accept(delivery(n)) for n in names)) == [
                True] * 5
            stopping = asyncio.create_task(intake.stop())
            # Its end of the pipe closed: "stop" and the end of the stream are both there.
            await wait_until(lambda: ingester._conn.closed, "the receiver to tell it to stop",
                             timeout=INGEST_TIMEOUT)
        finally:
            os.kill(ingester.pid, signal.SIGCONT)
        await stopping
    finally:
        if stopping is None:
            await intake.stop()
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        (f"s-{i}",) for i in range(6)]
    assert log_files(data_dir / JOURNAL_DIR / "0") == []
    assert store.get_cursor(cursor_name(0)) == "2:0"


# -- real processes: serve --role receiver -----------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
                found.append(int(entry))
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def forkserver_of(receiver: BotProcess) -> int:
    (server,) = [p for p in _children(receiver.pid)
                 if "multiprocessing.forkserver" in _cmdline(p)]
    return server


def ingester_of(receiver: BotProcess) -> int:
    """The receiver's ingester: the forkserver's child (a fork of it, same command line)."""
    (ingester,) = _children(forkserver_of(receiver))
    return ingester


class Receivers(Processes):
    """``serve --role receiver`` processes, and the helper processes a test took over from a
    receiver it killed (an orphaned ingester), all gone at the end of the test."""

    def __init__(self, tmp_path: Path, session: aiohttp.ClientSession) -> None:
        super().__init__(tmp_path, session)
        self.strays: list[int] = []

    async def post(self, proc: BotProcess, number: int, name: str) -> tuple[int, Any]:
        body, headers = signed(issue_payload(number=number, title=f"crash {number}"), name)
        async with self.session.post(proc.url + "/webhook", data=body,
                                     headers=headers) as resp:
            return resp.status, await resp.json()

    async def post_all(self, proc: BotProcess, names: dict[str, int]) -> dict[str, Any]:
        """Post concurrently; each delivery's (status, answer)."""
        answers = await asyncio.gather(*(self.post(proc, n, name)
                                         for name, n in names.items()))
        return dict(zip(names, answers, strict=True))

    async def healthz(self, proc: BotProcess) -> tuple[int, dict[str, Any]]:
        async with self.session.get(proc.url + "/healthz") as resp:
            return resp.status, await resp.json()

    def kill_tree(self, proc: BotProcess) -> None:
        """SIGKILL the receiver and every process it started, as a machine that loses power
        would: frozen first, so nothing it started sees it go and reacts."""
        proc.popen.send_signal(signal.SIGSTOP)
        helpers = _children(proc.pid)
        helpers += [c for h in helpers for c in _children(h)]
        for pid in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.popen.kill()
        proc.popen.wait(10)

    async def cleanup(self) -> None:
        for pid in self.strays:
            if _running(pid) and "multiprocessing.forkserver" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        await super().cleanup()


@pytest.fixture
async def receivers(tmp_path: Path) -> AsyncIterator[Receivers]:
    session = aiohttp.ClientSession()
    procs = Receivers(tmp_path, session)
    try:
        yield procs
    finally:
        try:
            await procs.cleanup()
        finally:
            await session.close()


def queued(names: dict[str, Any]) -> dict[str, tuple[int, dict[str, str]]]:
    return {name: (202, {"status": "queued"}) for name in names}


def expected_bodies(names: dict[str, int]) -> dict[str, bytes]:
    return {name: signed(issue_payload(number=n, title=f"crash {n}"), name)[0]
            for name, n in names.items()}


def recorded(data_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """delivery id -> (deliveries rows, jobs rows, payload) in the ledger."""
    rows = ledger(data_dir, "SELECT d.delivery_id, count(*), (SELECT count(*) FROM jobs j"
                            " WHERE j.delivery_id = d.delivery_id), p.body FROM deliveries d"
                            " LEFT JOIN payloads p USING (delivery_id) GROUP BY d.delivery_id")
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def all_segments(data_dir: Path) -> list[Path]:
    """Every segment file in every slot (a clean stop leaves none)."""
    return sorted((data_dir / JOURNAL_DIR).glob("*/*.log"))


def unread(data_dir: Path) -> list[str]:
    """The segments left in the journal that are not read to their end (by their slot's
    cursor), with what the cursor says."""
    found = []
    for slot_dir in sorted((data_dir / JOURNAL_DIR).iterdir()):
        cursor = ledger(data_dir, "SELECT value FROM cursors WHERE name = ?",
                        cursor_name(int(slot_dir.name)))
        for path in log_files(slot_dir):
            if cursor != [(f"{int(path.stem)}:{path.stat().st_size}",)]:
                found.append(f"{path} ({path.stat().st_size} bytes), cursor {cursor}")
    return found


@requires_proc
async def test_a_new_receiver_records_what_a_killed_one_journaled(
        receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    first = await receivers.start("receiver")
    running = {f"run-{i}": 91000 + i for i in range(30)}
    answers = await receivers.post_all(first, running)
    # The rest while its ingester is paused: journaled and answered, surely not recorded.
    os.kill(ingester_of(first), signal.SIGSTOP)
    unread_names = {f"unread-{i}": 92000 + i for i in range(30)}
    answers.update(await receivers.post_all(first, unread_names))
    receivers.kill_tree(first)
    assert answers == queued(answers)
    assert set(recorded(data_dir)) < set(answers)
    assert log_files(data_dir / JOURNAL_DIR / "0") == [
        segment_path(data_dir / JOURNAL_DIR / "0", 1)]

    second = await receivers.start("receiver")
    status, health = await receivers.healthz(second)
    assert status == 200 and health["journal"] == {"slot": 0, "segment": 2,
                                                   "ingester": "running"}
    # GitHub redelivers some: however far the ingester is, each is recorded once.
    again = dict(list(unread_names.items())[::5])
    redelivered = await receivers.post_all(second, again)
    assert {a[0] for a in redelivered.values()} == {202}
    assert {a[1]["status"] for a in redelivered.values()} <= {"queued", "duplicate"}
    expected = {name: (1, 1, body) for name, body in expected_bodies(
        {**running, **unread_names}).items()}
    await wait_until(lambda: recorded(data_dir) == expected,
                     "every answered delivery in the ledger once", timeout=INGEST_TIMEOUT,
                     diagnose=second.log_tail)
    # The killed receiver's segment is read and gone; a redelivery now is known.
    await wait_until(lambda: not segment_path(data_dir / JOURNAL_DIR / "0", 1).exists(),
                     "the dead receiver's segment to be deleted", timeout=INGEST_TIMEOUT)
    assert await receivers.post(second, 91000, "run-0") == (202, {"status": "duplicate"})

    assert await receivers.stop(second) == 0
    assert recorded(data_dir) == expected
    assert all_segments(data_dir) == []
    assert ledger(data_dir, "SELECT count(*) FROM jobs WHERE state = 'queued'") == [
        (len(expected),)]


@requires_proc
async def test_the_ingester_of_a_killed_receiver_finishes_its_journal(
        receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    slot_dir = data_dir / JOURNAL_DIR / "0"
    first = await receivers.start("receiver")
    orphan = ingester_of(first)
    receivers.strays.append(orphan)
    os.kill(orphan, signal.SIGSTOP)
    names = {f"orphan-{i}": 93000 + i for i in range(30)}
    answers = await receivers.post_all(first, names)
    first.popen.kill()  # the receiver alone: its ingester outlives it
    first.popen.wait(10)
    assert answers == queued(names)
    assert recorded(data_dir) == {}
    os.kill(orphan, signal.SIGCONT)

    # It sees its receiver gone, takes the free slot, reads everything, deletes the segments
    # and leaves: a receiver that never comes back loses nothing.
    await wait_until(lambda: not _running(orphan), "the orphaned ingester to leave",
                     timeout=INGEST_TIMEOUT, diagnose=first.log_tail)
    expected = {name: (1, 1, body) for name, body in expected_bodies(names).items()}
    assert recorded(data_dir) == expected
    assert log_files(slot_dir) == []
    assert ledger(data_dir, "SELECT value FROM cursors WHERE name = ?", cursor_name(0)) == [
        ("2:0",)]

    # The next receiver on the slot writes above the cursor, and its deliveries are read.
    second = await receivers.start("receiver")
    status, health = await receivers.healthz(second)
    assert status == 200 and health["journal"]["slot"] == 0
    assert health["journal"]["segment"] > 2
    assert await receivers.post(second, 93000, "orphan-0") == (202, {"status": "duplicate"})
    assert await receivers.post(second, 93100, "after") == (202, {"status": "queued"})
    await wait_until(lambda: "after" in recorded(data_dir), "the new delivery in the ledger",
                     timeout=INGEST_TIMEOUT, diagnose=second.log_tail)
    assert unread(data_dir) == []
    assert await receivers.stop(second) == 0
    assert all_segments(data_dir) == []


@requires_proc
async def test_an_orphaned_ingester_leaves_a_slot_a_new_receiver_took(
        receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    slot_dir = data_dir / JOURNAL_DIR / "0"
    first = await receivers.start("receiver")
    orphan = ingester_of(first)
    receivers.strays.append(orphan)
    os.kill(orphan, signal.SIGSTOP)
    before = {f"before-{i}": 96000 + i for i in range(20)}
    assert await receivers.post_all(first, before) == queued(before)
    first.popen.kill()
    first.popen.wait(10)

    # A new receiver takes the free slot before the old ingester notices its receiver gone.
    second = await receivers.start("receiver")
    status, health = await receivers.healthz(second)
    assert status == 200 and health["journal"] == {"slot": 0, "segment": 2,
                                                   "ingester": "running"}
    os.kill(orphan, signal.SIGCONT)
    await wait_until(lambda: not _running(orphan), "the orphaned ingester to leave",
                     timeout=INGEST_TIMEOUT, diagnose=second.log_tail)
    # It left the segment being written alone: what goes there now is read too.
    assert segment_path(slot_dir, 2).exists()
    after = {f"after-{i}": 97000 + i for i in range(10)}
    assert await receivers.post_all(second, after) == queued(after)
    expected = {name: (1, 1, body) for name, body in expected_bodies(
        {**before, **after}).items()}
    await wait_until(lambda: recorded(data_dir) == expected,
                     "every delivery in the ledger once", timeout=INGEST_TIMEOUT,
                     diagnose=second.log_tail)
    assert not segment_path(slot_dir, 1).exists()
    assert await receivers.stop(second) == 0
    assert all_segments(data_dir) == []


@requires_proc
async def test_a_receiver_restarts_a_killed_ingester(receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    receiver = await receivers.start("receiver")
    status, health = await receivers.healthz(receiver)
    assert status == 200 and health["ok"] is True
    assert health["journal"] == {"slot": 0, "segment": 1, "ingester": "running"}
    assert log_files(data_dir / JOURNAL_DIR / "0") == [
        segment_path(data_dir / JOURNAL_DIR / "0", 1)]
    before = {f"before-{i}": 94000 + i for i in range(10)}
    assert await receivers.post_all(receiver, before) == queued(before)

    killed = ingester_of(receiver)
    # The ledger's write lock held (as a long transaction elsewhere would): no new ingester
    # can open the store, so this test sees the receiver without one for as long as it needs.
    blocker = sqlite3.connect(data_dir / DB_FILENAME, isolation_level=None)
    try:
        blocker.execute("PRAGMA busy_timeout = 10000")
        blocker.execute("BEGIN IMMEDIATE")
        os.kill(killed, signal.SIGKILL)

        async def down() -> bool:
            status, health = await receivers.healthz(receiver)
            return (status, health["ok"], health["journal"]["ingester"]) == (
                503, False, "down")

        await wait_until(down, "/healthz to report the ingester down", timeout=INGEST_TIMEOUT,
                         diagnose=receiver.log_tail)
        meanwhile = {f"meanwhile-{i}": 95000 + i for i in range(20)}
        assert await receivers.post_all(receiver, meanwhile) == queued(meanwhile)
        assert set(recorded(data_dir)).isdisjoint(meanwhile)  # journaled, not recorded
    finally:
        blocker.close()  # rolls back

    async def running_again() -> bool:
        status, health = await receivers.healthz(receiver)
        return status == 200 and health["journal"]["ingester"] == "running"

    await wait_until(running_again, "a new ingester", timeout=INGEST_TIMEOUT,
                     diagnose=receiver.log_tail)
    assert ingester_of(receiver) != killed
    expected = {name: (1, 1, body) for name, body in expected_bodies(
        {**before, **meanwhile}).items()}
    await wait_until(lambda: recorded(data_dir) == expected,
                     "every delivery in the ledger once", timeout=INGEST_TIMEOUT,
                     diagnose=receiver.log_tail)
    assert "the ingester process is gone; starting another" in receiver.log()
    status, health = await receivers.healthz(receiver)
    assert health["journal"] == {"slot": 0, "segment": 1, "ingester": "running"}
    assert await receivers.stop(receiver) == 0
    assert recorded(data_dir) == expected
    assert all_segments(data_dir) == []
