"""Dejafix's Prometheus metrics, kept and written by prometheus-client.

Each ``Metrics`` (``create_app`` makes one per application) has its own
``prometheus_client.CollectorRegistry``: test apps in one process share nothing, and nothing is
put on the library's global default registry. A deployment of several processes (``serve``,
``serve --no-worker``, ``worker --port N``) has one registry in each, which that process serves at
/metrics on its own port, and each is scraped on its own; prometheus-client's multiprocess mode
is not needed and not used (``PROMETHEUS_MULTIPROC_DIR`` must stay unset).

Label values are always bounded words (event names from a fixed list, outcome words, HTTP status
classes), never repository names or text from a payload, so the series count stays small.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# No ``<name>_created`` series beside each counter and histogram (a gauge family of its own in
# the text format): /metrics shows only the series listed in the README. A switch in the
# library, read when a metric is made; no Dejafix metric wants them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# GitHub webhook events a label may name; any other X-GitHub-Event header (it is sender-chosen
# until the signature is checked) is counted as "other".
KNOWN_EVENTS = frozenset({
    "check_run", "check_suite", "create", "delete", "installation",
    "installation_repositories", "installation_target", "issue_comment", "issues", "label",
    "meta", "ping", "pull_request", "pull_request_review", "pull_request_review_comment",
    "pull_request_review_thread", "push", "release", "repository", "status", "workflow_job",
    "workflow_run",
    # The bot's own job kind: a slice of a repository's backfill (bot/features/installs.py).
    "dejafix_backfill",
})

RECEIVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0)
JOB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 150.0)

# The text exposition format prometheus_client.generate_latest writes.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def event_label(event: str | None) -> str:
    return event if event in KNOWN_EVENTS else "other"


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


class Counter:
    """A ``prometheus_client.Counter`` with its labels given to ``inc`` (``inc(outcome="done")``
    rather than ``labels(outcome="done").inc()``), and ``value`` to read a series back from the
    registry (tests)."""

    __slots__ = ("_counter", "_registry", "labelnames", "name")

    def __init__(self, registry: CollectorRegistry, name: str, documentation: str,
                 labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        self.name = name
        self.labelnames = tuple(labelnames)
        self._registry = registry
        self._counter = prometheus_client.Counter(name, documentation, self.labelnames,
                                                  registry=registry)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self._counter.labels(**labels) if labels else self._counter).inc(amount)

    def value(self, **labels: str) -> float:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {list(self.labelnames)}")
        found = self._registry.get_sample_value(self.name,
                                                {k: str(v) for k, v in labels.items()})
        return found if found is not None else 0.0


class BackfillFigures(Protocol):
    """What /metrics reads of one repository's backfill (``installs.BackfillRecord``)."""

    state: str
    prs_read: int
    prs_total: int | None
    clusters: int
    calls: int
    seconds_left: float | None
    waiting_until: float | None


class Metrics:
    """Dejafix's metrics, in one registry per application."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.deliveries = Counter(
            r, "dejafix_deliveries_total",
            "Webhook deliveries received, by event and what the receiver did (queued, "
            "duplicate, ignored, ping, unauthorized, bad_request, too_large, "
            "unsupported_media_type, error: not recorded, answered 503).", ("event", "outcome"))
        self.jobs = Counter(
            r, "dejafix_jobs_total",
            "Queued deliveries processed by the worker: done, retried (failed, run again "
            "later) or failed (given up).", ("event", "outcome"))
        self.matches = Counter(
            r, "dejafix_matches_total",
            "Issues answered by the known-fix handler, by outcome (commented, edited, "
            "unchanged, labelled, shadow, silent, skipped).", ("outcome",))
        self.regressions = Counter(
            r, "dejafix_regressions_total",
            "Matches that were possible regressions of their fix (never answered 'already "
            "fixed'), by kind (caused_by_fix, fix_failed, cites_fix, version_contains_fix) and"
            " by what was done (labelled, commented, edited, unchanged, silent, skipped).",
            ("kind", "action"))
        self.comments = Counter(
            r, "dejafix_comments_total",
            "Suggestion comments written on GitHub (created or edited), and those a dry run "
            "would have written (would_comment).", ("action",))
        self.dismissals = Counter(
            r, "dejafix_dismissals_total", "Suggestions dismissed with /dejafix not-this.")
        self.github_errors = Counter(
            r, "dejafix_github_errors_total",
            "GitHub API calls that failed (each attempt), by HTTP status class, or transport "
            "for connection errors and timeouts. Includes expected 404s (a missing config "
            "file).", ("status",))
        self.github_retries = Counter(
            r, "dejafix_github_retries_total",
            "GitHub API calls sent again within a job, by reason.", ("reason",))
        self.queue_depth = Gauge(
            "dejafix_queue_depth", "Deliveries queued or running (read at scrape time).",
            registry=r)
        self.failed_jobs = Gauge(
            "dejafix_failed_jobs", "Deliveries given up on, kept for inspection.", registry=r)
        self.oldest_queued = Gauge(
            "dejafix_oldest_queued_seconds",
            "How long the longest-waiting due job has waited to be claimed (PostgreSQL: by the "
            "database's clock; 0: none waits).", registry=r)
        self.listen_connected = Gauge(
            "dejafix_listen_connected",
            "1 while this process's LISTEN connection (PostgreSQL) is up, 0 while it is being "
            "re-established (jobs are then found by polling, within a second); 1 on SQLite, "
            "which has none to lose.", registry=r)
        self.taken_over = Counter(
            r, "dejafix_jobs_taken_over_total",
            "Running jobs this process's claims took from their worker: dead (its database "
            "session ended, or, on SQLite, left running by the previous process) or lease (its "
            "worker, alive, held it past its lease; its attempt was ended first).", ("reason",))
        for reason in ("dead", "lease"):  # shown at 0 from the start, not only once it happens
            self.taken_over.inc(0, reason=reason)
        self.clusters = Gauge("dejafix_clusters_loaded",
                              "Curated clusters (files and feeds) in the index in use.",
                              registry=r)
        self.learned_clusters = Gauge(
            "dejafix_learned_clusters", "Learned clusters in the store (read at scrape time).",
            registry=r)
        self.repo_indexes = Gauge(
            "dejafix_repo_indexes_resident",
            "Repositories whose learned clusters' index this process holds.", registry=r)
        self.repo_index_bytes = Gauge(
            "dejafix_repo_index_bytes",
            "Bytes those indexes hold (index_memory_mb is their budget).", registry=r)
        self.repo_index_builds = Counter(
            r, "dejafix_repo_index_builds_total",
            "Per-repository indexes built (a repository's first issue, a learned cluster, "
            "a changed feed, or one dropped for the budget and needed again).")
        self.repo_index_evictions = Counter(
            r, "dejafix_repo_index_evictions_total",
            "Per-repository indexes dropped, least recently used, to stay within "
            "index_memory_mb.")
        # What a delivery costs of the installation's API budget (5,000 calls an hour, shared
        # by everything the App does there), by what the delivery turned out to be.
        self.github_calls = Histogram(
            "dejafix_github_calls_per_delivery", "GitHub API calls one delivery made.",
            ["kind"], registry=self.registry,
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 50))
        self.github_conditional = Counter(
            self.registry, "dejafix_github_not_modified_total",
            "GitHub answers 304 Not Modified (a conditional request; not counted against the "
            "rate limit).", ["kind"])
        self.receiver_seconds = Histogram(
            "dejafix_webhook_duration_seconds",
            "Time the receiver took to answer a delivery.", buckets=RECEIVER_BUCKETS,
            registry=r)
        # Backfills, summed over repositories (the web page names them); refreshed by the
        # worker from the store every few seconds.
        self.backfills_running = Gauge(
            "dejafix_backfills_running",
            "Repositories whose backfill is under way (running or waiting for the rate limit).",
            registry=r)
        self.backfills_rate_limited = Gauge(
            "dejafix_backfills_rate_limited",
            "Of those, backfills waiting for GitHub's rate limit to reset.", registry=r)
        self.backfills_queued = Gauge(
            "dejafix_backfills_queued",
            "Repositories waiting for their installation's turn (one backfill at a time).",
            registry=r)
        self.backfills_done = Gauge(
            "dejafix_backfills_done", "Repositories whose backfill is done.", registry=r)
        self.backfill_prs_read = Gauge(
            "dejafix_backfill_prs_read", "Pull requests read by the backfills under way.",
            registry=r)
        self.backfill_prs_to_read = Gauge(
            "dejafix_backfill_prs_to_read",
            "Merged pull requests the backfills under way have still to read (of the totals "
            "GitHub reported).", registry=r)
        self.backfill_clusters = Gauge(
            "dejafix_backfill_clusters",
            "Clusters learned so far in the repositories whose backfill is under way.",
            registry=r)
        self.backfill_calls = Gauge(
            "dejafix_backfill_calls",
            "GitHub API calls spent by the backfills under way.", registry=r)
        self.backfill_seconds_left = Gauge(
            "dejafix_backfill_seconds_left",
            "The longest time left of a running backfill's current phase, at its rate so far "
            "(0: none known).", registry=r)
        self.backfill_wait_seconds = Gauge(
            "dejafix_backfill_rate_limit_wait_seconds",
            "The longest time a backfill still waits for the rate limit (0: none waits).",
            registry=r)
        self.job_seconds = Histogram(
            "dejafix_job_duration_seconds",
            "Time the worker took to process one delivery (one attempt).", buckets=JOB_BUCKETS,
            registry=r)

    def observe_backfills(self, records: Sequence[BackfillFigures], now: float) -> None:
        """The backfills' gauges, summed over repositories (never named in a label)."""
        active = [r for r in records if r.state in ("running", "waiting")]
        self.backfills_running.set(len(active))
        self.backfills_rate_limited.set(sum(1 for r in active if r.state == "waiting"))
        self.backfills_queued.set(sum(1 for r in records if r.state == "queued"))
        self.backfills_done.set(sum(1 for r in records if r.state == "done"))
        self.backfill_prs_read.set(sum(r.prs_read for r in active))
        self.backfill_prs_to_read.set(sum(max(0, (r.prs_total or 0) - r.prs_read)
                                          for r in active))
        self.backfill_clusters.set(sum(r.clusters for r in active))
        self.backfill_calls.set(sum(r.calls for r in active))
        self.backfill_seconds_left.set(max((r.seconds_left or 0.0 for r in active
                                            if r.state == "running"), default=0.0))
        self.backfill_wait_seconds.set(max((max(0.0, (r.waiting_until or now) - now)
                                            for r in active), default=0.0))

    def observe_queue(self, pending: int, failed: int, oldest_due_seconds: float,
                      listening: bool | None) -> None:
        """The queue's gauges from one reading of the store (``Store.queue_health``) and the
        store's LISTEN state (None: the backend has no connection to lose)."""
        self.queue_depth.set(pending)
        self.failed_jobs.set(failed)
        self.oldest_queued.set(oldest_due_seconds)
        self.listen_connected.set(0 if listening is False else 1)

    def render(self) -> str:
        """This application's registry in the text exposition format (``CONTENT_TYPE``)."""
        return prometheus_client.generate_latest(self.registry).decode()


# The application's metrics while a job runs, for the handlers, which see only their Context:
# set by the worker around each job, so two apps in one process (tests) never mix counts.
_METRICS: ContextVar[Metrics | None] = ContextVar("dejafix_metrics", default=None)


def current_metrics() -> Metrics | None:
    return _METRICS.get()


@contextmanager
def metrics_scope(metrics: Metrics) -> Iterator[None]:
    token = _METRICS.set(metrics)
    try:
        yield
    finally:
        _METRICS.reset(token)
