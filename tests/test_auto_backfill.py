"""Backfill by itself (issue 26, points 1, 3 and 4): an installation lines up one backfill per
repository, run as queued jobs one repository at a time, in slices that yield to live
deliveries, resumable, waiting for the rate limit as GitHub asks; its figures in the store for
the page and /metrics; ``mode: auto`` speaks once the repository's own backtest clears.

GitHub's real ``installation`` and ``installation_repositories`` payloads are read from
``../shared/github-payloads/`` (skipped when absent); each delivery is recorded in the store as
the receiver records it, and a real ``Worker`` runs the queue against the fake GitHub."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bench.backfill import generate_history
from bot.db.store import issue_key
from bot.features import installs
from bot.features.answer_plan import Plan, shadowed
from bot.features.auto_mode import decide, load_verdict
from bot.features.installs import BACKFILL_EVENT, BackfillRecord, load_record
from bot.jobs.worker import Worker
from bot.matching import MatchPolicy
from bot.metrics import Metrics
from bot.repo_config import RepoConfig
from bot.settings import ServiceConfig
from bot.web import dashboard
from bot.web.app import SERVICES
from tests.conftest import ROOT, SAMPLE_CLUSTERS, BotFactory, issue_payload
from tests.fake_github import FakeGitHub, Fault
from tests.handler_support import Handlers, HandlersFactory

# The generated histories draw their words from a short list, so every issue looks a little like
# every other: no margin is asked for, so that a copy of a fixed report is answered.
SPEAKS = MatchPolicy(margin=0.0)
# As the shipped config/bot.yml runs (a config without the key: off).
AUTO = ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], backfill="auto")
PAYLOADS = ROOT.parent / "shared" / "github-payloads"
INSTALLATION = 957387


def _payload(event: str, name: str) -> dict[str, Any]:
    path = PAYLOADS / event / f"{name}.payload.json"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _repos(payload: dict[str, Any], key: str) -> list[str]:
    return [r["full_name"] for r in payload[key]]


def _history(fake: FakeGitHub, repo: str, seed: int = 1, **sizes: int) -> None:
    """A history in two or more slices: more closed issues than one GraphQL page, and more
    fixes than one diffs batch."""
    options = {"prs": 120, "closing_prs": 45, "issues": 160, "duplicates": 30, **sizes}
    generate_history(fake, seed=seed, repo=repo, **options)


def _accept(store: Any, event: str, payload: dict[str, Any]) -> str:
    """Record a delivery as the receiver does (its repository, installation and issue key)."""
    delivery = str(uuid.uuid4())
    repo_data = payload.get("repository")
    repo = repo_data.get("full_name") if isinstance(repo_data, dict) else None
    number = payload.get("issue", {}).get("number") if isinstance(payload.get("issue"),
                                                                 dict) else None
    assert store.accept_delivery(delivery, event, payload.get("action"), repo,
                                 payload["installation"]["id"], json.dumps(payload).encode(),
                                 issue_key(repo, number))
    return delivery


class Running:
    """A real worker on the handlers' services, run in a task."""

    def __init__(self, services: Any) -> None:
        self.worker = Worker(services, metrics=Metrics(), poll_seconds=0.02)
        self.task = asyncio.create_task(self.worker.run())

    async def until(self, check: Callable[[], bool], timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await asyncio.to_thread(check):
            if self.task.done():
                self.task.result()
            assert loop.time() < deadline, "condition not reached in time"
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.worker.stop(0.0)
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def auto(make_handlers: HandlersFactory) -> Handlers:
    """Services as the shipped config/bot.yml runs them: backfill auto."""
    return await make_handlers(config=AUTO)


@pytest.fixture
async def slices(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Every saved cursor ends a slice: a small history then runs in several."""
    monkeypatch.setattr(installs, "SLICE_SECONDS", 0.0)
    monkeypatch.setattr(installs, "FLUSH_SECONDS", 0.01)
    installs._checked.clear()
    yield
    installs._checked.clear()


def _state(store: Any, repo: str) -> str | None:
    record = load_record(store, repo)
    return record.state if record is not None else None


def _backfill_jobs(store: Any) -> list[tuple[str, str, float]]:
    """(delivery id, state, available_at) of every backfill job, in queue order."""
    with sqlite3.connect(store.path) as conn:
        rows = conn.execute(
            "SELECT j.delivery_id, j.state, j.available_at FROM jobs j JOIN deliveries d"
            " ON d.delivery_id = j.delivery_id WHERE d.event = ? ORDER BY j.id",
            (BACKFILL_EVENT,)).fetchall()
    return [(str(d), str(s), float(a)) for d, s, a in rows]


def _graphql_repos(fake: FakeGitHub) -> list[str]:
    """The repository of each backfill GraphQL query, in the order the fake answered them."""
    out = []
    for r in fake.requests:
        if r.path == "/graphql" and isinstance(r.body, dict) and \
                "query DejafixBackfill" in str(r.body.get("query", "")):
            v = r.body.get("variables") or {}
            out.append(f"{v.get('owner')}/{v.get('name')}".lower())
    return out


async def test_an_installation_backfills_each_repository_one_at_a_time(
        auto: Handlers, slices: None) -> None:
    handlers = auto
    created = _payload("installation", "created")
    added = _payload("installation_repositories", "added")
    first, second = _repos(created, "repositories")[0], _repos(added, "repositories_added")[0]
    assert created["installation"]["id"] == added["installation"]["id"] == INSTALLATION
    _history(handlers.fake, first, seed=1)
    _history(handlers.fake, second, seed=2)
    store = handlers.store
    _accept(store, "installation", created)
    _accept(store, "installation_repositories", added)
    running = Running(handlers.services)
    try:
        await running.until(lambda: _state(store, first) == "done"
                            and _state(store, second) == "done")
    finally:
        await running.stop()
    one, two = load_record(store, first), load_record(store, second)
    assert one is not None and two is not None
    # Several slices each, every merged PR read, clusters learned, the calls counted.
    assert one.slices > 1 and two.slices > 1
    assert one.prs_read == one.prs_total and one.clusters == store.learned_count(first) > 0
    assert two.clusters == store.learned_count(second) > 0 and two.calls > 0
    # One repository of the installation at a time: every query of the first before any of
    # the second, though the second was lined up while the first ran.
    order = _graphql_repos(handlers.fake)
    assert set(order) == {first.lower(), second.lower()}
    # (The two deliveries run at once, so either may take the turn first.)
    lead = order[0]
    last_lead = max(i for i, r in enumerate(order) if r == lead)
    assert all(r == lead for r in order[:last_lead + 1])
    assert all(r != lead for r in order[last_lead + 1:])
    assert all(state == "done" for _, state, _ in _backfill_jobs(store))


async def test_a_redelivered_installation_lines_nothing_up_twice(
        auto: Handlers, slices: None) -> None:
    handlers = auto
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    _history(handlers.fake, repo, prs=20, closing_prs=5, issues=20, duplicates=2)
    store = handlers.store
    _accept(store, "installation", created)
    running = Running(handlers.services)
    try:
        await running.until(lambda: _state(store, repo) == "done")
        before = len(handlers.fake.requests)
        _accept(store, "installation", created)  # the same event again (another delivery id)
        await running.until(lambda: store.pending_count() == 0 and not running.worker.running)
    finally:
        await running.stop()
    assert len(handlers.fake.requests) == before


async def test_a_restart_resumes_where_the_last_slice_saved(
        make_handlers: HandlersFactory, auto: Handlers, slices: None) -> None:
    handlers = auto
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    _history(handlers.fake, repo, prs=500, closing_prs=150, issues=260, duplicates=40)
    store = handlers.store
    _accept(store, "installation", created)
    running = Running(handlers.services)
    try:
        await running.until(lambda: (r := load_record(store, repo)) is not None
                            and r.slices >= 2)
    finally:
        await running.stop()  # the process ends: its slice is cut off, its job given back
    assert _state(store, repo) != "done"
    assert await asyncio.to_thread(store.recover) >= 0
    again = Running(handlers.services)  # the next process
    try:
        await again.until(lambda: _state(store, repo) == "done")
    finally:
        await again.stop()
    record = load_record(store, repo)
    assert record is not None and record.prs_read == record.prs_total
    # Resumed, not restarted: only the very first page of pull requests was asked for from
    # the start of the history.
    starts = [r for r in handlers.fake.requests if r.path == "/graphql"
              and isinstance(r.body, dict)
              and "query DejafixBackfillPulls" in str(r.body.get("query", ""))
              and not (r.body.get("variables") or {}).get("after")]
    assert len(starts) == 1
    # The same clusters as one uninterrupted run into a store of its own.
    fresh = await make_handlers(config=AUTO)
    fresh_store = fresh.store
    await asyncio.to_thread(installs.start_backfills, fresh_store, INSTALLATION, [repo])
    third = Running(fresh.services)
    try:
        await third.until(lambda: _state(fresh_store, repo) == "done")
    finally:
        await third.stop()
    ours = {c.public_id: c.model_dump() for c in store.learned_clusters(repo)}
    theirs = {c.public_id: c.model_dump() for c in fresh_store.learned_clusters(repo)}
    assert ours.keys() == theirs.keys() and ours


@pytest.mark.parametrize("fault", ["primary", "secondary"])
async def test_a_rate_limit_makes_the_backfill_wait_without_holding_a_worker(
        auto: Handlers, slices: None, fault: str) -> None:
    handlers = auto
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    _history(handlers.fake, repo, prs=60, closing_prs=20, issues=30, duplicates=4)
    reset = int(time.time()) + 3600
    headers = ({"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "0",
                "X-RateLimit-Reset": str(reset)} if fault == "primary"
               else {"Retry-After": "900"})
    # The diffs phase's REST reads: GitHub refuses the first one.
    handlers.fake.failures[f"GET /repos/{repo.lower()}/pulls/"] = [
        Fault(status=403, headers=headers, message="API rate limit exceeded")]
    store = handlers.store
    _accept(store, "installation", created)
    running = Running(handlers.services)
    try:
        started = time.time()
        await running.until(lambda: _state(store, repo) == "waiting")
        await running.until(lambda: not running.worker.running)
        record = load_record(store, repo)
        assert record is not None and record.waiting_until is not None
        expected = reset if fault == "primary" else started + 900
        assert abs(record.waiting_until - expected) < 30
        # The next slice is queued, due then; no worker holds it meanwhile.
        queued = [j for j in _backfill_jobs(store) if j[1] == "queued"]
        assert len(queued) == 1 and abs(queued[0][2] - expected) < 30
        calls = len(handlers.fake.requests)
        await asyncio.sleep(0.3)
        assert len(handlers.fake.requests) == calls and not running.worker.running
        # The page says so, with the time.
        view = dashboard.backfill_view(record, time.time())
        assert view is not None and view.text.startswith("waiting for the rate limit until")
        # The reset comes (moved to now here): the backfill goes on and ends.
        with sqlite3.connect(store.path) as conn:
            conn.execute("UPDATE jobs SET available_at = 0 WHERE delivery_id = ?",
                         (queued[0][0],))
        running.worker.wake()
        await running.until(lambda: _state(store, repo) == "done")
    finally:
        await running.stop()


async def test_a_live_issue_during_a_backfill_is_answered_first(
        make_handlers: HandlersFactory, slices: None) -> None:
    handlers = await make_handlers(config=ServiceConfig(
        cluster_paths=[str(SAMPLE_CLUSTERS)], workers=1, repo_workers=1, matching=SPEAKS,
        backfill="auto"))
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    _history(handlers.fake, repo, prs=300, closing_prs=90, issues=260, duplicates=40)
    fake, store = handlers.fake, handlers.store
    # The live issue is a new report of a bug whose fix the first slice learns.
    fixed = next(i for (r, _), i in sorted(fake.issues.items())
                 if r == repo.lower() and i.get("state_reason") == "completed")
    hold = fake.hold("POST /graphql")
    _accept(store, "installation", created)
    running = Running(handlers.services)
    try:
        await running.until(lambda: hold.held >= 1)
        # While the first slice runs, an issue is opened.
        live = issue_payload(number=99999, title=fixed["title"], body=fixed["body"], repo=repo,
                             installation=INSTALLATION)
        _accept(store, "issues", live)
        hold.release()
        await running.until(lambda: any(r.method == "POST" and r.path.endswith(
            "/issues/99999/comments") for r in fake.requests))
        during = load_record(store, repo)
        assert during is not None and during.state != "done"
        await running.until(lambda: _state(store, repo) == "done")
    finally:
        await running.stop()
    # Answered between two slices, with the clusters learned so far.
    posted = next(i for i, r in enumerate(fake.requests) if r.method == "POST"
                  and r.path.endswith("/issues/99999/comments"))
    later = [i for i, r in enumerate(fake.requests) if r.path == "/graphql"
             and "query DejafixBackfill" in str((r.body or {}).get("query", ""))]
    assert later and max(later) > posted


async def test_an_issue_in_a_repository_with_nothing_learned_starts_its_backfill_once(
        auto: Handlers, slices: None) -> None:
    handlers = auto
    repo = "octo-org/unseen"
    _history(handlers.fake, repo, prs=20, closing_prs=5, issues=20, duplicates=2)
    store = handlers.store
    for number in (1001, 1002):
        _accept(store, "issues", issue_payload(number=number, title="Crash on start",
                                               body="It crashes.", repo=repo))
    running = Running(handlers.services)
    try:
        await running.until(lambda: _state(store, repo) == "done")
        await running.until(lambda: store.pending_count() == 0 and not running.worker.running)
    finally:
        await running.stop()
    firsts = [j for j in _backfill_jobs(store) if j[0].endswith(":0")]
    assert len(firsts) == 1


async def test_backfill_off_for_the_deployment_or_the_repository(
        make_handlers: HandlersFactory, slices: None) -> None:
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    off = await make_handlers(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                                   backfill="off"))
    _accept(off.store, "installation", created)
    running = Running(off.services)
    try:
        await running.until(lambda: off.store.pending_count() == 0
                            and not running.worker.running)
    finally:
        await running.stop()
    assert load_record(off.store, repo) is None and not _backfill_jobs(off.store)

    on = await make_handlers(config=AUTO)
    on.fake.add_file(repo, ".github/dejafix.yml", "backfill: false\n")
    _history(on.fake, repo, prs=20, closing_prs=5, issues=20, duplicates=2)
    _accept(on.store, "installation", created)
    running = Running(on.services)
    try:
        await running.until(lambda: _state(on.store, repo) == "off")
    finally:
        await running.stop()
    assert not _graphql_repos(on.fake) and on.store.learned_count(repo) == 0


async def test_the_page_and_metrics_show_the_progress(
        auto: Handlers, slices: None) -> None:
    handlers = auto
    created = _payload("installation", "created")
    added = _payload("installation_repositories", "added")
    first, second = _repos(created, "repositories")[0], _repos(added, "repositories_added")[0]
    _history(handlers.fake, first, prs=300, closing_prs=90, issues=260, duplicates=40)
    reset = int(time.time()) + 1800
    # The first repository's diffs phase meets the rate limit: it waits, the second is queued.
    handlers.fake.failures[f"GET /repos/{first.lower()}/pulls/"] = [Fault(
        status=403, message="API rate limit exceeded", headers={
            "X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": str(reset)})]
    store = handlers.store
    _accept(store, "installation", created)
    running = Running(handlers.services)
    try:
        await running.until(lambda: _state(store, first) == "waiting")
        # Another repository added meanwhile waits for the installation's turn.
        _accept(store, "installation_repositories", added)
        await running.until(lambda: _state(store, second) == "queued")
        await running.until(lambda: not running.worker.running)
        await running.worker.refresh_gauges()
        scraped = running.worker.metrics.render()
    finally:
        await running.stop()
    record = load_record(store, first)
    assert record is not None and record.prs_total == 300 and record.prs_read == 300
    assert record.clusters == store.learned_count(first) > 0 and record.calls > 0
    view = dashboard.backfill_view(record, time.time())
    assert view is not None and view.total == 300
    assert view.text == (
        f"waiting for the rate limit until {dashboard.when(reset)} (the fixes' diffs): "
        f"300 of 300 pull requests read, {record.clusters:,} clusters learned, "
        f"{record.calls:,} calls spent")
    queued = dashboard.backfill_view(load_record(store, second), time.time())
    assert queued is not None and queued.text.startswith("queued")
    # The page's HTML: the bar and the sentence, in the Health table.
    health = dashboard.health(store, handlers.services.index.current, first, RepoConfig(),
                              "comment", [])
    html = _render_repo(health, first)
    assert '<progress value="300" max="300">' in html
    assert f"waiting for the rate limit until {dashboard.when(reset)}" in html
    # A running backfill's sentence: read of total and the time left at its rate.
    running_view = dashboard.backfill_view(BackfillRecord(
        repo=first, state="running", prs_read=1200, prs_total=10_000, clusters=340,
        calls=812, seconds_left=720.0), time.time())
    assert running_view is not None and running_view.text == (
        "running (pull requests): 1,200 of 10,000 pull requests read, 340 clusters learned, "
        "812 calls spent; about 12 min left in this phase at the current rate")
    # /metrics: figures, never a repository's name.
    assert "dejafix_backfills_running 1.0" in scraped
    assert "dejafix_backfills_rate_limited 1.0" in scraped
    assert "dejafix_backfills_queued 1.0" in scraped
    assert "dejafix_backfill_prs_read 300.0" in scraped
    assert "codertocat" not in scraped.lower()


def _render_repo(health: dashboard.Health, repo: str) -> str:
    """The repository page's template, as the app sets it up (its filters, strict undefined)."""
    import jinja2

    from bot.web.pages import comment_html, inline_html

    env = jinja2.Environment(loader=jinja2.PackageLoader("bot.web", "templates"),
                             autoescape=jinja2.select_autoescape(default=True))
    env.filters.update({"comment_html": comment_html, "inline_html": inline_html})
    return env.get_template("repo.html").render(
        repo=repo, health=health, suggestions=[], incomplete=[], web_url="https://github.com",
        title="", body="", result=None, csrf="x")


# -- mode: auto ----------------------------------------------------------------------------

def _auto_config(**extra: Any) -> ServiceConfig:
    # One worker: the issue opened during the first slice runs right after it.
    return ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], default_mode="auto",
                         matching=SPEAKS, backfill="auto", workers=1, repo_workers=1, **extra)


def _suggested(store: Any, repo: str, number: int) -> bool:
    return any(s.issue == number for s in store.suggestions(repo))


async def _backfill_then_issue(handlers: Handlers, repo: str) -> tuple[str, str]:
    """The repository's backfill, an issue opened during it and one after it: what the bot did
    on each (``commented`` or ``shadow``)."""
    fake, store = handlers.fake, handlers.store
    _history(fake, repo, prs=300, closing_prs=90, issues=260, duplicates=40)
    fixed = [i for (r, _), i in sorted(fake.issues.items())
             if r == repo.lower() and i.get("state_reason") == "completed"]
    hold = fake.hold("POST /graphql")
    await asyncio.to_thread(installs.start_backfills, store, INSTALLATION, [repo])
    running = Running(handlers.services)
    outcomes = []
    try:
        await running.until(lambda: hold.held >= 1)
        _accept(store, "issues", issue_payload(number=99001, title=fixed[0]["title"],
                                               body=fixed[0]["body"], repo=repo,
                                               installation=INSTALLATION))
        hold.release()
        await running.until(lambda: _suggested(store, repo, 99001))
        await running.until(lambda: _state(store, repo) == "done")
        _accept(store, "issues", issue_payload(number=99002, title=fixed[1]["title"],
                                               body=fixed[1]["body"], repo=repo,
                                               installation=INSTALLATION))
        await running.until(lambda: _suggested(store, repo, 99002))
    finally:
        await running.stop()
    for number in (99001, 99002):
        outcomes.append(next(s.mode for s in store.suggestions(repo) if s.issue == number))
    return outcomes[0], outcomes[1]


async def test_mode_auto_comments_once_the_backtest_clears(
        make_handlers: HandlersFactory, slices: None) -> None:
    handlers = await make_handlers(config=_auto_config(auto_precision=0.0, auto_min_cases=1))
    repo = "octo-org/measured"
    during, after = await _backfill_then_issue(handlers, repo)
    verdict = load_verdict(handlers.store, repo)
    assert verdict is not None and verdict.cases >= 1
    assert (during, after) == ("shadow", "comment")
    comments = [r for r in handlers.fake.requests if r.method == "POST"
                and r.path.endswith("/comments")]
    assert [r.path.rsplit("/", 2)[-2] for r in comments] == ["99002"]
    health = dashboard.health(handlers.store, handlers.services.index.current, repo,
                              RepoConfig(), "auto", [],
                              service_config=handlers.services.config)
    assert health.auto is not None and health.auto.startswith(
        f"auto: commenting since backtest precision {verdict.precision:.2f} on "
        f"{verdict.cases} cases")


async def test_mode_auto_stays_in_shadow_without_enough_history(
        make_handlers: HandlersFactory, slices: None) -> None:
    handlers = await make_handlers(config=_auto_config(auto_min_cases=100_000))
    repo = "octo-org/young"
    during, after = await _backfill_then_issue(handlers, repo)
    assert (during, after) == ("shadow", "shadow")
    assert not [r for r in handlers.fake.requests if r.method == "POST"
                and r.path.endswith("/comments")]
    health = dashboard.health(handlers.store, handlers.services.index.current, repo,
                              RepoConfig(), "auto", [],
                              service_config=handlers.services.config)
    assert health.auto is not None and "not enough history" in health.auto


def test_mode_auto_decision_in_words() -> None:
    config = ServiceConfig(auto_precision=0.9, auto_min_cases=10)
    assert not decide(None, config).commenting
    assert "until its backfill is done" in decide(None, config).why
    ctx = type("Ctx", (), {"services": type("S", (), {"config": config})()})()
    # mode auto with nothing measured: shadow.
    assert shadowed(ctx, RepoConfig(mode="auto"), Plan(ranked=[]))  # type: ignore[arg-type]



async def test_github_installation_events_are_accepted_and_start_the_backfill(
        make_bot: BotFactory) -> None:
    created = _payload("installation", "created")
    repo = _repos(created, "repositories")[0]
    bot = await make_bot(config=AUTO)
    _history(bot.github, repo, prs=20, closing_prs=5, issues=20, duplicates=2)
    resp = await bot.deliver("installation", created)
    assert resp.status == 202, await resp.text()
    await bot.settle(timeout=60)
    services = bot.app[SERVICES]
    assert _state(services.store, repo) == "done"


async def test_a_dry_run_without_credentials_lines_up_no_backfill(make_bot: BotFactory) -> None:
    # The Quickstart: no App, the sample clusters; it never calls GitHub, so a backfill there
    # could only fail, attempt after attempt, against the real api.github.com.
    bot = await make_bot(config=AUTO, dry_run=True, with_credentials=False)
    repo = "octo-org/unseen"
    resp = await bot.deliver("issues", issue_payload(number=7, title="Crash on start",
                                                     body="It crashes.", repo=repo))
    assert resp.status == 202, await resp.text()
    await bot.settle(timeout=30)
    store = bot.app[SERVICES].store
    assert _backfill_jobs(store) == []
    assert _state(store, repo) is None
    assert not [r for r in bot.github.requests if "graphql" in r.path]
