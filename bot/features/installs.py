"""Backfill by itself: when the App is installed on repositories (``installation`` created,
``installation_repositories`` added: GitHub sends these to every App, no subscription needed),
and for a repository seen with nothing learned, its history is learned as queued jobs.

One repository of an installation at a time (``Store.backfill_turn``: a waiting line per
installation, kept in the store), in slices: a slice runs the backfill until its first saved
cursor after ``SLICE_SECONDS``, then queues the next slice as a new job. The queue claims oldest
first, so a live delivery that arrived during a slice runs before the next slice, and a slice
holds one of the repository's ``repo_workers`` slots for seconds, not hours. A slice that must
wait for the rate limit (the REST budget running low, GraphQL's points, or GitHub refusing with
``x-ratelimit-remaining: 0`` or a ``Retry-After``) queues the next slice due when GitHub says,
instead of sleeping in a worker. The cursor is the backfill's own (``Backfill``): a restart
resumes where the last slice saved.

Each repository's figures (``BackfillRecord``) are kept in the store, so the web page and
/metrics of any process show them. When a backfill is done, the repository's own backtest is
measured once (``auto_mode``) for ``mode: auto``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import cachetools
import gidgethub
from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.db.store import NewJob, Store
from bot.features.answer_plan import effective_policy
from bot.features.auto_mode import Verdict, compute_verdict
from bot.features.backfill import Backfill, BackfillPaused, BackfillProgress
from bot.features.context import Context
from bot.github.client import rate_limit_wait
from bot.repo_config import RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.backfill")
router = Router()

# The job kind of a backfill slice. Never a webhook event: the receiver ignores it (no router
# takes it), so only the bot's own jobs carry it.
BACKFILL_EVENT = "dejafix_backfill"
# A slice stops at its first saved cursor after this long (a GraphQL batch is up to 8 pages).
SLICE_SECONDS = 20.0
# How often a running slice writes its figures to the store (and always at its end).
FLUSH_SECONDS = 2.0
# GitHub refusing a GraphQL query for its rate limit says nothing of when to come back (the
# client keeps no headers for GraphQL errors): at least a minute, as GitHub's guide asks.
GRAPHQL_LIMIT_WAIT = 60.0
PROGRESS_PREFIX = "backfill-progress:"
_REPO_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}")
# One backtest at a time per process: it is CPU work in a thread.
_BACKTEST = threading.Lock()
# Repositories already checked for a backfill in this process (the check reads the store).
_checked: cachetools.TTLCache[str, bool] = cachetools.TTLCache(maxsize=10_000, ttl=3600)


@dataclass
class BackfillRecord:
    """A repository's backfill as the page and /metrics show it, kept in the store. ``state``:
    queued (waiting for its installation's turn), running, waiting (for the rate limit, until
    ``waiting_until``), done, stopped (``error`` says why) or off."""

    repo: str
    state: str = "queued"
    phase: str = "pulls"
    prs_read: int = 0
    prs_total: int | None = None
    issues_read: int = 0
    issues_total: int | None = None
    fixes_read: int = 0
    fixes_total: int | None = None
    clusters: int = 0
    duplicates: int = 0
    calls: int = 0
    slices: int = 0
    started_at: float | None = None
    updated_at: float = 0.0
    finished_at: float | None = None
    waiting_until: float | None = None
    # The current phase's time left at its rate so far (None: not known yet).
    seconds_left: float | None = None
    error: str | None = None

    @classmethod
    def parse(cls, value: str) -> BackfillRecord | None:
        try:
            data = json.loads(value)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("repo"), str):
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None

    def dump(self) -> str:
        return json.dumps(asdict(self))

    @property
    def active(self) -> bool:
        return self.state in ("running", "waiting")


def progress_name(repo: str) -> str:
    return PROGRESS_PREFIX + repo.lower()


def load_record(store: Store, repo: str) -> BackfillRecord | None:
    raw = store.get_cursor(progress_name(repo))
    return BackfillRecord.parse(raw) if raw else None


def save_record(store: Store, record: BackfillRecord) -> None:
    record.updated_at = time.time()
    store.set_cursor(progress_name(record.repo), record.dump())


def all_records(store: Store) -> list[BackfillRecord]:
    """Every repository's backfill (for /metrics: figures summed, never named)."""
    out = []
    for _, value, _ in store.cursors(PROGRESS_PREFIX):
        record = BackfillRecord.parse(value)
        if record is not None:
            out.append(record)
    return out


def _group(installation_id: int | None, repo: str) -> str:
    return str(installation_id) if installation_id is not None else "repo:" + repo.lower()


def backfill_job(repo: str, installation_id: int | None, run: int, number: int,
                 due_at: float | None = None) -> NewJob:
    """Slice ``number`` of backfill ``run`` of ``repo``: its id is fixed by these, so a slice
    retried after queueing its successor queues it once."""
    payload: dict[str, Any] = {"repository": {"full_name": repo},
                               "backfill": {"run": run, "slice": number}}
    if installation_id is not None:
        payload["installation"] = {"id": installation_id}
    return NewJob(delivery_id=f"dejafix-backfill:{repo.lower()}:{run}:{number}",
                  event=BACKFILL_EVENT, repo=repo, installation_id=installation_id,
                  payload=json.dumps(payload).encode(),
                  issue="backfill:" + _group(installation_id, repo), due_at=due_at)


def start_backfills(store: Store, installation_id: int | None, repos: list[str]) -> str | None:
    """Line ``repos`` up for their installation's backfills (a repository with a backfill
    already, running or done, is left out); the first starts at once if none runs. Returns
    the repository started, if any. Store calls: run it in a thread."""
    wanted = []
    for repo in repos:
        record = load_record(store, repo)
        if record is not None and record.state in ("queued", "running", "waiting", "done"):
            continue
        save_record(store, BackfillRecord(repo=repo))
        wanted.append(repo)
    if not wanted:
        return None
    run = int(time.time())
    return store.backfill_turn(_group(installation_id, wanted[0]), add=wanted,
                               job=lambda r: backfill_job(r, installation_id, run, 0))


def _finish_turn(store: Store, installation_id: int | None, repo: str) -> str | None:
    run = int(time.time())
    return store.backfill_turn(_group(installation_id, repo), finished=repo,
                               job=lambda r: backfill_job(r, installation_id, run, 0))


def installed_repos(data: dict[str, Any], key: str) -> list[str]:
    items = data.get(key)
    out = []
    for item in items if isinstance(items, list) else []:
        name = item.get("full_name") if isinstance(item, dict) else None
        if isinstance(name, str) and _REPO_NAME.fullmatch(name):
            out.append(name)
    return out


def _can_read_github(ctx: Context) -> bool:
    """A dry run without credentials (the Quickstart) answers from the sample clusters and
    never calls GitHub: a backfill there would only fail, attempt after attempt."""
    return not (ctx.services.dry_run and not ctx.services.github.authenticated)


@router.register("installation", action="created")
@router.register("installation_repositories", action="added")
async def on_installed(event: Event, ctx: Context) -> None:
    key = "repositories" if event.event == "installation" else "repositories_added"
    repos = installed_repos(event.data, key)
    if not repos or not _can_read_github(ctx):
        return
    if ctx.services.config.backfill == "off":
        log.info("installation %s: %d repositories added; backfill is off (config/bot.yml)",
                 ctx.installation_id, len(repos))
        return
    started = await asyncio.to_thread(start_backfills, ctx.services.store,
                                      ctx.installation_id, repos)
    log.info("installation %s: backfill of %d repositories lined up%s", ctx.installation_id,
             len(repos), f"; {started} first" if started else "")


async def backfill_unseen(ctx: Context) -> None:
    """A repository seen with nothing learned and no backfill gets one, once (its own
    ``backfill: false`` stops it when its first slice reads the file)."""
    if ctx.services.config.backfill == "off" or not _can_read_github(ctx):
        return
    key = ctx.repo_name.lower()
    if key in _checked:
        return
    _checked[key] = True
    store = ctx.services.store
    repo, installation = ctx.repo_name, ctx.installation_id

    def check() -> str | None:
        if store.learned_count(repo) or load_record(store, repo) is not None \
                or store.cursors(f"backfill:{key}:"):
            return None
        return start_backfills(store, installation, [repo]) or ""

    started = await asyncio.to_thread(check)
    if started is not None:
        log.info("%s: nothing learned yet; its backfill is lined up", repo)


class _RateWait(Exception):
    def __init__(self, until: float, why: str) -> None:
        super().__init__(why)
        self.until = until


async def _wait_instead(seconds: float) -> None:
    """The backfill's sleep in a job: the slice ends and its successor is due then."""
    raise _RateWait(time.time() + seconds, "rate limit nearly spent")


def _github_wait(exc: BaseException) -> float | None:
    """Seconds GitHub asked to wait, when ``exc`` is a (primary or secondary) rate limit."""
    if isinstance(exc, gidgethub.BadGraphQLRequest):
        if exc.status_code in (403, 429) and "rate limit" in str(exc.response).lower():
            return GRAPHQL_LIMIT_WAIT
        return None
    if isinstance(exc, gidgethub.HTTPException):
        return rate_limit_wait(exc)
    return None


def _lost_access(exc: BaseException) -> bool:
    status = getattr(exc, "status_code", None)
    return isinstance(exc, gidgethub.BadRequest | gidgethub.BadGraphQLRequest) and \
        status is not None and int(status) in (401, 403, 404, 410)


class _Flusher:
    """Writes the slice's figures to the store (in a thread, at most every FLUSH_SECONDS, the
    latest only), so the loop never waits on the store for a progress report."""

    def __init__(self, store: Store, record: BackfillRecord, base_calls: int,
                 base_duplicates: int) -> None:
        self.store, self.record = store, record
        self.base_calls, self.base_duplicates = base_calls, base_duplicates
        self.dirty = asyncio.Event()
        self.closing = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def update(self, progress: BackfillProgress) -> None:
        r = self.record
        r.phase = progress.phase
        # A slice that starts in a later phase has not been told the earlier phases' totals.
        r.prs_read = progress.prs_read
        r.prs_total = progress.prs_total if progress.prs_total is not None else r.prs_total
        r.issues_read = progress.issues_read
        r.issues_total = (progress.issues_total if progress.issues_total is not None
                          else r.issues_total)
        r.fixes_read = progress.fixes_read
        r.fixes_total = (progress.fixes_total if progress.fixes_total is not None
                         else r.fixes_total)
        r.clusters = progress.clusters
        r.duplicates = self.base_duplicates + progress.duplicates
        r.calls = self.base_calls + progress.calls
        r.seconds_left = progress.seconds_left(time.time())
        self.dirty.set()

    async def _run(self) -> None:
        while True:
            await self.dirty.wait()
            if self.closing.is_set():
                return
            self.dirty.clear()
            await asyncio.to_thread(save_record, self.store, self.record)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closing.wait(), FLUSH_SECONDS)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="dejafix-backfill-progress")

    async def stop(self) -> None:
        """Ends after the write under way, never during it: a cancelled write would still land
        in its thread, possibly after the slice's last one."""
        self.closing.set()
        self.dirty.set()
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)


async def run_slice(ctx: Context, *, slice_seconds: float | None = None,
                    clock: Callable[[], float] = time.monotonic) -> str:
    """One slice of the repository's backfill; queues the next when there is more. Returns
    what became of it: paused, waiting, done, stopped or off."""
    services, store, repo = ctx.services, ctx.services.store, ctx.repo_name
    info = ctx.payload.get("backfill")
    if not isinstance(info, dict):
        info = {}
    run, number = int(info.get("run") or 0), int(info.get("slice") or 0)
    installation = ctx.installation_id
    record = await asyncio.to_thread(load_record, store, repo) or BackfillRecord(repo=repo)
    if record.state in ("done", "off"):
        # A slice queued twice (a retried job) finds the work done.
        return record.state

    async def end(state: str, error: str | None = None) -> str:
        record.state, record.error, record.waiting_until = state, error, None
        record.finished_at = time.time()
        await asyncio.to_thread(save_record, store, record)
        await asyncio.to_thread(_finish_turn, store, installation, repo)
        return state

    try:
        config = await ctx.repo_config()
    except RepoConfigError as exc:
        log.warning("%s: backfill stopped: its .github/dejafix.yml cannot be used (%s)", repo,
                    exc)
        return await end("stopped", "invalid .github/dejafix.yml")
    if services.config.backfill == "off" or not config.backfill:
        log.info("%s: backfill off (%s)", repo, "config/bot.yml" if
                 services.config.backfill == "off" else ".github/dejafix.yml")
        return await end("off")
    record.state, record.error, record.waiting_until = "running", None, None
    record.slices += 1
    if record.started_at is None:
        record.started_at = time.time()
    limit = SLICE_SECONDS if slice_seconds is None else slice_seconds
    deadline = clock() + limit
    flusher = _Flusher(store, record, record.calls, record.duplicates)
    backfill = Backfill(ctx.repo, store, repo, sleep=_wait_instead, progress=flusher.update,
                        should_pause=lambda: clock() >= deadline)
    flusher.start()
    due: float | None = None
    try:
        await backfill.run()
    except BackfillPaused:
        pass
    except _RateWait as wait:
        due = wait.until
    except (gidgethub.HTTPException, gidgethub.GraphQLException) as exc:
        seconds = _github_wait(exc)
        if seconds is None:
            await flusher.stop()
            if _lost_access(exc):
                log.warning("%s: backfill stopped: GitHub refused (%s)", repo, exc)
                return await end("stopped", f"GitHub refused ({getattr(exc, 'status_code', '')})")
            # Anything else: the job fails and the worker retries it (the cursor is saved).
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            await asyncio.to_thread(save_record, store, record)
            raise
        due = time.time() + seconds
    finally:
        await flusher.stop()
        flusher.update(backfill.progress)
    if backfill.progress.phase == "done":
        record.seconds_left = None
        await _measure(ctx, config)
        log.info("%s: backfill done (%d PRs read, %d clusters, %d calls, %d slices)", repo,
                 record.prs_read, record.clusters, record.calls, record.slices)
        return await end("done")
    if due is not None:
        record.state, record.waiting_until = "waiting", due
        log.info("%s: backfill waits for the rate limit until %s", repo,
                 time.strftime("%H:%M:%S", time.gmtime(due)))
    await asyncio.to_thread(save_record, store, record)
    # A new job, queued now: every delivery that arrived during this slice is older, and runs
    # first.
    await asyncio.to_thread(store.queue_job,
                            backfill_job(repo, installation, run, number + 1, due))
    return "waiting" if due is not None else "paused"


async def _measure(ctx: Context, config: RepoConfig) -> None:
    """The repository's own backtest, once its history is learned (for ``mode: auto``)."""
    policy = effective_policy(ctx.services.config.matching, config)

    def measure() -> Verdict:
        with _BACKTEST:
            return compute_verdict(ctx.services.store, ctx.repo_name, policy)

    try:
        verdict = await asyncio.to_thread(measure)
    except Exception as exc:  # a backtest failure must not undo the backfill
        log.warning("%s: backtest after the backfill failed (%s: %s)", ctx.repo_name,
                    type(exc).__name__, exc)
        return
    log.info("%s: backtest: precision %.2f on %d cases (%d clusters)", ctx.repo_name,
             verdict.precision, verdict.cases, verdict.clusters)
