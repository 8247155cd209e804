"""The worker under a burst: never more jobs at once than ``workers``, none claimed ahead of a
free slot; at shutdown the job in hand goes back to the queue with its attempt counted, the
others were never claimed; issues of a repository without clusters are answered without reading
or matching anything."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from bot.settings import ServiceConfig
from bot.web.app import METRICS
from tests.conftest import REPO, SAMPLE_CLUSTERS, BotFactory, issue_payload
from tests.fault_support import wait_until
from tests.samples import RESET_HANG

ISSUES = f"/repos/{REPO}/issues/"


def job_rows(data_dir: Path) -> list[tuple[str, str, int]]:
    """(delivery, state, attempts) of every job, read from the database file."""
    with sqlite3.connect(data_dir / "dejafix.sqlite3") as conn:
        rows = conn.execute("SELECT delivery_id, state, attempts FROM jobs ORDER BY id")
        return [(str(d), str(s), int(a)) for d, s, a in rows]


def leased(data_dir: Path) -> int:
    return sum(1 for _, state, _ in job_rows(data_dir) if state == "running")


async def test_a_burst_never_runs_more_jobs_at_once_than_workers(make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], workers=2,
                                              repo_workers=0))
    hold = bot.github.hold(f"POST {ISSUES}", count=6)
    for n in range(1, 7):
        resp = await bot.deliver("issues", issue_payload(**RESET_HANG, number=n),
                                 delivery=f"burst-{n}")
        assert resp.status == 202
    # Two jobs reach their comment POST; the other four wait in the queue, unclaimed.
    await wait_until(lambda: hold.held >= 2, "two comment POSTs")
    await asyncio.sleep(0.2)  # room for a third, if the worker did not keep to ``workers``
    assert hold.held == 2
    assert leased(bot.data_dir) == 2
    hold.release()
    await bot.settle()
    posted = sorted(int(r.path.split("/")[-2]) for r in bot.github.calls("POST", "/comments"))
    assert posted == [1, 2, 3, 4, 5, 6]
    assert [state for _, state, _ in job_rows(bot.data_dir)] == ["done"] * 6


async def test_a_repository_runs_at_most_repo_workers_jobs_at_once(make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], workers=8,
                                              repo_workers=3))
    hold = bot.github.hold(f"POST {ISSUES}", count=6)
    for n in range(1, 7):
        await bot.deliver("issues", issue_payload(**RESET_HANG, number=n), delivery=f"r-{n}")
    await wait_until(lambda: hold.held >= 3, "three comment POSTs")
    await asyncio.sleep(0.2)
    assert (hold.held, leased(bot.data_dir)) == (3, 3)
    hold.release()
    await bot.settle()
    assert len(bot.github.calls("POST", "/comments")) == 6


async def test_the_job_in_hand_goes_back_to_the_queue_at_shutdown(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], workers=1,
                                              drain_seconds=0.2))
    hold = bot.github.hold(f"POST {ISSUES}", count=3)
    for n in range(1, 4):
        await bot.deliver("issues", issue_payload(**RESET_HANG, number=n), delivery=f"stop-{n}")
    await wait_until(lambda: hold.held == 1, "the first comment POST")
    with caplog.at_level(logging.WARNING, logger="dejafix"):
        await bot.client.close()  # SIGTERM's path: the app's cleanup stops the worker
    hold.release(perform=False)
    # The one in its handler is given back, its attempt counted (it started); the two others
    # were never claimed, so they count none.
    assert job_rows(bot.data_dir) == [("stop-1", "queued", 1), ("stop-2", "queued", 0),
                                      ("stop-3", "queued", 0)]
    assert "shutdown: 1 delivery(ies) unfinished, given back to the queue" in caplog.text
    assert hold.performed == 0 and bot.github.comments == {}


async def test_issues_of_a_repository_without_clusters_are_silent_and_said_once(
        make_bot: BotFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "no-clusters"
    empty.mkdir()
    bot = await make_bot(dry_run=True, with_credentials=False,
                         config=ServiceConfig(cluster_paths=[str(empty)]))
    with caplog.at_level(logging.INFO, logger="dejafix.known_fix"):
        for n in range(1, 4):
            assert (await bot.deliver("issues", issue_payload(**RESET_HANG, number=n))).status \
                == 202
        await bot.settle()
    said = [r.getMessage() for r in caplog.records if r.name == "dejafix.known_fix"]
    assert said == [f"{REPO}: no clusters for this repository or its upstreams; its issues "
                    "get no suggestion until some are loaded or learned"]
    assert bot.app[METRICS].matches.value(outcome="silent") == 3
    assert [state for _, state, _ in job_rows(bot.data_dir)] == ["done"] * 3
    assert bot.github.repo_requests() == []


async def test_a_worker_whose_database_session_is_lost_cancels_its_jobs(
        make_bot: BotFactory, pg_url: str) -> None:
    """PostgreSQL: the session the worker's jobs are held under is ended (a network cut, an
    administrator): other workers may take those jobs at once, so this one cancels them at its
    next check instead of running them beside their new worker; its next claim opens a new
    session."""
    import psycopg

    from bot.db.postgres import OWNER_SPACE
    from bot.web.app import WORKER

    bot = await make_bot(database_url=pg_url)
    hold = bot.github.hold(f"POST {ISSUES}")
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=1), delivery="lost-1")
    await wait_until(lambda: hold.held >= 1, "the comment POST")
    worker = bot.app[WORKER]
    [job] = list(worker.running.values())
    assert job.owner is not None
    with psycopg.connect(pg_url, autocommit=True) as admin:
        [(pid,)] = admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s::oid AND objid = %s::oid AND objsubid = 2",
            (OWNER_SPACE, job.owner)).fetchall()
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert await worker.check_session() == 1
    await wait_until(lambda: not worker.running, "the job to be cancelled")
    assert await worker.check_session() == 0
    # The job is anyone's now, this worker's too: taken over and run again, once.
    hold.release(perform=False)
    await bot.settle()
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT state, attempts FROM jobs").fetchall() == [("done", 2)]
    assert len(bot.github.calls("POST", f"{ISSUES}1/comments")) == 2
