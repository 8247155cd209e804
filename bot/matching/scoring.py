"""The index of clusters and the scorer: inverted postings for recall, evidence features for the
few candidates that come out, one calibrated probability per candidate.

Ranking runs in two stages so that its cost does not grow with the number of clusters in Python:
a BM25F pass over numpy postings picks the best ``_SHORTLIST`` clusters, and only those are looked
at closely (file, symbol and error overlap, title coverage, and, when the matcher is built with an
embedding encoder, the cosine between the issue's and the cluster's sentence embeddings).
"""

from __future__ import annotations

import gc
import logging
import math
from array import array
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import numpy as np

from bot.clusters.models import Cluster
from bot.matching.boilerplate import Boilerplate
from bot.matching.evidence import (
    ClusterEvidence,
    IssueEvidence,
    extract_cluster_evidence,
    extract_issue_evidence,
    normalise_error,
    path_suffix_match,
)
from bot.matching.model import DEFAULT_MODEL, FEATURES, SEMANTIC, SEMANTIC_MODEL, ScoreModel
from bot.matching.semantic import INSTALL_HINT, Encoder, load_encoder
from bot.matching.text import clean_body, clean_title, tokens
from bot.matching.types import IssueText, Match, MatchEvidence, MatchPolicy

_K1 = 1.2
_B = 0.6
_SHORTLIST = 40
# Field weights of BM25F: a word in a title or label says more than one in a summary.
_W_TITLE = 2.0
_W_SUMMARY = 1.0
_W_FILE = 1.0
# Query side: words of the issue title count fully, words found only in the body count less
# (bodies are long and wander).
_Q_TITLE = 1.0
_Q_BODY = 0.5
# The issue text given to the encoder: its title, then the start of its cleaned body (the encoder
# reads 256 word pieces at most; a bug is described at the top, logs and templates follow).
_SEMANTIC_BODY_CHARS = 1000

log = logging.getLogger(__name__)


_NO_SYMBOLS: dict[str, str] = {}


class _Doc:
    """What ``features`` needs of one cluster, kept compact: a 100k-cluster index holds 100k of
    these, so tuples replace sets and lists, and empty containers are shared.

    ``titles`` holds the distinct tokens of the label and of each member title in their first
    occurrence order: ``set(tokens)`` rebuilds the very set (same iteration order) that the
    token list gives, so sums over it add in the same order. ``title_totals`` are their idf sums.
    """

    __slots__ = (
        "cluster",
        "errors",
        "files",
        "numbers",
        "repo",
        "symbols_lower",
        "terms",
        "title_totals",
        "titles",
        "weak_files",
    )

    def __init__(
        self,
        cluster: Cluster,
        titles: tuple[tuple[str, ...], ...],
        terms: tuple[str, ...],
        evidence: ClusterEvidence,
        repo: str,
    ) -> None:
        self.cluster = cluster
        self.titles = titles
        self.title_totals: tuple[float, ...] = ()
        self.terms = terms
        self.files = tuple(evidence.files)
        self.weak_files = tuple(evidence.weak_files) if evidence.weak_files else ()
        self.errors = tuple(e for e in evidence.errors if len(e) >= 6)
        self.numbers = tuple(evidence.numbers)
        self.symbols_lower = (
            {s.lower(): s for s in evidence.symbols} if evidence.symbols else _NO_SYMBOLS
        )
        self.repo = repo


@dataclass
class Features:
    """One candidate's signals, each in [0, 1] (``text`` may exceed 1 slightly)."""

    values: dict[str, float]
    shared_files: list[str]
    shared_symbols: list[str]
    shared_errors: list[str]
    matched_terms: list[str]
    title_similarity: float


@dataclass
class _Query:
    title_terms: set[str]
    all_terms: set[str]
    weights: dict[str, float]
    evidence: IssueEvidence
    norm_text: str
    symbols_lower: set[str]
    # Derived once per query rather than once per candidate.
    idf: dict[str, float]  # of every term in all_terms
    title_total: float  # sum of the idf of title_terms, in their set order
    by_weight: list[str]  # all_terms by decreasing idf, then by the term itself
    numbers: set[int]


# IDF is computed as if the index held at least this many clusters, the missing ones sharing no
# word with the rest. A new installation with a handful of clusters would otherwise see every
# word as common (with 3 clusters a word in one of them gets an IDF of 1, not 5), and the
# calibration, fitted on a few hundred clusters, would keep it silent on obvious duplicates.
_MIN_COLLECTION = 50


def _idf(n: int, df: int) -> float:
    n = max(n, _MIN_COLLECTION)
    return math.log(1.0 + (n - df + 0.5) / (df + 0.5))


def cluster_semantic_text(cluster: Cluster) -> str:
    """What the encoder reads of a cluster: its label, its members' titles, its summary."""
    parts = [clean_title(cluster.display_label)]
    seen = {parts[0].lower()}
    for m in cluster.members:
        title = clean_title(m.title) if m.title else ""
        if title and title.lower() not in seen:
            seen.add(title.lower())
            parts.append(title)
    if cluster.summary:
        parts.append(cluster.summary.strip())
    return ". ".join(p.rstrip(". ") for p in parts if p)


def issue_semantic_text(title: str, body: str) -> str:
    """What the encoder reads of an issue: its title, then the start of its cleaned body."""
    cleaned = " ".join(clean_body(body).split())[:_SEMANTIC_BODY_CHARS]
    return f"{clean_title(title).rstrip('. ')}. {cleaned}".strip(". ")


class Matcher:
    """An index over clusters. Building it is the expensive part; ``rank`` is fast and pure.

    ``semantic`` adds the embedding feature: True loads the encoder from the installed model
    package (and falls back to the lexical matcher, with a warning, when it is not installed);
    an ``Encoder`` is used as given. With it and no ``model``, the coefficients fitted with the
    feature (``SEMANTIC_MODEL``) are used.
    """

    def __init__(
        self,
        clusters: Iterable[Cluster],
        model: ScoreModel | None = None,
        *,
        semantic: bool | Encoder = False,
    ) -> None:
        encoder: Encoder | None = None
        if isinstance(semantic, Encoder):
            encoder = semantic
        elif semantic:
            encoder = load_encoder()
            if encoder is None:
                log.warning(
                    "matching.semantic is on but the model package is not installed (%s);"
                    " matching without it",
                    INSTALL_HINT,
                )
        self._encoder = encoder
        self.model = model or (SEMANTIC_MODEL if encoder is not None else DEFAULT_MODEL)
        self.feature_names: tuple[str, ...] = (
            (*FEATURES, SEMANTIC) if encoder is not None else FEATURES
        )
        # Building allocates millions of small objects that all survive: with the collector on,
        # its full passes walk every one of them (and every loaded cluster) again and again.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._build(clusters)
        finally:
            if gc_was_enabled:
                gc.enable()
        self._landed = np.array([d.cluster.landed_fix.landed for d in self._docs], dtype=bool)
        self._stale = np.array([d.cluster.freshness.stale for d in self._docs], dtype=bool)
        self._repos = np.array([d.repo for d in self._docs], dtype=object)
        self._mask_cache: dict[tuple[frozenset[str] | None, bool, bool], np.ndarray] = {}
        # Unit vectors of every cluster, computed once here (the bot builds the index in a thread).
        self._vectors: np.ndarray | None = None
        if encoder is not None:
            self._vectors = encoder.encode(
                [cluster_semantic_text(d.cluster) for d in self._docs], memo=True
            )

    def _build(self, clusters: Iterable[Cluster]) -> None:
        docs: list[_Doc] = []
        # The weighted term frequencies of every cluster, flat: term ids, weights, and how many
        # terms each cluster has (postings are cut from these once document frequencies are
        # known). Flat arrays instead of one dict per cluster keep the build's peak memory low.
        vocab: dict[str, int] = {}
        flat_terms = array("i")
        flat_tf = array("d")
        counts = array("i")
        lengths: list[float] = []
        title_order: list[tuple[str, ...]] = []  # each title set's tokens in set order
        path_terms: dict[str, tuple[str, ...]] = {}
        for cluster in clusters:
            titles_text = [clean_title(cluster.display_label)]
            titles_text.extend(clean_title(m.title) for m in cluster.members if m.title)
            title_toks = [tuple(dict.fromkeys(tokens(t))) for t in titles_text]
            tf: dict[str, float] = {}
            for toks in title_toks:
                tset = set(toks)
                if tset:
                    title_order.append(tuple(tset))
                for t in tset:
                    tf[t] = tf.get(t, 0.0) + _W_TITLE
            for t in tokens(cluster.summary or ""):
                tf[t] = tf.get(t, 0.0) + _W_SUMMARY
            evidence = extract_cluster_evidence(cluster)
            for path in evidence.files:
                weight = _W_FILE * (0.3 if path in evidence.weak_files else 1.0)
                ptoks = path_terms.get(path)
                if ptoks is None:
                    ptoks = path_terms[path] = tuple(set(tokens(path)))
                for t in ptoks:
                    tf[t] = tf.get(t, 0.0) + weight
            if cluster.subsystem:
                for t in tokens(cluster.subsystem):
                    tf[t] = tf.get(t, 0.0) + _W_SUMMARY
            docs.append(
                _Doc(
                    cluster=cluster,
                    titles=tuple(toks for toks in title_toks if toks),
                    terms=tuple(tf),
                    evidence=evidence,
                    repo=cluster.repo.lower(),
                )
            )
            lengths.append(sum(tf.values()))
            size = len(vocab)
            for t in tf:
                tid = vocab.setdefault(t, size)
                if tid == size:
                    size += 1
                flat_terms.append(tid)
            flat_tf.extend(tf.values())
            counts.append(len(tf))
        del path_terms
        self._docs = docs

        n = len(docs)
        self._n = n
        n_terms = len(vocab)
        term_ids = np.frombuffer(flat_terms, dtype=np.intc) if n_terms else np.zeros(0, np.intc)
        df = np.bincount(term_ids, minlength=n_terms)
        # IDF depends on the document frequency only: one log per distinct frequency.
        df_list = df.tolist()
        idf_of_df = {c: _idf(n, c) for c in set(df_list)}
        self._idf = dict(zip(vocab, [idf_of_df[c] for c in df_list], strict=True))
        self._default_idf = _idf(n, 0)
        self._vocab = vocab
        idf = self._idf
        totals: list[float] = [sum([idf[t] for t in toks]) for toks in title_order]
        del title_order
        pos = 0
        for doc in docs:
            k = len(doc.titles)
            doc.title_totals = tuple(totals[pos : pos + k])
            pos += k
        del totals

        lengths_arr = np.array(lengths, dtype=float)
        avg = float(lengths_arr.mean()) if n else 1.0
        norm = _K1 * (1 - _B + _B * lengths_arr / avg) if avg else np.full(n, _K1)
        doc_of = np.repeat(np.arange(n, dtype=np.int32), np.frombuffer(counts, dtype=np.intc))
        tf_arr = np.frombuffer(flat_tf, dtype=np.float64)
        vals = tf_arr * (_K1 + 1) / (tf_arr + norm[doc_of])
        # Postings of term ``tid``: ``_post_ids[_post_off[tid]:_post_off[tid + 1]]`` (cluster
        # positions, ascending) and the same slice of ``_post_vals``.
        order = np.argsort(term_ids, kind="stable")
        self._post_ids = doc_of[order]
        self._post_vals = vals[order]
        off = np.zeros(n_terms + 1, dtype=np.int64)
        np.cumsum(df, out=off[1:])
        self._post_off = off
        del order, doc_of, vals, tf_arr, flat_terms, flat_tf

        # Files and basenames across the index: a basename that many fixes touched (run.py,
        # config.py) says less than one only this fix touched.
        base_df: Counter[str] = Counter()
        for doc in docs:
            base_df.update({f.rsplit("/", 1)[-1] for f in doc.files})
        self._base_df = base_df
        sym_df: Counter[str] = Counter()
        for doc in docs:
            sym_df.update(doc.symbols_lower.keys())
        self._sym_df = sym_df

    @property
    def semantic(self) -> bool:
        """Whether the embedding feature is computed."""
        return self._encoder is not None

    def __len__(self) -> int:
        return self._n

    @property
    def clusters(self) -> list[Cluster]:
        return [d.cluster for d in self._docs]

    def idf(self, term: str) -> float:
        return self._idf.get(term, self._default_idf)

    # --- query side ----------------------------------------------------------------------------

    def _query(self, issue: IssueText, boilerplate: Boilerplate | None) -> _Query:
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
        all_terms = title_terms | set(body_counts)
        idf_get = self._idf.get
        default = self._default_idf
        idf = {t: idf_get(t, default) for t in all_terms}
        return _Query(
            title_terms=title_terms,
            all_terms=all_terms,
            weights=weights,
            evidence=evidence,
            norm_text=" " + norm_text + " ",
            symbols_lower={s.lower() for s in evidence.symbols},
            idf=idf,
            title_total=sum([idf[t] for t in title_terms]),
            # Ties broken by the term itself: set order changes between processes, comments
            # must not.
            by_weight=sorted(all_terms, key=lambda t: (-idf[t], t)),
            numbers=set(evidence.numbers),
        )

    def _mask(self, repos: Collection[str] | None, policy: MatchPolicy) -> np.ndarray:
        key_repos = frozenset(r.lower() for r in repos) if repos is not None else None
        key = (key_repos, policy.include_unlanded, policy.include_stale)
        mask = self._mask_cache.get(key)
        if mask is None:
            mask = np.ones(self._n, dtype=bool)
            if not policy.include_unlanded:
                mask &= self._landed
            if not policy.include_stale:
                mask &= ~self._stale
            if key_repos is not None:
                mask &= np.array([r in key_repos for r in self._repos], dtype=bool)
            if len(self._mask_cache) > 256:
                self._mask_cache.clear()
            self._mask_cache[key] = mask
        return mask

    def _bm25(self, q: _Query) -> tuple[np.ndarray, float]:
        scores = np.zeros(self._n, dtype=float)
        total = 0.0
        vocab_get = self._vocab.get
        off = self._post_off
        post_ids = self._post_ids
        post_vals = self._post_vals
        for t, w in q.weights.items():
            idf = q.idf[t]
            total += idf * w
            tid = vocab_get(t)
            if tid is not None:
                a = off[tid]
                b = off[tid + 1]
                scores[post_ids[a:b]] += (idf * w) * post_vals[a:b]
        return scores, total

    # --- candidate features --------------------------------------------------------------------

    def features(self, q: _Query, i: int, bm25: float, bm25_max: float) -> Features:
        doc = self._docs[i]
        idf = self._idf
        qidf = q.idf
        all_terms = q.all_terms
        title_terms = q.title_terms
        # The query's terms this cluster has (its own terms are a tuple, not a set, to keep the
        # index small; every use below is a membership test of a query term).
        common = all_terms.intersection(doc.terms)
        values: dict[str, float] = {}
        values["text"] = bm25 / bm25_max if bm25_max > 0 else 0.0
        # The share of the issue title's idf mass that the cluster has.
        values["title_cov"] = (
            sum([qidf[t] for t in title_terms if t in common]) / q.title_total
            if q.title_total > 0
            else 0.0
        )
        # How much of the best-described known title of the cluster the issue says: a release
        # note's one-line label, fully present in the issue, is strong even without files.
        # And the idf-weighted Jaccard similarity of the issue title with each of those titles.
        # A title sharing no term with the issue scores 0 on both: skipped.
        best_title = 0.0
        title_sim = 0.0
        for toks, total in zip(doc.titles, doc.title_totals, strict=True):
            if all_terms.isdisjoint(toks):
                continue
            tset = set(toks)
            if total > 0:
                best_title = max(best_title, sum([idf[t] for t in tset if t in all_terms]) / total)
            inter = sum([idf[t] for t in title_terms & tset])
            union = sum([qidf[t] if t in qidf else idf[t] for t in title_terms | tset])
            title_sim = max(title_sim, inter / union)
        values["label_cov"] = best_title

        # Files: a suffix match of two or more components is specific; a bare basename match
        # is worth what its rarity says; test and generated files count less.
        shared_files: list[str] = []
        file_score = 0.0
        for fix_path in doc.files:
            best = 0.0
            for issue_path in q.evidence.files:
                n = path_suffix_match(issue_path, fix_path)
                if n == 0:
                    continue
                if n >= 2:
                    s = 1.0
                else:
                    base_df = self._base_df.get(fix_path.rsplit("/", 1)[-1], 1)
                    s = min(1.0, 0.35 + 0.5 / base_df)
                best = max(best, s)
            if best > 0:
                if fix_path in doc.weak_files:
                    best *= 0.3
                shared_files.append(fix_path)
                file_score += best
        values["files"] = min(1.0, file_score)

        # Symbols: a long identifier (``set_config_value``) names one place in the code; a short
        # one (``chat_id``) is a field every part of the code passes around.
        shared_symbols: list[str] = []
        sym_score = 0.0
        for low in q.symbols_lower & doc.symbols_lower.keys() if doc.symbols_lower else ():
            shared_symbols.append(doc.symbols_lower[low])
            specificity = min(1.0, max(0.0, len(low) - 4) / 10.0)
            rarity = self.idf(low) / self._default_idf if self._default_idf else 0.0
            sym_score += specificity * rarity / self._sym_df.get(low, 1)
        values["symbols"] = min(1.0, sym_score)

        shared_errors: list[str] = []
        err_score = 0.0
        for err in doc.errors:  # only those of six characters or more
            if (" " + err + " ") in q.norm_text or (len(err) >= 12 and err in q.norm_text):
                shared_errors.append(err)
                # Exception type names alone are common ("TypeError"); a message is specific.
                err_score += 0.3 if (" " not in err) else 1.0
        values["errors"] = min(1.0, err_score)
        values["ref"] = 0.0 if q.numbers.isdisjoint(doc.numbers) else 1.0

        # The twelve strongest shared terms, in the query's precomputed order.
        matched: list[str] = []
        for t in q.by_weight:
            if t in common:
                matched.append(t)
                if len(matched) == 12:
                    break
        return Features(
            values=values,
            shared_files=shared_files,
            shared_symbols=sorted(shared_symbols),
            shared_errors=shared_errors,
            matched_terms=matched,
            title_similarity=round(title_sim, 4),
        )

    def _similarities(
        self, issue: IssueText, boilerplate: Boilerplate | None, top: np.ndarray
    ) -> list[float] | None:
        """Cosine of the issue's embedding with each shortlisted cluster's, clipped to [0, 1]."""
        if self._encoder is None or self._vectors is None or len(top) == 0:
            return None
        body = issue.body or ""
        if boilerplate:
            body = boilerplate.strip(body)
        vec = self._encoder.encode([issue_semantic_text(issue.title, body)])[0]
        sims = np.clip(self._vectors[top] @ vec, 0.0, 1.0)
        return [round(float(v), 6) for v in sims]

    def _rank(
        self,
        issue: IssueText,
        repos: Collection[str] | None,
        policy: MatchPolicy,
        boilerplate: Boilerplate | None,
        shortlist: int = _SHORTLIST,
    ) -> list[tuple[int, Features, float]]:
        """Shortlist by BM25F, then the relevance logit of each shortlisted cluster, best first."""
        if self._n == 0:
            return []
        q = self._query(issue, boilerplate)
        scores, total = self._bm25(q)
        mask = self._mask(repos, policy)
        scores = np.where(mask, scores, -1.0)
        k = min(shortlist, int(mask.sum()))
        if k <= 0:
            return []
        top = np.argpartition(-scores, k - 1)[:k] if k < self._n else np.arange(self._n)
        top = top[mask[top]]
        sims = self._similarities(issue, boilerplate, top)
        out: list[tuple[int, Features, float]] = []
        for j, i in enumerate(top):
            feats = self.features(q, int(i), float(max(scores[i], 0.0)), total)
            if sims is not None:
                feats.values[SEMANTIC] = sims[j]
            out.append((int(i), feats, self.model.relevance(feats.values)))
        out.sort(key=lambda x: -x[2])
        return out

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
        ranked = self._rank(issue, repos, policy, boilerplate)
        matches: list[Match] = []
        for pos, (i, feats, rel) in enumerate(ranked[:limit]):
            # The gap to the strongest other candidate: a clear winner is more often right than
            # one of two look-alikes with the same score.
            other = ranked[1][2] if pos == 0 and len(ranked) > 1 else ranked[0][2]
            if pos == 0 and len(ranked) == 1:
                other = self.model.floor
            score = self.model.probability(rel, rel - other)
            parts = {
                name: round(self.model.weights.get(name, 0.0) * feats.values[name], 4)
                for name in self.feature_names
                if feats.values.get(name)
            }
            matches.append(
                Match(
                    cluster=self._docs[i].cluster,
                    score=round(score, 4),
                    evidence=MatchEvidence(
                        parts=parts,
                        title_similarity=feats.title_similarity,
                        shared_files=feats.shared_files,
                        shared_symbols=feats.shared_symbols,
                        shared_errors=feats.shared_errors,
                        matched_terms=feats.matched_terms,
                    ),
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
