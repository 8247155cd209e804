"""The index of clusters and the scorer: inverted postings for recall, evidence features for the
few candidates that come out, one calibrated probability per candidate.

Ranking runs in two stages so that its cost does not grow with the number of clusters in Python:
a BM25F pass over numpy postings picks the best ``_SHORTLIST`` clusters, and only those are looked
at closely (file, symbol and error overlap, title coverage, and, when the matcher is built with an
embedding encoder, the cosine between the issue's and the cluster's sentence embeddings).
"""

from __future__ import annotations

import logging
import math
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


@dataclass
class _Doc:
    cluster: Cluster
    titles: list[set[str]]  # token sets of the label and of each member title
    terms: set[str]
    evidence: ClusterEvidence
    symbols_lower: dict[str, str]
    repo: str


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
        self._docs: list[_Doc] = []
        doc_tf: list[dict[str, float]] = []
        for cluster in clusters:
            titles_text = [clean_title(cluster.display_label)]
            titles_text.extend(clean_title(m.title) for m in cluster.members if m.title)
            title_sets = [set(tokens(t)) for t in titles_text]
            tf: dict[str, float] = {}
            for tset in title_sets:
                for t in tset:
                    tf[t] = tf.get(t, 0.0) + _W_TITLE
            for t in tokens(cluster.summary or ""):
                tf[t] = tf.get(t, 0.0) + _W_SUMMARY
            evidence = extract_cluster_evidence(cluster)
            for path in evidence.files:
                weight = _W_FILE * (0.3 if path in evidence.weak_files else 1.0)
                for t in set(tokens(path)):
                    tf[t] = tf.get(t, 0.0) + weight
            if cluster.subsystem:
                for t in tokens(cluster.subsystem):
                    tf[t] = tf.get(t, 0.0) + _W_SUMMARY
            self._docs.append(
                _Doc(
                    cluster=cluster,
                    titles=[s for s in title_sets if s],
                    terms=set(tf),
                    evidence=evidence,
                    symbols_lower={s.lower(): s for s in evidence.symbols},
                    repo=cluster.repo.lower(),
                )
            )
            doc_tf.append(tf)

        n = len(self._docs)
        self._n = n
        df: Counter[str] = Counter()
        for tf in doc_tf:
            df.update(tf.keys())
        self._idf = {t: _idf(n, c) for t, c in df.items()}
        self._default_idf = _idf(n, 0)
        lengths = np.array([sum(tf.values()) for tf in doc_tf], dtype=float)
        avg = float(lengths.mean()) if n else 1.0
        postings: dict[str, tuple[list[int], list[float]]] = {}
        for i, tf in enumerate(doc_tf):
            norm = _K1 * (1 - _B + _B * lengths[i] / avg) if avg else _K1
            for t, f in tf.items():
                ids, vals = postings.setdefault(t, ([], []))
                ids.append(i)
                vals.append(f * (_K1 + 1) / (f + norm))
        self._postings = {
            t: (np.asarray(ids, dtype=np.int64), np.asarray(vals, dtype=float))
            for t, (ids, vals) in postings.items()
        }
        # Files and basenames across the index: a basename that many fixes touched (run.py,
        # config.py) says less than one only this fix touched.
        base_df: Counter[str] = Counter()
        for doc in self._docs:
            base_df.update({f.rsplit("/", 1)[-1] for f in doc.evidence.files})
        self._base_df = base_df
        sym_df: Counter[str] = Counter()
        for doc in self._docs:
            sym_df.update(doc.symbols_lower.keys())
        self._sym_df = sym_df
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
        return _Query(
            title_terms=title_terms,
            all_terms=title_terms | set(body_counts),
            weights=weights,
            evidence=evidence,
            norm_text=" " + norm_text + " ",
            symbols_lower={s.lower() for s in evidence.symbols},
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
        for t, w in q.weights.items():
            idf = self.idf(t)
            total += idf * w
            posting = self._postings.get(t)
            if posting is not None:
                ids, vals = posting
                scores[ids] += (idf * w) * vals
        return scores, total

    # --- candidate features --------------------------------------------------------------------

    def _coverage(self, terms: set[str], within: set[str]) -> float:
        total = sum(self.idf(t) for t in terms)
        if total <= 0:
            return 0.0
        return sum(self.idf(t) for t in terms if t in within) / total

    def features(self, q: _Query, i: int, bm25: float, bm25_max: float) -> Features:
        doc = self._docs[i]
        values: dict[str, float] = {}
        values["text"] = bm25 / bm25_max if bm25_max > 0 else 0.0
        values["title_cov"] = self._coverage(q.title_terms, doc.terms)
        # How much of the best-described known title of the cluster the issue says: a release
        # note's one-line label, fully present in the issue, is strong even without files.
        best_title = 0.0
        for tset in doc.titles:
            best_title = max(best_title, self._coverage(tset, q.all_terms))
        values["label_cov"] = best_title
        title_sim = 0.0
        for tset in doc.titles:
            union = q.title_terms | tset
            if union:
                inter = sum(self.idf(t) for t in q.title_terms & tset)
                title_sim = max(title_sim, inter / sum(self.idf(t) for t in union))

        # Files: a suffix match of two or more components is specific; a bare basename match
        # is worth what its rarity says; test and generated files count less.
        shared_files: list[str] = []
        file_score = 0.0
        for fix_path in doc.evidence.files:
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
                if fix_path in doc.evidence.weak_files:
                    best *= 0.3
                shared_files.append(fix_path)
                file_score += best
        values["files"] = min(1.0, file_score)

        # Symbols: a long identifier (``set_config_value``) names one place in the code; a short
        # one (``chat_id``) is a field every part of the code passes around.
        shared_symbols: list[str] = []
        sym_score = 0.0
        for low in q.symbols_lower & doc.symbols_lower.keys():
            shared_symbols.append(doc.symbols_lower[low])
            specificity = min(1.0, max(0.0, len(low) - 4) / 10.0)
            rarity = self.idf(low) / self._default_idf if self._default_idf else 0.0
            sym_score += specificity * rarity / self._sym_df.get(low, 1)
        values["symbols"] = min(1.0, sym_score)

        shared_errors: list[str] = []
        err_score = 0.0
        for err in doc.evidence.errors:
            if len(err) < 6:
                continue
            if (" " + err + " ") in q.norm_text or (len(err) >= 12 and err in q.norm_text):
                shared_errors.append(err)
                # Exception type names alone are common ("TypeError"); a message is specific.
                err_score += 0.3 if (" " not in err) else 1.0
        values["errors"] = min(1.0, err_score)
        values["ref"] = 1.0 if doc.evidence.numbers & set(q.evidence.numbers) else 0.0

        # Ties broken by the term itself: set order changes between processes, comments must not.
        matched = sorted(
            (t for t in q.all_terms if t in doc.terms), key=lambda t: (-self.idf(t), t)
        )[:12]
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
