"""Fitting the scoring model on labelled issues, and cross-validating it.

Two small L2-regularised logistic regressions, in numpy:

1. relevance: over every shortlisted (issue, cluster) pair, "is this the cluster the issue
   duplicates?" from the evidence features;
2. calibration: over each issue's top candidate, "is the top candidate right?" from its relevance
   and its lead over the runner-up — the question ``decide`` has to answer.

Cross-validation folds are grouped by the expected cluster, so that a held-out issue's cluster was
never seen with a label during the fit: the hidden set is other clusters' duplicates.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bot.clusters.models import Cluster
from bot.matching.model import FEATURES, ScoreModel
from bot.matching.scoring import Matcher
from bot.matching.types import IssueText, MatchPolicy

# Signals too rare in any labelled set to fit, set by hand. An issue that cites a member or the fix
# PR of a cluster by number is pointing at it; it still needs some text agreement to be trusted.
FIXED_WEIGHTS = {"ref": 2.5}


@dataclass
class Outcome:
    """One labelled issue as a system saw it."""

    expected: str | None
    top: str | None
    score: float
    second: float
    in_top5: bool


@dataclass
class QueryFeatures:
    expected: str | None
    candidates: list[tuple[str, list[float]]]
    # The feature each column of a candidate's vector holds.
    names: tuple[str, ...] = FEATURES


def collect(
    matcher: Matcher, queries: Iterable[dict[str, Any]], policy: MatchPolicy
) -> list[QueryFeatures]:
    """The shortlist and its feature vectors for each labelled issue (model-independent)."""
    out = []
    for q in queries:
        issue = IssueText(
            number=q.get("number"), title=str(q.get("title") or ""), body=str(q.get("body") or "")
        )
        ranked = matcher._rank(issue, None, policy, None)
        cands = [
            (matcher.public_id(int(i)), row)
            for i, row in zip(ranked.docs.tolist(), ranked.values.tolist(), strict=True)
        ]
        exp = str(q["expected"]) if q.get("expected") else None
        out.append(QueryFeatures(expected=exp, candidates=cands, names=matcher.feature_names))
    return out


def _logistic(
    x: np.ndarray, y: np.ndarray, l2: float, weight: np.ndarray | None = None
) -> np.ndarray:
    """L2-regularised logistic regression by Newton's method; the bias (last column of the
    returned vector) is not penalised."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(d + 1)
    sw = np.ones(n) if weight is None else weight
    reg = np.full(d + 1, l2)
    reg[-1] = 1e-6
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-np.clip(xb @ w, -30, 30)))
        grad = xb.T @ (sw * (p - y)) + reg * w
        hess = (xb * (sw * p * (1 - p))[:, None]).T @ xb + np.diag(reg)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def fit(data: Sequence[QueryFeatures], l2_rel: float = 1.0, l2_cal: float = 1.0) -> ScoreModel:
    rows, labels, weights = [], [], []
    for q in data:
        n = max(1, len(q.candidates))
        for cid, vec in q.candidates:
            rows.append(vec)
            labels.append(1.0 if cid == q.expected else 0.0)
            # Each issue counts once, however long its shortlist: otherwise the negatives of
            # long shortlists drown the few positives.
            weights.append(1.0 if cid == q.expected else 1.0 / n)
    if not rows:
        return ScoreModel(weights=dict(FIXED_WEIGHTS))
    x = np.asarray(rows, dtype=float)
    names = data[0].names
    fitted = [i for i, f in enumerate(names) if f not in FIXED_WEIGHTS]
    w = _logistic(x[:, fitted], np.asarray(labels), l2_rel, np.asarray(weights))
    rel_weights = {k: v for k, v in FIXED_WEIGHTS.items() if k in names}
    rel_weights.update({names[i]: float(v) for i, v in zip(fitted, w[:-1], strict=True)})
    model = ScoreModel(weights=rel_weights, bias=float(w[-1]))

    cal_x, cal_y = [], []
    for q in data:
        top, rel, gap = _top(model, q)
        if top is None:
            continue
        cal_x.append([rel, gap])
        cal_y.append(1.0 if top == q.expected else 0.0)
    if not cal_x:
        return model
    c = _logistic(np.asarray(cal_x, dtype=float), np.asarray(cal_y), l2_cal)
    return ScoreModel(
        weights=rel_weights,
        bias=float(w[-1]),
        cal_rel=float(c[0]),
        cal_gap=float(c[1]),
        cal_bias=float(c[2]),
        floor=model.floor,
    )


def _top(model: ScoreModel, q: QueryFeatures) -> tuple[str | None, float, float]:
    if not q.candidates:
        return None, 0.0, 0.0
    rels = sorted(
        (
            (model.relevance(dict(zip(q.names, vec, strict=True))), cid)
            for cid, vec in q.candidates
        ),
        reverse=True,
    )
    second = rels[1][0] if len(rels) > 1 else model.floor
    return rels[0][1], rels[0][0], rels[0][0] - second


def outcome(model: ScoreModel, q: QueryFeatures) -> Outcome:
    if not q.candidates:
        return Outcome(q.expected, None, 0.0, 0.0, False)
    scored = sorted(
        (
            (model.relevance(dict(zip(q.names, vec, strict=True))), cid)
            for cid, vec in q.candidates
        ),
        reverse=True,
    )
    top_rel, top = scored[0]
    second_rel = scored[1][0] if len(scored) > 1 else model.floor
    score = model.probability(top_rel, top_rel - second_rel)
    second = model.probability(second_rel, second_rel - top_rel) if len(scored) > 1 else 0.0
    return Outcome(
        expected=q.expected,
        top=top,
        score=score,
        second=second,
        in_top5=any(cid == q.expected for _, cid in scored[:5]),
    )


def folds_by_cluster(data: Sequence[QueryFeatures], k: int, seed: int = 0) -> list[list[int]]:
    """k folds; all issues of one expected cluster fall in the same fold."""
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(data):
        key = q.expected if q.expected else f"none-{i}"
        groups.setdefault(key, []).append(i)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    folds: list[list[int]] = [[] for _ in range(k)]
    # Largest groups first, each into the currently smallest fold, keeps folds even.
    for key in sorted(keys, key=lambda g: -len(groups[g])):
        min(folds, key=len).extend(groups[key])
    return [f for f in folds if f]


def cross_validate(
    clusters: Iterable[Cluster],
    queries: Sequence[dict[str, Any]],
    folds: int = 10,
    policy: MatchPolicy | None = None,
    l2_rel: float = 1.0,
    l2_cal: float = 1.0,
    *,
    matcher: Matcher | None = None,
) -> list[Outcome]:
    """Held-out outcomes: each issue scored by a model fitted without its fold. ``matcher``
    (built over the same clusters) saves building the index again, and decides the features:
    with an encoder, the semantic feature is fitted too."""
    matcher = matcher or Matcher(clusters)
    data = collect(matcher, queries, policy or MatchPolicy())
    out: list[Outcome | None] = [None] * len(data)
    for fold in folds_by_cluster(data, folds):
        held = set(fold)
        train = [q for i, q in enumerate(data) if i not in held]
        model = fit(train, l2_rel, l2_cal)
        for i in fold:
            out[i] = outcome(model, data[i])
    return [o for o in out if o is not None]
