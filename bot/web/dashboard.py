"""What the repository page shows, as typed values: the latest suggestions and their state, the
repository's health, fixes that look incomplete, and the backtest from stored history. Plain
reads of the store and the index, done in a thread by the handlers; no HTML here."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

from bot.clusters.models import Cluster
from bot.db.store import CommentRecord, Pause, Store, Suggestion
from bot.features.auto_mode import decide, load_verdict
from bot.features.installs import BackfillRecord, load_record
from bot.github.payloads import iso_seconds
from bot.matching.index import ClusterIndex
from bot.matching.signals import LABELS, ROWS, WORDS
from bot.matching.types import Match, MatchEvidence
from bot.render.comment import code, evidence_rows
from bot.repo_config import RepoConfig
from bot.settings import ServiceConfig


def when(epoch: float | None) -> str:
    if not epoch:
        return "—"
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class EvidenceView:
    """Evidence for (the comment's rows: signal, what matched and where it came from as
    markdown, weight) and against (what sets the issue and the bug apart)."""

    for_: list[tuple[str, str, float]]
    against: list[str]


def evidence_view(evidence: MatchEvidence, cluster: Cluster | None, repo: str,
                  score: float = 0.0) -> EvidenceView:
    """The same rows as the comment's "Why Dejafix thinks so" (each piece once, with where it
    came from); without the cluster's record (since removed), the pieces alone."""
    if cluster is not None:
        rows = evidence_rows(Match(cluster, score, evidence), repo)
    else:
        # The comment's rows with pieces, each as many as the comment shows, the words last.
        listed = [*(row for row in ROWS.values() if row.name != WORDS), ROWS[WORDS]]
        rows = [(row.name, ", ".join(code(x) for x in getattr(evidence, row.pieces)[:row.shown]),
                 0.0) for row in listed if row.pieces and getattr(evidence, row.pieces)]
    against = [f"{LABELS.get(name, name)} ({value:+.2f})"
               for name, value in sorted(evidence.parts.items(), key=lambda kv: kv[1])
               if value < 0]
    issue_only = sorted(set(evidence.issue_facets) - set(evidence.cluster_facets))
    if issue_only and evidence.cluster_facets:
        against.append("the issue names " + ", ".join(issue_only) + "; the bug's reports name "
                       + ", ".join(sorted(evidence.cluster_facets)))
    return EvidenceView(rows, against)


@dataclass(frozen=True)
class SuggestionView:
    issue: int
    issue_url: str
    cluster: str
    cluster_label: str
    score: float
    mode: str
    state: str
    comment_url: str | None
    evidence: EvidenceView
    regression: str | None
    updated: str
    body: str


def suggestion_state(s: Suggestion, comment: CommentRecord | None,
                     feedback: list[tuple[str, str, str | None]]) -> str:
    """posted, edited, shadow (not posted), labelled (a possible regression), a dry run's
    (not posted), dismissed with ``/dejafix not-this``, or moved with ``same-as``."""
    for cluster, kind, login in reversed(feedback):
        by = f" by {login}" if login else ""
        if kind == "dismissed" and cluster == s.cluster:
            return f"dismissed (/dejafix not-this{by})"
        if kind == "confirmed" and cluster != s.cluster:
            return f"moved to {cluster} (/dejafix same-as{by})"
        if kind == "confirmed":
            return f"confirmed (/dejafix same-as{by})"
    if s.mode == "shadow":
        return "shadow (not posted)"
    if s.mode == "label":
        return "labelled, not answered (possible regression)"
    if comment is None:
        # A live run writes the comment ledger's row before the suggestion (and never prunes
        # it): a comment suggestion without one is a dry run's answer, which posts nothing.
        return "dry run (not posted)"
    if comment is not None and comment.updated_at > comment.created_at + 1:
        return "posted, edited"
    return "posted"


def suggestions_view(store: Store, index: ClusterIndex, repos: list[str], web_url: str,
                     limit: int = 50) -> list[SuggestionView]:
    """``repos``: the repository, then its upstreams (where a suggested cluster may be)."""
    repo = repos[0]
    rows = store.suggestions(repo, limit)
    issues = [s.issue for s in rows]
    comments = store.comments_on(repo, issues)
    feedback = store.feedback_on(repo, issues)
    out = []
    for s in rows:
        cluster = find_cluster(index, repos, s.cluster)
        comment = comments.get(s.issue)
        url = f"{web_url}/{repo}/issues/{s.issue}"
        out.append(SuggestionView(
            issue=s.issue, issue_url=url, cluster=s.cluster,
            cluster_label=cluster.display_label if cluster else s.cluster, score=s.score,
            mode=s.mode, state=suggestion_state(s, comment, feedback.get(s.issue, [])),
            comment_url=(f"{url}#issuecomment-{comment.comment_id}"
                         if comment is not None and comment.comment_id and s.mode == "comment"
                         else None),
            evidence=evidence_view(MatchEvidence.model_validate(json.loads(s.evidence)),
                                   cluster, repo, s.score),
            regression=s.regression, updated=when(s.updated_at), body=s.body,
        ))
    return out


@dataclass(frozen=True)
class Health:
    mode: str
    mode_source: str
    pause: Pause | None
    cap_used: int
    cap: int
    dismissed: int
    judged: int
    pause_window: int
    pause_rate: float
    config_errors: list[str]
    curated: int
    learned: int
    last_backfill: str | None
    # The backfill run as jobs (installs.py): its figures, or None when it never ran.
    backfill: BackfillView | None = None
    # ``mode: auto``: whether it comments and why.
    auto: str | None = None

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.paused


@dataclass(frozen=True)
class BackfillView:
    """A repository's backfill as the page shows it: a sentence, and the pull requests read of
    the total for the progress bar."""

    state: str
    text: str
    done: int
    total: int | None


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 1:
        return "under a minute"
    if minutes < 120:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def backfill_view(record: BackfillRecord | None, now: float) -> BackfillView | None:
    if record is None:
        return None
    phase = {"pulls": "pull requests", "duplicates": "duplicate-closed issues",
             "diffs": "the fixes' diffs", "done": "done"}.get(record.phase, record.phase)
    read = (f"{record.prs_read:,} of {record.prs_total:,} pull requests read"
            if record.prs_total is not None else f"{record.prs_read:,} pull requests read")
    figures = f"{read}, {record.clusters:,} clusters learned, {record.calls:,} calls spent"
    if record.state == "queued":
        text = "queued: waits for its installation's turn (one repository at a time)"
    elif record.state == "running":
        left = (f"; about {_duration(record.seconds_left)} left in this phase at the current "
                "rate" if record.seconds_left is not None else "")
        text = f"running ({phase}): {figures}{left}"
    elif record.state == "waiting":
        text = (f"waiting for the rate limit until {when(record.waiting_until)} ({phase}): "
                f"{figures}")
    elif record.state == "done":
        text = f"done {when(record.finished_at)}: {figures}"
    elif record.state == "off":
        text = "off (backfill: off in config/bot.yml, or backfill: false in .github/dejafix.yml)"
    else:
        text = f"stopped ({record.error or 'unknown reason'}): {figures}"
    return BackfillView(record.state, text, record.prs_read, record.prs_total)


def health(store: Store, index: ClusterIndex, repo: str, config: RepoConfig,
           default_mode: str, config_errors: list[str], *,
           service_config: ServiceConfig | None = None) -> Health:
    pause = store.get_pause(repo)
    since = (pause.resumed_at or 0.0) if pause is not None else 0.0
    dismissed, judged = store.dismissal_rate(repo, config.pause_window, since)
    learned = store.learned_count(repo)
    backfills = store.cursors(f"backfill:{repo.lower()}:")
    last = max(backfills, key=lambda b: b[2]) if backfills else None
    record = load_record(store, repo)
    mode = config.mode or default_mode
    auto = None
    if mode == "auto":
        service = service_config or ServiceConfig()
        auto = decide(load_verdict(store, repo), service,
                      backfill_off=service.backfill == "off" or not config.backfill
                      or (record is not None and record.state == "off")).why
    return Health(
        mode=mode,
        mode_source=".github/dejafix.yml" if config.mode else "the deployment's default_mode",
        pause=pause, cap_used=store.comments_in_last(repo, 24 * 3600),
        cap=config.max_comments_per_day, dismissed=dismissed, judged=judged,
        pause_window=config.pause_window, pause_rate=config.pause_dismissal_rate,
        config_errors=config_errors, curated=max(index.count(repo) - learned, 0),
        learned=learned,
        last_backfill=(f"{'finished' if last[1].startswith('done') else 'stopped at ' + last[1]}"
                       f", {when(last[2])}") if last else None,
        backfill=backfill_view(record, time.time()), auto=auto,
    )


@dataclass(frozen=True)
class Report:
    issue: int
    issue_url: str
    matched: str
    regression: str | None


@dataclass(frozen=True)
class IncompleteFix:
    """A cluster whose reports kept coming after its fix shipped."""

    cluster: str
    label: str
    fix_url: str | None
    fix_pr: int | None
    fixed_on: str
    reports: list[Report] = field(default_factory=list)
    regressions: int = 0


def find_cluster(index: ClusterIndex, repos: list[str], public_id: str) -> Cluster | None:
    """The cluster a suggestion names: the repository's own, else an upstream's."""
    for repo in repos:
        cluster = index.find(repo, public_id)
        if cluster is not None:
            return cluster
    return None


def incomplete_fixes(store: Store, index: ClusterIndex, repos: list[str], web_url: str,
                     limit: int = 20) -> list[IncompleteFix]:
    """Clusters with reports matched after their fix was *released* (a merge alone proves
    nothing: the bot only ever suggests landed fixes), and possible regressions of theirs
    whatever the dates; possible regressions first, then the most reports. ``repos``: the
    repository, then its upstreams. A report's date is when the bot matched it, seconds after
    it was opened (or edited)."""
    repo = repos[0]
    by_cluster: dict[str, list[tuple[int, str, float, str | None]]] = defaultdict(list)
    for mark in store.suggestion_marks(repo):
        by_cluster[mark[1]].append(mark)
    out: list[IncompleteFix] = []
    for public_id, marks in by_cluster.items():
        cluster = find_cluster(index, repos, public_id)
        if cluster is None:
            continue
        fix = cluster.landed_fix
        released = iso_seconds(fix.released_at)
        later = [m for m in marks if m[3] or (released is not None and m[2] > released)]
        if not later:
            continue
        reports = [Report(issue, f"{web_url}/{repo}/issues/{issue}", when(at), regression)
                   for issue, _, at, regression in later]
        out.append(IncompleteFix(
            cluster=public_id, label=cluster.display_label,
            fix_url=f"{web_url}/{cluster.repo}/pull/{fix.pr}" if fix.pr else None,
            fix_pr=fix.pr,
            fixed_on=(f"released {fix.released_in or ''} {(fix.released_at or '')[:10]}".strip()
                      if fix.released_at else f"merged {(fix.merged_at or '')[:10]}"),
            reports=reports, regressions=sum(1 for m in later if m[3])))
    out.sort(key=lambda f: (-f.regressions, -len(f.reports), f.cluster))
    return out[:limit]


@dataclass(frozen=True)
class BacktestView:
    """How the bot would have done on the repository's own history (``bot/eval/backtest.py``,
    the same figures as ``dejafix backtest``)."""

    clusters: int
    queries: int
    positives: int
    threshold: float
    said: int
    right: int
    precision: float
    recall: float
    # (threshold, comments, right, precision, recall), highest threshold first.
    table: list[tuple[float, int, int, float, float]]
    recommended: tuple[float, float, float] | None
    # The precision-recall curve as SVG polyline points in a 0..200 box (recall across).
    curve: str
    want_precision: float = 0.9
    # How many clusters the repository has, when more than were replayed.
    of: int = 0


# A replay builds a matcher per distinct history prefix, so its time grows with the square of
# the clusters (bench/page.py on this 2-core machine: 100 clusters 2.2 s, 200 6.0 s, 400
# 23 s): the page replays the latest 200.
BACKTEST_CLUSTERS = 200


def latest_clusters(index: ClusterIndex, repo: str) -> tuple[list[Cluster], int]:
    """The repository's clusters whose fix merged last, at most ``BACKTEST_CLUSTERS``, and
    how many it has."""
    clusters = index.clusters(repo)
    latest = sorted(clusters, key=lambda c: c.landed_fix.merged_at or "")[-BACKTEST_CLUSTERS:]
    return latest, len(clusters)


def backtest(clusters: list[Cluster], threshold: float, margin: float,
             want_precision: float = 0.9, of: int = 0) -> BacktestView | None:
    """None when no issue of these clusters carries an opening date."""
    from bot.eval.backtest import history_queries, recommend_threshold, replay
    from bot.eval.offline import pr_at, pr_curve
    from bot.matching import MatchPolicy

    queries = history_queries(clusters)
    if not queries:
        return None
    policy = MatchPolicy().model_copy(update={"threshold": threshold, "margin": margin})
    outcomes = replay(clusters, policy, queries)
    said, right, precision, recall = pr_at(outcomes, threshold, margin)
    table = []
    for step in range(19, 9, -1):
        th = step / 20
        n, ok, p, r = pr_at(outcomes, th, margin)
        table.append((th, n, ok, p, r))
    curve = " ".join(f"{r * 200:.1f},{200 - p * 200:.1f}"
                     for _, p, r in sorted(pr_curve(outcomes), key=lambda c: c[2]))
    return BacktestView(
        clusters=len(clusters), queries=len(outcomes),
        positives=sum(1 for o in outcomes if o.expected), threshold=threshold, said=said,
        right=right, precision=precision, recall=recall, table=table,
        recommended=recommend_threshold(outcomes, want_precision), curve=curve,
        want_precision=want_precision, of=of if of > len(clusters) else 0)
