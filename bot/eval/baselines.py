"""The two peer baselines that ``python -m bot eval`` measures next to the matcher, in the same run.

- ``TitleEditDistance``: what the potential-duplicates GitHub Action does — normalised
  Damerau-Levenshtein similarity between the new issue's title and every existing title, and a
  threshold. A cluster's existing titles are its members' titles and its label (release-note
  clusters have only a label).
- ``PlainBM25``: Okapi BM25 of the issue's title and body against each cluster's label, summary
  and member titles, with plain word tokens: no code awareness, no evidence, no noise removal.

Each returns, for one issue, clusters ranked best first with the baseline's own score; the
evaluation picks each baseline's best single threshold.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable

import numpy as np

from bot.clusters.models import Cluster

_WORD = re.compile(r"\w+")
_ENGLISH_STOP = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "if",
        "in",
        "into",
        "is",
        "it",
        "no",
        "not",
        "of",
        "on",
        "or",
        "such",
        "that",
        "the",
        "their",
        "then",
        "there",
        "these",
        "they",
        "this",
        "to",
        "was",
        "will",
        "with",
        "i",
        "we",
        "you",
        "when",
    ]
)


def _titles(cluster: Cluster) -> list[str]:
    titles = [cluster.display_label]
    titles.extend(m.title for m in cluster.members if m.title)
    return [t.lower() for t in titles if t]


class TitleEditDistance:
    """Normalised Damerau-Levenshtein (optimal string alignment) similarity of titles."""

    name = "title edit distance"

    def __init__(self, clusters: Iterable[Cluster], max_len: int = 160) -> None:
        self.clusters = list(clusters)
        self.max_len = max_len
        owners: list[int] = []
        texts: list[str] = []
        for i, cluster in enumerate(self.clusters):
            for title in _titles(cluster):
                owners.append(i)
                texts.append(title[:max_len])
        self._owners = np.asarray(owners, dtype=np.int64)
        self._lengths = np.asarray([len(t) for t in texts], dtype=np.int64)
        width = int(self._lengths.max()) if texts else 0
        # Titles as a code-point matrix, padded with -1 (never equal to a real character).
        self._codes = np.full((len(texts), width), -1, dtype=np.int64)
        for row, text in enumerate(texts):
            self._codes[row, : len(text)] = [ord(c) for c in text]

    def similarities(self, title: str) -> np.ndarray:
        """Similarity of ``title`` to every stored title, computed for all titles at once:
        the DP runs over the characters of the query and the title positions, vectorised over
        titles."""
        query = [ord(c) for c in title.lower()[: self.max_len]]
        n_titles, width = self._codes.shape
        m = len(query)
        if n_titles == 0:
            return np.zeros(0)
        if m == 0:
            return np.zeros(n_titles)
        cols = np.arange(width + 1, dtype=np.int64)
        codes = self._codes
        prev2 = np.zeros((n_titles, width + 1), dtype=np.int64)
        prev = np.tile(cols, (n_titles, 1))
        for i in range(1, m + 1):
            qc = query[i - 1]
            base = np.empty_like(prev)
            base[:, 0] = i
            # Substitution and deletion depend on the previous row only.
            base[:, 1:] = np.minimum(prev[:, :-1] + (codes != qc), prev[:, 1:] + 1)
            if i > 1 and width > 1:
                swap = (codes[:, 1:] == query[i - 2]) & (codes[:, :-1] == qc)
                base[:, 2:] = np.where(
                    swap, np.minimum(base[:, 2:], prev2[:, :-2] + 1), base[:, 2:]
                )
            # Insertion chains along the row: cur[j] = min_k<=j (base[k] + j - k), a running min.
            cur = np.minimum.accumulate(base - cols, axis=1) + cols
            prev2, prev = prev, cur
        dist = prev[np.arange(n_titles), self._lengths]
        longest = np.maximum(self._lengths, m)
        return 1.0 - dist / np.maximum(longest, 1)

    def rank(self, title: str, body: str | None = None, limit: int = 5) -> list[tuple[str, float]]:
        sims = self.similarities(title)
        best: dict[int, float] = {}
        for owner, sim in zip(self._owners.tolist(), sims.tolist(), strict=True):
            if sim > best.get(owner, -1.0):
                best[owner] = sim
        ordered = sorted(best.items(), key=lambda kv: -kv[1])[:limit]
        return [(self.clusters[i].public_id, float(s)) for i, s in ordered]


class PlainBM25:
    """Okapi BM25 (k1 = 1.2, b = 0.75) over plain word tokens of all cluster text."""

    name = "BM25 title+body"

    def __init__(self, clusters: Iterable[Cluster], k1: float = 1.2, b: float = 0.75) -> None:
        self.clusters = list(clusters)
        self.k1, self.b = k1, b
        self._tfs: list[Counter[str]] = []
        for cluster in self.clusters:
            text = " ".join([cluster.display_label, cluster.summary or "", *_titles(cluster)])
            self._tfs.append(Counter(self._tokens(text)))
        n = len(self._tfs)
        df: Counter[str] = Counter()
        for tf in self._tfs:
            df.update(tf.keys())
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}
        lengths = [sum(tf.values()) for tf in self._tfs]
        self._lengths = lengths
        self._avg = sum(lengths) / n if n else 1.0

    @staticmethod
    def _tokens(text: str) -> list[str]:
        return [w for w in _WORD.findall(text.lower()) if w not in _ENGLISH_STOP]

    def rank(self, title: str, body: str | None = None, limit: int = 5) -> list[tuple[str, float]]:
        query = Counter(self._tokens(title + " " + (body or "")))
        scores: list[float] = []
        for tf, length in zip(self._tfs, self._lengths, strict=True):
            norm = self.k1 * (1 - self.b + self.b * length / self._avg)
            s = 0.0
            for t in query:
                f = tf.get(t)
                if f:
                    s += self._idf[t] * f * (self.k1 + 1) / (f + norm)
            scores.append(s)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:limit]
        return [(self.clusters[i].public_id, scores[i]) for i in order]


BASELINES = (TitleEditDistance, PlainBM25)
