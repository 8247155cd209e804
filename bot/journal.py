"""The receiver's durable intake: an append-only journal on disk, read into SQLite by a child
process.

Why not the rounds of ``bot/intake.py``: a request's answer waited for a SQLite commit in
another process (pickled over a pipe, a writer thread taking the GIL back from the busy loop),
and while a dozen requests waited for their round the loop had nothing to do. Measured on the
bench's 2-core machine, a receiver whose writes cost nothing answered as many requests as a bare
aiohttp handler; with the rounds, 0.6 of that. Appending a delivery to a file costs the loop a
few microseconds (one ``writev`` a pass of the loop, for every delivery that pass accepted) and
is as durable as the SQLite commit was: both are in the kernel's page cache when the 202 goes
out, so they survive the process being killed, and neither is synced to disk on every request
(``PRAGMA synchronous = NORMAL``; a power loss may take the last ones with it either way).

Layout: ``<data dir>/journal/<slot>/<segment>.log``. A receiver holds one slot (a lock file, so
several receivers on one data directory each write their own), starts a new segment at every
start (a segment cut short by a crash is never appended to) and another every
``SEGMENT_BYTES``. A record is a header (magic, lengths, CRC-32) then a small JSON array of the
delivery's fields and the body as received.

The ingester (a forkserver child started by the receiver) reads the segments in order and
records their deliveries and jobs with ``Store.ingest`` (the slot's cursor moves in the same
transaction, so a restart reads nothing twice). The bodies stay where they are: a payload row
says where its body is in the segment, and the worker reads it from there. A segment read to
its end (a newer one exists, or its receiver is gone) is deleted once every job with a body in
it is done; after ``RETAIN_SECONDS`` the bodies of jobs still waiting are copied into the store
and it is deleted all the same (``release_segments``). Copying every body into SQLite at once
wrote it twice more (the log, then the checkpoint), and that was most of what the ingester cost
the receiver. The ingester also reads the slots whose receiver is gone (their lock is free), so
that a receiver that never comes back loses nothing.

Dedupe: a delivery id is a redelivery if it is among the ``REMEMBER`` ids held in memory: the
ledger's newest when the receiver started, then those it journaled (which push the oldest out).
The loop never reads the ledger: a query a pass grew dearer as the ledger and its log grew (4% of
the requests a second within 16 s of load). An id journaled by another receiver, or older than
those remembered, is answered as new; the ingester records every id once and drops the second
copy, so it is still not redone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import sqlite3
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pydantic_core import PydanticSerializationError, from_json, to_json

from bot.round_writer import open_child_store, spawn
from bot.store import JOURNAL_DIR, Delivery, Store, read_journal_body

log = logging.getLogger("dejafix.journal")

__all__ = ["JOURNAL_DIR", "Ingester", "Journal", "JournalInUse", "ReceiverIntake",
           "read_records"]

SEGMENT_BYTES = 64 * 1024 * 1024
# Delivery ids a receiver remembers, the ledger's newest at start then its own (about 100
# bytes each).
REMEMBER = 50_000
# Slots a data directory may have: one per receiver running at once.
MAX_SLOTS = 64
# magic, version, metadata length, body length, CRC-32 of metadata + body
_HEADER = struct.Struct("<3sBIII")
_MAGIC = b"DJF"
_VERSION = 1
# A record larger than this is not a record (a corrupt length): the receiver's bodies are
# bounded by max_body_bytes, far below it.
_MAX_RECORD = 256 * 1024 * 1024
# Deliveries recorded in one ingest transaction.
INGEST_BATCH = 256
# Seconds a read segment is kept for the bodies of jobs not done yet, before they are copied
# into the store; and between the ingester's looks at what it may delete.
RETAIN_SECONDS = 900.0
RELEASE_SECONDS = 1.0
# Seconds the ingester sleeps when told nothing, and between looks at the other slots.
INGEST_POLL = 0.05
# Seconds from the start of one pass to the next, at least: under load, fewer and larger
# transactions. From 5 ms to 50 ms the ingester's CPU fell by a third, and the receiver beside
# it on two cores answered 0.99 of the bare handler's requests instead of 0.92 (medians of seven
# interleaved runs); the worker polls every 0.2 s anyway.
INGEST_INTERVAL = 0.05
SCAN_SECONDS = 10.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
# Seconds between the receiver's looks at whether its ingester is still there.
WATCH_SECONDS = 1.0
# The receiver's notes to its ingester.
_MORE = b"n"
_STOP = b"s"


class JournalInUse(RuntimeError):
    """Every slot of the journal is held by a running receiver."""


def _segment_name(number: int) -> str:
    return f"{number:012d}.log"


def _segments(slot_dir: Path) -> list[int]:
    numbers = []
    for path in slot_dir.glob("*.log"):
        with contextlib.suppress(ValueError):
            numbers.append(int(path.stem))
    return sorted(numbers)


def _try_lock(slot_dir: Path) -> int | None:
    """The slot's lock file, locked (its fd), or None if another process holds it."""
    slot_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(slot_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def encode(delivery: Delivery, received_at: float) -> bytes:
    delivery_id, event, action, repo, installation_id, body = delivery
    # pydantic-core's encoder: a fifth of the stdlib's time for this short array.
    try:
        meta = to_json([delivery_id, event, action, repo, installation_id, received_at])
    except PydanticSerializationError as exc:
        # The only field JSON can refuse here is a string UTF-8 cannot hold (a lone
        # surrogate): the error SQLite gives the same delivery in ``serve`` alone.
        raise UnicodeError(str(exc)) from exc
    crc = zlib.crc32(body, zlib.crc32(meta))
    return _HEADER.pack(_MAGIC, _VERSION, len(meta), len(body), crc) + meta + body


@dataclass(frozen=True)
class Record:
    delivery: Delivery
    received_at: float
    end: int  # offset just past the record in its segment


def read_records(data: bytes | memoryview, base: int = 0
                 ) -> tuple[list[Record], int, str | None]:
    """The complete records at the start of ``data`` (read from offset ``base`` of a segment),
    the offset just past the last, and why the bytes there are not a record (None: they are
    the start of one not yet complete, or nothing)."""
    view = memoryview(data)
    records: list[Record] = []
    pos = 0
    while len(view) - pos >= _HEADER.size:
        magic, version, meta_len, body_len, crc = _HEADER.unpack_from(view, pos)
        if magic != _MAGIC or version != _VERSION or meta_len + body_len > _MAX_RECORD:
            return records, base + pos, f"offset {base + pos}: not a record header"
        end = pos + _HEADER.size + meta_len + body_len
        if end > len(view):
            break
        meta = bytes(view[pos + _HEADER.size: pos + _HEADER.size + meta_len])
        body = bytes(view[pos + _HEADER.size + meta_len: end])
        if zlib.crc32(body, zlib.crc32(meta)) != crc:
            return records, base + pos, f"offset {base + pos}: checksum does not match"
        try:
            delivery_id, event, action, repo, installation_id, received_at = from_json(meta)
            received = float(received_at)
        except (ValueError, TypeError) as exc:
            return records, base + pos, f"offset {base + pos}: bad metadata ({exc})"
        records.append(Record((delivery_id, event, action, repo, installation_id, body),
                              received, base + end))
        pos = end
    return records, base + pos, None


class Journal:
    """The loop's side: ``accept`` appends a delivery and returns once it is written.

    ``open`` looks for a free slot and belongs in a thread; ``accept``, ``flush`` and
    ``close_segment`` (which flushes, settling its callers' futures) run on the event loop: a
    set lookup a delivery and one ``writev`` a pass, a file closed."""

    def __init__(self, data_dir: Path, db_path: Path, *, segment_bytes: int = SEGMENT_BYTES,
                 remember: int = REMEMBER, clock: Any = time.time) -> None:
        self.root = data_dir / JOURNAL_DIR
        self.db_path = db_path
        self.segment_bytes = segment_bytes
        self._clock = clock
        self._recent: set[str] = set()
        self._order: collections.deque[str] = collections.deque()
        self._remember = remember
        # Accepted in this pass of the loop, not written yet: (delivery, received at, caller).
        self._waiting: list[tuple[Delivery, float, asyncio.Future[bool]]] = []
        self._inflight: dict[str, asyncio.Future[bool]] = {}
        self._flush_scheduled = False
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._size = 0
        self.slot: int | None = None
        self.segment: int | None = None
        # Called after each write: tells the ingester there is more to read.
        self.on_write: Any = None

    @property
    def slot_dir(self) -> Path:
        assert self.slot is not None
        return self.root / str(self.slot)

    def open(self) -> None:
        for slot in range(MAX_SLOTS):
            fd = _try_lock(self.root / str(slot))
            if fd is not None:
                self._lock_fd, self.slot = fd, slot
                break
        else:
            raise JournalInUse(f"{self.root}: all {MAX_SLOTS} slots are held by running "
                               "receivers")
        try:
            reader = sqlite3.connect(self.db_path.resolve().as_uri() + "?mode=ro", uri=True)
            try:
                # After every segment there is and the one the ingester has gone on to: a
                # segment numbered below the cursor counts as read, so it would never be read
                # (and would be deleted once no job waits for a body in it).
                row = reader.execute("SELECT value FROM cursors WHERE name = ?",
                                     (cursor_name(self.slot),)).fetchone()
                # The ledger's newest ids: a redelivery of one is recognised after a restart.
                known = reader.execute("SELECT delivery_id FROM deliveries ORDER BY rowid DESC"
                                       " LIMIT ?", (self._remember,)).fetchall()
            finally:
                reader.close()
            for (delivery_id,) in reversed(known):
                self._remember_id(delivery_id)
            cursor = _parse_cursor(row[0] if row else None)
            existing = _segments(self.slot_dir)
            self._new_segment(max(existing[-1] if existing else 0,
                                  cursor[0] if cursor else 0) + 1)
        except BaseException:
            self.close()
            raise

    def _new_segment(self, number: int) -> None:
        path = self.slot_dir / _segment_name(number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.segment, self._size = fd, number, 0

    async def accept(self, delivery: Delivery) -> bool:
        """True once a new delivery is in the journal; False for a redelivery."""
        delivery_id = delivery[0]
        earlier = self._inflight.get(delivery_id)
        if earlier is not None:
            # The same id twice in one pass: a redelivery of the first, if the first is taken.
            await asyncio.shield(earlier)
            return False
        if delivery_id in self._recent:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((delivery, self._clock(), future))
        self._inflight[delivery_id] = future
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Everything this pass of the loop accepts goes out in one write.
            asyncio.get_running_loop().call_soon(self.flush)
        return await future

    def _remember_id(self, delivery_id: str) -> None:
        self._recent.add(delivery_id)
        self._order.append(delivery_id)
        if len(self._order) > self._remember:
            self._recent.discard(self._order.popleft())

    def flush(self) -> None:
        """Write what was accepted since the last flush; settle its callers."""
        self._flush_scheduled = False
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        try:
            if self._fd is None:
                raise OSError("the journal is closed")
            new, records = [], []
            refused: set[str] = set()
            for delivery, received_at, future in waiting:
                try:
                    records.append(encode(delivery, received_at))
                except UnicodeError as exc:  # a field JSON cannot hold (a lone surrogate)
                    refused.add(delivery[0])
                    if not future.done():
                        future.set_exception(exc)  # its caller answers 400 and logs it
                    else:  # its caller went away: nobody else would say
                        log.warning("delivery %s: not journaled (%s)", delivery[0], exc)
                    continue
                new.append(delivery)
            if records:
                self._write_all(records)
        except OSError as exc:
            self._failed(waiting, exc)
            return
        finally:
            for delivery, _, _ in waiting:
                self._inflight.pop(delivery[0], None)
        for delivery, _, future in waiting:
            if delivery[0] in refused:
                continue  # not written: a redelivery that can be recorded is taken
            if future.done():  # a caller that went away
                self._remember_id(delivery[0])  # written all the same
                continue
            self._remember_id(delivery[0])
            future.set_result(True)
        if self._size >= self.segment_bytes and self.segment is not None:
            try:
                self._new_segment(self.segment + 1)
            except OSError as exc:  # the next flush writes to the old one, or fails
                log.error("journal: no new segment (%s)", exc)
        if new and self.on_write is not None:
            self.on_write()

    def _failed(self, waiting: list[tuple[Delivery, float, asyncio.Future[bool]]],
                error: Exception) -> None:
        log.error("journal: %d deliveries could not be written (%s); they are answered with "
                  "an error, so GitHub shows them as failed and they can be redelivered",
                  len(waiting), error)
        for _, _, future in waiting:
            if not future.done():
                future.set_exception(error)
        if isinstance(error, OSError):
            # A failed write may have left part of a record: nothing goes after it.
            with contextlib.suppress(OSError):
                if self._fd is not None and self.segment is not None:
                    self._new_segment(self.segment + 1)

    def _write_all(self, chunks: list[bytes]) -> None:
        assert self._fd is not None
        total = sum(len(c) for c in chunks)
        written = os.writev(self._fd, chunks)
        self._size += written
        if written < total:  # rare (a signal, a full disk): the rest, one chunk at a time
            data = b"".join(chunks)[written:]
            while data:
                n = os.write(self._fd, data)
                self._size += n
                data = data[n:]

    def close_segment(self) -> None:
        """Write what is pending and stop writing; the slot stays held."""
        if self._waiting:
            self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Let go of the slot: another receiver may take it, an ingester may read it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        self.close_segment()
        self.release()


# -- the ingester ----------------------------------------------------------------------------


def cursor_name(slot: int) -> str:
    return f"journal:{slot}"


def _parse_cursor(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    try:
        segment, offset = value.split(":")
        return int(segment), int(offset)
    except ValueError:
        return None


class SlotReader:
    """Reads one slot's segments in order into the store, from where its cursor says, keeping
    its place (open segment, offset, a record not yet complete) between passes."""

    def __init__(self, store: Store, slot_dir: Path, slot: int) -> None:
        self.store = store
        self.slot_dir = slot_dir
        self.slot = slot
        self.name = cursor_name(slot)
        self._segment: int | None = None
        self._offset = 0
        self._file: Any = None
        self._buffer = b""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _start(self) -> bool:
        """Open the segment the cursor points into (or the first one after it)."""
        segments = _segments(self.slot_dir)
        cursor = _parse_cursor(self.store.get_cursor(self.name))
        for number in segments:
            if cursor is not None and number < cursor[0]:
                continue  # read already: kept for its bodies (release_segments)
            offset = cursor[1] if cursor is not None and number == cursor[0] else 0
            try:
                self._file = open(self.slot_dir / _segment_name(number), "rb")  # noqa: SIM115
            except FileNotFoundError:
                continue
            self._file.seek(offset)
            self._segment, self._offset, self._buffer = number, offset, b""
            return True
        return False

    def read(self, *, owned: bool) -> int:
        """Record what the journal has that is complete; the number of new deliveries.
        ``owned``: the slot's receiver is alive, so its newest segment may still grow (and an
        incomplete record at its end is being written)."""
        recorded = 0
        while True:
            if self._file is None and not self._start():
                return recorded
            recorded += self._read_to_end(complete=False)
            assert self._segment is not None
            newer = [n for n in _segments(self.slot_dir) if n > self._segment]
            if not newer and owned:
                return recorded
            # Never written again (its receiver moved on, or is gone): read what came last,
            # then go on from the next segment.
            recorded += self._read_to_end(complete=True)
            path = self.slot_dir / _segment_name(self._segment)
            if self._buffer:
                log.warning("journal: %s ends with %d bytes of a record cut short (a receiver "
                            "that stopped while writing it, before it answered)", path,
                            len(self._buffer))
            self.close()
            # Kept while its bodies are the jobs' payloads: release_segments deletes it.
            self.store.set_cursor(self.name, f"{newer[0] if newer else self._segment + 1}:0")
            if not newer:
                return recorded

    def _read_to_end(self, *, complete: bool) -> int:
        assert self._file is not None and self._segment is not None
        recorded = 0
        while True:
            chunk = self._file.read(4 * 1024 * 1024)
            if not chunk and not (complete and self._buffer):
                return recorded
            self._buffer += chunk
            records, end, corrupt = read_records(self._buffer, self._offset)
            for start in range(0, len(records), INGEST_BATCH):
                recorded += self._record(records[start:start + INGEST_BATCH])
            self._buffer = self._buffer[end - self._offset:]
            self._offset = end
            if corrupt is not None and complete:
                path = self.slot_dir / _segment_name(self._segment)
                log.error("journal: %s: %s; the rest of it is not read (kept as %s.corrupt)",
                          path, corrupt, path.name)
                with contextlib.suppress(OSError):
                    os.link(path, path.with_name(path.name + ".corrupt"))
                self._buffer = b""
                self._file.seek(0, os.SEEK_END)
                return recorded
            if not chunk:
                return recorded


    def _record(self, batch: list[Record]) -> int:
        cursor = (self.name, f"{self._segment}:{batch[-1].end}")
        # The bodies stay in the segment until their jobs are done (release_segments).
        refs = [f"{self.slot}/{self._segment}:{r.end - len(r.delivery[5])}:"
                f"{len(r.delivery[5])}" for r in batch]
        try:
            return sum(self.store.ingest([r.delivery for r in batch],
                                         [r.received_at for r in batch], cursor, refs))
        except sqlite3.OperationalError:
            raise  # busy, disk: the whole pass is tried again
        except Exception:
            if len(batch) == 1:
                # A record the ledger cannot take: kept in no table, so it is said loudly,
                # and the journal goes on past it rather than stopping every later delivery.
                log.exception("journal: delivery %s (%s) cannot be recorded; skipped",
                              batch[0].delivery[0], self.slot_dir / _segment_name(
                                  self._segment or 0))
                self.store.ingest([], [], cursor)
                return 0
        return sum(self._record([record]) for record in batch)


def release_segments(store: Store, slot_dir: Path, slot: int,
                     retain_seconds: float = RETAIN_SECONDS) -> int:
    """Delete the slot's segments that are read and whose bodies no job waits for; copy into
    the store the bodies of jobs still waiting in a read segment last written more than
    ``retain_seconds`` ago (a worker that is down or far behind must not keep the journal
    growing), then delete it. Returns how many segments went."""
    cursor = _parse_cursor(store.get_cursor(cursor_name(slot)))
    if cursor is None:
        return 0
    released = 0
    for number in _segments(slot_dir):
        if number >= cursor[0]:
            break  # being read, or not yet
        path = slot_dir / _segment_name(number)
        if store.journal_waits(slot, number):
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                continue
            if age < retain_seconds:
                continue
            waiting = store.journal_waiting(slot, number)
            bodies = []
            for delivery_id, ref in waiting:
                try:
                    body = read_journal_body(slot_dir.parent.parent, ref)
                except (OSError, ValueError) as exc:
                    # Cut short (a power loss: segments are not synced): the loss is said
                    # once, the row no longer points here, and its job fails when it runs.
                    log.error("journal: the body of delivery %s could not be read from %s "
                              "(%s); its job will fail", delivery_id, path, exc)
                    body = b""
                bodies.append((delivery_id, ref, body))
            store.keep_bodies(bodies)
            log.info("journal: %s read %.0f s ago; the bodies of %d job(s) not done yet copied "
                     "into the store", path, age, len(bodies))
            if store.journal_waiting(slot, number):
                continue  # a new job appeared meanwhile: next time
        _remove(path)
        released += 1
    return released


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def ingest_slot(store: Store, slot_dir: Path, slot: int, *, owned: bool) -> int:
    """Read a slot's journal into the store once (see ``SlotReader``)."""
    reader = SlotReader(store, slot_dir, slot)
    try:
        return reader.read(owned=owned)
    finally:
        reader.close()


def _slots(root: Path) -> Iterator[tuple[int, Path]]:
    if not root.is_dir():
        return
    for child in sorted(root.iterdir()):
        if child.is_dir() and child.name.isdigit():
            yield int(child.name), child


def ingest_free_slots(store: Store, root: Path, own: int | None) -> int:
    """Read the journals whose receiver is gone (their lock is free): a receiver that is not
    restarted must not keep its last deliveries from the worker."""
    recorded = 0
    for slot, slot_dir in _slots(root):
        if slot == own or not _segments(slot_dir):
            continue
        fd = _try_lock(slot_dir)
        if fd is None:
            continue  # its receiver is alive: its own ingester reads it
        try:
            recorded += ingest_slot(store, slot_dir, slot, owned=False)
            release_segments(store, slot_dir, slot)
        finally:
            os.close(fd)
    return recorded


def _serve(conn: Connection, data_dir: str, max_attempts: int, slot: int) -> None:
    """The ingester process: read the journal into the store whenever told, and at least every
    ``INGEST_POLL`` seconds, until told to stop or the receiver goes away."""
    opened = open_child_store(conn, data_dir, max_attempts)  # "ready" said
    if opened is None:
        return
    store, checkpointer = opened
    root = Path(data_dir) / JOURNAL_DIR
    slot_dir = root / str(slot)
    reader = SlotReader(store, slot_dir, slot)
    next_scan = next_release = 0.0
    lock: int | None = None
    try:
        stopping = False
        while not stopping:
            started = time.monotonic()
            try:
                # The receiver writes single bytes: "n" there is more to read, "s" stop.
                if conn.poll(INGEST_POLL):
                    notes = os.read(conn.fileno(), 65536)
                    if not notes:
                        raise EOFError
                    if _STOP in notes:
                        stopping = True  # told by the receiver, which holds the slot
            except (EOFError, OSError):
                # The receiver is gone: read what it wrote, then leave; unless a new receiver
                # has the slot already (its own ingester reads it, and this one must not
                # take the segment it is writing for a finished one).
                stopping = True
                lock = _try_lock(slot_dir)
                if lock is None:
                    log.info("journal: slot %d has a new receiver; this ingester leaves", slot)
                    break
            try:
                reader.read(owned=not stopping)
                if time.monotonic() >= next_release or stopping:
                    release_segments(store, slot_dir, slot)
                    next_release = time.monotonic() + RELEASE_SECONDS
                if time.monotonic() >= next_scan or stopping:
                    ingest_free_slots(store, root, slot)
                    next_scan = time.monotonic() + SCAN_SECONDS
            except Exception:
                # The journal keeps it all; the next pass tries again from the cursor.
                log.exception("journal: ingest failed; retrying")
                reader.close()
                reader = SlotReader(store, slot_dir, slot)
                time.sleep(INGEST_POLL)
            # Under load, fewer and larger transactions: the worker polls every 0.2 s anyway.
            rest = started + INGEST_INTERVAL - time.monotonic()
            if rest > 0 and not stopping:
                time.sleep(rest)
    finally:
        if lock is not None:
            os.close(lock)
        reader.close()
        checkpointer.stop()
        store.close()


class Ingester:
    """The child process that reads the receiver's journal into the store."""

    def __init__(self, data_dir: Path, max_attempts: int, slot: int) -> None:
        self._conn, child, self._process = spawn(_serve, (str(data_dir), max_attempts, slot),
                                                 "dejafix-ingester")
        self._gone = False
        try:
            self._process.start()
            child.close()
            if not self._conn.poll(START_TIMEOUT):
                raise RuntimeError(f"the ingester did not start in {START_TIMEOUT:g} s")
            kind, error = self._conn.recv()
            if kind != "ready":
                raise RuntimeError(f"the ingester could not open the store: {error}")
        except BaseException:
            child.close()
            self.close()
            raise
        # From here on the loop only tells it there is more: a write that would wait (the
        # child is behind, its pipe full of such notes) is dropped, since it reads it all.
        os.set_blocking(self._conn.fileno(), False)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._gone and self._process.is_alive()

    def notify(self) -> None:
        if self._gone:
            return
        try:
            # One byte: written whole or not at all, so the stream never holds half a note.
            os.write(self._conn.fileno(), _MORE)
        except BlockingIOError:
            pass
        except OSError as exc:
            self._gone = True
            log.error("journal: the ingester process went away (%s)", exc)

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Let it read what is written, then stop it (in a thread: it may take seconds)."""
        if not self._gone:
            with contextlib.suppress(OSError, ValueError):
                os.set_blocking(self._conn.fileno(), True)
                os.write(self._conn.fileno(), _STOP)
        self._gone = True
        with contextlib.suppress(OSError):
            self._conn.close()
        if self._process.pid is None:
            return
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("journal: the ingester did not finish in %g s; killed (the next start "
                        "reads the rest)", timeout)
            self._process.kill()
            self._process.join()


class ReceiverIntake:
    """A receiver's journal and its ingester, started and stopped together; an ingester that
    dies is started again (the journal keeps every delivery meanwhile)."""

    def __init__(self, data_dir: Path, db_path: Path, max_attempts: int) -> None:
        self.data_dir = data_dir
        self.max_attempts = max_attempts
        self.journal = Journal(data_dir, db_path)
        self.journal.on_write = self._notify
        self.ingester: Ingester | None = None
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.journal.open)
        try:
            await asyncio.to_thread(self._start_ingester)
        except BaseException:
            await asyncio.to_thread(self.journal.close)
            raise
        self._watch_task = asyncio.create_task(self._watch(), name="dejafix-ingester-watch")

    def _start_ingester(self) -> None:
        assert self.journal.slot is not None
        self.ingester = Ingester(self.data_dir, self.max_attempts, self.journal.slot)

    async def accept(self, delivery: Delivery) -> bool:
        return await self.journal.accept(delivery)

    def _notify(self) -> None:
        if self.ingester is not None:
            self.ingester.notify()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            if self.ingester is not None and self.ingester.alive:
                continue
            log.error("journal: the ingester process is gone; starting another (deliveries "
                      "are still journaled meanwhile)")
            try:
                if self.ingester is not None:
                    await asyncio.to_thread(self.ingester.close, 0.0)
                await asyncio.to_thread(self._start_ingester)
            except Exception as exc:
                log.error("journal: no ingester (%s); trying again in %g s", exc,
                          WATCH_SECONDS)
                self.ingester = None

    def status(self) -> dict[str, Any]:
        return {"slot": self.journal.slot, "segment": self.journal.segment,
                "ingester": "running" if self.ingester is not None and self.ingester.alive
                else "down"}

    async def stop(self) -> None:
        """Write what is pending, then let the ingester read it all and stop."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        # On the loop: what is still pending is flushed here, settling its callers' futures
        # (a thread must not), and closing a file does not wait.
        self.journal.close_segment()
        try:
            if self.ingester is not None:
                # It reads the segments to their end, the last one included, while this
                # process still holds the slot: no new receiver writes there meanwhile.
                await asyncio.to_thread(self.ingester.close)
        finally:
            self.journal.release()
