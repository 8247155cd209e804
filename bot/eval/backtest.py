"""Backtest: how the bot would have done on a repository's own history, before it is turned on.

Every issue of a learned cluster is a query, answered only with the clusters whose fix had
landed before the issue was opened (and without the issue itself among their members): a report
opened after its bug's fix is a duplicate the bot should have answered; the original report,
opened before any fix, should have got silence. The figures are computed by the same code as
``python -m bot eval``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bot.clusters.models import Cluster
from bot.eval.fit import Outcome
from bot.matching import IssueText, Matcher, MatchPolicy


@dataclass(frozen=True)
class HistoryQuery:
    number: int
    title: str
    body: str
    created_at: str
    expected: str | None


def _created(member: object) -> str | None:
    value = getattr(member, "created_at", None)
    return str(value) if value else None


def history_queries(clusters: Iterable[Cluster]) -> list[HistoryQuery]:
    """Issues with a known opening date, labelled with the cluster whose fix predates them."""
    queries: list[HistoryQuery] = []
    for cluster in clusters:
        merged = cluster.landed_fix.merged_at
        for m in cluster.members:
            created = _created(m)
            if m.kind != "issue" or not created or not m.title:
                continue
            later = merged is not None and created > merged and cluster.landed_fix.landed
            body = str(getattr(m, "body_excerpt", None) or "")
            queries.append(HistoryQuery(m.number, m.title, body, created,
                                        cluster.public_id if later else None))
    queries.sort(key=lambda q: (q.created_at, q.number))
    return queries


def _without(cluster: Cluster, number: int) -> Cluster:
    kept = [m for m in cluster.members if not (m.kind == "issue" and m.number == number)]
    return cluster if len(kept) == len(cluster.members) else cluster.model_copy(
        update={"members": kept})


def replay(clusters: list[Cluster], policy: MatchPolicy | None = None,
           queries: list[HistoryQuery] | None = None) -> list[Outcome]:
    """One outcome per history query, each ranked against the clusters of its own time."""
    policy = policy or MatchPolicy()
    queries = history_queries(clusters) if queries is None else queries
    outcomes: list[Outcome] = []
    cache: dict[tuple[tuple[str, ...], int | None], Matcher] = {}
    for q in queries:
        before = [c for c in clusters if c.landed_fix.landed and c.landed_fix.merged_at
                  and c.landed_fix.merged_at < q.created_at]
        member_of = any(m.kind == "issue" and m.number == q.number
                        for c in before for m in c.members)
        key = (tuple(sorted(c.public_id for c in before)), q.number if member_of else None)
        matcher = cache.get(key)
        if matcher is None:
            matcher = Matcher([_without(c, q.number) for c in before])
            cache[key] = matcher
        matches = matcher.rank(IssueText(number=q.number, title=q.title, body=q.body),
                               limit=5, policy=policy)
        outcomes.append(Outcome(
            expected=q.expected,
            top=matches[0].public_id if matches else None,
            score=matches[0].score if matches else 0.0,
            second=matches[1].score if len(matches) > 1 else 0.0,
            in_top5=any(m.public_id == q.expected for m in matches),
        ))
    return outcomes


def recommend_threshold(outcomes: list[Outcome], want_precision: float
                        ) -> tuple[float, float, float] | None:
    """The lowest threshold whose precision reaches the wanted one: (threshold, P, R)."""
    from bot.eval.offline import pr_curve

    ok = [c for c in pr_curve(outcomes) if c[1] >= want_precision and c[2] > 0]
    return min(ok, key=lambda c: c[0]) if ok else None


# A replay builds a matcher per distinct history prefix: its time grows with the square of the
# clusters (bench/page.py: 200 clusters about 6 s on 2 cores), so it replays the latest ones.
MEASURE_CLUSTERS = 200


@dataclass(frozen=True)
class Figures:
    """A backtest at one threshold: the comments it would have made (``said``), the right ones,
    their precision and the recall over the issues that were duplicates of a fixed bug."""

    clusters: int
    queries: int
    positives: int
    said: int
    right: int
    precision: float
    recall: float


def measure(clusters: list[Cluster], policy: MatchPolicy,
            limit: int = MEASURE_CLUSTERS) -> Figures:
    """The repository's own backtest at ``policy``'s threshold and margin, over the ``limit``
    clusters whose fix merged last. CPU work: call it in a thread."""
    from bot.eval.offline import pr_at

    latest = sorted(clusters, key=lambda c: c.landed_fix.merged_at or "")[-limit:]
    outcomes = replay(latest, policy)
    said, right, precision, recall = pr_at(outcomes, policy.threshold, policy.margin)
    return Figures(len(latest), len(outcomes), sum(1 for o in outcomes if o.expected), said,
                   right, precision, recall)
