"""Building the index: each cluster is read once, as it is loaded, into flat arrays.

``IndexBuilder.add`` takes one validated cluster, extracts what matching needs (weighted terms,
title tokens, files, symbols, errors, numbers) as ids into shared tables, appends them, and keeps
the record as JSON; the ``Cluster`` object can be dropped at once. So a build holds no more than
one cluster object at a time, whatever the number of clusters, and ``finish`` turns the columns
into ``IndexArrays`` with a handful of numpy passes.
"""

from __future__ import annotations

import gc
import math
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import TypeVar

import numpy as np

from bot.clusters.models import Cluster
from bot.matching import facets
from bot.matching.arrays import HashKeys, IndexArrays, StringTable, hash_cached, ranges
from bot.matching.evidence import extract_cluster_evidence, is_weak_file
from bot.matching.facets import facet_candidates
from bot.matching.text import clean_title, tokens

_K1 = 1.2
_B = 0.6
# Field weights of BM25F: a word in a title or label says more than one in a summary.
_W_TITLE = 2.0
_W_SUMMARY = 1.0
_W_FILE = 1.0
_WEAK_FILE = 0.3

# IDF is computed as if the index held at least this many clusters, the missing ones sharing no
# word with the rest. A new installation with a handful of clusters would otherwise see every
# word as common (with 3 clusters a word in one of them gets an IDF of 1, not 5), and the
# calibration, fitted on a few hundred clusters, would keep it silent on obvious duplicates.
_MIN_COLLECTION = 50

_T = TypeVar("_T")

# A term in more than this share of the clusters (and more than _COMMON_MIN of them) is common:
# the matcher's first stage skips it (see bot/matching/scoring.py), and the index keeps, for it,
# the _IMPACT clusters it weighs most in (their titles and labels say it), for an issue whose
# title says it.
_COMMON_SHARE = 0.02
_COMMON_MIN = 2000


# How many of those a common term keeps: ten shortlists' worth is plenty to bring in the
# look-alikes of a generic title, and every one of them costs each query that says the term.
_IMPACT = 400


def common_df(n: int) -> float:
    """The document frequency above which a term is common in an index of ``n`` clusters."""
    return max(_COMMON_MIN, _COMMON_SHARE * n)


def idf_of(n: int, df: int) -> float:
    n = max(n, _MIN_COLLECTION)
    return math.log(1.0 + (n - df + 0.5) / (df + 0.5))


class _Ids:
    """Strings to dense ids, in first-seen order."""

    __slots__ = ("ids", "strings")

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.strings: list[str] = []

    def __call__(self, text: str) -> int:
        i = self.ids.get(text)
        if i is None:
            i = self.ids[text] = len(self.strings)
            self.strings.append(text)
        return i


def _np(buf: array, dtype: type) -> np.ndarray:  # type: ignore[type-arg]
    return np.frombuffer(buf, dtype=dtype) if len(buf) else np.zeros(0, dtype=dtype)


class _Column:
    """A CSR column under construction: flat values and how many each cluster has."""

    __slots__ = ("counts", "values")

    def __init__(self, code: str) -> None:
        self.values = array(code)
        self.counts = array("i")

    def add(self, values: Iterable[int | float]) -> None:
        before = len(self.values)
        self.values.extend(values)  # type: ignore[arg-type]
        self.counts.append(len(self.values) - before)

    def add_bytes(self, packed: bytes) -> None:
        self.values.frombytes(packed)
        self.counts.append(len(packed) // self.values.itemsize)

    def keep(self, alive: np.ndarray | None) -> np.ndarray | None:
        """Which flat values belong to live clusters (None: all of them)."""
        return None if alive is None else np.repeat(alive, _np(self.counts, np.intc))

    def finish(self, alive: np.ndarray | None, dtype: type) -> tuple[np.ndarray, np.ndarray]:
        values = _np(self.values, dtype)
        counts = _np(self.counts, np.intc).astype(np.int64)
        if alive is not None:
            values = values[self.keep(alive)]
            counts = counts[alive]
        return _offsets(counts), np.array(values)


def _offsets(counts: np.ndarray) -> np.ndarray:
    off = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    return off


@dataclass(slots=True)
class Extract:
    """What the index keeps of one cluster, as plain values: computed by ``extract`` wherever
    the cluster was validated (possibly another process), then ``IndexBuilder.insert``-ed.
    Terms and symbols travel as their 64-bit hashes (``arrays.HashKeys``), packed: putting a
    cluster into the index is then appending bytes, with no lookup per word."""

    key: tuple[str, str]
    term_hashes: bytes  # distinct terms, in first-seen order (uint64 each)
    weights: bytes  # the BM25F term frequency of each (float64 each)
    length: float  # their sum
    title_hashes: bytes  # the distinct tokens of each non-empty title, one title after another
    title_lengths: tuple[int, ...]  # tokens per title
    files: tuple[str, ...]
    sym_hashes: bytes  # symbols by lower-cased name (uint64 each)...
    sym_lengths: tuple[int, ...]  # ...the length of that name...
    sym_shown: tuple[str, ...]  # ...and the spelling shown (the last one seen)
    errors: tuple[str, ...]
    numbers: tuple[int, ...]
    members: tuple[int, ...]  # number * 2 + is_pr
    issues: tuple[int, ...]  # member issue numbers
    landed_pr: int
    landed: bool
    stale: bool
    reverted: bool
    record: bytes
    facet_hashes: bytes = b""  # the words the cluster is tagged with (facets.py), uint64 each


# Tokens of each path, computed once per distinct path (per process).
_PATH_TERMS: dict[str, tuple[str, ...]] = {}


def extract(cluster: Cluster, record: bytes | None = None) -> Extract:
    """One cluster's terms, titles, files, symbols, errors and numbers; ``record`` is its JSON
    if the caller has it already."""
    titles_text = [clean_title(cluster.display_label)]
    titles_text.extend(clean_title(m.title) for m in cluster.members if m.title)
    titles: list[tuple[str, ...]] = []
    for text in titles_text:
        toks = tuple(dict.fromkeys(tokens(text)))
        if toks:
            titles.append(toks)
    # Counted in C, then weighted: whole-number counts times the weight are exactly the sums
    # of the weights, in the same first-seen order.
    tf = {t: c * _W_TITLE for t, c in Counter(chain.from_iterable(titles)).items()}
    for t, c in Counter(tokens(cluster.summary or "")).items():
        tf[t] = tf.get(t, 0.0) + c * _W_SUMMARY
    evidence = extract_cluster_evidence(cluster)
    for path in evidence.files:
        weight = _W_FILE * (_WEAK_FILE if path in evidence.weak_files else 1.0)
        ptoks = _PATH_TERMS.get(path)
        if ptoks is None:
            if len(_PATH_TERMS) > 1 << 17:
                _PATH_TERMS.clear()
            ptoks = _PATH_TERMS[path] = tuple(dict.fromkeys(tokens(path)))
        for t in ptoks:
            tf[t] = tf.get(t, 0.0) + weight
    if cluster.subsystem:
        for t in tokens(cluster.subsystem):
            tf[t] = tf.get(t, 0.0) + _W_SUMMARY
    shown: dict[str, str] = {}
    for sym in evidence.symbols:
        shown[sym.lower()] = sym
    pr = cluster.landed_fix.pr
    return Extract(
        key=cluster.key,
        term_hashes=array("Q", map(hash_cached, tf)).tobytes(),
        weights=array("d", tf.values()).tobytes(),
        length=sum(tf.values()),
        title_hashes=array("Q", map(hash_cached, chain.from_iterable(titles))).tobytes(),
        title_lengths=tuple(map(len, titles)),
        files=tuple(evidence.files),
        sym_hashes=array("Q", map(hash_cached, shown)).tobytes(),
        sym_lengths=tuple(map(len, shown)),
        sym_shown=tuple(shown.values()),
        errors=tuple(e for e in evidence.errors if len(e) >= 6),
        numbers=tuple(sorted(evidence.numbers)),
        members=tuple(m.number * 2 + (1 if m.is_pr else 0) for m in cluster.members),
        issues=tuple(m.number for m in cluster.members if m.kind == "issue"),
        landed_pr=pr if pr is not None else -1,
        landed=cluster.landed_fix.landed,
        stale=cluster.freshness.stale,
        reverted=cluster.landed_fix.reverted,
        record=record if record is not None
        else cluster.model_dump_json().encode("utf-8", "surrogatepass"),
        facet_hashes=array("Q", map(hash_cached, facet_candidates(cluster))).tobytes(),
    )


class IndexBuilder:
    """Clusters in, ``IndexArrays`` out. A cluster added again under the same (repo, id)
    replaces the earlier one (as the loader's "later definition wins" says) and takes its
    place at the end."""

    def __init__(self) -> None:
        self._position: dict[tuple[str, str], int] = {}
        self._dead: list[int] = []
        self._paths = _Ids()
        self._sym_shown = _Ids()
        self._errors = _Ids()
        self._repos = _Ids()
        self._public_ids: list[str] = []
        # Every record's JSON in one buffer (a list of 100,000 bytes objects, joined at the
        # end, held them twice).
        self._records = bytearray()
        self._record_ends = array("q")
        self._fwd = _Column("Q")  # term hashes
        self._fwd_tf = array("d")
        self._lengths = array("d")
        self._titles = _Column("i")  # per cluster: token counts of its titles
        self._title_toks = array("Q")  # token hashes
        self._files = _Column("i")
        self._sym_l = _Column("Q")  # lower-cased name hashes
        self._sym_len = array("i")
        self._sym_s = array("i")
        self._errs = _Column("i")
        self._nums = _Column("q")
        self._members = _Column("q")
        self._landed_pr = array("q")
        self._landed = array("b")
        self._stale = array("b")
        self._repo_ids = array("i")
        self._facets = _Column("Q")  # facet candidate hashes

    def __len__(self) -> int:
        return len(self._position)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._position

    def add(self, cluster: Cluster, record: bytes | None = None) -> None:
        """Index one cluster; ``record`` is its JSON if the caller has it already."""
        self.insert(extract(cluster, record))

    def insert(self, ex: Extract) -> None:
        key = ex.key
        earlier = self._position.get(key)
        if earlier is not None:
            self._dead.append(earlier)
        self._position[key] = len(self._public_ids)
        self._fwd.add_bytes(ex.term_hashes)
        self._fwd_tf.frombytes(ex.weights)
        self._lengths.append(ex.length)
        self._title_toks.frombytes(ex.title_hashes)
        self._titles.add(ex.title_lengths)
        self._files.add([self._paths(p) for p in ex.files])
        self._sym_l.add_bytes(ex.sym_hashes)
        self._sym_len.extend(ex.sym_lengths)
        self._sym_s.extend([self._sym_shown(s) for s in ex.sym_shown])
        self._errs.add([self._errors(e) for e in ex.errors])
        self._nums.add(ex.numbers)
        self._members.add(ex.members)
        self._landed_pr.append(ex.landed_pr)
        self._landed.append(ex.landed)
        self._stale.append(ex.stale)
        self._repo_ids.append(self._repos(key[0]))
        self._facets.add_bytes(ex.facet_hashes)
        self._public_ids.append(key[1])
        self._records += ex.record
        self._record_ends.append(len(self._records))

    def _record_table(self, alive: np.ndarray | None) -> StringTable:
        ends = _np(self._record_ends, np.int64)
        off = np.zeros(len(ends) + 1, dtype=np.int64)
        off[1:] = ends
        blob = np.frombuffer(self._records, dtype=np.uint8) if self._records \
            else np.zeros(0, dtype=np.uint8)
        if alive is None:
            return StringTable(blob, off)
        positions, lengths = ranges(off, np.flatnonzero(alive))
        return StringTable(blob[positions], _offsets(lengths))

    def finish(self) -> IndexArrays:
        """The arrays."""
        was_enabled = gc.isenabled()
        gc.disable()  # millions of small survivors: full collections would walk them all
        try:
            return self._finish()
        finally:
            if was_enabled:
                gc.enable()

    def _finish(self) -> IndexArrays:
        total = len(self._public_ids)
        alive: np.ndarray | None = None
        if self._dead:
            alive = np.ones(total, dtype=bool)
            alive[self._dead] = False
        n = total - len(self._dead)

        def live(values: np.ndarray) -> np.ndarray:
            return values if alive is None else values[alive]

        def live_list(values: list[_T]) -> list[_T]:
            if alive is None:
                return values
            return [v for v, a in zip(values, alive.tolist(), strict=True) if a]

        # Terms: ids are the positions of their hashes, sorted; BM25F weights per cluster
        # (forward) and per term (postings).
        fwd_off, fwd_hashes = self._fwd.finish(alive, np.uint64)
        tf = _np(self._fwd_tf, np.float64)
        fwd_keep = self._fwd.keep(alive)
        if fwd_keep is not None:
            tf = tf[fwd_keep]
        lengths = live(_np(self._lengths, np.float64))
        term_hashes, inverse_ids = np.unique(fwd_hashes, return_inverse=True)
        fwd_ids: np.ndarray = inverse_ids.astype(np.int32).reshape(-1)
        del fwd_hashes
        n_terms = len(term_hashes)
        df = np.bincount(fwd_ids, minlength=n_terms).astype(np.int64)
        # IDF depends on the document frequency only: one log per distinct frequency, with the
        # same arithmetic as ``idf_of``.
        uniq, inverse = np.unique(df, return_inverse=True)
        idf = np.array([idf_of(n, int(c)) for c in uniq], dtype=np.float64)[inverse]
        default_idf = idf_of(n, 0)
        doc_of = np.repeat(np.arange(n, dtype=np.int32), np.diff(fwd_off))
        avg = float(lengths.mean()) if n else 1.0
        norm = _K1 * (1 - _B + _B * lengths / avg) if avg else np.full(n, _K1)
        fwd_vals = tf * (_K1 + 1) / (tf + norm[doc_of])
        order = np.argsort(fwd_ids, kind="stable")
        post_ids = doc_of[order]
        post_vals = fwd_vals[order]
        post_off = _offsets(df)
        del order, doc_of, tf
        # Common terms: the clusters each weighs most in, strongest first.
        top = _IMPACT
        impact_counts = np.zeros(n_terms, dtype=np.int64)
        impact_parts: list[np.ndarray] = []
        for tid in np.flatnonzero(df > common_df(n)).tolist():
            lo, hi = int(post_off[tid]), int(post_off[tid + 1])
            best = np.argsort(-post_vals[lo:hi], kind="stable")[:top] + lo
            impact_parts.append(best)
            impact_counts[tid] = len(best)
        impact = np.concatenate(impact_parts) if impact_parts else np.zeros(0, dtype=np.int64)

        # Titles: per cluster its titles, per title its tokens and their idf sum.
        title_off, tok_counts = self._titles.finish(alive, np.intc)
        tok_hashes = _np(self._title_toks, np.uint64)
        if alive is not None:
            title_keep = self._titles.keep(alive)
            assert title_keep is not None
            tok_hashes = tok_hashes[np.repeat(title_keep, _np(self._titles.values, np.intc))]
        # Every title token is one of its cluster's terms.
        tok_ids = np.searchsorted(term_hashes, tok_hashes).astype(np.int32)
        tok_off = _offsets(tok_counts.astype(np.int64))
        title_total = np.zeros(len(tok_counts), dtype=np.float64)
        if len(tok_ids):
            # Every stored title has at least one token, so reduceat sees no empty segment.
            title_total = np.add.reduceat(idf[tok_ids], tok_off[:-1])

        # Files: weakness per path, the document frequency of each basename, paths by their
        # last component (what an issue's path is looked up by).
        file_off, file_ids = self._files.finish(alive, np.intc)
        paths = self._paths.strings
        path_weak = np.array([is_weak_file(p) for p in paths], dtype=bool)
        bases = _Ids()
        path_base = np.array([bases(p.rsplit("/", 1)[-1]) for p in paths], dtype=np.int64)
        n_bases = max(1, len(bases.strings))
        doc_of_file = np.repeat(np.arange(n, dtype=np.int64), np.diff(file_off))
        pairs = np.unique(doc_of_file * n_bases + path_base[file_ids]) if len(file_ids) \
            else np.zeros(0, np.int64)
        base_df = np.bincount(pairs % n_bases, minlength=len(bases.strings))
        path_base_df = base_df[path_base] if len(paths) else np.zeros(0, np.int64)
        lasts = _Ids()
        last_of = np.array([lasts(last_part(p)) for p in paths], dtype=np.int64)
        last_paths = np.argsort(last_of, kind="stable")
        last_off = _offsets(np.bincount(last_of, minlength=len(lasts.strings)))

        # Symbols: the weight of each shared lower-cased name is fixed by the index.
        sym_off, sym_hashes = self._sym_l.finish(alive, np.uint64)
        sym_shown = _np(self._sym_s, np.intc)
        sym_len = _np(self._sym_len, np.intc)
        sym_keep = self._sym_l.keep(alive)
        if sym_keep is not None:
            sym_shown = sym_shown[sym_keep]
            sym_len = sym_len[sym_keep]
        low_hashes, first, inverse_low = np.unique(sym_hashes, return_index=True,
                                                   return_inverse=True)
        sym_low: np.ndarray = inverse_low.astype(np.int32).reshape(-1)
        sym_df = np.bincount(sym_low, minlength=len(low_hashes))
        # A symbol's rarity is its idf as a term (the default idf if no cluster has the term).
        pos = np.minimum(np.searchsorted(term_hashes, low_hashes), max(0, n_terms - 1))
        is_term = term_hashes[pos] == low_hashes if n_terms else np.zeros(len(pos), bool)
        term_idf = np.where(is_term, idf[pos] if n_terms else 0.0, default_idf)
        # A long identifier (``set_config_value``) names one place in the code; a short one
        # (``chat_id``) is a field every part of the code passes around.
        specificity = np.minimum(1.0, np.maximum(0.0, sym_len[first] - 4) / 10.0)
        rarity = term_idf / default_idf if default_idf else np.zeros(len(low_hashes))
        sym_weight = specificity * rarity / np.maximum(sym_df, 1)

        err_off, err_ids = self._errs.finish(alive, np.intc)
        num_off, nums = self._nums.finish(alive, np.int64)
        mem_off, mem_keys = self._members.finish(alive, np.int64)
        mem_docs = np.repeat(np.arange(n, dtype=np.int64), np.diff(mem_off))
        mem_order = np.argsort(mem_keys, kind="stable")
        landed_pr = live(_np(self._landed_pr, np.int64))
        fix_docs = np.flatnonzero(landed_pr >= 0)
        fix_keys = landed_pr[fix_docs] * 2 + 1
        fix_order = np.argsort(fix_keys, kind="stable")

        facet_off, facet_ids, facet_terms = self._facet_arrays(alive, term_hashes, df, n)

        records = self._record_table(alive)
        return IndexArrays(
            n=n,
            default_idf=default_idf,
            repos=list(self._repos.strings),
            terms=HashKeys(term_hashes),
            idf=idf,
            post_off=post_off,
            post_ids=post_ids,
            post_vals=post_vals,
            impact_off=_offsets(impact_counts),
            impact_ids=post_ids[impact],
            impact_vals=post_vals[impact],
            fwd_off=fwd_off,
            fwd_ids=fwd_ids,
            fwd_vals=fwd_vals,
            title_off=title_off,
            tok_off=tok_off,
            tok_ids=tok_ids,
            title_total=title_total,
            file_off=file_off,
            file_ids=file_ids,
            paths=StringTable.build(paths),
            path_weak=path_weak,
            path_base_df=path_base_df,
            last_parts=StringTable.build(lasts.strings, keyed=True),
            last_off=last_off,
            last_paths=last_paths,
            sym_off=sym_off,
            sym_low=sym_low,
            sym_shown=np.array(sym_shown),
            symbols_low=HashKeys(low_hashes),
            symbols_shown=StringTable.build(self._sym_shown.strings),
            sym_weight=sym_weight,
            err_off=err_off,
            err_ids=err_ids,
            errors=StringTable.build(self._errors.strings),
            num_off=num_off,
            nums=nums,
            landed=live(_np(self._landed, np.int8)).astype(bool),
            stale=live(_np(self._stale, np.int8)).astype(bool),
            repo_ids=np.array(live(_np(self._repo_ids, np.intc))),
            public_ids=StringTable.build(live_list(self._public_ids), keyed=True),
            member_keys=mem_keys[mem_order],
            member_docs=mem_docs[mem_order],
            fix_keys=fix_keys[fix_order],
            fix_docs=fix_docs[fix_order],
            records=records,
            # A repository whose records did not change keeps the index built for it.
            fingerprint=records.digest(),
            facet_off=facet_off,
            facet_ids=facet_ids,
            facet_terms=facet_terms,
        )

    def _facet_arrays(self, alive: np.ndarray | None, term_hashes: np.ndarray, df: np.ndarray,
                      n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per cluster, the term ids of the facet values it is tagged with (sorted); and every
        facet value's term id (sorted). A candidate that is not one of the index's terms (a
        file name no text says) cannot be named by an issue's words and is dropped."""
        off, hashes = self._facets.finish(alive, np.uint64)
        if not len(hashes) or not len(term_hashes):
            return np.zeros(n + 1, dtype=np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        pos = np.minimum(np.searchsorted(term_hashes, hashes), len(term_hashes) - 1)
        known = term_hashes[pos] == hashes
        doc = np.repeat(np.arange(n, dtype=np.int64), np.diff(off))
        tids = pos.astype(np.int64)
        # (cluster, term) once each, sorted by cluster then term.
        pairs = np.unique(doc[known] * len(term_hashes) + tids[known])
        pair_doc, pair_term = np.divmod(pairs, len(term_hashes))
        tagged = np.bincount(pair_term, minlength=len(term_hashes))
        vocab = np.array([t for t in np.flatnonzero(tagged).tolist()
                          if facets.is_facet(int(tagged[t]), int(df[t]), n)], dtype=np.int64)
        keep = np.isin(pair_term, vocab)
        counts = np.bincount(pair_doc[keep], minlength=n)
        return _offsets(counts), pair_term[keep].astype(np.int32), vocab.astype(np.int32)


def last_part(path: str) -> str:
    """The last non-empty component: what ``path_suffix_match`` compares first."""
    parts = [p for p in path.split("/") if p]
    return parts[-1] if parts else ""
