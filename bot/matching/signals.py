"""The evidence signals, each declared once: its name (the model's weight key and the feature
matrix's column), how its column is computed over a shortlist, its sign, how a maintainer reads
it (the comment's row, the page's label) and which pieces of evidence it shows.

Everything that lists signals is built from ``SIGNALS``: the matcher's feature matrix and its
``feature_names``, the model's feature set (``bot/matching/model.py``), the fit's sign constraints
and fixed weights (``bot/eval/fit.py``), the comment's evidence rows (``bot/render/comment.py``)
and the page's names (``bot/web/dashboard.py``). A new signal is a column function and an entry
here (plus a field of ``MatchEvidence`` if it shows pieces of its own), and a refitted model.

The order of ``SIGNALS`` is the order of the columns, and relevance is summed column by column in
it: a floating-point sum in another order differs in the last bits, so appending keeps every score
of the existing signals exactly as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bot.clusters.models import Cluster
from bot.matching.arrays import IndexArrays, member, ranges
from bot.matching.facets import facet_candidates

# A title word is rare (``title_miss``) when its idf is at least this share of the idf of a
# word no cluster has.
_RARE_IDF = 0.5
# Test and generated files the fix changed count this much of a file the issue names.
_WEAK_FILE = 0.3


@dataclass
class Query:
    """An issue as the index sees it: its terms with their ids and weights, and the files,
    symbols, numbers and facet values it names, resolved against the index."""

    words: list[str]  # every distinct term of the issue (body terms first)
    tids: np.ndarray  # index term id of each, -1 when the index does not have it
    coef: np.ndarray  # idf x query weight of each
    qidf_title: np.ndarray  # idf of each title term, 0 for body-only terms
    is_title: np.ndarray  # whether each term is in the title
    idf: list[float]  # of each term
    title_ids: np.ndarray  # sorted index ids of the title terms
    known: np.ndarray  # sorted index ids of all terms
    known_pos: np.ndarray  # for each of ``known``, its position in ``words``
    total: float  # sum of ``coef``: the BM25 score of a cluster that had every term
    title_total: float
    norm_text: str
    sym_ids: np.ndarray  # sorted index ids of the issue's symbols (lower-cased)
    numbers: np.ndarray  # issues and PRs it says it is the bug of ("duplicate of #N")
    numbers_against: np.ndarray  # ... that it says it is not, or not any more
    file_paths: np.ndarray  # path ids the issue's files match, sorted
    file_scores: np.ndarray  # and how specific each match is
    title_facets: np.ndarray  # sorted term ids of the facet values the issue's title names


@dataclass
class Shortlist:
    """The candidates the features are computed for, with what several signals share: which
    of the issue's terms each candidate has (``term_pos[bounds[j]:bounds[j + 1]]`` for
    candidate ``j``, in shortlist order) and where its terms are in the forward index."""

    a: IndexArrays
    q: Query
    top: np.ndarray  # cluster positions, in the order the first stage left them
    scores: np.ndarray  # the first stage's scores of every cluster
    pruned: bool  # whether the first stage left common words out
    error_weight: Callable[[int], float]  # what one of the index's error texts adds
    cluster: Callable[[int], Cluster]  # a cluster's record, by position
    # How many of a repository's bugs each of its changed files was changed by: sorted keys
    # ``repo_id * len(paths) + path_id`` and their counts (None: each counts once).
    path_df: tuple[np.ndarray, np.ndarray] | None = None
    k: int = field(init=False)
    rows: np.ndarray = field(init=False)
    fwd_idx: np.ndarray = field(init=False)
    fwd_seg: np.ndarray = field(init=False)
    hit: np.ndarray = field(init=False)
    seg_hit: np.ndarray = field(init=False)
    term_pos: np.ndarray = field(init=False)
    bounds: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        a, q = self.a, self.q
        self.k = len(self.top)
        self.rows = np.arange(self.k)
        self.fwd_idx, lengths = ranges(a.fwd_off, self.top)
        self.fwd_seg = np.repeat(self.rows, lengths)
        self.hit, pos = member(q.known, a.fwd_ids[self.fwd_idx])
        self.seg_hit = self.fwd_seg[self.hit]
        self.term_pos = q.known_pos[pos[self.hit]]
        self.bounds = np.searchsorted(self.seg_hit, np.arange(self.k + 1))

    def per_candidate(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the candidates' entries in a table with ``offsets``, and whose each is."""
        idx, lengths = ranges(offsets, self.top)
        return idx, np.repeat(self.rows, lengths)

    def own_terms(self, j: int) -> list[int]:
        """Positions in ``q.words`` of the issue's terms candidate ``j`` has."""
        return [int(p) for p in self.term_pos[self.bounds[j] : self.bounds[j + 1]]]

    @functools.cached_property
    def titles(self) -> tuple[np.ndarray, np.ndarray]:
        """How much of its best-described title each candidate's issue says (a release note's
        one-line label, fully present in the issue, is strong even without files), and the
        idf-weighted Jaccard similarity of the issue title with its closest title (shown in
        comments). A title sharing no term with the issue scores 0 on both."""
        a, q, k = self.a, self.q, self.k
        label_cov = np.zeros(k)
        title_sim = np.zeros(k)
        t_idx, t_len = ranges(a.title_off, self.top)
        if len(t_idx):
            n_titles = len(t_idx)
            tok_idx, tok_len = ranges(a.tok_off, t_idx)
            toks = a.tok_ids[tok_idx]
            tok_title = np.repeat(np.arange(n_titles), tok_len)
            tok_idf = a.idf[toks]
            in_all, _ = member(q.known, toks)
            in_title, _ = member(q.title_ids, toks)
            shared = np.bincount(tok_title, weights=in_all, minlength=n_titles) > 0
            cov = np.bincount(tok_title, weights=tok_idf * in_all, minlength=n_titles)
            inter = np.bincount(tok_title, weights=tok_idf * in_title, minlength=n_titles)
            total = a.title_total[t_idx]
            union = q.title_total + total - inter
            with np.errstate(divide="ignore", invalid="ignore"):
                best = np.where(shared & (total > 0), cov / total, 0.0)
                sim = np.where(shared & (union > 0), inter / union, 0.0)
            # Each candidate's titles are contiguous: the best of each run (every stored
            # cluster has a title, its label, unless the label has no word at all).
            has = t_len > 0
            starts = (np.cumsum(t_len) - t_len)[has]
            label_cov[has] = np.maximum.reduceat(best, starts)
            title_sim[has] = np.maximum.reduceat(sim, starts)
        return label_cov, title_sim


# --- columns -------------------------------------------------------------------------------------


def _text(s: Shortlist) -> np.ndarray:
    """The BM25F score of the issue's terms (exact: every shared term, common ones included),
    as a share of the score of a cluster that had them all."""
    q = s.q
    if s.pruned:
        bm25 = np.bincount(s.seg_hit, weights=s.a.fwd_vals[s.fwd_idx[s.hit]] * q.coef[s.term_pos],
                           minlength=s.k)
    else:
        bm25 = np.maximum(s.scores[s.top], 0.0)
    return bm25 / q.total if q.total > 0 else np.zeros(s.k)


def _title_cov(s: Shortlist) -> np.ndarray:
    """The idf-weighted share of the issue title's words that the cluster's text says."""
    q = s.q
    if q.title_total <= 0:
        return np.zeros(s.k)
    return np.bincount(s.seg_hit, weights=q.qidf_title[s.term_pos], minlength=s.k) / q.title_total


def _label_cov(s: Shortlist) -> np.ndarray:
    return s.titles[0]


def _files(s: Shortlist) -> np.ndarray:
    """Files the fix changed that the issue names, each as specific as the issue names it and
    as specific to this bug as the repository's other fixes leave it: a file that many of its
    bugs' fixes changed (the connector, the parser) says little about which bug this is."""
    q = s.q
    if not len(q.file_paths):
        return np.zeros(s.k)
    idx, seg = s.per_candidate(s.a.file_off)
    pids = s.a.file_ids[idx]
    found, where = member(q.file_paths, pids)
    w = np.where(found, q.file_scores[where], 0.0)
    w = np.where(s.a.path_weak[pids], w * _WEAK_FILE, w)
    if s.path_df is not None and found.any():
        keys, counts = s.path_df
        pair = s.a.repo_ids[s.top[seg]].astype(np.int64) * len(s.a.paths) + pids
        at = np.minimum(np.searchsorted(keys, pair), len(keys) - 1)
        df = np.where(keys[at] == pair, counts[at], 1)
        w = w / np.sqrt(np.maximum(df, 1))
    return np.minimum(1.0, np.bincount(seg, weights=w, minlength=s.k))


def _symbols(s: Shortlist) -> np.ndarray:
    """Functions, classes and error types the issue names that the fix's code has."""
    if not len(s.q.sym_ids):
        return np.zeros(s.k)
    idx, seg = s.per_candidate(s.a.sym_off)
    lows = s.a.sym_low[idx]
    found, _ = member(s.q.sym_ids, lows)
    return np.minimum(1.0, np.bincount(seg, weights=s.a.sym_weight[lows] * found,
                                       minlength=s.k))


def _errors(s: Shortlist) -> np.ndarray:
    """Error texts of the bug's reports that the issue quotes."""
    idx, seg = s.per_candidate(s.a.err_off)
    if not len(idx):
        return np.zeros(s.k)
    eids = s.a.err_ids[idx]
    weight = {e: s.error_weight(e) for e in set(eids.tolist())}
    w = np.array([weight[e] for e in eids.tolist()], dtype=np.float64)
    return np.minimum(1.0, np.bincount(seg, weights=w, minlength=s.k))


def _cited(s: Shortlist, numbers: np.ndarray) -> np.ndarray:
    """1 where the issue cites one of the cluster's issues or PRs among ``numbers``."""
    if not len(numbers):
        return np.zeros(s.k)
    idx, seg = s.per_candidate(s.a.num_off)
    found, _ = member(numbers, s.a.nums[idx])
    return (np.bincount(seg, weights=found, minlength=s.k) > 0).astype(np.float64)


def _ref(s: Shortlist) -> np.ndarray:
    """1 where the issue says it is the bug of one of the cluster's issues or PRs ("duplicate
    of #N", "closes #N"; bot/matching/citations.py)."""
    return _cited(s, s.q.numbers)


def _ref_against(s: Shortlist) -> np.ndarray:
    """1 where the issue cites one of the cluster's issues or PRs as another bug, as what is
    left of it, or as a fix that failed ("distinct from #N", "follow-up to #N")."""
    return _cited(s, s.q.numbers_against)


def _facet_conflict(s: Shortlist) -> np.ndarray:
    """1 where the issue's title names a facet value (a platform, a provider, a component)
    that the cluster never says, while the cluster is tagged with one the issue never says:
    the same symptom somewhere else."""
    a, q, k = s.a, s.q, s.k
    if not len(q.title_facets) or not len(a.facet_ids):
        return np.zeros(k)
    # Issue title facets the cluster's text says.
    said, _ = member(q.title_facets, a.fwd_ids[s.fwd_idx])
    explained = np.bincount(s.fwd_seg, weights=said, minlength=k)
    issue_only = explained < len(q.title_facets)
    # Cluster tags the issue's text (title or body) never says.
    idx, seg = s.per_candidate(a.facet_off)
    in_issue, _ = member(q.known, a.facet_ids[idx])
    cluster_only = np.bincount(seg, weights=~in_issue, minlength=k) > 0
    return (issue_only & cluster_only).astype(np.float64)


def _title_miss(s: Shortlist) -> np.ndarray:
    """The share of the title's rare words (by idf) the cluster never says: a look-alike shares
    the common part of a title and misses what is particular. Only words some cluster says
    count: in a small index every unseen word is "rare", and a word no cluster explains tells
    one cluster from another not at all."""
    q = s.q
    rare = np.where((q.qidf_title >= _RARE_IDF * s.a.default_idf) & (q.tids >= 0),
                    q.qidf_title, 0.0)
    rare_total = float(rare.sum())
    if rare_total <= 0:
        return np.zeros(s.k)
    return 1.0 - np.bincount(s.seg_hit, weights=rare[s.term_pos], minlength=s.k) / rare_total


# --- pieces: what a candidate shares with the issue, for the comment ---------------------------


def _shared_terms(s: Shortlist, j: int, value: float) -> dict[str, list[str]]:
    """The twelve strongest shared terms, by idf, then the term itself: set order changes
    between processes, comments must not."""
    q = s.q
    strongest = sorted(s.own_terms(j), key=lambda p: (-q.idf[p], q.words[p]))[:12]
    return {"matched_terms": [q.words[p] for p in strongest]}


def _shared_files(s: Shortlist, j: int, value: float) -> dict[str, list[str]]:
    a, i = s.a, int(s.top[j])
    found: list[str] = []
    if len(s.q.file_paths):
        for pid in a.file_ids[a.file_off[i] : a.file_off[i + 1]].tolist():
            if member(s.q.file_paths, np.array([pid]))[0][0]:
                found.append(a.paths[pid])
    return {"shared_files": found}


def _shared_symbols(s: Shortlist, j: int, value: float) -> dict[str, list[str]]:
    a, i = s.a, int(s.top[j])
    if not len(s.q.sym_ids):
        return {"shared_symbols": []}
    lo, hi = a.sym_off[i], a.sym_off[i + 1]
    found, _ = member(s.q.sym_ids, a.sym_low[lo:hi])
    return {"shared_symbols": sorted(a.symbols_shown[int(x)]
                                     for x in a.sym_shown[lo:hi][found].tolist())}


def _shared_errors(s: Shortlist, j: int, value: float) -> dict[str, list[str]]:
    a, i = s.a, int(s.top[j])
    return {"shared_errors": [a.errors[e] for e in a.err_ids[a.err_off[i] : a.err_off[i + 1]]
                              .tolist() if s.error_weight(e) > 0]}


def _conflicting_facets(s: Shortlist, j: int, value: float) -> dict[str, list[str]]:
    """The facet values the issue's title names that the cluster never says, and those the
    cluster is tagged with that the issue never says."""
    if not value:
        return {}
    a, q, i = s.a, s.q, int(s.top[j])
    mine_terms = a.fwd_ids[a.fwd_off[i] : a.fwd_off[i + 1]]
    said, _ = member(np.sort(mine_terms), q.title_facets)
    tags = a.facet_ids[a.facet_off[i] : a.facet_off[i + 1]]
    in_issue, _ = member(q.known, tags)
    word = {int(t): q.words[int(p)] for t, p in zip(q.known.tolist(), q.known_pos.tolist(),
                                                    strict=True)}
    return {"issue_facets": sorted(word[int(t)] for t in q.title_facets[~said].tolist()),
            "cluster_facets": sorted(_term_names(s, i, tags[~in_issue]))}


def _term_names(s: Shortlist, i: int, term_ids: np.ndarray) -> list[str]:
    """The words of some of cluster ``i``'s facet term ids (the index keeps terms by hash
    only): its tags came from its own record, so they are read from there."""
    wanted = set(term_ids.tolist())
    found: dict[int, str] = {}
    for text in facet_candidates(s.cluster(i)):
        tid = s.a.terms.get(text)
        if tid in wanted:
            found.setdefault(tid, text)
    return [found[t] for t in term_ids.tolist() if t in found]


# --- the registry --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signal:
    name: str
    column: Callable[[Shortlist], np.ndarray]
    # What a maintainer reads for this signal's part of the score (the page, "against").
    label: str
    # The row of the comment's evidence table it counts in (signals sharing a row add their
    # weights up); None: never shown there (evidence against a match is not in that table).
    row: str | None
    # Evidence against a match: its fitted weight may only be negative (every other one only
    # positive: agreement that noise in a small set would make count against is set to 0).
    against: bool = False
    # The ``MatchEvidence`` field listing what the candidate shares with the issue (the row's
    # pieces), and how many of them the comment shows.
    pieces: str | None = None
    shown: int = 0
    # Fills the pieces fields (and any other evidence fields) for one candidate; signals of
    # one row that share a field declare it once.
    explain: Callable[[Shortlist, int, float], dict[str, list[str]]] | None = None
    # What the comment says in the row of a signal without pieces.
    about: str | None = None
    # Set by hand, not fitted: too rare in any labelled set to fit.
    fixed_weight: float | None = None


WORDS = "words"

SIGNALS: tuple[Signal, ...] = (
    # The three word signals (how much of the issue's text, of its title, and of the best-
    # described known title the bug's text says) rest on the same shared words: one row.
    Signal("text", _text, "text", WORDS, pieces="matched_terms", shown=6,
           explain=_shared_terms),
    Signal("title_cov", _title_cov, "title words", WORDS, pieces="matched_terms", shown=6),
    Signal("label_cov", _label_cov, "bug label", WORDS, pieces="matched_terms", shown=6),
    Signal("files", _files, "files", "files", pieces="shared_files", shown=4,
           explain=_shared_files),
    Signal("symbols", _symbols, "functions / classes", "functions / classes",
           pieces="shared_symbols", shown=4, explain=_shared_symbols),
    Signal("errors", _errors, "error text", "error text", pieces="shared_errors", shown=2,
           explain=_shared_errors),
    # An issue that cites a member or the fix PR of a cluster by number is pointing at it; it
    # still needs some text agreement to be trusted.
    Signal("ref", _ref, "reference", "reference",
           about="the issue says it is the bug of an issue or PR of this one",
           fixed_weight=2.5),
    # Its counterpart: the citation says the issue is not this bug (or not any more). Set by
    # hand like ``ref``, and as strong.
    Signal("ref_against", _ref_against, "a citation that sets the issue apart", None,
           against=True, fixed_weight=-2.5),
    Signal("facet_conflict", _facet_conflict, "platform / component", None, against=True,
           explain=_conflicting_facets),
    Signal("title_miss", _title_miss, "title words the bug never uses", None, against=True),
)

BY_NAME: dict[str, Signal] = {s.name: s for s in SIGNALS}
AGAINST: frozenset[str] = frozenset(s.name for s in SIGNALS if s.against)
FIXED_WEIGHTS: dict[str, float] = {s.name: s.fixed_weight for s in SIGNALS
                                   if s.fixed_weight is not None}
# What a maintainer reads for each score part (the page).
LABELS: dict[str, str] = {s.name: s.label for s in SIGNALS}


@dataclass(frozen=True)
class Row:
    """One row of the comment's evidence table: the signals it adds up, its pieces."""

    name: str
    signals: frozenset[str]
    pieces: str | None
    shown: int
    about: str | None


def _rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for s in SIGNALS:
        if s.row is None:
            continue
        old = rows.get(s.row)
        if old is None:
            rows[s.row] = Row(s.row, frozenset({s.name}), s.pieces, s.shown, s.about)
        else:
            rows[s.row] = Row(s.row, old.signals | {s.name}, old.pieces or s.pieces,
                              max(old.shown, s.shown), old.about or s.about)
    return rows


ROWS: dict[str, Row] = _rows()
ROW_OF: dict[str, str] = {name: row.name for row in ROWS.values() for name in row.signals}
