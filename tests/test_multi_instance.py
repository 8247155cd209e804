"""Many instances, one PostgreSQL database, real processes: web processes (``serve
--no-worker``) and worker processes (``worker``) on one database and one fake GitHub, each with
a data directory of its own (a host's own disk). Redelivery storms spread over the web
processes, a worker killed while it holds a job, a chaos run with a fifth of GitHub's answers
failing, learned clusters, the daily cap and config pushes seen across instances, a rolling
restart, and a repository whose GitHub calls hang.

Every test here needs the PostgreSQL server (``DEJAFIX_TEST_DATABASE_URL``); without one they
are skipped with one line saying so (``.ci/run`` makes that a failure)."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bot.render.comment import MARKER
from tests.conftest import SAMPLE_CLUSTERS, issue_payload
from tests.fake_github import Chaos, FakeGitHub
from tests.fault_support import BotProcess, FaultHarness, wait_until
from tests.samples import LEARN_REPO, NEW_REPORT, RESET_HANG, merged_pr, seed_history

UNRELATED = {"title": "Dark mode colours are off in the settings page",
             "body": "The toggle renders white on white."}


@pytest.fixture
async def harness(github: tuple[FakeGitHub, str], key_pair: tuple[str, str],
                  tmp_path: Path, pg_url: str) -> AsyncIterator[FaultHarness]:
    fake, url = github
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100))
    h = FaultHarness(fake=fake, github_url=url, private_pem=key_pair[0], tmp_path=tmp_path,
                     session=session, database_url=pg_url)
    try:
        yield h
    finally:
        await h.cleanup()
    assert h.leaks() == [], "secrets in the bot's stderr"


def repos_clusters(tmp_path: Path, repos: list[str]) -> Path:
    """The sample reset-hang cluster, once per repository (invented names)."""
    folder = tmp_path / "clusters"
    folder.mkdir(exist_ok=True)
    record = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    for i, repo in enumerate(repos):
        (folder / f"c{i}.json").write_text(json.dumps({**record, "repo": repo}))
    return folder


async def start_fleet(h: FaultHarness, *, webs: int = 2, workers: int = 2,
                      **config: Any) -> tuple[list[BotProcess], list[BotProcess]]:
    """``webs`` web processes and ``workers`` worker processes, each on its own data dir."""
    n = len(h.processes)
    web = [h.spawn("--no-worker", data_dir=h.tmp_path / f"host-{n + i}", **config)
           for i in range(webs)]
    work = [h.spawn(command="worker", data_dir=h.tmp_path / f"host-{n + webs + i}", **config)
            for i in range(workers)]
    for proc in web + work:
        await h.wait_ready(proc)
    return web, work


def comments_on(fake: FakeGitHub, repo: str, number: int) -> list[dict[str, Any]]:
    return [c for c in fake.comments.get((repo.lower(), number), [])
            if c["body"].startswith(MARKER)]


async def drained(h: FaultHarness, proc: BotProcess, timeout: float = 60.0) -> None:
    await h.settle(proc, timeout=timeout)


# -- redeliveries, crashes --------------------------------------------------------------------


async def test_1000_redeliveries_over_two_web_processes_one_job_one_comment(
        harness: FaultHarness, tmp_path: Path) -> None:
    repo = "acme/storm"
    web, _ = await start_fleet(harness, cluster_paths=[str(repos_clusters(tmp_path, [repo]))])
    body, headers = harness.delivery(issue_payload(**RESET_HANG, repo=repo), delivery="storm")
    gate = asyncio.Semaphore(100)

    async def send(i: int) -> str:
        async with gate, harness.session.post(web[i % 2].url + "/webhook", data=body,
                                              headers=headers) as resp:
            assert resp.status == 202
            return str((await resp.json())["status"])

    statuses = collections.Counter(await asyncio.gather(*(send(i) for i in range(1000))))
    assert statuses == {"queued": 1, "duplicate": 999}
    await drained(harness, web[0])
    assert len(comments_on(harness.fake, repo, 90001)) == 1
    assert harness.ledger("SELECT count(*), min(state) FROM jobs") == [(1, "done")]


async def metric(h: FaultHarness, proc: BotProcess, sample: str) -> float:
    """One sample of the process's /metrics (0 when absent)."""
    async with h.session.get(proc.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


async def test_a_worker_killed_holding_a_job_is_taken_over_within_seconds(
        harness: FaultHarness, tmp_path: Path) -> None:
    """The lease is the default five minutes: the job is answered within 10 s of the kill all
    the same, because the killed worker's database session (and the lock that said it was
    alive) ended with it."""
    repo = "acme/crash"
    config = {"cluster_paths": [str(repos_clusters(tmp_path, [repo]))], "lease_seconds": 300.0,
              "github_timeout": 30.0}
    comments = f"/repos/{repo}/issues/90001/comments"
    hold = harness.fake.hold(f"POST {comments}")  # the first POST only, never performed
    [web], [first] = await start_fleet(harness, webs=1, workers=1, **config)
    status, _ = await harness.deliver(web, issue_payload(**RESET_HANG, repo=repo),
                                      delivery="crash")
    assert status == 202
    await wait_until(hold.arrived.is_set, "the first worker's POST", diagnose=first.log_tail)
    second = await harness.start(command="worker", data_dir=tmp_path / "host-b", **config)
    loop = asyncio.get_running_loop()
    first.popen.kill()  # SIGKILL: no drain, no release
    killed_at = loop.time()
    await wait_until(lambda: len(harness.fake.calls("POST", comments)) == 2,
                     "the second worker's POST within 10 s of the kill", timeout=10.0,
                     diagnose=second.log_tail)
    print(f"taken over and answered {loop.time() - killed_at:.2f} s after the kill "
          f"(lease: {config['lease_seconds']:.0f} s)")
    await drained(harness, web)
    assert len(comments_on(harness.fake, repo, 90001)) == 1
    assert harness.ledger("SELECT state, attempts, last_error FROM jobs") == [
        ("done", 2, "its worker's database session ended (the process died) during attempt 1")]
    assert await metric(harness, second,
                        'dejafix_jobs_taken_over_total{reason="dead"}') == 1.0
    assert "taken over from its worker" in second.log()
    assert await metric(harness, second, "dejafix_listen_connected") == 1.0


async def test_a_stopped_worker_keeps_its_job_until_its_lease_and_its_late_result_is_refused(
        harness: FaultHarness, tmp_path: Path) -> None:
    """SIGSTOP: the worker is alive but silent; its session stays open, so its job is not
    taken before the lease runs out. Then the attempt is ended and the other worker runs the
    job once; the stopped worker, continued, finds its attempt cut off (half the lease) and
    its failure refused: one comment, the job done once."""
    repo = "acme/stopped"
    lease = 6.0
    config = {"cluster_paths": [str(repos_clusters(tmp_path, [repo]))], "lease_seconds": lease,
              "github_timeout": 30.0}
    comments = f"/repos/{repo}/issues/90001/comments"
    hold = harness.fake.hold(f"POST {comments}")  # the first POST only, never performed
    [web], [first] = await start_fleet(harness, webs=1, workers=1, **config)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    status, _ = await harness.deliver(web, issue_payload(**RESET_HANG, repo=repo),
                                      delivery="stopped")
    assert status == 202
    await wait_until(hold.arrived.is_set, "the first worker's POST", diagnose=first.log_tail)
    first.signal(signal.SIGSTOP)
    [(claim, owner)] = harness.ledger("SELECT claim, owner FROM jobs")
    second = await harness.start(command="worker", data_dir=tmp_path / "host-b", **config)
    await wait_until(lambda: len(harness.fake.calls("POST", comments)) == 2,
                     "the second worker's POST after the lease", timeout=lease + 20,
                     diagnose=second.log_tail)
    # Not before the lease (claimed after ``sent``): the stopped worker was alive until then.
    assert loop.time() - sent >= lease
    await drained(harness, web)
    first.signal(signal.SIGCONT)
    await wait_until(lambda: "is another worker's" in first.log(),
                     "the continued worker to be refused", diagnose=first.log_tail)
    assert len(comments_on(harness.fake, repo, 90001)) == 1
    [(state, attempts, error, claim_now)] = harness.ledger(
        "SELECT state, attempts, last_error, claim FROM jobs")
    assert (state, attempts, error) == (
        "done", 2, "attempt 1 ended: its worker held it past its lease")
    assert claim_now > claim and owner is not None
    assert await metric(harness, second,
                        'dejafix_jobs_taken_over_total{reason="lease"}') == 1.0
    assert await metric(harness, second,
                        'dejafix_jobs_taken_over_total{reason="dead"}') == 0.0
    assert first.alive()


async def test_300_issues_over_20_repos_under_chaos_one_comment_where_due(
        harness: FaultHarness, tmp_path: Path) -> None:
    """A fifth of GitHub's answers fail (502, timeouts, secondary rate limits, a comment created
    and then answered 502): every matching issue ends with exactly one comment, every other
    issue with none, nothing given up on."""
    fake = harness.fake
    repos = [f"acme{i:02d}/app" for i in range(20)]
    fake.chaos = Chaos(rate=0.2, timeout=3.0, seed=15)
    web, _ = await start_fleet(
        harness, cluster_paths=[str(repos_clusters(tmp_path, repos))], github_timeout=1.0,
        retry_base=0.05, max_attempts=50)
    expected: dict[tuple[str, int], bool] = {}
    sends = []
    for i in range(300):
        repo, number = repos[i % 20], 1000 + i
        matching = i % 3 != 0
        text = RESET_HANG if matching else UNRELATED
        expected[(repo, number)] = matching
        body, headers = harness.delivery(issue_payload(**text, repo=repo, number=number))
        sends.append((web[i % 2].url, body, headers))

    async def send(url: str, body: bytes, headers: dict[str, str]) -> int:
        async with harness.session.post(url + "/webhook", data=body, headers=headers) as resp:
            return resp.status

    assert set(await asyncio.gather(*(send(*s) for s in sends))) == {202}
    await drained(harness, web[0], timeout=240.0)
    wrong = {key: len(comments_on(fake, *key)) for key, due in expected.items()
             if len(comments_on(fake, *key)) != (1 if due else 0)}
    assert wrong == {}, wrong
    assert harness.ledger("SELECT count(*) FROM jobs WHERE state = 'failed'") == [(0,)]
    # The chaos was real: every kind of fault, dozens of them (about 80 of some 400 calls
    # since a newly opened issue is not searched for our comment on its first attempt).
    assert sum(fake.chaos.injected.values()) > 50, fake.chaos.injected
    assert all(fake.chaos.injected.get(kind, 0) > 0
               for kind in ("rate_limit", "502", "timeout", "created_then_502")), \
        fake.chaos.injected


# -- what instances share ---------------------------------------------------------------------


async def only(h: FaultHarness, running: BotProcess, *others: BotProcess) -> None:
    """Let ``running`` alone take jobs: the others are stopped (SIGSTOP) until their turn
    (SIGCONT). A stopped process keeps its sockets: what is notified meanwhile waits for it.
    Never stopped inside a transaction: one stopped holding the claims' advisory lock (its
    worker claims every second) would hold up ``running``'s claims until its turn."""
    running.signal(signal.SIGCONT)
    for _ in range(200):
        for proc in others:
            proc.signal(signal.SIGSTOP)
        # A statement under way when it stopped ends at the server and leaves the session idle
        # in its transaction: looked at once that is older than any live transaction here.
        await asyncio.sleep(0.25)
        stuck = await asyncio.to_thread(
            h.ledger, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state IN ('idle in transaction', 'idle in transaction (aborted)')"
            " AND clock_timestamp() - state_change > interval '200 milliseconds'")
        if not stuck[0][0]:
            return
        for proc in others:
            proc.signal(signal.SIGCONT)
        await asyncio.sleep(0.05)
    raise AssertionError("the other instances kept stopping inside a transaction")


async def test_a_cluster_learned_through_one_instance_is_used_by_the_others_next_match(
        harness: FaultHarness, tmp_path: Path) -> None:
    empty = tmp_path / "no-clusters"
    empty.mkdir()
    seed_history(harness.fake)
    first, second = [await harness.start(data_dir=tmp_path / f"host-{i}",
                                         cluster_paths=[str(empty)], cluster_reload=0)
                     for i in range(2)]
    await only(harness, first, second)  # the merged fix is learned by the first instance
    status, _ = await harness.deliver(first, merged_pr(), event="pull_request")
    assert status == 202
    await drained(harness, first)
    assert harness.ledger("SELECT public_id FROM learned_clusters") == [("10",)]
    await only(harness, second, first)  # and the next report is matched by the second
    status, _ = await harness.deliver(second, issue_payload(**NEW_REPORT, repo=LEARN_REPO,
                                                            number=12))
    await drained(harness, second)
    assert len(comments_on(harness.fake, LEARN_REPO, 12)) == 1
    assert "#12 commented" in second.log() and "#12" not in first.log()
    first.signal(signal.SIGCONT)


async def test_the_daily_cap_holds_across_instances(harness: FaultHarness,
                                                   tmp_path: Path) -> None:
    repo = "acme/capped"
    fake = harness.fake
    fake.add_file(repo, ".github/dejafix.yml", "max_comments_per_day: 2\n")
    # Every job reads the issue's comments for a while first: the six run side by side.
    fake.delays[f"GET /repos/{repo}/issues/"] = 0.5
    web, _ = await start_fleet(harness, cluster_paths=[str(repos_clusters(tmp_path, [repo]))],
                               repo_workers=0)
    for i in range(6):
        status, _ = await harness.deliver(web[i % 2], issue_payload(**RESET_HANG, repo=repo,
                                                                    number=500 + i))
        assert status == 202
    await drained(harness, web[0])
    commented = [n for n in range(500, 506) if comments_on(fake, repo, n)]
    assert len(commented) == 2, commented


async def test_a_config_push_seen_by_one_instance_drops_the_others_cached_config(
        harness: FaultHarness, tmp_path: Path) -> None:
    repo = "acme/configured"
    fake = harness.fake
    clusters = [str(repos_clusters(tmp_path, [repo]))]
    first, second = [await harness.start(data_dir=tmp_path / f"host-{i}", cluster_paths=clusters)
                     for i in range(2)]
    fake.add_file(repo, ".github/dejafix.yml", "enabled: false\n")
    await only(harness, second, first)  # the second instance reads (and caches) the disabled config
    await harness.deliver(second, issue_payload(**RESET_HANG, repo=repo, number=1))
    await drained(harness, second)
    assert comments_on(fake, repo, 1) == [] and "#1 skipped: disabled" in second.log()
    fake.add_file(repo, ".github/dejafix.yml", "enabled: true\n")
    push = {"ref": "refs/heads/main", "after": "0" * 40, "deleted": True,
            "repository": {"full_name": repo, "default_branch": "main"},
            "installation": {"id": 77}, "commits": [{"modified": [".github/dejafix.yml"]}]}
    await only(harness, first, second)  # the push is seen by the first
    await harness.deliver(first, push, event="push")
    await drained(harness, first)
    assert "cached config(s) dropped" in first.log()
    await only(harness, second, first)
    # Within the config cache's TTL (300 s): only the notification can have dropped it.
    await harness.deliver(second, issue_payload(**RESET_HANG, repo=repo, number=2))
    await drained(harness, second)
    assert len(comments_on(fake, repo, 2)) == 1, second.log_tail()
    first.signal(signal.SIGCONT)


async def test_a_repositorys_own_clusters_read_by_one_instance_serve_the_others(
        harness: FaultHarness, tmp_path: Path) -> None:
    """``clusters:`` read through one instance are stored once: the other answers from them
    without reading the files, and a push that removes them, seen by one, silences both."""
    repo = "acme/own-bugs"
    fake = harness.fake
    empty = tmp_path / "no-clusters"
    empty.mkdir()
    record = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    fake.add_file(repo, ".github/dejafix.yml", "clusters: [bugs]\n")
    fake.add_file(repo, "bugs/reset-hang.json", json.dumps({**record, "repo": repo}))
    first, second = [await harness.start(data_dir=tmp_path / f"host-{i}",
                                         cluster_paths=[str(empty)], cluster_reload=0)
                     for i in range(2)]

    def reads() -> int:
        return len([r for r in fake.requests if r.path.startswith(
            (f"/repos/{repo}/contents/bugs", f"/repos/{repo}/git/blobs/"))])

    await only(harness, first, second)
    await harness.deliver(first, issue_payload(**RESET_HANG, repo=repo, number=1))
    await drained(harness, first)
    assert len(comments_on(fake, repo, 1)) == 1, first.log_tail()
    read = reads()
    assert read == 2  # the folder's listing and its one file

    await only(harness, second, first)
    await harness.deliver(second, issue_payload(**RESET_HANG, repo=repo, number=2))
    await drained(harness, second)
    assert len(comments_on(fake, repo, 2)) == 1, second.log_tail()
    assert reads() == read  # from the store: nothing read again

    del fake.files[(repo.lower(), "bugs/reset-hang.json")]
    push = {"ref": "refs/heads/main", "after": "2" * 40, "before": "1" * 40,
            "repository": {"full_name": repo, "default_branch": "main"},
            "installation": {"id": 77}, "sender": {"login": "maintainer", "type": "User"},
            "commits": [{"removed": ["bugs/reset-hang.json"], "added": [], "modified": []}]}
    await only(harness, first, second)  # the push is seen by the first
    await harness.deliver(first, push, event="push")
    await drained(harness, first)
    await only(harness, second, first)  # the next report: the second, which read nothing
    await harness.deliver(second, issue_payload(**RESET_HANG, repo=repo, number=3))
    await drained(harness, second)
    assert comments_on(fake, repo, 3) == [], second.log_tail()
    assert f"{repo}: no clusters for this repository" in second.log(), second.log_tail()
    first.signal(signal.SIGCONT)


# -- deploys, slow repositories ---------------------------------------------------------------


async def test_a_rolling_restart_of_two_instances_refuses_no_delivery(
        harness: FaultHarness, tmp_path: Path) -> None:
    """Behind a load balancer that sends each delivery to an instance whose /healthz said 200
    at its last check (every 50 ms), each instance in turn gets SIGTERM and is replaced by a new
    one: every delivery sent meanwhile is answered 202, and all of them are done once."""
    config = {"drain_seconds": 2.0, "stop_grace": 1.0}
    instances = [await harness.start(data_dir=tmp_path / f"host-{i}", **config)
                 for i in range(2)]
    healthy: dict[int, bool] = {id(p): True for p in instances}
    stop = asyncio.Event()

    async def checker() -> None:
        while not stop.is_set():
            for proc in list(instances):
                try:
                    async with harness.session.get(proc.url + "/healthz") as resp:
                        healthy[id(proc)] = resp.status == 200
                except aiohttp.ClientError:
                    healthy[id(proc)] = False
            await asyncio.sleep(0.05)

    answers: list[tuple[str, int]] = []

    async def sender() -> None:
        n = 0
        while not stop.is_set():
            targets = [p for p in instances if healthy.get(id(p))]
            if targets:
                proc = targets[n % len(targets)]
                delivery = f"rolling-{n}"
                body, headers = harness.delivery(
                    issue_payload(**UNRELATED, number=20000 + n), delivery=delivery)
                try:
                    async with harness.session.post(proc.url + "/webhook", data=body,
                                                    headers=headers) as resp:
                        answers.append((delivery, resp.status))
                except aiohttp.ClientError as exc:
                    answers.append((delivery, -1))
                    print("refused:", delivery, exc)
                n += 1
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(checker()), asyncio.create_task(sender())]
    try:
        for i in range(2):
            old = instances[i]
            new = await harness.start(data_dir=tmp_path / f"host-new-{i}", **config)
            instances.append(new)
            old.signal(signal.SIGTERM)
            assert await old.wait_exit(30.0) == 0
            instances.remove(old)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert len(answers) > 50
    refused = [a for a in answers if a[1] != 202]
    assert refused == [], refused
    await drained(harness, instances[0])
    done = dict(harness.ledger("SELECT delivery_id, state FROM deliveries"))
    assert {d for d, _ in answers} == set(done) and set(done.values()) == {"done"}


async def test_a_repository_whose_calls_hang_does_not_hold_up_another(
        harness: FaultHarness, tmp_path: Path) -> None:
    """Every call for one repository hangs, and it has eight issues queued: its jobs take the
    slots one repository may have (``repo_workers``) and wait there, the other slots stay free,
    and an issue of another repository is still answered within seconds."""
    slow, fast = "acme/slow", "acme/fast"
    fake = harness.fake
    fake.hang_repos.add(slow)
    [proc] = [await harness.start(cluster_paths=[str(repos_clusters(tmp_path, [slow, fast]))],
                                  workers=4, repo_workers=2, github_timeout=60.0)]
    for i in range(8):
        await harness.deliver(proc, issue_payload(**RESET_HANG, repo=slow, number=100 + i))
    await wait_until(lambda: len(fake.calls(contains=f"/repos/{slow}/")) >= 1,
                     "the slow repository's calls to hang", diagnose=proc.log_tail)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    await harness.deliver(proc, issue_payload(**RESET_HANG, repo=fast, number=1))
    await wait_until(lambda: bool(comments_on(fake, fast, 1)), "the other repository's comment",
                     timeout=10.0, diagnose=proc.log_tail)
    print(f"answered {loop.time() - sent:.2f}s after delivery")
    assert comments_on(fake, slow, 100) == []

