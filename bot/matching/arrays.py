"""The cluster index as flat arrays: what the matcher reads, and how it goes to and from disk.

A 100,000-cluster index held as Python objects (one per cluster, with its sets, tuples and
strings) costs over a gigabyte and takes seconds of the GIL to hand from one process to another.
Held as a few dozen numpy arrays it costs a few hundred megabytes, is written by the process that
builds it and memory-mapped by the one that serves it: loading is a few ``open`` calls, and the
pages the queries never touch are never read.

Strings (terms, paths, symbols, error texts, cluster ids, the records themselves) live in
``StringTable``s: one UTF-8 blob and the offsets into it. Looking a string up by value goes
through a sorted array of 64-bit hashes, so the serving process builds no dictionary either.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Bumped whenever a field's meaning changes: an index directory written by another format is
# rebuilt, never read.
FORMAT = 4


def hash64(text: str) -> int:
    """A hash that is the same in every process (``hash()`` is salted per process)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# The same words are hashed again and again (an issue's vocabulary, and a corpus's, is mostly
# everyday words): their hashes are remembered.
hash_cached = functools.lru_cache(maxsize=1 << 16)(hash64)


def hash_all(texts: Iterable[str], *, cached: bool = False) -> np.ndarray:
    return np.fromiter(map(hash_cached if cached else hash64, texts), dtype=np.uint64)


def member(sorted_values: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``values``: whether ``sorted_values`` holds it, and at which position."""
    if len(sorted_values) == 0:
        return np.zeros(len(values), dtype=bool), np.zeros(len(values), dtype=np.int64)
    pos = np.searchsorted(sorted_values, values)
    pos[pos == len(sorted_values)] = 0
    return sorted_values[pos] == values, pos


def ranges(off: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat positions of rows ``rows`` of a CSR structure with offsets ``off``, and how many
    each row has: ``data[positions]`` is the rows' data, concatenated in the order given."""
    starts = off[rows]
    lengths = off[rows + 1] - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64), lengths
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return shift + np.arange(total, dtype=np.int64), lengths


class StringTable:
    """Strings by id: ``table[i]``; by value, with ``lookup`` (when built with ``keyed``)."""

    __slots__ = ("_blob", "_hashes", "_ids", "_off")

    def __init__(self, blob: np.ndarray, off: np.ndarray, hashes: np.ndarray | None = None,
                 ids: np.ndarray | None = None) -> None:
        self._blob = blob
        self._off = off
        self._hashes = hashes
        self._ids = ids

    @classmethod
    def build(cls, strings: Sequence[str], *, keyed: bool = False) -> StringTable:
        table = cls.from_bytes([s.encode("utf-8", "surrogatepass") for s in strings])
        if keyed:
            raw = hash_all(strings)
            order = np.argsort(raw, kind="stable")
            table._hashes = raw[order]
            table._ids = order.astype(np.int32)
        return table

    @classmethod
    def from_bytes(cls, encoded: Sequence[bytes]) -> StringTable:
        off = np.zeros(len(encoded) + 1, dtype=np.int64)
        if encoded:
            np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)),
                      out=off[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), off)

    def __len__(self) -> int:
        return len(self._off) - 1

    def __getitem__(self, i: int) -> str:
        return self.raw(i).decode("utf-8", "surrogatepass")

    def digest(self) -> str:
        """Of every string, in order."""
        digest = hashlib.sha256(np.ascontiguousarray(self._off).data)
        digest.update(np.ascontiguousarray(self._blob).data)  # no copy of the records
        return digest.hexdigest()

    def raw(self, i: int) -> bytes:
        return self._blob[int(self._off[i]) : int(self._off[i + 1])].tobytes()

    def lookup_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """The id of each hashed string, -1 where the table does not hold it."""
        if self._hashes is None or self._ids is None:
            raise TypeError("this table was built without keys")
        out = np.full(len(hashes), -1, dtype=np.int64)
        found, pos = member(self._hashes, hashes)
        out[found] = self._ids[pos[found]]
        return out

    def lookup(self, strings: Sequence[str]) -> np.ndarray:
        return self.lookup_hashes(hash_all(strings, cached=True))

    def get(self, text: str) -> int:
        return int(self.lookup_hashes(np.array([hash_cached(text)], dtype=np.uint64))[0])

    def parts(self) -> dict[str, np.ndarray]:
        out = {"blob": self._blob, "off": self._off}
        if self._hashes is not None and self._ids is not None:
            out["hashes"] = self._hashes
            out["ids"] = self._ids
        return out

    @classmethod
    def from_parts(cls, parts: dict[str, np.ndarray]) -> StringTable:
        return cls(parts["blob"], parts["off"], parts.get("hashes"), parts.get("ids"))


class HashKeys:
    """A set of strings known only by their 64-bit hashes, sorted: the id of a string is the
    position of its hash. Terms and symbols need nothing else (the strings an issue shares with a
    cluster are the issue's own), and hashes can be computed wherever a cluster is read, so a
    build needs no dictionary of every word. Two strings with one hash would count as one: at a
    million distinct terms, a chance of about one in thirty million."""

    __slots__ = ("hashes",)

    def __init__(self, hashes: np.ndarray) -> None:
        self.hashes = hashes

    def __len__(self) -> int:
        return len(self.hashes)

    def lookup(self, strings: Sequence[str]) -> np.ndarray:
        """The id of each string, -1 where it is not in the set."""
        out = np.full(len(strings), -1, dtype=np.int64)
        found, pos = member(self.hashes, hash_all(strings, cached=True))
        out[found] = pos[found]
        return out

    def get(self, text: str) -> int:
        return int(self.lookup([text])[0])


@dataclasses.dataclass
class IndexArrays:
    """Everything a ``Matcher`` needs, for ``n`` clusters. CSR pairs ``*_off`` / data: row ``i``
    of ``x`` is ``x[x_off[i]:x_off[i + 1]]``."""

    n: int
    default_idf: float
    repos: list[str]
    # Vocabulary: term ids by value, the idf of each.
    terms: HashKeys
    idf: np.ndarray
    # Postings (term -> clusters, ascending) and their BM25F weight; the same per cluster.
    post_off: np.ndarray
    post_ids: np.ndarray
    post_vals: np.ndarray
    # For each common term, the postings it weighs most in, strongest first (empty otherwise).
    impact_off: np.ndarray
    impact_ids: np.ndarray
    impact_vals: np.ndarray
    fwd_off: np.ndarray
    fwd_ids: np.ndarray
    fwd_vals: np.ndarray
    # Titles (label, then each member title): distinct token ids, the idf sum of each title.
    title_off: np.ndarray  # cluster -> titles
    tok_off: np.ndarray  # title -> tokens
    tok_ids: np.ndarray
    title_total: np.ndarray
    # Files the fixes changed: ids into ``paths``; per path, its weakness (tests, docs...),
    # the document frequency of its basename, and paths by their last component.
    file_off: np.ndarray
    file_ids: np.ndarray
    paths: StringTable
    path_weak: np.ndarray
    path_base_df: np.ndarray
    last_parts: StringTable
    last_off: np.ndarray
    last_paths: np.ndarray
    # Symbols: per cluster, ids of the lower-cased name and of the spelling shown.
    sym_off: np.ndarray
    sym_low: np.ndarray
    sym_shown: np.ndarray
    symbols_low: HashKeys
    symbols_shown: StringTable
    sym_weight: np.ndarray  # per lower-cased symbol: specificity x rarity / clusters naming it
    # Error texts (six characters or more).
    err_off: np.ndarray
    err_ids: np.ndarray
    errors: StringTable
    # Issue and PR numbers the cluster names.
    num_off: np.ndarray
    nums: np.ndarray
    # Per cluster.
    landed: np.ndarray
    stale: np.ndarray
    repo_ids: np.ndarray
    public_ids: StringTable
    # Members as ``number * 2 + is_pr``, sorted, with their cluster; landed fix PRs the same.
    member_keys: np.ndarray
    member_docs: np.ndarray
    fix_keys: np.ndarray
    fix_docs: np.ndarray
    records: StringTable  # each cluster's record as JSON
    # A digest of the records, in order: an unchanged repository keeps its built index.
    fingerprint: str = ""
    # Facets (bot/matching/facets.py): per cluster, the term ids of the facet values it is
    # tagged with, sorted; and the term ids of every facet value, sorted.
    facet_off: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(1, np.int64))
    facet_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    facet_terms: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def nbytes(self) -> int:
        """What the arrays hold, in bytes (mapped ones too: their pages are read as queried)."""
        total = 0
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, HashKeys):
                total += value.hashes.nbytes
            elif isinstance(value, StringTable):
                total += sum(a.nbytes for a in value.parts().values())
            elif isinstance(value, np.ndarray):
                total += value.nbytes
        return total

    # --- on disk ------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """One ``.npy`` per array and a ``meta.json``; written to a temporary name and renamed,
        so a reader never sees half an index."""
        tmp = directory.with_name(directory.name + ".tmp")
        if tmp.exists():  # left by a writer that was killed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        meta: dict[str, Any] = {"format": FORMAT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, HashKeys):
                meta.setdefault("keys", []).append(f.name)
                np.save(tmp / f"{f.name}.hashes.npy", value.hashes)
            elif isinstance(value, StringTable):
                meta.setdefault("tables", []).append(f.name)
                for part, arr in value.parts().items():
                    np.save(tmp / f"{f.name}.{part}.npy", arr)
            elif isinstance(value, np.ndarray):
                meta.setdefault("arrays", []).append(f.name)
                np.save(tmp / f"{f.name}.npy", value)
            elif value is not None:
                meta[f.name] = value
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        for file in tmp.iterdir():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, directory)

    @classmethod
    def load(cls, directory: Path) -> IndexArrays:
        """Memory-mapped: nothing is read until a query touches it. The arrays are plain
        ``ndarray`` views of the maps: ``np.memmap`` runs Python code on every slice, which a
        query takes hundreds of."""
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{directory}: index format {meta.get('format')}, expected {FORMAT}")
        values: dict[str, Any] = {}
        tables = set(meta.get("tables", []))
        keys = set(meta.get("keys", []))
        arrays = set(meta.get("arrays", []))
        for f in dataclasses.fields(cls):
            if f.name in keys:
                values[f.name] = HashKeys(_mapped(directory / f"{f.name}.hashes.npy"))
            elif f.name in tables:
                parts = {}
                for part in ("blob", "off", "hashes", "ids"):
                    file = directory / f"{f.name}.{part}.npy"
                    if file.exists():
                        parts[part] = _mapped(file)
                values[f.name] = StringTable.from_parts(parts)
            elif f.name in arrays:
                file = directory / f"{f.name}.npy"
                if not file.exists():
                    raise ValueError(f"{directory}: {file.name} is missing")
                values[f.name] = _mapped(file)
            elif f.name in meta:
                values[f.name] = meta[f.name]
        return cls(**values)


def _mapped(file: Path) -> np.ndarray:
    array = np.load(file, mmap_mode="r")
    return array.view(np.ndarray) if isinstance(array, np.memmap) else array
