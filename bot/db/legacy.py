"""What an earlier Dejafix left in a SQLite data directory, read once at the upgrade.

Versions before schema step 6 kept deliveries in a journal (``<data dir>/journal/<slot>/
<segment>.log``): a payload row said where its body was (``ref``, "<slot>/<segment>:<offset>:
<length>") with an empty body, and records after a slot's cursor (``cursors``, "journal:<slot>"
= "<segment>:<offset>") had been answered 202 but not yet recorded. Both are read here, so an
upgrade loses no delivery; the journal directory is then renamed ``journal.imported``. A record
is a header (magic, version, lengths, CRC-32), a JSON array of the delivery's fields, the body.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bot import logs

log = logging.getLogger("dejafix.store")

JOURNAL_DIR = "journal"
_HEADER = struct.Struct("<3sBIII")
_MAGIC = b"DJF"

# (delivery id, event, action, repo, installation id, body)
Record = tuple[str, str, str | None, str | None, int | None, bytes]


def _segment(root: Path, slot: str, segment: int) -> Path:
    return root / slot / f"{segment:012d}.log"


def copy_bodies(conn: sqlite3.Connection, data_dir: Path) -> int:
    """Inside step 6's transaction: every body still in a journal segment, into ``payloads``.
    One that cannot be read stays empty (step 6 then keeps its job as failed, with the
    reason)."""
    root = data_dir / JOURNAL_DIR
    rows = conn.execute("SELECT delivery_id, ref FROM payloads WHERE ref IS NOT NULL"
                        " AND length(body) = 0").fetchall()
    copied = 0
    for delivery_id, ref in rows:
        try:
            where, offset, length = str(ref).rsplit(":", 2)
            slot, segment = where.split("/")
            with _segment(root, slot, int(segment)).open("rb") as fh:
                fh.seek(int(offset))
                body = fh.read(int(length))
        except (OSError, ValueError) as exc:
            log.warning("store: delivery %s: its body in the journal cannot be read (%s)",
                        delivery_id, exc)
            continue
        if len(body) == int(length):
            conn.execute("UPDATE payloads SET body = ?, ref = NULL WHERE delivery_id = ?",
                         (body, delivery_id))
            copied += 1
    return copied


def unrecorded(conn: sqlite3.Connection, data_dir: Path) -> Iterator[Record]:
    """The journal's records after each slot's cursor: accepted, never recorded."""
    root = data_dir / JOURNAL_DIR
    if not root.is_dir():
        return
    for slot_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        row = conn.execute("SELECT value FROM cursors WHERE name = ?",
                           (f"journal:{slot_dir.name}",)).fetchone()
        start_segment, start_offset = 0, 0
        if row is not None:
            try:
                seg, off = str(row[0]).split(":")
                start_segment, start_offset = int(seg), int(off)
            except ValueError:
                pass
        for path in sorted(slot_dir.glob("*.log")):
            try:
                number = int(path.stem)
            except ValueError:
                continue
            if number < start_segment:
                continue
            data = path.read_bytes()
            yield from _records(data, start_offset if number == start_segment else 0, path)


def _records(data: bytes, pos: int, path: Path) -> Iterator[Record]:
    while len(data) - pos >= _HEADER.size:
        magic, _version, meta_len, body_len, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + meta_len + body_len
        if magic != _MAGIC or end > len(data):
            if magic != _MAGIC:
                log.warning("store: %s offset %d: not a journal record; the rest is skipped",
                            path, pos)
            return
        meta = data[pos + _HEADER.size: pos + _HEADER.size + meta_len]
        body = data[pos + _HEADER.size + meta_len: end]
        pos = end
        if zlib.crc32(body, zlib.crc32(meta)) != crc:
            log.warning("store: %s: a journal record's checksum does not match; skipped", path)
            continue
        try:
            delivery_id, event, action, repo, installation_id, _received = json.loads(meta)
        except (ValueError, TypeError):
            continue
        yield delivery_id, event, action, repo, installation_id, body


def issue_number(body: bytes) -> int | None:
    """The issue (or pull request) a payload is about, as the receiver keys a new job."""
    try:
        data: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return logs.issue_number(data) if isinstance(data, dict) else None


def retire(data_dir: Path) -> None:
    """The journal has been read: renamed, kept for inspection, never read again."""
    root = data_dir / JOURNAL_DIR
    if root.is_dir():
        target = data_dir / "journal.imported"
        n = 1
        while target.exists():
            n += 1
            target = data_dir / f"journal.imported.{n}"
        root.rename(target)
        log.info("store: the journal of the earlier version was read and moved to %s", target)
