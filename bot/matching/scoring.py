"""The matcher: an issue's terms against the index's postings for recall, then evidence features
for the few candidates that come out, one calibrated probability per candidate.

Ranking runs in two stages so that its cost does not grow with the number of clusters in Python:
a BM25F pass over numpy postings picks the best ``_SHORTLIST`` clusters, and only those are looked
at closely (file, symbol and error overlap, title coverage, citations, facets), all of it as
array operations over the shortlist's slices of the index (``bot/matching/arrays.py``).

At scale, the first stage skips the words that most clusters share (``build.common_df``): such a
term adds a little to thousands of scores and decides none. A common word of the issue's title
still brings in the clusters it weighs most in (all of them, when the title has no rarer word),
and when fewer than a shortlist of clusters score without the skipped words, they all count. The
shortlisted clusters are scored on every shared term, common ones included, from the per-cluster
(forward) index, so their text score is exact.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np

from bot.clusters.models import Cluster
from bot.matching.arrays import IndexArrays, member, ranges
from bot.matching.boilerplate import Boilerplate
from bot.matching.build import IndexBuilder, common_df, last_part
from bot.matching.citations import AGAINST_MATCH, FOR_MATCH, citations
from bot.matching.evidence import (
    extract_issue_evidence,
    is_symbol,
    normalise_error,
    path_suffix_match,
)
from bot.matching.frames import parse_traces
from bot.matching.model import DEFAULT_MODEL, FEATURES, ScoreModel
from bot.matching.signals import SIGNALS, Query, Shortlist
from bot.matching.text import clean_body, clean_title, tokens
from bot.matching.types import IssueText, Match, MatchEvidence, MatchPolicy

_SHORTLIST = 40
# Query side: words of the issue title count fully, words found only in the body count less
# (bodies are long and wander).
_Q_TITLE = 1.0
_Q_BODY = 0.5
_ERROR_TEXTS = 1 << 16


log = logging.getLogger("dejafix.matching")

# What matching reads of an issue: GitHub caps a title at 256 characters and a body at 65,536
# (the webhook's own cut, bot/github/payloads.py, keeps the same figures), and every text pass
# is linear, so an issue's matching costs at most what a full-size body costs. Text beyond
# these is cut here, where an issue enters matching, and the cut is logged: a forged or
# future payload, or a caller that did not cut, cannot make one delivery's matching longer.
MAX_TITLE_CHARS = 1024
MAX_BODY_CHARS = 65536


def bounded(issue: IssueText) -> IssueText:
    """``issue`` with its title and body cut to what matching reads (logged when cut)."""
    body = issue.body or ""
    if len(issue.title) <= MAX_TITLE_CHARS and len(body) <= MAX_BODY_CHARS:
        return issue
    log.info("issue %s: matching reads the first %d of %d title and %d of %d body characters",
             issue.number, min(len(issue.title), MAX_TITLE_CHARS), len(issue.title),
             min(len(body), MAX_BODY_CHARS), len(body))
    return issue.model_copy(update={"title": issue.title[:MAX_TITLE_CHARS],
                                    "body": body[:MAX_BODY_CHARS]})


@dataclass
class _Ranked:
    """The shortlist, best first: cluster positions, feature matrix, relevance. ``order[r]`` is
    the position in ``shortlist`` of the candidate ranked ``r``."""

    docs: np.ndarray
    values: np.ndarray  # one row per candidate, one column per feature name
    relevance: np.ndarray
    shortlist: Shortlist | None
    order: np.ndarray


def _frames(text: str) -> tuple[list[str], list[str]]:
    """The files and functions of the project's frames in the stack traces ``text`` quotes
    (Python, JavaScript and TypeScript, Rust, Go: bot/matching/frames.py)."""
    files: list[str] = []
    functions: list[str] = []
    for trace in parse_traces(text):
        for frame in trace.frames:
            # The project's frames only: a runtime's or the standard library's file would match
            # any repository's file of the same name (``logging/__init__.py``). A library's own
            # frames in its users' Python tracebacks are read by extract_issue_evidence.
            if not frame.project:
                continue
            files.append(frame.path)
            if frame.function:
                # ``Class.method``, ``pkg.(*T).Method``, ``crate::module::func``: the name.
                name = frame.function.replace("::", ".").rsplit(".", 1)[-1].strip("()*<>")
                if len(name) >= 3 and is_symbol(name):
                    functions.append(name)
    return list(dict.fromkeys(files)), list(dict.fromkeys(functions))


def _index_of(clusters: Iterable[Cluster]) -> IndexArrays:
    """The index of ``clusters``."""
    builder = IndexBuilder()
    for cluster in clusters:
        builder.add(cluster)
    return builder.finish()


class Matcher:
    """An index over clusters. Building it is the expensive part; ``rank`` is fast and pure.

    ``arrays`` is an index built elsewhere (another process, a file); ``clusters`` is then
    ignored.
    """

    def __init__(
        self,
        clusters: Iterable[Cluster] = (),
        model: ScoreModel | None = None,
        *,
        arrays: IndexArrays | None = None,
    ) -> None:
        if arrays is None:
            arrays = _index_of(clusters)
        self._a = arrays
        self._n = arrays.n
        self.model = model or DEFAULT_MODEL
        self.feature_names: tuple[str, ...] = FEATURES
        # A model read from a file is checked as it is read (ScoreModel.from_json); one built
        # in code is checked here: a weight filled with 0 would switch a signal off unseen.
        self.model.check()
        self._weights = [self.model.weights[name] for name in self.feature_names]
        self._mask_cache: dict[tuple[frozenset[str] | None, bool, bool], np.ndarray] = {}
        self._error_texts: dict[int, str] = {}  # decoded once, not on every query
        # Terms in so many clusters that the first stage skips them (see the module docstring).
        self._common_df = common_df(self._n)

    @property
    def arrays(self) -> IndexArrays:
        return self._a

    def __len__(self) -> int:
        return self._n

    @functools.cached_property
    def _path_df(self) -> tuple[np.ndarray, np.ndarray]:
        """How many bugs of each repository changed each file (see ``signals._files``)."""
        a = self._a
        owner = np.repeat(a.repo_ids.astype(np.int64), np.diff(a.file_off))
        keys, counts = np.unique(owner * len(a.paths) + a.file_ids, return_counts=True)
        return keys, counts

    # --- clusters by position --------------------------------------------------------------------

    def cluster(self, i: int) -> Cluster:
        """The record of cluster ``i``, validated again from its stored JSON."""
        return Cluster.model_validate_json(self._a.records.raw(i))

    def public_id(self, i: int) -> str:
        return self._a.public_ids[i]

    @property
    def clusters(self) -> list[Cluster]:
        """Every cluster, rebuilt from its record: for small indexes and tools, not the bot."""
        return [self.cluster(i) for i in range(self._n)]

    def find(self, public_id: str | None = None, kind: str | None = None,
             number: int | None = None) -> int | None:
        """The first cluster with this id, or with issue/PR ``number`` as a member (a PR also
        as its landed fix); None when there is none."""
        found: list[int] = []
        if public_id is not None:
            i = self._a.public_ids.get(public_id)
            if i >= 0:
                found.append(i)
        if kind is not None and number is not None:
            key = number * 2 + (1 if kind == "pr" else 0)
            tables = [(self._a.member_keys, self._a.member_docs)]
            if kind == "pr":
                tables.append((self._a.fix_keys, self._a.fix_docs))
            for keys, docs in tables:
                lo = int(np.searchsorted(keys, key, side="left"))
                hi = int(np.searchsorted(keys, key, side="right"))
                if hi > lo:
                    found.append(int(docs[lo:hi].min()))
        return min(found) if found else None

    # --- query side ----------------------------------------------------------------------------

    def _query(self, issue: IssueText, boilerplate: Boilerplate | None) -> Query:
        a = self._a
        raw_body = issue.body or ""
        body = boilerplate.strip(raw_body) if boilerplate else raw_body
        title = clean_title(issue.title)
        title_terms = set(tokens(title))
        body_counts = Counter(tokens(clean_body(body)))
        weights: dict[str, float] = {}
        for t, c in body_counts.items():
            weights[t] = _Q_BODY * min(1.0 + math.log(c), 2.0)
        for t in title_terms:
            weights[t] = weights.get(t, 0.0) + _Q_TITLE
        evidence = extract_issue_evidence(title + "\n" + body)
        norm_text = normalise_error(title + "\n" + body)
        words = list(weights)
        tids = a.terms.lookup(words) if words else np.zeros(0, dtype=np.int64)
        known = tids >= 0
        idf = np.full(len(words), a.default_idf)
        idf[known] = a.idf[tids[known]]
        idf_list = idf.tolist()
        coef_list = [i * w for i, w in zip(idf_list, weights.values(), strict=True)]
        total = 0.0
        for c in coef_list:  # in order, as the first stage adds scores up
            total += c
        is_title = np.array([t in title_terms for t in words], dtype=bool)
        known_idx = np.flatnonzero(known)
        known_order = np.argsort(tids[known_idx], kind="stable")
        frame_files, frame_functions = _frames(title + "\n" + body)
        symbols = list(dict.fromkeys(s.lower() for s in [*evidence.symbols, *frame_functions]))
        sym_ids = a.symbols_low.lookup(symbols) if symbols else np.zeros(0, dtype=np.int64)
        file_paths, file_scores = self._file_matches(
            list(dict.fromkeys([*evidence.files, *frame_files])))
        # A citation counts for a match only where the issue says it is the cited bug
        # ("duplicate of #N", "closes #N"), and against it where it says it is another, what
        # is left of it, or that its fix failed; a cause ("regression from #N") is for
        # bot/matching/regression.py, a bare mention for neither.
        cited = citations(title + "\n" + body, self._a.repos)
        numbers = sorted({c.number for c in cited if c.kind in FOR_MATCH})
        numbers_against = sorted({c.number for c in cited if c.kind in AGAINST_MATCH})
        title_known = np.sort(tids[is_title & known])
        return Query(
            words=words,
            tids=tids,
            coef=np.array(coef_list, dtype=np.float64),
            qidf_title=np.where(is_title, idf, 0.0),
            is_title=is_title,
            idf=idf_list,
            title_ids=title_known,
            known=tids[known_idx][known_order],
            known_pos=known_idx[known_order],
            total=total,
            title_total=float(sum([idf_list[i] for i in np.flatnonzero(is_title).tolist()])),
            norm_text=" " + norm_text + " ",
            sym_ids=np.sort(sym_ids[sym_ids >= 0]),
            numbers=np.array(numbers, dtype=np.int64),
            numbers_against=np.array(numbers_against, dtype=np.int64),
            file_paths=file_paths,
            file_scores=file_scores,
            title_facets=title_known[member(a.facet_terms, title_known)[0]]
            if len(a.facet_terms) else np.zeros(0, dtype=np.int64),
        )

    def _file_matches(self, issue_files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The index's paths that an issue's files name, and how specifically: a suffix match
        of two or more components is specific; a bare basename match is worth what its rarity
        says (a basename many fixes touched, run.py, config.py, says little)."""
        a = self._a
        best: dict[int, float] = {}
        if issue_files and len(a.last_off) > 1:
            slots = a.last_parts.lookup([last_part(f) for f in issue_files])
            for issue_path, slot in zip(issue_files, slots.tolist(), strict=True):
                if slot < 0:
                    continue
                for pid in a.last_paths[a.last_off[slot] : a.last_off[slot + 1]].tolist():
                    n = path_suffix_match(issue_path, a.paths[pid])
                    if n == 0:
                        continue
                    # (at least 1: a path of a redefined cluster only is in no live cluster)
                    base_df = max(1, int(a.path_base_df[pid]))
                    s = 1.0 if n >= 2 else min(1.0, 0.35 + 0.5 / base_df)
                    if s > best.get(pid, 0.0):
                        best[pid] = s
        pids = np.array(sorted(best), dtype=np.int64)
        return pids, np.array([best[p] for p in pids.tolist()], dtype=np.float64)

    def _mask(self, repos: Collection[str] | None, policy: MatchPolicy) -> np.ndarray:
        key_repos = frozenset(r.lower() for r in repos) if repos is not None else None
        key = (key_repos, policy.include_unlanded, policy.include_stale)
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = np.ones(self._n, dtype=bool)
            if not policy.include_unlanded:
                mask &= self._a.landed
            if not policy.include_stale:
                mask &= ~self._a.stale
            if key_repos is not None:
                wanted = [i for i, r in enumerate(self._a.repos) if r in key_repos]
                mask &= np.isin(self._a.repo_ids, wanted)
            if len(self._mask_cache) > 256:
                self._mask_cache.clear()
            self._mask_cache[key] = mask
        return mask

    def _first_stage(self, q: Query, prune: bool = True) -> tuple[np.ndarray, bool]:
        """BM25F scores of every cluster; with ``prune``, without the common words (True when
        one was left out: the scores of the shortlist are then recomputed in full)."""
        a = self._a
        known = q.tids >= 0
        tids = q.tids[known]
        coef = q.coef[known]
        df = a.post_off[tids + 1] - a.post_off[tids]
        rare = (df <= self._common_df) | (not prune)
        title = q.is_title[known]
        if not (rare & title).any():
            rare |= title  # a title of common words only: they decide, they all count
        pruned = not bool(rare.all())
        # In the order of the issue's terms, as every other sum of the score.
        idx, lengths = ranges(a.post_off, tids[rare])
        ids = a.post_ids[idx]
        vals = a.post_vals[idx] * np.repeat(coef[rare], lengths)
        # The common words of the title still bring in the clusters they weigh most in (whose
        # titles and labels say them): a generic title ("Error when running the agent") must
        # meet its look-alikes, or a lone candidate would look like a clear winner.
        common_title = ~rare & title
        if common_title.any():
            idx, lengths = ranges(a.impact_off, tids[common_title])
            ids = np.concatenate([ids, a.impact_ids[idx]])
            vals = np.concatenate([vals, a.impact_vals[idx] *
                                   np.repeat(coef[common_title], lengths)])
        return np.bincount(ids, weights=vals, minlength=self._n), pruned

    # --- the shortlist -------------------------------------------------------------------------

    def _rank(
        self,
        issue: IssueText,
        repos: Collection[str] | None,
        policy: MatchPolicy,
        boilerplate: Boilerplate | None,
        shortlist: int = _SHORTLIST,
    ) -> _Ranked:
        """Shortlist by BM25F, then the features and relevance of each, best first."""
        none = np.zeros(0, dtype=np.int64)
        empty = _Ranked(none, np.zeros((0, len(self.feature_names))), np.zeros(0), None, none)
        if self._n == 0:
            return empty
        q = self._query(issue, boilerplate)
        scores, pruned = self._first_stage(q)
        mask = self._mask(repos, policy)
        # The shortlist among the clusters that scored at all (usually a fraction of them)...
        scored = np.flatnonzero(scores > 0)
        scored = scored[mask[scored]]
        if pruned and len(scored) <= shortlist:
            # Too few clusters share a rarer word: the common ones decide who else is close.
            scores, pruned = self._first_stage(q, prune=False)
            scored = np.flatnonzero(scores > 0)
            scored = scored[mask[scored]]
        if len(scored) > shortlist:
            top = scored[np.argpartition(-scores[scored], shortlist - 1)[:shortlist]]
        else:
            # ...unless fewer than a shortlist did: then any allowed cluster may fill it.
            scores = np.where(mask, scores, -1.0)
            k = min(shortlist, int(mask.sum()))
            if k <= 0:
                return empty
            top = np.argpartition(-scores, k - 1)[:k] if k < self._n else np.arange(self._n)
            top = top[mask[top]]
        s = Shortlist(self._a, q, top, scores, pruned,
                      error_weight=functools.partial(self._error_weight, q), cluster=self.cluster,
                      path_df=self._path_df)
        values = np.column_stack([sig.column(s) for sig in SIGNALS])
        relevance = np.zeros(len(top))
        for j, w in enumerate(self._weights):  # column by column: the model's own sum order
            relevance += w * values[:, j]
        relevance = self.model.bias + relevance
        order = np.argsort(-relevance, kind="stable")
        return _Ranked(top[order], values[order], relevance[order], s, order)

    def _error_weight(self, q: Query, eid: int) -> float:
        """What one of a cluster's error texts adds when the issue quotes it: an exception type
        alone is common ("TypeError"); a message is specific."""
        err = self._error_texts.get(eid)
        if err is None:
            if len(self._error_texts) > _ERROR_TEXTS:
                self._error_texts.clear()
            err = self._error_texts[eid] = self._a.errors[eid]
        if (" " + err + " ") in q.norm_text or (len(err) >= 12 and err in q.norm_text):
            return 0.3 if " " not in err else 1.0
        return 0.0

    def _evidence(self, ranked: _Ranked, row: int) -> MatchEvidence:
        """What a comment shows for one candidate: each signal's share, and what was shared."""
        s = ranked.shortlist
        assert s is not None
        j = int(ranked.order[row])
        values = ranked.values[row].tolist()
        parts = {
            sig.name: round(w * v, 4)
            for sig, w, v in zip(SIGNALS, self._weights, values, strict=True)
            if v
        }
        shared: dict[str, list[str]] = {}
        for sig, v in zip(SIGNALS, values, strict=True):
            if sig.explain is not None:
                shared.update(sig.explain(s, j, v))
        return MatchEvidence.model_validate(
            {"parts": parts, "title_similarity": round(float(s.titles[1][j]), 4), **shared})

    def rank(
        self,
        issue: IssueText,
        repos: Collection[str] | None = None,
        *,
        limit: int = 5,
        policy: MatchPolicy | None = None,
        boilerplate: Boilerplate | None = None,
    ) -> list[Match]:
        """Ranked candidates, best first, each with a calibrated score and its evidence."""
        policy = policy or MatchPolicy()
        ranked = self._rank(bounded(issue), repos, policy, boilerplate)
        rel = ranked.relevance.tolist()
        matches: list[Match] = []
        for pos in range(min(limit, len(rel))):
            # The gap to the strongest other candidate: a clear winner is more often right than
            # one of two look-alikes with the same score.
            other = rel[1] if pos == 0 and len(rel) > 1 else rel[0]
            if pos == 0 and len(rel) == 1:
                other = self.model.floor
            score = self.model.probability(rel[pos], rel[pos] - other)
            i = int(ranked.docs[pos])
            matches.append(
                Match.deferred(
                    self.public_id(i),
                    functools.partial(self.cluster, i),
                    score=round(score, 4),
                    explain=functools.partial(self._evidence, ranked, pos),
                )
            )
        return matches


def decide(matches: list[Match], policy: MatchPolicy) -> Match | None:
    """The match worth a comment, or None: below the threshold, or not clearly ahead."""
    if not matches:
        return None
    best = matches[0]
    if best.score < policy.threshold:
        return None
    if len(matches) > 1 and best.score - matches[1].score < policy.margin:
        return None
    return best
