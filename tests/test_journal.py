"""The receiver's journal (``bot/journal.py``): the record format, the ``Journal`` a receiver
appends to, the ``SlotReader`` that reads it into SQLite, the bodies the ledger's payload rows
point at in it (``bot/store.py``: ``ref``, ``read_journal_body``), ``release_segments`` that
deletes a read segment once no job waits for its bodies, and ``serve --role receiver`` as real
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
import time
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
    read_records,
    release_segments,
)
from bot.journal import ingest_free_slots as _ingest_free_slots
from bot.journal import ingest_slot as _ingest_slot
from bot.store import (
    DB_FILENAME,
    MIGRATIONS,
    Delivery,
    Store,
    read_journal_body,
    segment_file,
)
from tests.conftest import REPO, issue_payload
from tests.fault_support import BotProcess, wait_until
from tests.test_roles import Processes, harness, ledger, signed

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


class TookTooLong(BaseException):
    """Not an Exception: the reader's own ``except Exception`` must not swallow it."""


@contextlib.contextmanager
def within(seconds: int, what: str) -> Iterator[None]:
    """Fail, rather than hang, if the block takes longer (a reader going round in circles)."""
    def expired(signum: int, frame: Any) -> None:
        raise TookTooLong(f"{what}: not finished after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def ingest_slot(store: Store, slot_dir: Path, slot: int, *, owned: bool) -> int:
    with within(10, f"reading slot {slot}"):
        return _ingest_slot(store, slot_dir, slot, owned=owned)


def ingest_free_slots(store: Store, root: Path, own: int | None) -> int:
    with within(10, "reading the free slots"):
        return _ingest_free_slots(store, root, own)


def log_files(slot_dir: Path) -> list[Path]:
    return sorted(slot_dir.glob("*.log"))


def segment_path(slot_dir: Path, number: int) -> Path:
    return slot_dir / f"{number:012d}.log"


def ids_in(path: Path) -> list[str]:
    records, end, error = read_records(path.read_bytes())
    assert (end, error) == (path.stat().st_size, None), (path, end, error)
    return [r.delivery[0] for r in records]


def journal_logs(caplog: pytest.LogCaptureFixture, level: int,
                 logger: str = "dejafix.journal") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno == level]


def finish(data_dir: Path, *names: str) -> None:
    """Mark the jobs of these deliveries done, as a worker in another process would: through a
    connection of the test's own to the ledger."""
    conn = sqlite3.connect(data_dir / DB_FILENAME, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout = 10000")
        marks = ",".join("?" * len(names))
        conn.execute("BEGIN IMMEDIATE")
        done = conn.execute(f"UPDATE jobs SET state = 'done', lease_until = NULL"
                            f" WHERE delivery_id IN ({marks})", names).rowcount
        conn.execute(f"UPDATE deliveries SET state = 'done' WHERE delivery_id IN ({marks})",
                     names)
        conn.execute("COMMIT")
    finally:
        conn.close()
    assert done == len(set(names)), (done, names)


def payload_rows(data_dir: Path) -> dict[str, tuple[bytes, str | None]]:
    """delivery id -> (the payload row's body, its ref)."""
    return {d: (body, ref) for d, body, ref in ledger(
        data_dir, "SELECT delivery_id, body, ref FROM payloads")}


def ref_segment(data_dir: Path, ref: str) -> Path:
    """The segment file a ref points into ("<slot>/<segment>:<offset>:<length>")."""
    slot, segment = ref.split(":")[0].split("/")
    return segment_file(data_dir, slot, segment)


def body_places(slot_dir: Path) -> dict[str, str]:
    """delivery id -> "<slot>/<segment>:<offset>:<length>" of its body in the slot's segments,
    worked out from the record headers (not from the ingester's arithmetic)."""
    places = {}
    for path in log_files(slot_dir):
        data = path.read_bytes()
        start = 0
        for record in read_records(data)[0]:
            _, _, meta_len, body_len, _ = HEADER.unpack_from(data, start)
            places[record.delivery[0]] = (
                f"{slot_dir.name}/{int(path.stem)}:{start + HEADER.size + meta_len}:{body_len}")
            start = record.end
    return places


def age(*paths: Path, seconds: float) -> None:
    """Set the segments' modification time that many seconds back."""
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def all_segments(data_dir: Path) -> list[Path]:
    """Every segment file in every slot."""
    return sorted((data_dir / JOURNAL_DIR).glob("*/*.log"))


def assert_journal_holds(data_dir: Path, bodies: dict[str, bytes]) -> None:
    """The jobs not done are exactly those of ``bodies``, each with its body in the journal
    (none in the ledger), and the journal keeps no segment that none of them needs."""
    rows = ledger(data_dir, "SELECT p.delivery_id, p.body, p.ref FROM payloads p"
                            " JOIN jobs j USING (delivery_id) WHERE j.state != 'done'")
    assert {d: (body, ref is not None) for d, body, ref in rows} == {
        d: (b"", True) for d in bodies}
    assert {d: read_journal_body(data_dir, ref) for d, _, ref in rows} == bodies
    assert all_segments(data_dir) == sorted({ref_segment(data_dir, ref) for _, _, ref in rows})


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
    assert await journal.accept(delivery("in-ledger")) is False  # in the ledger at start
    assert ids_in(segment) == ["new"]


async def test_a_journal_remembers_the_ledgers_newest_ids_within_its_bound(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    for name in ("oldest", "older", "newer"):
        assert store.accept_delivery(name, "issues", "opened", REPO, 77, b"{}")
    journal = open_journal(journals, data_dir, remember=2)
    assert await journal.accept(delivery("newer")) is False
    assert await journal.accept(delivery("older")) is False
    # Beyond the bound: answered as new and journaled; the ingester records it once.
    assert await journal.accept(delivery("oldest")) is True
    # Its own ids push the oldest out in turn.
    assert await journal.accept(delivery("own")) is True
    assert await journal.accept(delivery("older")) is True
    assert await journal.accept(delivery("own")) is False
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["oldest", "own", "older"]
    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == 1
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("newer",), ("older",), ("oldest",), ("own",)]


async def test_the_loop_never_reads_the_ledger(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir)
    # Recorded after the journal opened (by another receiver's ingester): not known here.
    assert store.accept_delivery("elsewhere", "issues", "opened", REPO, 77, b"{}")
    assert await journal.accept(delivery("elsewhere")) is True
    assert await journal.accept(delivery("fresh")) is True
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["elsewhere", "fresh"]
    # Recorded once all the same.
    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == 1
    assert ledger(data_dir, "SELECT count(*) FROM deliveries") == [(2,)]


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
    assert isinstance(results[1], UnicodeError)
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["good-1", "good-2"]
    assert len(writes) == 1
    # Not remembered: nothing was written, so a copy with fields it can hold is taken.
    assert await journal.accept(delivery("bad")) is True
    assert ids_in(segment_path(journal.slot_dir, 1)) == ["good-1", "good-2", "bad"]


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
    # Read, as when the receiver is gone: the cursor points past them. They stay, since their
    # jobs' bodies are in them.
    assert ingest_slot(store, slot_dir, 0, owned=False) == 2
    assert log_files(slot_dir) == [segment_path(slot_dir, n) for n in (1, 2)]
    assert store.get_cursor(cursor_name(0)) == "3:0"

    third = open_journal(journals, data_dir)
    assert third.slot == 0 and third.segment is not None and third.segment > 3
    assert await third.accept(delivery("after"))
    # Neither skipped as read already nor deleted unread.
    assert ingest_slot(store, slot_dir, 0, owned=True) == 1
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("after",), ("before-1",), ("before-2",)]
    newest = segment_path(slot_dir, third.segment)
    assert log_files(slot_dir) == [segment_path(slot_dir, n) for n in (1, 2)] + [newest]

    # The segments below the cursor are never read again, even once their deliveries are done
    # and pruned from the ledger (nothing else would keep them from being recorded twice).
    finish(data_dir, "before-1", "before-2")
    assert store.prune(-60) == 2
    assert ingest_slot(store, slot_dir, 0, owned=True) == 0
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries") == [("after",)]
    # No job waits for their bodies any more: they go; the one being written stays.
    assert release_segments(store, slot_dir, 0) == 2
    assert log_files(slot_dir) == [newest]


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
    # The bodies stay in the journal: each payload row says where, and holds none itself.
    places = body_places(journal.slot_dir)
    assert payload_rows(data_dir) == {item[0]: (b"", places[item[0]]) for item in items}
    assert {item[0]: read_journal_body(data_dir, places[item[0]]) for item in items} == {
        item[0]: item[5] for item in items}
    assert store.get_cursor(cursor_name(0)) == f"1:{segment.stat().st_size}"
    assert log_files(journal.slot_dir) == [segment]  # its receiver may still write there

    # The worker's jobs carry the bodies, read from the journal.
    jobs = store.claim_jobs(lease_seconds=60, limit=10)
    assert [(j.delivery_id, j.payload) for j in jobs] == [(i[0], i[5]) for i in items]
    # Done and pruned from the ledger: only the cursor keeps them from being read again.
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


async def test_a_finished_segment_with_a_torn_tail_is_read_then_released(
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
    assert store.get_cursor(cursor_name(0)) == "5:0"
    # Read to its end, kept while the two jobs wait for their bodies; gone once they are done.
    assert log_files(slot_dir) == [segment]
    assert release_segments(store, slot_dir, 0) == 0
    assert [j.payload for j in store.claim_jobs(lease_seconds=60, limit=5)] == [
        delivery("f-1")[5], delivery("f-2")[5]]
    finish(data_dir, "f-1", "f-2")
    assert release_segments(store, slot_dir, 0) == 1
    assert log_files(slot_dir) == []
    assert ingest_slot(store, slot_dir, 0, owned=False) == 0
    assert journal_logs(caplog, logging.WARNING) == warnings  # the torn tail told once


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
    assert log_files(slot_dir) == [first, second]  # the first kept for c-1's and c-2's bodies
    assert store.get_cursor(cursor_name(0)) == f"2:{len(newest)}"
    # Read again: nothing more, nothing logged again.
    assert ingest_slot(store, slot_dir, 0, owned=True) == 0
    assert len(journal_logs(caplog, logging.ERROR)) == 1
    # Their jobs done, the first segment goes; its corrupt copy and the segment the receiver
    # still writes stay, even with c-next done too.
    finish(data_dir, "c-1", "c-2", "c-next")
    assert release_segments(store, slot_dir, 0) == 1
    assert log_files(slot_dir) == [second]
    assert kept.read_bytes() == original
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
    assert store.get_cursor(cursor_name(1)) == "2:0"
    # Read, and kept for gone-1's body while its job waits.
    assert log_files(root / "1") == [segment_path(root / "1", 1)]
    assert len(log_files(root / "0")) == 1 and len(log_files(root / "2")) == 1
    # Its job done, the next look at the free slots deletes it.
    finish(data_dir, "gone-1")
    assert ingest_free_slots(store, root, own=2) == 0
    assert log_files(root / "1") == []
    # The reader let go of the slot it read: a new receiver can take it.
    assert open_journal(journals, data_dir).slot == 1

    live.close()
    assert ingest_free_slots(store, root, own=None) == 2
    assert ledger(data_dir, "SELECT delivery_id FROM deliveries ORDER BY delivery_id") == [
        ("gone-1",), ("live-1",), ("own-1",)]
    assert [len(log_files(root / s)) for s in "02"] == [1, 1]
    finish(data_dir, "live-1", "own-1")
    assert ingest_free_slots(store, root, own=None) == 0
    assert log_files(root / "0") == [] and log_files(root / "2") == []


# -- bodies kept in the journal, and when a segment goes ---------------------------------------


async def test_the_ledger_points_at_each_body_in_the_journal_and_claims_read_it(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    # One segment a delivery for the first ones (the refs name different segments), then
    # enough in one pass for one ingest to insert its rows in several chunks.
    journal = open_journal(journals, data_dir, segment_bytes=1)
    items = list(ROUND_TRIP.values())
    for item in items:
        assert await journal.accept(item)
    journal.segment_bytes = 1 << 30
    many = [delivery(f"m-{i:03d}", f"{{\"n\": {i}}}".encode()) for i in range(250)]
    assert await asyncio.gather(*(journal.accept(d) for d in many)) == [True] * len(many)
    items += many
    places = body_places(journal.slot_dir)
    assert len({ref_segment(data_dir, p) for p in places.values()}) == len(ROUND_TRIP) + 1

    assert ingest_slot(store, journal.slot_dir, 0, owned=True) == len(items)
    assert payload_rows(data_dir) == {item[0]: (b"", places[item[0]]) for item in items}
    for item in items:
        body = read_journal_body(data_dir, places[item[0]])
        assert type(body) is bytes and body == item[5], item[0]

    first = store.claim_job(lease_seconds=60)
    assert first is not None
    assert (first.delivery_id, first.payload) == (items[0][0], items[0][5])
    rest = store.claim_jobs(lease_seconds=60, limit=len(items))
    assert [(j.delivery_id, j.payload) for j in rest] == [(i[0], i[5]) for i in items[1:]]
    assert {type(j.payload) for j in [first, *rest]} == {bytes}

    # A ref past the end of its segment, or into a segment that is not there.
    where, offset, length = places[items[len(ROUND_TRIP) - 1][0]].rsplit(":", 2)
    with pytest.raises(ValueError, match="the segment ends before the body does"):
        read_journal_body(data_dir, f"{where}:{offset}:{int(length) + 1}")
    with pytest.raises(FileNotFoundError):
        read_journal_body(data_dir, "0/99:0:1")


async def test_the_same_id_twice_in_a_segment_points_at_its_first_body(
        data_dir: Path, store: Store) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    write_segment(slot_dir, 1, encode(delivery("a"), 1.0) + encode(delivery("x", b"first"), 2.0)
                  + encode(delivery("x", b"second"), 3.0) + encode(delivery("b"), 4.0))
    assert ingest_slot(store, slot_dir, 0, owned=False) == 3
    jobs = store.claim_jobs(lease_seconds=60, limit=5)
    assert [(j.delivery_id, j.payload) for j in jobs] == [
        ("a", delivery("a")[5]), ("x", b"first"), ("b", delivery("b")[5])]


async def test_a_read_segment_goes_once_no_job_waits_for_its_bodies(
        data_dir: Path, store: Store, journals: list[Journal]) -> None:
    journal = open_journal(journals, data_dir, segment_bytes=1)
    names = [f"r-{n}" for n in range(1, 13)]
    for name in names:  # r-<n> alone in segment n
        assert await journal.accept(delivery(name))
    slot_dir = journal.slot_dir
    segments = {n: segment_path(slot_dir, n) for n in range(1, 14)}
    assert log_files(slot_dir) == list(segments.values())
    assert release_segments(store, slot_dir, 0) == 0  # never read: no cursor
    assert log_files(slot_dir) == list(segments.values())

    assert ingest_slot(store, slot_dir, 0, owned=True) == 12
    assert store.get_cursor(cursor_name(0)) == "13:0"
    assert await journal.accept(delivery("r-13"))  # in 13, at the cursor, not read yet
    segments[14] = segment_path(slot_dir, 14)
    assert log_files(slot_dir) == list(segments.values())
    # Every job waits for its body: nothing goes.
    assert release_segments(store, slot_dir, 0) == 0
    assert log_files(slot_dir) == list(segments.values())

    jobs = store.claim_jobs(lease_seconds=60, limit=3)
    assert [j.delivery_id for j in jobs] == names[:3]
    assert store.complete_job(jobs[0].id)  # r-1 done
    assert store.fail_job(jobs[2].id, "boom")  # r-3 dead-lettered: not done
    finish(data_dir, "r-10", "r-11")
    # r-2 running, r-3 failed, r-4..r-9 and r-12 queued: their segments stay (segment 1's
    # refs are not mistaken for segment 10's, 11's or 12's).
    assert release_segments(store, slot_dir, 0) == 3
    assert log_files(slot_dir) == [segments[n] for n in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14)]
    claimed = store.claim_jobs(lease_seconds=60, limit=20)
    assert {j.delivery_id: j.payload for j in claimed} == {
        n: delivery(n)[5] for n in [*names[3:9], "r-12"]}

    # Every job done, every segment long past the retention: those at and above the cursor
    # stay (the one being read, and the one after it).
    finish(data_dir, *names)
    age(*log_files(slot_dir), seconds=3600)
    assert release_segments(store, slot_dir, 0, retain_seconds=0) == 9
    assert log_files(slot_dir) == [segments[13], segments[14]]
    assert ingest_slot(store, slot_dir, 0, owned=True) == 1
    assert payload_rows(data_dir)["r-13"] == (b"", body_places(slot_dir)["r-13"])


async def test_bodies_that_wait_past_the_retention_are_copied_into_the_ledger(
        data_dir: Path, store: Store, journals: list[Journal],
        caplog: pytest.LogCaptureFixture) -> None:
    journal = open_journal(journals, data_dir, segment_bytes=1)
    items = [delivery("k-1"), delivery("k-2", bytes(range(256)) * 3), delivery("k-3"),
             delivery("k-4"), delivery("k-5")]
    bodies = {item[0]: item[5] for item in items}
    for item in items:  # k-<n> alone in segment n; 6 is being written
        assert await journal.accept(item)
    slot_dir = journal.slot_dir
    seg = {n: segment_path(slot_dir, n) for n in range(1, 7)}
    assert ingest_slot(store, slot_dir, 0, owned=True) == 5
    places = body_places(slot_dir)
    leased = store.claim_jobs(lease_seconds=60, limit=2)
    assert [j.delivery_id for j in leased] == ["k-1", "k-2"]
    assert store.complete_job(leased[0].id)  # k-1 done; k-2 running; the rest queued

    caplog.set_level(logging.INFO, logger="dejafix.journal")
    age(seg[1], seg[2], seg[3], seg[6], seconds=120)
    age(seg[4], seg[5], seconds=30)
    assert release_segments(store, slot_dir, 0, retain_seconds=60) == 3
    assert log_files(slot_dir) == [seg[4], seg[5], seg[6]]
    # Copied: the bodies of the jobs not done, from the segments older than the retention.
    assert payload_rows(data_dir) == {
        "k-1": (b"", places["k-1"]), "k-2": (bodies["k-2"], None),
        "k-3": (bodies["k-3"], None), "k-4": (b"", places["k-4"]),
        "k-5": (b"", places["k-5"])}
    copied = journal_logs(caplog, logging.INFO)
    assert len(copied) == 2
    assert [str(seg[n]) in m and "1 job(s)" in m for n, m in zip((2, 3), copied,
                                                                  strict=True)] == [True] * 2

    # The default retention (RETAIN_SECONDS, 15 minutes): k-5's segment is not old enough
    # at 10 minutes, and is at 20.
    age(seg[5], seconds=600)
    assert release_segments(store, slot_dir, 0) == 0
    age(seg[5], seconds=1200)
    assert release_segments(store, slot_dir, 0) == 1
    # No retention: whatever waits is copied at once.
    assert release_segments(store, slot_dir, 0, retain_seconds=0) == 1
    assert log_files(slot_dir) == [seg[6]]
    assert payload_rows(data_dir) == {"k-1": (b"", places["k-1"]),
                                      **{n: (bodies[n], None) for n in bodies if n != "k-1"}}

    # Jobs claimed after that get their bodies from the ledger: the queued ones, and the
    # running one given back.
    assert [(j.delivery_id, j.payload) for j in store.claim_jobs(lease_seconds=60, limit=9)
            ] == [(n, bodies[n]) for n in ("k-3", "k-4", "k-5")]
    assert store.release_jobs([leased[1].id]) == 1
    again = store.claim_job(lease_seconds=60)
    assert again is not None and (again.delivery_id, again.payload) == ("k-2", bodies["k-2"])


def test_a_body_copied_and_its_segment_deleted_after_its_row_was_read(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    segment = write_segment(slot_dir, 1, encode(delivery("x-1"), 1.0)
                            + encode(delivery("x-2", b"\x00two"), 2.0))
    assert ingest_slot(store, slot_dir, 0, owned=False) == 2
    ref1, ref2 = payload_rows(data_dir)["x-1"][1], payload_rows(data_dir)["x-2"][1]
    assert ref1 is not None and ref2 is not None
    caplog.set_level(logging.INFO, logger="dejafix.store")

    # A worker has read x-1's row (ref1 in hand); meanwhile release_segments copies the body
    # into the ledger and deletes the segment. The worker's read of the file finds it gone,
    # and reads the row again.
    assert store.keep_bodies([("x-1", ref1, read_journal_body(data_dir, ref1))]) == 1
    segment.unlink()
    assert store._journal_body("x-1", ref1) == delivery("x-1")[5]
    assert journal_logs(caplog, logging.ERROR, "dejafix.store") == []

    # x-2's body was never copied: gone with its segment. An empty payload (its job fails),
    # and an error that says so.
    assert store._journal_body("x-2", ref2) == b""
    errors = journal_logs(caplog, logging.ERROR, "dejafix.store")
    assert len(errors) == 1
    assert "x-2" in errors[0] and ref2 in errors[0] and "gone" in errors[0]
    # The same through a claim.
    assert [(j.delivery_id, j.payload) for j in store.claim_jobs(lease_seconds=60, limit=5)
            ] == [("x-1", delivery("x-1")[5]), ("x-2", b"")]
    assert len(journal_logs(caplog, logging.ERROR, "dejafix.store")) == 2

    # A copy for a ref its row no longer has (copied already) changes nothing.
    assert store.keep_bodies([("x-1", ref1, b"stale")]) == 0
    assert payload_rows(data_dir)["x-1"] == (delivery("x-1")[5], None)


def test_a_body_cut_short_in_its_segment_is_an_empty_payload_and_an_error(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    segment = write_segment(slot_dir, 1, encode(delivery("y-1"), 1.0))
    assert ingest_slot(store, slot_dir, 0, owned=False) == 1
    os.truncate(segment, segment.stat().st_size - 3)
    caplog.set_level(logging.ERROR, logger="dejafix.store")
    job = store.claim_job(lease_seconds=60)
    assert job is not None and (job.delivery_id, job.payload) == ("y-1", b"")
    errors = journal_logs(caplog, logging.ERROR, "dejafix.store")
    assert len(errors) == 1
    assert "y-1" in errors[0] and "the segment ends before the body does" in errors[0]


def test_a_segment_past_the_retention_goes_even_if_a_body_in_it_cannot_be_read(
        data_dir: Path, store: Store, caplog: pytest.LogCaptureFixture) -> None:
    slot_dir = data_dir / JOURNAL_DIR / "0"
    segment = write_segment(slot_dir, 1, encode(delivery("z-1"), 1.0)
                            + encode(delivery("z-2"), 2.0))
    assert ingest_slot(store, slot_dir, 0, owned=False) == 2
    os.truncate(segment, segment.stat().st_size - 3)  # z-2's body cut short
    age(segment, seconds=120)
    caplog.set_level(logging.ERROR, logger="dejafix.journal")
    released = [release_segments(store, slot_dir, 0, retain_seconds=60) for _ in range(3)]
    # What can be read is copied into the ledger; the rest is said once, and the segment goes.
    assert payload_rows(data_dir)["z-1"] == (delivery("z-1")[5], None)
    errors = journal_logs(caplog, logging.ERROR)
    assert len(errors) == 1 and "z-2" in errors[0], errors
    assert released == [1, 0, 0]
    assert log_files(slot_dir) == []


def test_the_ledger_schema_has_the_payloads_ref(data_dir: Path, store: Store) -> None:
    assert store.schema_version() == MIGRATIONS[-1][0] == 5
    assert [(r[1], r[2], r[3]) for r in ledger(data_dir, "PRAGMA table_info(payloads)")] == [
        ("delivery_id", "TEXT", 0), ("body", "BLOB", 1), ("ref", "TEXT", 0)]
    assert ledger(data_dir, "SELECT tbl_name FROM sqlite_master WHERE type = 'index'"
                            " AND name = 'payloads_ref'") == [("payloads",)]


def test_a_version_4_ledger_is_upgraded_and_keeps_its_bodies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    monkeypatch.setattr("bot.store.MIGRATIONS", MIGRATIONS[:4])  # the Dejafix before ref
    with Store(data_dir) as old:
        assert old.schema_version() == 4
        assert old.accept_delivery("v4", "issues", "opened", REPO, 77, b"{\"v\": 4}")
    assert "ref" not in {r[1] for r in ledger(data_dir, "PRAGMA table_info(payloads)")}
    monkeypatch.undo()

    with Store(data_dir) as new:
        assert new.schema_version() == 5
        assert payload_rows(data_dir) == {"v4": (b"{\"v\": 4}", None)}
        slot_dir = data_dir / JOURNAL_DIR / "0"
        write_segment(slot_dir, 1, encode(delivery("v5"), 5.0))
        assert ingest_slot(new, slot_dir, 0, owned=False) == 1
        assert [(j.delivery_id, j.payload) for j in new.claim_jobs(lease_seconds=60, limit=5)
                ] == [("v4", b"{\"v\": 4}"), ("v5", delivery("v5")[5])]
    with Store(data_dir) as again:  # opened again: nothing to do
        assert again.schema_version() == 5


@requires_proc
async def test_a_clean_stop_reads_everything_into_the_ledger(
        data_dir: Path, store: Store) -> None:
    """The stop note and the end of the pipe reach the ingester together: it must read them as
    "stop" (a last read, to the end), not as "my receiver is gone" (the slot's lock,
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
    assert store.get_cursor(cursor_name(0)) == "2:0"
    # No worker ran: the segment is kept, and holds exactly the six jobs' bodies.
    assert_journal_holds(data_dir, {f"s-{i}": delivery(f"s-{i}")[5] for i in range(6)})
    finish(data_dir, *(f"s-{i}" for i in range(6)))
    assert release_segments(store, data_dir / JOURNAL_DIR / "0", 0) == 1
    assert all_segments(data_dir) == []


@requires_proc
async def test_a_stopping_ingester_deletes_the_segment_its_jobs_are_done_with(
        data_dir: Path, store: Store) -> None:
    """The segment being written is read to its end only at the stop: that last pass must
    delete it if no job waits for its bodies (the next look would never come)."""
    intake = ReceiverIntake(data_dir, data_dir / DB_FILENAME, max_attempts=5)
    await intake.start()
    try:
        assert await asyncio.gather(*(intake.accept(delivery(f"e-{i}")) for i in range(3))) == [
            True] * 3
        await wait_until(lambda: recorded_ids(data_dir) == {"e-0", "e-1", "e-2"},
                         "the ingester to record them", timeout=INGEST_TIMEOUT)
        finish(data_dir, "e-0", "e-1", "e-2")
        segment = segment_path(data_dir / JOURNAL_DIR / "0", 1)
        assert segment.exists()  # at the cursor: its receiver may still write there
    finally:
        await intake.stop()
    assert store.get_cursor(cursor_name(0)) == "2:0"
    assert all_segments(data_dir) == []


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

    async def orphan(self, names: dict[str, int]
                     ) -> tuple[BotProcess, int, dict[str, Any]]:
        """A receiver whose ingester is paused gets ``names`` posted, then the receiver alone
        is killed: (that receiver, its paused ingester, the answers)."""
        first = await self.start("receiver")
        orphan = ingester_of(first)
        self.strays.append(orphan)
        os.kill(orphan, signal.SIGSTOP)
        answers = await self.post_all(first, names)
        first.popen.kill()  # the receiver alone: its ingester outlives it
        first.popen.wait(10)
        return first, orphan, answers

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
    async with harness(Receivers, tmp_path) as procs:
        yield procs


def queued(names: dict[str, Any]) -> dict[str, tuple[int, dict[str, str]]]:
    return {name: (202, {"status": "queued"}) for name in names}


def expected_bodies(names: dict[str, int]) -> dict[str, bytes]:
    return {name: signed(issue_payload(number=n, title=f"crash {n}"), name)[0]
            for name, n in names.items()}


def recorded(data_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """delivery id -> (deliveries rows, jobs rows, payload) in the ledger; a payload kept in the
    journal is read from there (its segment must still be there)."""
    rows = ledger(data_dir, "SELECT d.delivery_id, count(*), (SELECT count(*) FROM jobs j"
                            " WHERE j.delivery_id = d.delivery_id), p.body, p.ref"
                            " FROM deliveries d LEFT JOIN payloads p USING (delivery_id)"
                            " GROUP BY d.delivery_id")
    return {r[0]: (r[1], r[2], r[3] if r[4] is None else read_journal_body(data_dir, r[4]))
            for r in rows}


def recorded_ids(data_dir: Path) -> set[str]:
    return {r[0] for r in ledger(data_dir, "SELECT delivery_id FROM deliveries")}


def unread(data_dir: Path) -> list[str]:
    """The segments left in the journal that are not read to their end (by their slot's
    cursor: one below it is read, and kept for its bodies), with what the cursor says."""
    found = []
    for slot_dir in sorted((data_dir / JOURNAL_DIR).iterdir()):
        cursor = ledger(data_dir, "SELECT value FROM cursors WHERE name = ?",
                        cursor_name(int(slot_dir.name)))
        for path in log_files(slot_dir):
            if cursor and int(path.stem) < int(cursor[0][0].split(":")[0]):
                continue
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
    # The killed receiver's segment is read, and kept for the bodies of the jobs (no worker
    # runs them here); once they are done, the running ingester deletes it.
    first_segment = segment_path(data_dir / JOURNAL_DIR / "0", 1)
    assert first_segment.exists()
    assert {ref_segment(data_dir, ref) for _, ref in payload_rows(data_dir).values()} == {
        first_segment}
    finish(data_dir, *expected)
    await wait_until(lambda: not first_segment.exists(),
                     "the dead receiver's segment to be deleted", timeout=INGEST_TIMEOUT,
                     diagnose=second.log_tail)
    assert await receivers.post(second, 91000, "run-0") == (202, {"status": "duplicate"})
    late = {f"late-{i}": 98000 + i for i in range(10)}
    assert await receivers.post_all(second, late) == queued(late)
    await wait_until(lambda: set(late) <= recorded_ids(data_dir), "the late deliveries",
                     timeout=INGEST_TIMEOUT, diagnose=second.log_tail)

    assert await receivers.stop(second) == 0
    assert recorded_ids(data_dir) == set(expected) | set(late)
    assert ledger(data_dir, "SELECT state, count(*) FROM deliveries GROUP BY state"
                            " ORDER BY state") == [("done", len(expected)), ("queued", len(late))]
    assert_journal_holds(data_dir, expected_bodies(late))


@requires_proc
async def test_the_ingester_of_a_killed_receiver_finishes_its_journal(
        receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    slot_dir = data_dir / JOURNAL_DIR / "0"
    names = {f"orphan-{i}": 93000 + i for i in range(30)}
    first, orphan, answers = await receivers.orphan(names)
    assert answers == queued(names)
    assert recorded(data_dir) == {}
    os.kill(orphan, signal.SIGCONT)

    # It sees its receiver gone, takes the free slot, reads everything and leaves: a receiver
    # that never comes back loses nothing. The segment stays for the queued jobs' bodies.
    await wait_until(lambda: not _running(orphan), "the orphaned ingester to leave",
                     timeout=INGEST_TIMEOUT, diagnose=first.log_tail)
    expected = {name: (1, 1, body) for name, body in expected_bodies(names).items()}
    assert recorded(data_dir) == expected
    assert log_files(slot_dir) == [segment_path(slot_dir, 1)]
    assert_journal_holds(data_dir, expected_bodies(names))
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
    # The orphan's deliveries done, the new receiver's ingester deletes their segment.
    finish(data_dir, *names)
    await wait_until(lambda: not segment_path(slot_dir, 1).exists(),
                     "the orphan's segment to be deleted", timeout=INGEST_TIMEOUT,
                     diagnose=second.log_tail)
    assert await receivers.stop(second) == 0
    assert_journal_holds(data_dir, expected_bodies({"after": 93100}))


@requires_proc
async def test_an_orphaned_ingester_leaves_a_slot_a_new_receiver_took(
        receivers: Receivers) -> None:
    data_dir = receivers.data_dir
    slot_dir = data_dir / JOURNAL_DIR / "0"
    before = {f"before-{i}": 96000 + i for i in range(20)}
    _, orphan, answers = await receivers.orphan(before)
    assert answers == queued(before)

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
    # The first receiver's segment, read by the second's ingester, goes once its jobs are done.
    assert segment_path(slot_dir, 1).exists()
    finish(data_dir, *before)
    await wait_until(lambda: not segment_path(slot_dir, 1).exists(),
                     "the first receiver's segment to be deleted", timeout=INGEST_TIMEOUT,
                     diagnose=second.log_tail)
    assert await receivers.stop(second) == 0
    assert_journal_holds(data_dir, expected_bodies(after))


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
    assert_journal_holds(data_dir, expected_bodies({**before, **meanwhile}))
