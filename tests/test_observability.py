"""Observability: /metrics in the Prometheus text format (written by prometheus-client, read back
with its own parser), JSON log lines (python-json-logger) carrying the delivery, repository and
issue, and /healthz's clusters per repository."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pythonjsonlogger.json import JsonFormatter

from bot.__main__ import _configure_logging, build_parser
from bot.clusters.load import load_clusters
from bot.logs import TEXT_FORMAT, ContextFilter, bind, json_formatter, log_context
from bot.metrics import Counter as MetricCounter
from bot.metrics import Metrics
from bot.settings import ServiceConfig
from bot.web.app import METRICS, SERVICES
from tests.conftest import REPO, ROOT, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload
from tests.samples import RESET_HANG

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[dict[str, Any], Samples]:
    """Families by name and every sample keyed by (sample name, sorted labels)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"sample {key} written twice"
            samples[key] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


async def scrape(bot: BotUnderTest) -> tuple[dict[str, Any], Samples]:
    resp = await bot.client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse(await resp.text())


def check_histogram(samples: Samples, name: str, expected_count: int) -> None:
    """Cumulative buckets, non-decreasing, +Inf equal to _count, a positive _sum."""
    buckets = sorted(((float(dict(labels)["le"]), v) for (n, labels), v in samples.items()
                      if n == f"{name}_bucket"), key=lambda b: b[0])
    assert len(buckets) >= 2 and buckets[-1][0] == float("inf")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), f"{name}: buckets not cumulative: {counts}"
    assert counts[-1] == value(samples, f"{name}_count") == expected_count
    total = value(samples, f"{name}_sum")
    assert total is not None and 0 < total <= buckets[-2][0] * expected_count


# -- /metrics ----------------------------------------------------------------------------------

async def test_metrics_count_deliveries_jobs_matches_and_github_errors(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    # A matching issue, its redelivery, an event no handler takes, a bad signature, and an
    # event name a sender made up (it must not become a label value).
    assert (await bot.deliver("issues", issue_payload(**RESET_HANG),
                              delivery="d-match")).status == 202
    assert (await bot.deliver("issues", issue_payload(**RESET_HANG),
                              delivery="d-match")).status == 202
    assert (await bot.deliver("issues", issue_payload("assigned"))).status == 202
    assert (await bot.deliver("issues", issue_payload(), secret="wrong")).status == 401
    assert (await bot.deliver('evil"event', issue_payload(), secret="wrong")).status == 401
    await bot.settle()

    families, samples = await scrape(bot)
    deliveries = {tuple(sorted(s.labels.items())): s.value
                  for s in families["dejafix_deliveries"].samples}
    assert families["dejafix_deliveries"].type == "counter"
    assert deliveries == {
        (("event", "issues"), ("outcome", "queued")): 1.0,
        (("event", "issues"), ("outcome", "duplicate")): 1.0,
        (("event", "issues"), ("outcome", "ignored")): 1.0,
        (("event", "issues"), ("outcome", "unauthorized")): 1.0,
        (("event", "other"), ("outcome", "unauthorized")): 1.0,
    }
    assert value(samples, "dejafix_jobs_total", event="issues", outcome="done") == 1.0
    assert [s for s in families["dejafix_jobs"].samples if s.labels["outcome"] != "done"] == []
    assert value(samples, "dejafix_matches_total", outcome="commented") == 1.0
    assert value(samples, "dejafix_comments_total", action="created") == 1.0
    assert value(samples, "dejafix_dismissals_total") == 0.0
    # The fake holds no files: GraphQL says so (no error), the owner's config is a 404.
    not_found = len(bot.github.calls("GET", "/contents/"))
    assert not_found == 1
    assert value(samples, "dejafix_github_errors_total", status="4xx") == not_found
    assert families["dejafix_queue_depth"].type == "gauge"
    assert value(samples, "dejafix_queue_depth") == 0.0
    assert value(samples, "dejafix_clusters_loaded") == bot.app[SERVICES].index.current.size
    assert families["dejafix_webhook_duration_seconds"].type == "histogram"
    check_histogram(samples, "dejafix_webhook_duration_seconds", 5)
    check_histogram(samples, "dejafix_job_duration_seconds", 1)


async def test_receiver_rejections_are_counted_by_outcome(make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              max_body_bytes=64 * 1024))
    assert (await bot.deliver("issues", b"x" * (65 * 1024))).status == 413
    assert (await bot.deliver("issues", b"not json")).status == 400
    assert (await bot.deliver("issues", b"{}", headers={"Content-Type": "text/plain"})
            ).status == 415
    assert (await bot.deliver("ping", {"zen": "Keep it simple."})).status == 200
    assert (await bot.deliver("issues", issue_payload(), headers={
        "X-Hub-Signature-256": "sha1=00"})).status == 401
    _, samples = await scrape(bot)
    got = {dict(labels)["outcome"]: v for (name, labels), v in samples.items()
           if name == "dejafix_deliveries_total"}
    assert got == {"too_large": 1.0, "bad_request": 1.0, "unsupported_media_type": 1.0,
                   "ping": 1.0, "unauthorized": 1.0}
    assert value(samples, "dejafix_deliveries_total", event="ping", outcome="ping") == 1.0


async def test_queue_depth_is_read_from_the_store_at_scrape_time(make_bot: BotFactory) -> None:
    bot = await make_bot()
    # The first job stops at its config read; the second waits for the same read.
    hold = bot.github.hold("GET /repos/", count=100)
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=90002))
    await asyncio.wait_for(hold.arrived.wait(), timeout=10)
    _, samples = await scrape(bot)
    assert value(samples, "dejafix_queue_depth") == 2.0
    hold.release()
    await bot.settle()
    _, samples = await scrape(bot)
    assert value(samples, "dejafix_queue_depth") == 0.0
    assert value(samples, "dejafix_jobs_total", event="issues", outcome="done") == 2.0


async def test_github_errors_and_retries_are_counted(make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              retry_base=0.01))
    comments = f"/repos/{REPO}/issues/90001/comments"
    # Two 502s on the (idempotent) listing are retried inside the job; a 500 on the POST is
    # not, so the job fails once and the worker runs it again.
    bot.github.failures[f"GET {comments}"] = [502, 502]
    bot.github.failures[f"POST {comments}"] = [500]
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    _, samples = await scrape(bot)
    assert value(samples, "dejafix_github_errors_total", status="5xx") == 3.0
    assert value(samples, "dejafix_github_retries_total", reason="server_error") == 2.0
    assert value(samples, "dejafix_jobs_total", event="issues", outcome="retried") == 1.0
    assert value(samples, "dejafix_jobs_total", event="issues", outcome="done") == 1.0
    assert value(samples, "dejafix_comments_total", action="created") == 1.0
    check_histogram(samples, "dejafix_job_duration_seconds", 2)


async def test_dismissal_is_counted(make_bot: BotFactory) -> None:
    from tests.samples import comment_payload

    bot = await make_bot()
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    await bot.deliver("issue_comment", comment_payload("/dejafix not-this"))
    await bot.settle()
    _, samples = await scrape(bot)
    assert value(samples, "dejafix_dismissals_total") == 1.0
    assert value(samples, "dejafix_deliveries_total", event="issue_comment",
                 outcome="queued") == 1.0


async def test_each_app_has_its_own_registry(make_bot: BotFactory) -> None:
    bot = await make_bot()
    from bot.settings import Settings
    from bot.web.app import create_app

    other = create_app(Settings(data_dir=bot.data_dir / "other"), ServiceConfig(),
                       dry_run=True)
    assert other[METRICS] is not bot.app[METRICS]
    await bot.deliver("issues", issue_payload("assigned"))
    assert other[METRICS].deliveries.value(event="issues", outcome="ignored") == 0
    assert bot.app[METRICS].deliveries.value(event="issues", outcome="ignored") == 1


# Every family /metrics shows, with its type: the README's Observability section lists them.
FAMILIES = {
    "dejafix_deliveries": "counter", "dejafix_jobs": "counter", "dejafix_matches": "counter",
    "dejafix_comments": "counter", "dejafix_regressions": "counter",
    "dejafix_dismissals": "counter", "dejafix_github_errors": "counter",
    "dejafix_github_retries": "counter", "dejafix_queue_depth": "gauge",
    "dejafix_failed_jobs": "gauge", "dejafix_clusters_loaded": "gauge",
    "dejafix_webhook_duration_seconds": "histogram", "dejafix_job_duration_seconds": "histogram",
    "dejafix_github_calls_per_delivery": "histogram", "dejafix_github_not_modified": "counter",
    "dejafix_learned_clusters": "gauge", "dejafix_repo_indexes_resident": "gauge",
    "dejafix_repo_index_bytes": "gauge", "dejafix_repo_index_builds": "counter",
    "dejafix_repo_index_evictions": "counter", "dejafix_oldest_queued_seconds": "gauge",
    "dejafix_listen_connected": "gauge", "dejafix_jobs_taken_over": "counter",
    "dejafix_backfills_running": "gauge", "dejafix_backfills_rate_limited": "gauge",
    "dejafix_backfills_queued": "gauge", "dejafix_backfills_done": "gauge",
    "dejafix_backfill_prs_read": "gauge", "dejafix_backfill_prs_to_read": "gauge",
    "dejafix_backfill_clusters": "gauge", "dejafix_backfill_calls": "gauge",
    "dejafix_backfill_seconds_left": "gauge", "dejafix_backfill_rate_limit_wait_seconds": "gauge",
}


async def test_metrics_lists_the_documented_families_and_nothing_else(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    families, samples = await scrape(bot)
    assert {name: f.type for name, f in families.items()} == FAMILIES
    assert all(f.documentation for f in families.values())
    # No _created series beside the counters and histograms (the library's default).
    assert not [key for key in samples if key[0].endswith("_created")]
    labels = {name: {k for s in f.samples for k in s.labels} - {"le"}
              for name, f in families.items()}
    assert labels["dejafix_deliveries"] == labels["dejafix_jobs"] == {"event", "outcome"}
    assert labels["dejafix_matches"] == {"outcome"}
    assert labels["dejafix_comments"] == {"action"}
    assert labels["dejafix_github_errors"] == {"status"}
    assert labels["dejafix_webhook_duration_seconds"] == set()
    # This app's registry, not prometheus-client's process-wide default one.
    assert prometheus_client.REGISTRY.get_sample_value(
        "dejafix_deliveries_total", {"event": "issues", "outcome": "queued"}) is None
    assert bot.app[METRICS].registry is not prometheus_client.REGISTRY


def test_exposition_escapes_and_round_trips() -> None:
    """Label values and help text with quotes, backslashes and newlines come back whole; the
    counter wrapper's ``inc`` and ``value`` check their labels; histogram bounds are ``<=``."""
    metrics = Metrics()
    registry = metrics.registry
    counter = MetricCounter(registry, "t_events_total",
                            'Help with "quotes", a \\ and a\nnewline.', ("kind",))
    counter.inc(kind='a "quoted" \\ value\nwith newline')
    counter.inc(2.5, kind="plain")
    hist = prometheus_client.Histogram("t_seconds", "h", ("step",), buckets=(0.1, 1.0),
                                       registry=registry)
    hist.labels(step="x").observe(0.1)  # on a bound: counted in that bucket
    hist.labels(step="x").observe(0.5)
    hist.labels(step="x").observe(7.0)
    families, samples = parse(metrics.render())
    assert families["t_events"].documentation == 'Help with "quotes", a \\ and a\nnewline.'
    assert value(samples, "t_events_total", kind='a "quoted" \\ value\nwith newline') == 1.0
    assert value(samples, "t_events_total", kind="plain") == 2.5
    assert counter.value(kind="plain") == 2.5 and counter.value(kind="never") == 0.0
    assert [value(samples, "t_seconds_bucket", step="x", le=le) for le in
            ("0.1", "1.0", "+Inf")] == [1.0, 2.0, 3.0]
    assert value(samples, "t_seconds_count", step="x") == 3.0
    assert value(samples, "t_seconds_sum", step="x") == pytest.approx(7.6)
    assert "dejafix_deliveries" in families  # the app's own metrics in the same text
    with pytest.raises(ValueError):
        counter.inc(-1, kind="plain")
    with pytest.raises(ValueError):
        counter.inc(kind="plain", extra="no")
    with pytest.raises(ValueError):
        counter.inc()  # a labelled counter needs its labels
    with pytest.raises(ValueError):
        metrics.dismissals.inc(kind="no")
    with pytest.raises(ValueError):
        counter.value()
    with pytest.raises(ValueError):
        MetricCounter(registry, "t_events_total", "twice")
    with pytest.raises(ValueError):
        MetricCounter(registry, "t_events", "a counter's name ends in _total")


def test_counters_are_thread_safe() -> None:
    metrics = Metrics()

    def bump() -> None:
        for _ in range(2000):
            metrics.dismissals.inc()
            metrics.job_seconds.observe(0.02)

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, samples = parse(metrics.render())
    assert value(samples, "dejafix_dismissals_total") == 16000.0
    assert value(samples, "dejafix_job_duration_seconds_count") == 16000.0


# -- JSON logs ---------------------------------------------------------------------------------

@contextmanager
def json_log_capture() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    dejafix = logging.getLogger("dejafix")
    old_level = dejafix.level
    dejafix.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        dejafix.setLevel(old_level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_json_log_lines_carry_delivery_repo_and_issue(make_bot: BotFactory) -> None:
    bot = await make_bot()
    with json_log_capture() as stream:
        await bot.deliver("issues", issue_payload(**RESET_HANG, number=90001),
                          delivery="d-json")
        await bot.settle()
        await bot.deliver("issues", issue_payload(**RESET_HANG), secret="wrong",
                          delivery="d-forged")
    lines = json_lines(stream)
    assert lines, "nothing was logged"
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line)
    ours = [line for line in lines if line.get("delivery") == "d-json"]
    loggers = Counter(line["logger"] for line in ours)
    # The receiver's "queued" line and the handler's "commented" line.
    assert loggers["dejafix.webhook"] >= 1 and loggers["dejafix.known_fix"] >= 1
    for line in ours:
        assert line["repo"] == REPO and line["issue"] == 90001, line
    commented = [line for line in ours if line["logger"] == "dejafix.known_fix"]
    assert "commented" in commented[0]["message"]
    # Before the signature is checked only the delivery id is known: nothing from the body.
    forged = [line for line in lines if line.get("delivery") == "d-forged"]
    assert forged and all("repo" not in line and "issue" not in line for line in forged)


def test_log_context_is_scoped_and_reset() -> None:
    with json_log_capture() as stream:
        log = logging.getLogger("dejafix.test")
        with log_context(delivery="d1"):
            bind(repo="o/r", issue=5)
            log.info("inside")
            with log_context(issue=6):
                log.info("nested")
        log.info("outside")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    inside, nested, outside, failed = json_lines(stream)
    assert (inside["delivery"], inside["repo"], inside["issue"]) == ("d1", "o/r", 5)
    assert (nested["delivery"], nested["issue"]) == ("d1", 6)
    assert not {"delivery", "repo", "issue"} & set(outside)
    assert outside["message"] == "outside" and outside["level"] == "INFO"
    assert outside["logger"] == "dejafix.test"
    assert failed["level"] == "ERROR" and "RuntimeError: boom" in failed["exc"]
    assert "exc_info" not in failed


async def test_log_context_reaches_tasks_and_threads() -> None:
    """asyncio.to_thread runs its function in a copy of the caller's context: a line logged in
    the thread carries the job's fields, and a bind in the thread stays there."""
    log = logging.getLogger("dejafix.test")

    def in_thread(n: int) -> None:
        log.info("thread %d", n)
        bind(repo="changed/in-thread")
        log.info("bound in thread")

    with json_log_capture() as stream:
        with log_context(delivery="d3", repo="o/r", issue=8):
            await asyncio.gather(asyncio.to_thread(in_thread, 1),
                                 asyncio.create_task(asyncio.to_thread(in_thread, 2)))
            log.info("after")
        await asyncio.to_thread(log.info, "no context")
    lines = {line["message"]: line for line in json_lines(stream)}
    for message in ("thread 1", "thread 2", "after"):
        line = lines[message]
        assert (line["delivery"], line["repo"], line["issue"]) == ("d3", "o/r", 8), line
    assert lines["bound in thread"]["repo"] == "changed/in-thread"
    assert not {"delivery", "repo", "issue"} & set(lines["no context"])


def test_json_line_keys_time_and_extras() -> None:
    """The keys of a line: time as ISO 8601 in UTC (the record's own time), level, logger,
    message (non-ASCII kept), a field given with ``extra=`` over the context's, ``stack``."""
    with json_log_capture() as stream:
        log = logging.getLogger("dejafix.test")
        with log_context(delivery="d4", issue=1):
            log.warning("héllo %s", "wörld", extra={"issue": 2})
    (line,) = json_lines(stream)
    assert set(line) == {"time", "level", "logger", "message", "delivery", "issue"}
    assert (line["level"], line["logger"], line["message"]) == (
        "WARNING", "dejafix.test", "héllo wörld")
    assert "héllo" in stream.getvalue()
    assert (line["delivery"], line["issue"]) == ("d4", 2)
    assert datetime.fromisoformat(line["time"]).tzinfo is not None
    # A record made here (whether logging collects stack_info depends on process-wide switches
    # that _configure_logging turns off): its time to the microsecond, its stack as "stack".
    record = logging.getLogger("dejafix.x").makeRecord(
        "dejafix.x", logging.INFO, __file__, 1, "m", (), None, sinfo="Stack:\n  here")
    record.created = 1_764_446_146.123456
    formatted = json.loads(json_formatter().format(record))
    assert formatted == {"level": "INFO", "logger": "dejafix.x", "message": "m",
                         "stack": "Stack:\n  here", "time": "2025-11-29T19:55:46.123456+00:00"}
    assert formatted["time"] == datetime.fromtimestamp(record.created, UTC).isoformat()


def test_context_filter_puts_the_fields_on_the_record() -> None:
    """For any formatter: the filter copies the context onto the record, in the logging call."""
    record = logging.LogRecord("dejafix.x", logging.INFO, __file__, 1, "m", None, None)
    with log_context(delivery="d2", repo="o/r", issue=7):
        assert ContextFilter().filter(record)
    assert (record.delivery, record.repo, record.issue) == ("d2", "o/r", 7)
    text = logging.Formatter("%(delivery)s %(repo)s#%(issue)s %(message)s").format(record)
    assert text == "d2 o/r#7 m"


@contextmanager
def bare_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers = []
    try:
        yield root
    finally:
        root.handlers = saved
        root.setLevel(level)


def test_configure_logging_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEJAFIX_LOG_FORMAT", raising=False)
    with bare_root() as root:
        _configure_logging("info")
        (handler,) = root.handlers
        assert not isinstance(handler.formatter, JsonFormatter)
        assert handler.formatter is not None
        assert handler.formatter._fmt == TEXT_FORMAT == (
            "%(asctime)s %(levelname)s %(name)s: %(message)s")
        record = logging.getLogger("dejafix.t").makeRecord("dejafix.t", logging.INFO, "(unknown)",
                                                         0, "m %s", ("x",), None)
        assert handler.format(record).endswith(" INFO dejafix.t: m x")
    with bare_root() as root:
        _configure_logging("info", "json")
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        assert any(isinstance(f, ContextFilter) for f in handler.filters)
    monkeypatch.setenv("DEJAFIX_LOG_FORMAT", "json")
    with bare_root() as root:
        _configure_logging("info")
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])


def test_serve_writes_json_lines(tmp_path: Path) -> None:
    """The real process, DEJAFIX_LOG_FORMAT=json: every line on stderr is one JSON object."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAFIX_")}
    env.update(DEJAFIX_LOG_FORMAT="json", DEJAFIX_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bot", "serve", "--dry-run", "--port", "0"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "ready" in line:
                break
    finally:
        # The lines up to "ready" are the test; a graceful stop would add its 2 s grace.
        proc.kill()
        proc.wait(timeout=30)
    parsed = [json.loads(line) for line in lines]
    assert any("ready" in p["message"] and p["logger"] == "dejafix" for p in parsed), lines
    assert all(p["level"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"} for p in parsed)


# -- /healthz ----------------------------------------------------------------------------------

async def test_healthz_counts_repositories_and_names_none(make_bot: BotFactory) -> None:
    bot = await make_bot()
    resp = await bot.client.get("/healthz")
    assert resp.status == 200
    text = await resp.text()
    data = json.loads(text)
    expected = Counter(c.repo.lower() for c in load_clusters([SAMPLE_CLUSTERS]).clusters)
    assert data["clusters_repos"] == len(expected) and data["clusters"] == sum(expected.values())
    # Anyone may ask /healthz: no repository's name (a private one's least of all), in any
    # case or as an owner alone.
    for repo in expected:
        owner = repo.split("/")[0]
        assert repo not in text.lower() and f'"{owner}' not in text.lower(), repo
    # Nor /metrics, which is as open.
    metrics = (await (await bot.client.get("/metrics")).text()).lower()
    assert not [repo for repo in expected if repo in metrics or repo.split("/")[0] in metrics]
    for key in ("ok", "worker", "version", "dry_run", "clusters", "clusters_version",
                "queued", "failed"):
        assert key in data
    assert data["queued"] == 0
