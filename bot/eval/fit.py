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

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bot.clusters.models import Cluster, Member
from bot.matching.model import FEATURES, ScoreModel, features_only
from bot.matching.regression import regression_of
from bot.matching.scoring import Matcher
from bot.matching.signals import AGAINST, FIXED_WEIGHTS
from bot.matching.text import clean_title
from bot.matching.types import IssueText, MatchPolicy

# Signals too rare in any labelled set to fit are set by hand (``FIXED_WEIGHTS``), and evidence
# against a match (``AGAINST``) may only weigh negatively, every other signal only positively: a
# feature of agreement that the fit would make count against (as noise in a small set can) is
# set to zero instead. Both are declared with each signal in bot/matching/signals.py.
# No feature alone may add more than this to the relevance (before calibration): when every
# matching signal fires, the score must still be able to hear what speaks against.
MAX_WEIGHT = 3.0
# What a pair made from a cluster's own members weighs against one real labelled issue.
SYNTHETIC_WEIGHT = 0.5


@dataclass
class Outcome:
    """One labelled issue as a system saw it."""

    expected: str | None
    top: str | None
    score: float
    second: float
    in_top5: bool
    # The top match is a possible regression of its cluster's fix (bot/matching/regression.py):
    # under the default ``regressions: label`` the bot labels it and posts no comment.
    regression: bool = False


@dataclass
class QueryFeatures:
    expected: str | None
    candidates: list[tuple[str, list[float]]]
    # The feature each column of a candidate's vector holds.
    names: tuple[str, ...] = FEATURES
    # The cluster the issue belongs to (folds keep a group together), and its weight in a fit.
    group: str = ""
    weight: float = 1.0


def _features_of(matcher: Matcher, issue: IssueText, policy: MatchPolicy, expected: str | None,
                 group: str, weight: float = 1.0) -> QueryFeatures:
    ranked = matcher._rank(issue, None, policy, None)
    cands = [
        (matcher.public_id(int(i)), row)
        for i, row in zip(ranked.docs.tolist(), ranked.values.tolist(), strict=True)
    ]
    return QueryFeatures(expected=expected, candidates=cands, names=matcher.feature_names,
                         group=group, weight=weight)


def collect(
    matcher: Matcher, queries: Iterable[dict[str, Any]], policy: MatchPolicy
) -> list[QueryFeatures]:
    """The shortlist and its feature vectors for each labelled issue (model-independent)."""
    out = []
    for n, q in enumerate(queries):
        issue = _issue_of(q)
        exp = str(q["expected"]) if q.get("expected") else None
        out.append(_features_of(matcher, issue, policy, exp, exp or f"none-{n}"))
    return out


def _query_members(cluster: Cluster) -> list[Member]:
    """Members whose title can stand for a new report of the cluster's bug: not the fix PR,
    and not a title the cluster's label repeats (that pair would be too easy)."""
    label = clean_title(cluster.display_label).lower()
    out = []
    for m in cluster.members:
        if not m.title or m.is_fix_pr or m.number == cluster.landed_fix.pr:
            continue
        if clean_title(m.title).lower() == label:
            continue
        out.append(m)
    return out


def synthetic(clusters: Sequence[Cluster], policy: MatchPolicy | None = None, *,
              parts: int = 5, per_cluster: int = 2, seed: int = 0,
              weight: float = SYNTHETIC_WEIGHT) -> list[QueryFeatures]:
    """Self-supervised pairs from the clusters themselves, no labelled issue needed.

    Each cluster with a member title of its own gives, per such member (up to
    ``per_cluster``), a positive and a negative, both title only (as many real reports are):
    the member's title against the index with that member taken out of its cluster (its
    cluster is the answer), and against the index without its cluster at all (nothing is the
    answer, and whatever comes first is a look-alike: a sibling of the same subsystem, the
    hardest negative there is). Clusters are taken out ``parts`` groups at a time, so each
    group costs two index builds."""
    policy = policy or MatchPolicy()
    titled = {c.public_id: _query_members(c)[:per_cluster] for c in clusters
              if c.landed_fix.landed and _query_members(c)}
    ids = sorted(titled)
    random.Random(seed).shuffle(ids)
    out: list[QueryFeatures] = []
    for g in range(parts):
        group = set(ids[g::parts])
        if not group:
            continue
        without = Matcher([c for c in clusters if c.public_id not in group],
                          model=features_only())
        for r in range(per_cluster):
            chosen = {cid: titled[cid][r] for cid in group if len(titled[cid]) > r}
            if not chosen:
                continue
            less = Matcher([
                c.model_copy(update={"members": [m for m in c.members
                                                 if m is not chosen[c.public_id]]})
                if c.public_id in chosen else c
                for c in clusters
            ], model=features_only())
            for cid, m in sorted(chosen.items()):
                issue = IssueText(title=m.title or "", body="")
                out.append(_features_of(less, issue, policy, cid, cid, weight))
                out.append(_features_of(without, issue, policy, None, cid, weight))
    return out


def data_digest(clusters: Iterable[Cluster], queries: Iterable[dict[str, Any]]) -> str:
    """A hash of what a fit learned from: the clusters and the labelled issues."""
    h = hashlib.sha256()
    for c in clusters:
        h.update(c.model_dump_json().encode("utf-8", "surrogatepass"))
    for q in queries:
        h.update(json.dumps(q, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def _logistic(
    x: np.ndarray, y: np.ndarray, l2: float, weight: np.ndarray | None = None,
    lower: np.ndarray | None = None, upper: np.ndarray | None = None,
) -> np.ndarray:
    """L2-regularised logistic regression by Newton's method, each coefficient kept within
    ``[lower, upper]`` (an active set: a coefficient on its bound whose gradient pushes it out
    stays there); the bias (last column of the returned vector) is free and not penalised."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(d + 1)
    lo = np.concatenate([lower if lower is not None else np.full(d, -np.inf), [-np.inf]])
    hi = np.concatenate([upper if upper is not None else np.full(d, np.inf), [np.inf]])
    sw = np.ones(n) if weight is None else weight
    reg = np.full(d + 1, l2)
    reg[-1] = 1e-6
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-np.clip(xb @ w, -30, 30)))
        grad = xb.T @ (sw * (p - y)) + reg * w
        hess = (xb * (sw * p * (1 - p))[:, None]).T @ xb + np.diag(reg)
        stuck = ((w <= lo) & (grad > 0)) | ((w >= hi) & (grad < 0))
        free = ~stuck
        step = np.zeros(d + 1)
        step[free] = np.linalg.solve(hess[np.ix_(free, free)], grad[free])
        new = np.clip(w - step, lo, hi)
        moved = np.abs(new - w).max()
        w = new
        if moved < 1e-8:
            break
    return w


def _fit_relevance(data: Sequence[QueryFeatures], l2: float) -> ScoreModel:
    rows, labels, weights = [], [], []
    for q in data:
        n = max(1, len(q.candidates))
        for cid, vec in q.candidates:
            rows.append(vec)
            labels.append(1.0 if cid == q.expected else 0.0)
            # Each issue counts once, however long its shortlist: otherwise the negatives of
            # long shortlists drown the few positives.
            weights.append(q.weight * (1.0 if cid == q.expected else 1.0 / n))
    if not rows:
        return ScoreModel(weights=dict(FIXED_WEIGHTS))
    names = data[0].names
    x = np.asarray(rows, dtype=float)
    fitted = [i for i, f in enumerate(names) if f not in FIXED_WEIGHTS]
    lower = np.array([-MAX_WEIGHT if names[i] in AGAINST else 0.0 for i in fitted])
    upper = np.array([0.0 if names[i] in AGAINST else MAX_WEIGHT for i in fitted])
    w = _logistic(x[:, fitted], np.asarray(labels), l2, np.asarray(weights), lower, upper)
    rel_weights = {k: v for k, v in FIXED_WEIGHTS.items() if k in names}
    rel_weights.update({names[i]: round(float(v), 4) for i, v in zip(fitted, w[:-1],
                                                                    strict=True)})
    return ScoreModel(weights=rel_weights, bias=round(float(w[-1]), 4))


def fit(data: Sequence[QueryFeatures], l2_rel: float = 1.0, l2_cal: float = 1.0,
        inner_folds: int = 5) -> ScoreModel:
    """Relevance on every shortlisted pair; calibration on each issue's top candidate, scored
    by a relevance fitted *without* that issue's fold: a model calibrated on the very issues it
    was fitted on believes itself, and is over-confident on the next repository."""
    model = _fit_relevance(data, l2_rel)
    if not data:
        return model
    cal_x, cal_y, cal_w = [], [], []
    for fold in folds_by_cluster(data, inner_folds, seed=1):
        held = set(fold)
        inner = _fit_relevance([q for i, q in enumerate(data) if i not in held], l2_rel)
        for i in fold:
            q = data[i]
            top, rel, gap = _top(inner, q)
            if top is None:
                continue
            cal_x.append([rel, gap])
            cal_y.append(1.0 if top == q.expected else 0.0)
            cal_w.append(q.weight)
    if not cal_x:
        return model
    c = _logistic(np.asarray(cal_x, dtype=float), np.asarray(cal_y), l2_cal,
                  np.asarray(cal_w), np.zeros(2), np.array([np.inf, np.inf]))
    return ScoreModel(
        weights=model.weights,
        bias=model.bias,
        cal_rel=round(float(c[0]), 4),
        cal_gap=round(float(c[1]), 4),
        cal_bias=round(float(c[2]), 4),
        floor=model.floor,
    )


def _relevance(model: ScoreModel, names: tuple[str, ...], vec: list[float]) -> float:
    return model.relevance(dict(zip(names, vec, strict=True)))


def _top(model: ScoreModel, q: QueryFeatures) -> tuple[str | None, float, float]:
    if not q.candidates:
        return None, 0.0, 0.0
    rels = sorted(((_relevance(model, q.names, vec), cid) for cid, vec in q.candidates),
                  reverse=True)
    second = rels[1][0] if len(rels) > 1 else model.floor
    return rels[0][1], rels[0][0], rels[0][0] - second


def outcome(model: ScoreModel, q: QueryFeatures) -> Outcome:
    if not q.candidates:
        return Outcome(q.expected, None, 0.0, 0.0, False)
    scored = sorted(((_relevance(model, q.names, vec), cid) for cid, vec in q.candidates),
                    reverse=True)
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
        key = q.group or (q.expected if q.expected else f"none-{i}")
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
    extra: Sequence[QueryFeatures] | None = None,
    seed: int = 0,
) -> list[Outcome]:
    """Held-out outcomes: each issue scored by a model fitted without its fold. ``matcher``
    (built over the same clusters) saves building the index again. ``extra`` are training pairs
    beside the labelled issues (by default the clusters' own, ``synthetic``): those of a
    held-out issue's cluster are left out of its fold's fit, as its labelled issues are."""
    clusters = list(clusters)
    policy = policy or MatchPolicy()
    matcher = matcher or Matcher(clusters, model=features_only())
    data = collect(matcher, queries, policy)
    if extra is None:
        extra = synthetic(clusters, policy)
    out: list[Outcome | None] = [None] * len(data)
    by_id = {c.public_id: c for c in clusters}
    for fold in folds_by_cluster(data, folds, seed):
        held = set(fold)
        groups = {data[i].group for i in fold}
        train = [q for i, q in enumerate(data) if i not in held]
        train += [q for q in extra if q.group not in groups]
        model = fit(train, l2_rel, l2_cal)
        for i in fold:
            o = outcome(model, data[i])
            if o.top is not None and o.top in by_id:
                o.regression = regression_of(_issue_of(queries[i]), by_id[o.top]) is not None
            out[i] = o
    return [o for o in out if o is not None]


def _issue_of(q: dict[str, Any]) -> IssueText:
    return IssueText(number=q.get("number"), title=str(q.get("title") or ""),
                     body=str(q.get("body") or ""))
