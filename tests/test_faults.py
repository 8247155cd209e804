"""Fault tests with real processes: the bot runs as ``python -m bot serve`` in a subprocess, the
fake GitHub in this test's event loop on loopback. Kill -9 and SIGTERM in the middle of a job,
a comment POST that fails every way GitHub fails, a storm of redeliveries, a flood of bad
requests. Every test ends with exactly one comment where one is due, and with no secret in the
bot's stderr (checked in the fixture's teardown)."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bot.render.comment import MARKER
from tests.conftest import REPO, SECRET, issue_payload, sign
from tests.fake_github import FakeGitHub, Recorded, rate_limit_fault, timeout_fault
from tests.fault_support import BotProcess, FaultHarness, wait_until
from tests.samples import RESET_HANG

ISSUE = 90001
COMMENTS = f"/repos/{REPO}/issues/{ISSUE}/comments"
# While the fake holds a request, the bot's own GitHub timeout must not end it first.
HELD_TIMEOUT = 60.0


@pytest.fixture
async def harness(github: tuple[FakeGitHub, str], key_pair: tuple[str, str],
                  tmp_path: Path) -> AsyncIterator[FaultHarness]:
    fake, url = github
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50))
    h = FaultHarness(fake=fake, github_url=url, private_pem=key_pair[0], tmp_path=tmp_path,
                     session=session)
    try:
        yield h
    finally:
        await h.cleanup()
    # Every process this test started, whatever it went through: no credential in its stderr
    # (and the check had tokens to look for: each process minted at least one).
    if h.processes:
        assert fake.tokens, "no installation token was minted: the secret check is vacuous"
    assert h.leaks() == [], "secrets in the bot's stderr"


def issue_comments(fake: FakeGitHub, number: int = ISSUE) -> list[dict[str, Any]]:
    return fake.comments.get((REPO.lower(), number), [])


def our_comments(fake: FakeGitHub, number: int = ISSUE) -> list[dict[str, Any]]:
    return [c for c in issue_comments(fake, number) if c["body"].startswith(MARKER)]


async def deliver_reset_hang(h: FaultHarness, proc: BotProcess, delivery: str) -> None:
    status, answer = await h.deliver(proc, issue_payload(**RESET_HANG), delivery=delivery)
    assert (status, answer["status"]) == (202, "queued")


# -- 1. kill -9 while the comment POST is in flight ------------------------------------------


async def test_kill_9_before_github_did_the_post_restart_posts_exactly_once(
        harness: FaultHarness) -> None:
    """The fake holds the POST without doing it; the bot dies; the fake sees the client go and
    never does the POST. The restarted bot finds no comment and posts the one comment."""
    fake = harness.fake
    hold = fake.hold(f"POST {COMMENTS}")
    first = await harness.start(github_timeout=HELD_TIMEOUT)
    await deliver_reset_hang(harness, first, "kill-before")
    await wait_until(hold.arrived.is_set, "the comment POST to reach the fake",
                     diagnose=first.log_tail)

    first.signal(signal.SIGKILL)
    assert await first.wait_exit(10.0) == -signal.SIGKILL
    await wait_until(hold.disconnected.is_set, "the fake to see the killed client go")
    hold.release(perform=False)  # abandoned: GitHub never created it
    assert issue_comments(fake) == []
    assert hold.performed == 0

    second = await harness.start()
    await harness.settle(second)
    assert "1 unfinished job(s) from the last run requeued" in second.log()
    comments = issue_comments(fake)
    assert len(comments) == 1 and comments[0]["body"].startswith(MARKER)
    assert len(fake.calls("POST", COMMENTS)) == 2  # the lost one, and the one that landed
    assert fake.calls("PATCH") == []
    assert await harness.stop(second) == 0
    assert harness.ledger("SELECT comment_id FROM comments") == [(comments[0]["id"],)]
    assert harness.ledger("SELECT delivery_id, state FROM deliveries") == [("kill-before", "done")]


async def test_kill_9_after_github_did_the_post_restart_does_not_post_again(
        harness: FaultHarness) -> None:
    """The fake creates the comment and holds the answer; the bot dies before it learns the
    comment id (nothing in its ledger). The restarted bot must find the marker on the issue."""
    fake = harness.fake
    hold = fake.hold(f"POST {COMMENTS}", perform_first=True)
    first = await harness.start(github_timeout=HELD_TIMEOUT)
    await deliver_reset_hang(harness, first, "kill-after")
    await wait_until(hold.arrived.is_set, "the comment POST to be done by the fake",
                     diagnose=first.log_tail)
    [created] = issue_comments(fake)

    first.signal(signal.SIGKILL)
    assert await first.wait_exit(10.0) == -signal.SIGKILL
    await wait_until(hold.disconnected.is_set, "the fake to see the killed client go")
    hold.release()
    assert harness.ledger("SELECT count(*) FROM comments") == [(0,)]  # died before recording

    second = await harness.start()
    await harness.settle(second)
    assert "1 unfinished job(s) from the last run requeued" in second.log()
    assert issue_comments(fake) == [created]
    assert len(fake.calls("POST", COMMENTS)) == 1  # only the one before the kill
    # Editing our own comment in place (same text) is fine; nothing else was written.
    assert {r.path for r in fake.calls("PATCH")} <= {
        f"/repos/{REPO}/issues/comments/{created['id']}"}
    assert len(fake.calls("PATCH")) <= 1
    assert await harness.stop(second) == 0
    assert harness.ledger("SELECT comment_id FROM comments") == [(created["id"],)]
    assert harness.ledger("SELECT state FROM deliveries") == [("done",)]


# -- 2. the comment POST fails every way GitHub fails -----------------------------------------


async def test_post_502_then_timeout_then_rate_limit_then_one_comment(
        harness: FaultHarness) -> None:
    fake = harness.fake
    github_timeout = 1.0
    fake.failures[f"POST {COMMENTS}"] = [
        502,
        timeout_fault(github_timeout * 4),  # the client gives up first; never performed
        rate_limit_fault(403, retry_after="1"),
    ]
    proc = await harness.start(github_timeout=github_timeout)
    await deliver_reset_hang(harness, proc, "flaky-post")
    await wait_until(lambda: len(fake.calls("POST", COMMENTS)) >= 4, "the fourth POST",
                     timeout=30.0, diagnose=proc.log_tail)
    await harness.settle(proc)

    assert len(our_comments(fake)) == 1 and len(issue_comments(fake)) == 1
    assert len(fake.calls("POST", COMMENTS)) == 4
    # The bot gave up on the slow answer and closed the request; the fake saw it go.
    assert [r.path for r in fake.disconnects] == [COMMENTS]
    health = await harness.health(proc)
    assert (health["queued"], health["failed"]) == (0, 0)
    assert await harness.stop(proc) == 0

    log = proc.log()
    lines = log.splitlines()
    attempt_lines = [line for line in lines if "delivery flaky-post: attempt" in line]
    assert len(attempt_lines) == 2, "\n".join(attempt_lines) or log[-3000:]
    # The 502 (gidgethub names it GitHubBroken), then the timeout: one WARNING line each while
    # the job will be retried, no traceback, nothing at ERROR.
    assert "WARNING" in attempt_lines[0] and "attempt 1 of 5 failed" in attempt_lines[0]
    assert "GitHubBroken" in attempt_lines[0]
    assert "attempt 2 of 5 failed" in attempt_lines[1] and "TimeoutError" in attempt_lines[1]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert not [line for line in lines if "WARNING" in line and "handler" in line], log[-3000:]
    rate_limited = [line for line in lines if "WARNING dejafix.github: GitHub POST " in line
                    and f"{COMMENTS}: rate limited (403); retry 1 in" in line]
    assert len(rate_limited) == 1, log[-3000:]
    assert any(f"{REPO}#{ISSUE} commented" in line for line in lines)
    assert harness.ledger("SELECT state, attempts FROM jobs") == [("done", 3)]


async def test_post_done_but_its_answer_timed_out_is_not_posted_again(
        harness: FaultHarness) -> None:
    """The worst timeout: GitHub created the comment, the answer never came. The job-level
    retry must find the marker comment instead of posting a second one."""
    fake = harness.fake
    hold = fake.hold(f"POST {COMMENTS}", perform_first=True)  # never released: no answer
    proc = await harness.start(github_timeout=1.0)
    await deliver_reset_hang(harness, proc, "lost-answer")
    await harness.settle(proc)

    assert hold.performed == 1 and hold.disconnected.is_set()
    [comment] = issue_comments(fake)
    assert len(fake.calls("POST", COMMENTS)) == 1
    assert [r.path for r in fake.calls("PATCH")] == [
        f"/repos/{REPO}/issues/comments/{comment['id']}"]
    assert await harness.stop(proc) == 0
    assert "delivery lost-answer: attempt 1 of 5 failed (HandlerFailures: TimeoutError" in \
        proc.log()
    assert harness.ledger("SELECT comment_id FROM comments") == [(comment["id"],)]
    assert harness.ledger("SELECT state, attempts FROM jobs") == [("done", 2)]


# -- 3. a storm of redeliveries of one delivery id --------------------------------------------


async def test_1000_concurrent_redeliveries_one_row_one_comment(harness: FaultHarness) -> None:
    fake = harness.fake
    proc = await harness.start()
    body, headers = harness.delivery(issue_payload(**RESET_HANG), delivery="storm-1")
    gate = asyncio.Semaphore(50)

    async def send() -> tuple[int, str]:
        async with gate, harness.session.post(proc.url + "/webhook", data=body,
                                              headers=headers) as resp:
            return resp.status, (await resp.json())["status"]

    answers = await asyncio.gather(*(send() for _ in range(1000)))
    statuses = collections.Counter(status for status, _ in answers)
    kinds = collections.Counter(kind for _, kind in answers)
    assert set(statuses) == {202}, statuses
    assert kinds == {"queued": 1, "duplicate": 999}, kinds

    await harness.settle(proc)
    assert len(issue_comments(fake)) == 1
    assert len(fake.calls("POST", COMMENTS)) == 1
    assert await harness.stop(proc) == 0
    assert harness.ledger("SELECT delivery_id, state FROM deliveries") == [("storm-1", "done")]
    assert harness.ledger("SELECT count(*) FROM jobs") == [(1,)]


# -- 4. a flood of bad requests ---------------------------------------------------------------

MAX_BODY = 16 * 1024
Body = bytes | Callable[[], AsyncIterator[bytes]]


def chunked(data: bytes, size: int = 4096) -> Callable[[], AsyncIterator[bytes]]:
    """A body sent with Transfer-Encoding: chunked, so the server cannot refuse it by length."""

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i:i + size]

    return chunks


def bad_requests() -> list[tuple[str, Body, dict[str, str], int]]:
    """(kind, body, headers, expected status) for each kind of bad request."""
    good = json.dumps(issue_payload(**RESET_HANG)).encode()

    def headers(body: bytes, **extra: str) -> dict[str, str]:
        sent = {"Content-Type": "application/json", "X-GitHub-Event": "issues",
                "X-GitHub-Delivery": "bad", "X-Hub-Signature-256": sign(body)}
        sent.update(extra)
        return {k: v for k, v in sent.items() if v}

    truncated = good[: len(good) // 2]
    oversized = json.dumps(issue_payload(title="x", body="y" * (MAX_BODY + 1024))).encode()
    not_json = b"this is not JSON at all"
    array = b"[1, 2, 3]"
    nested = b"[" * 15_000  # under the size limit, over the parser's recursion limit
    bad_utf8 = b'{"action": "opened", "x": "\xff\xfe"}'
    form = b"nopayload=1"
    form_headers = headers(form, **{"Content-Type": "application/x-www-form-urlencoded"})
    return [
        ("unsigned", good, headers(good, **{"X-Hub-Signature-256": ""}), 401),
        ("wrong signature", good, headers(good, **{"X-Hub-Signature-256": sign(good, "nope")}),
         401),
        ("sha1 signature", good, headers(good, **{"X-Hub-Signature-256": "sha1=" + "0" * 40}),
         401),
        ("truncated JSON", truncated, headers(truncated), 400),
        ("oversized", oversized, headers(oversized), 413),
        ("oversized, chunked", chunked(oversized), headers(oversized), 413),
        ("not JSON", not_json, headers(not_json), 400),
        ("JSON array", array, headers(array), 400),
        ("deeply nested JSON", nested, headers(nested), 400),
        ("invalid UTF-8", bad_utf8, headers(bad_utf8), 400),
        ("form without payload", form, form_headers, 400),
        ("wrong content type", good, headers(good, **{"Content-Type": "text/plain"}), 415),
        ("no event header", good, headers(good, **{"X-GitHub-Event": ""}), 400),
    ]


async def test_10000_bad_requests_all_4xx_bounded_memory_then_still_works(
        harness: FaultHarness) -> None:
    fake = harness.fake
    proc = await harness.start(max_body_bytes=MAX_BODY)
    kinds = bad_requests()
    gate = asyncio.Semaphore(50)
    seen: collections.Counter[tuple[str, int | str]] = collections.Counter()

    async def send(i: int) -> None:
        kind, body, headers, _expected = kinds[i % len(kinds)]
        data = body if isinstance(body, bytes) else body()
        async with gate:
            try:
                async with harness.session.post(proc.url + "/webhook", data=data,
                                                headers=headers) as resp:
                    await resp.read()
                    seen[(kind, resp.status)] += 1
            except aiohttp.ClientError as exc:  # a reset or a dropped connection
                seen[(kind, type(exc).__name__)] += 1

    await asyncio.gather(*(send(i) for i in range(1000)))
    rss_warm = proc.rss_kb()
    await asyncio.gather(*(send(i) for i in range(1000, 10_000)))
    rss_after = proc.rss_kb()
    print(f"bot VmRSS: {rss_warm} kB after 1,000 bad requests, {rss_after} kB after 10,000")

    expected: collections.Counter[tuple[str, int | str]] = collections.Counter()
    for i in range(10_000):
        kind, _, _, status = kinds[i % len(kinds)]
        expected[(kind, status)] += 1
    assert seen == expected  # every answer the right 4xx: no 5xx, no reset
    assert rss_after - rss_warm < 40 * 1024, (rss_warm, rss_after)
    assert fake.repo_requests() == []  # none of them reached GitHub
    assert harness.ledger("SELECT count(*) FROM deliveries") == [(0,)]

    await deliver_reset_hang(harness, proc, "after-the-flood")
    await harness.settle(proc)
    assert len(issue_comments(fake)) == 1
    assert await harness.stop(proc) == 0
    assert harness.ledger("SELECT delivery_id, state FROM deliveries") == [
        ("after-the-flood", "done")]


# -- 5. SIGTERM while a job is in progress ----------------------------------------------------


async def healthz_status(h: FaultHarness, proc: BotProcess) -> int:
    async with h.session.get(proc.url + "/healthz") as resp:
        return resp.status


async def test_sigterm_with_a_held_job_drains_accepting_and_restart_finishes_it(
        harness: FaultHarness) -> None:
    """A deploy: SIGTERM while a job waits on GitHub. /healthz turns 503 at once, deliveries
    sent during the whole drain are accepted (GitHub never redelivers them on its own), the
    held job is given back to the queue when the drain ends, and the next start runs it and
    every delivery accepted meanwhile."""
    fake = harness.fake
    drain = 3.0
    hold = fake.hold(f"POST {COMMENTS}")
    first = await harness.start(drain_seconds=drain, stop_grace=0.0,
                                github_timeout=HELD_TIMEOUT)
    await deliver_reset_hang(harness, first, "term-held")
    await wait_until(hold.arrived.is_set, "the comment POST to reach the fake",
                     diagnose=first.log_tail)

    loop = asyncio.get_running_loop()
    started = loop.time()
    first.signal(signal.SIGTERM)
    await wait_until(_is(harness, first, 503), "/healthz to say 503", timeout=drain,
                     diagnose=first.log_tail)
    # Deliveries keep coming for most of the drain: every one is accepted.
    sent: list[str] = []
    while loop.time() - started < drain - 0.5:
        delivery = f"during-drain-{len(sent)}"
        status, answer = await harness.deliver(
            first, issue_payload(number=70000 + len(sent), title="unrelated"), delivery=delivery)
        assert (status, answer["status"]) == (202, "queued"), (delivery, status, answer)
        sent.append(delivery)
        await asyncio.sleep(0.05)
    assert len(sent) >= 10
    assert await first.wait_exit(drain + 15.0) == 0
    took = loop.time() - started
    assert took >= drain * 0.9, f"exited after {took:.2f}s, before the {drain}s drain"
    log = first.log()
    assert "shutdown: 1 delivery(ies) unfinished, given back to the queue" in log
    assert "shutdown complete" in log
    # The cancelled job closed its request; the POST was never done.
    await wait_until(hold.disconnected.is_set, "the fake to see the request abandoned")
    assert issue_comments(fake) == []
    # Given back, not left running: its attempt counted, and it waits for no lease.
    assert harness.ledger("SELECT state, attempts FROM jobs WHERE delivery_id = ?",
                          "term-held") == [("queued", 1)]

    second = await harness.start(drain_seconds=drain)
    await harness.settle(second)
    assert len(issue_comments(fake)) == 1
    assert len(fake.calls("POST", COMMENTS)) == 2
    assert await harness.stop(second) == 0
    states = dict(harness.ledger("SELECT delivery_id, state FROM deliveries"))
    assert states == {"term-held": "done", **{d: "done" for d in sent}}


def _is(h: FaultHarness, proc: BotProcess, status: int) -> Callable[[], Any]:
    async def check() -> bool:
        try:
            return await healthz_status(h, proc) == status
        except aiohttp.ClientError:
            return False
    return check


async def test_sigterm_job_that_finishes_within_the_drain_is_not_redone(
        harness: FaultHarness) -> None:
    fake = harness.fake
    drain = 15.0  # long: the job is released as soon as the drain has begun
    hold = fake.hold(f"POST {COMMENTS}")
    first = await harness.start(drain_seconds=drain, stop_grace=0.0,
                                github_timeout=HELD_TIMEOUT)
    await deliver_reset_hang(harness, first, "term-drained")
    await wait_until(hold.arrived.is_set, "the comment POST to reach the fake",
                     diagnose=first.log_tail)

    first.signal(signal.SIGTERM)
    await wait_until(_is(harness, first, 503), "/healthz to say 503", diagnose=first.log_tail)
    assert first.alive()
    hold.release()  # GitHub answers during the drain
    assert await first.wait_exit(drain + 15.0) == 0
    assert "unfinished" not in first.log()
    assert len(issue_comments(fake)) == 1
    assert harness.ledger("SELECT state FROM deliveries") == [("done",)]

    second = await harness.start(drain_seconds=drain)
    await harness.settle(second)
    assert "requeued" not in second.log()
    assert len(fake.calls("POST", COMMENTS)) == 1
    assert await harness.stop(second) == 0


# -- two processes on one data directory ------------------------------------------------------


async def test_second_process_on_the_same_data_dir_does_not_redo_a_running_job(
        harness: FaultHarness) -> None:
    """An overlapping deploy: the new process starts while the old one is still in the middle
    of a job. Refusing to start and leaving the job alone are both fine; redoing it is not."""
    fake = harness.fake
    hold = fake.hold(f"POST {COMMENTS}", count=2)
    # One worker, busy with the held job: the old process cannot take the job a second time
    # itself (its per-issue lock would serialise that), so any second run is the new one's.
    old = await harness.start(github_timeout=HELD_TIMEOUT, workers=1)
    await deliver_reset_hang(harness, old, "overlap")
    await wait_until(hold.arrived.is_set, "the old process's POST to reach the fake",
                     diagnose=old.log_tail)

    new = harness.spawn(github_timeout=HELD_TIMEOUT)
    started = await harness.wait_ready(new, exit_ok=True)
    if not started:
        assert new.popen.returncode != 0, new.log_tail()
    elif "requeued" in new.log():
        # It took the old process's job: let its own POST arrive too before GitHub answers.
        await wait_until(lambda: hold.held >= 2, "the new process's POST",
                         diagnose=new.log_tail)
    hold.release()
    await harness.settle(old)
    if started:
        await harness.settle(new)
    assert len(issue_comments(fake)) == 1, [c["id"] for c in issue_comments(fake)]


# -- secrets ----------------------------------------------------------------------------------


async def test_secret_scan_finds_a_leak(harness: FaultHarness) -> None:
    """The teardown check can fail: every kind of secret it knows is found when present."""
    fake = harness.fake
    fake.tokens["ghs_planted0123456789abcdef"] = 77
    fake.requests.append(Recorded("GET", "/app", "",
                                  {"Authorization": "bearer eyJplanted.jwt.value"}, None))
    pem_line = next(line for line in harness.private_pem.splitlines()
                    if not line.startswith("-----"))
    log = harness.tmp_path / "bot-planted.log"
    for planted, name in [(SECRET, "webhook secret"), (pem_line, "PEM body line 1"),
                          ("ghs_planted0123456789abcdef", "installation token"),
                          ("eyJplanted.jwt.value", "bearer credential")]:
        log.write_text(f"2026-01-01 INFO dejafix: something {planted} happened\n")
        fake_proc = BotProcess(popen=_exited_popen(), port=0, log_path=log)
        harness.processes.append(fake_proc)
        try:
            leaks = harness.leaks()
            assert any(leak.startswith(name) for leak in leaks), (name, leaks)
        finally:
            harness.processes.remove(fake_proc)
    fake.tokens.clear()
    fake.requests.clear()


def _exited_popen() -> subprocess.Popen[bytes]:
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    return popen
