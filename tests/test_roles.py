"""``serve --role receiver|worker``: a receiver that records deliveries and answers GitHub
without running them, a worker that runs what any process queued on the same data directory.
First in this process (``create_app`` with a role, aiohttp's test client), then as real
``python -m bot serve`` processes sharing one SQLite file: nothing is faked but GitHub's
absence (dry-run without App credentials reads and posts nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import yaml
from pydantic import SecretStr

from bot.app import JOURNAL, create_app
from bot.settings import ServiceConfig, Settings
from bot.store import DB_FILENAME, Store, read_journal_body
from bot.worker import WORKER_POLL_SECONDS
from tests.conftest import PAYLOADS, REPO, ROOT, SAMPLE_CLUSTERS, SECRET, sign
from tests.fault_support import READY_TIMEOUT, BotProcess, free_port, wait_until
from tests.test_e2e_webhook import RESET_HANG

# Seconds for a job to be done once queued: the worker asks the queue every 0.2 s.
DONE_TIMEOUT = 10.0


def opened_payload(number: int) -> dict[str, Any]:
    """GitHub's own ``issues.opened`` example, in the sample clusters' repository, with the
    words of a known bug (a dry-run worker logs the comment it would post)."""
    path = PAYLOADS / "issues" / "opened.payload.json"
    if not path.exists():
        pytest.skip("shared github-payloads not present")
    payload: dict[str, Any] = json.loads(path.read_text())
    payload["repository"]["full_name"] = REPO
    payload["issue"].update(RESET_HANG, number=number)
    return payload


def signed(payload: dict[str, Any], delivery: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    return body, {"Content-Type": "application/json", "X-GitHub-Event": "issues",
                  "X-GitHub-Delivery": delivery, "X-Hub-Signature-256": sign(body)}


def ledger(data_dir: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows from the shared SQLite file, through a read-only connection of the test's own."""
    conn = sqlite3.connect(f"file:{data_dir / DB_FILENAME}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


def job_states(data_dir: Path) -> dict[str, tuple[str, str, int]]:
    """delivery id -> (delivery state, job state, attempts)."""
    return {r[0]: (r[1], r[2], r[3]) for r in ledger(
        data_dir, "SELECT delivery_id, d.state, j.state, j.attempts"
                  " FROM deliveries d JOIN jobs j USING (delivery_id)")}


def done(data_dir: Path, *deliveries: str) -> Callable[[], bool]:
    def check() -> bool:
        states = job_states(data_dir)
        return all(states.get(d, ("", "", 0))[:2] == ("done", "done") for d in deliveries)

    return check


# -- in this process --------------------------------------------------------------------------


def role_app(data_dir: Path, role: str) -> Any:
    settings = Settings(webhook_secret=SecretStr(SECRET), data_dir=data_dir)
    config = ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], cluster_reload=0,
                           drain_seconds=1.0)
    return create_app(settings, config, dry_run=True, role=role)


async def test_a_receiver_records_and_answers_and_leaves_the_job_queued(
        tmp_path: Path, aiohttp_client: Any) -> None:
    data_dir = tmp_path / "data"
    client = await aiohttp_client(role_app(data_dir, "receiver"))
    body, headers = signed(opened_payload(90001), "recv-1")

    resp = await client.post("/webhook", data=body, headers=headers)
    assert resp.status == 202 and await resp.json() == {"status": "queued"}
    # Journaled before the answer, exactly as received (bot/journal.py); recorded in the
    # ledger by the receiver's ingester process moments later.
    (segment,) = (data_dir / "journal" / "0").glob("*.log")
    assert body in segment.read_bytes()
    await wait_until(lambda: bool(ledger(data_dir, "SELECT 1 FROM deliveries")),
                     "the ingester to record the delivery", timeout=DONE_TIMEOUT)
    assert ledger(data_dir, "SELECT delivery_id, event, action, repo FROM deliveries") == [
        ("recv-1", "issues", "opened", REPO)]
    # Its body stays in the journal until the job is done: the row says where.
    ((stored, ref),) = ledger(data_dir, "SELECT body, ref FROM payloads")
    assert stored == b"" and read_journal_body(data_dir, ref) == body
    # No worker in this process: after several of a worker's polls, still queued, never run.
    await asyncio.sleep(5 * WORKER_POLL_SECONDS)
    assert job_states(data_dir) == {"recv-1": ("queued", "queued", 0)}

    health = await client.get("/healthz")
    data = await health.json()
    assert health.status == 200
    assert (data["ok"], data["role"], data["worker"]) == (True, "receiver", "external")
    assert (data["queued"], data["failed"], data["dry_run"]) == (1, 0, True)
    # A redelivery is recognised by the receiver alone.
    again = await client.post("/webhook", data=body, headers=headers)
    assert again.status == 202 and await again.json() == {"status": "duplicate"}
    # The signature is still checked (the role changes nothing about that).
    forged = await client.post("/webhook", data=body + b" ",
                               headers={**headers, "X-GitHub-Delivery": "recv-2"})
    assert forged.status == 401
    assert job_states(data_dir) == {"recv-1": ("queued", "queued", 0)}


@pytest.mark.parametrize("role", ["receiver", "all"])
async def test_a_field_the_queue_cannot_hold_is_a_400_and_the_next_delivery_is_taken(
        tmp_path: Path, aiohttp_client: Any, caplog: pytest.LogCaptureFixture,
        role: str) -> None:
    data_dir = tmp_path / "data"
    client = await aiohttp_client(role_app(data_dir, role))
    # A push is taken whatever its action. json.dumps escapes the lone surrogate (valid
    # JSON); UTF-8 cannot hold it.
    payload = {"action": "x\ud800", "ref": "refs/heads/main", "repository": {"full_name": REPO}}
    body, headers = signed(payload, "bad-field")
    headers["X-GitHub-Event"] = "push"
    with caplog.at_level(logging.WARNING, logger="dejafix.webhook"):
        resp = await client.post("/webhook", data=body, headers=headers)
    assert resp.status == 400
    assert await resp.json() == {"error": "a field of the delivery cannot be recorded"}
    assert any(r.getMessage().startswith("delivery bad-field: push not recorded")
               for r in caplog.records)
    body, headers = signed({**payload, "action": "x"}, "good-field")
    headers["X-GitHub-Event"] = "push"
    resp = await client.post("/webhook", data=body, headers=headers)
    assert resp.status == 202 and await resp.json() == {"status": "queued"}


async def test_a_journal_write_that_fails_is_a_503_and_the_next_one_is_taken(
        tmp_path: Path, aiohttp_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    app = role_app(data_dir, "receiver")
    client = await aiohttp_client(app)
    journal = app[JOURNAL].journal
    assert journal._fd is not None
    # The segment's descriptor swapped for a read-only one: the write fails as a full disk's
    # would.
    readonly = os.open(journal.slot_dir / "000000000001.log", os.O_RDONLY)
    os.dup2(readonly, journal._fd)
    os.close(readonly)
    body, headers = signed(opened_payload(90006), "unwritten")
    with caplog.at_level(logging.ERROR, logger="dejafix.webhook"):
        resp = await client.post("/webhook", data=body, headers=headers)
    assert resp.status == 503
    assert await resp.json() == {"error": "the delivery could not be recorded"}
    errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno == logging.ERROR]
    assert [(name, text[:41]) for name, text in errors] == [
        ("dejafix.journal", "journal: 1 deliveries could not be writte"),
        ("dejafix.webhook", "delivery unwritten: could not be recorded")]
    # GitHub's redelivery goes to a new segment, and is recorded.
    resp = await client.post("/webhook", data=body, headers=headers)
    assert resp.status == 202 and await resp.json() == {"status": "queued"}
    await wait_until(lambda: bool(ledger(data_dir, "SELECT 1 FROM deliveries WHERE"
                                           " delivery_id = 'unwritten'")),
                     "the redelivery in the ledger", timeout=DONE_TIMEOUT)


async def test_a_worker_runs_what_others_queued_and_takes_no_deliveries(
        tmp_path: Path, aiohttp_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    data_dir = tmp_path / "data"
    queued_body = json.dumps(opened_payload(90002)).encode()
    # Queued by another Store (another process's), before the worker starts.
    with Store(data_dir) as other:
        assert other.accept_delivery("by-store", "issues", "opened", REPO, None, queued_body)
    receiver = await aiohttp_client(role_app(data_dir, "receiver"))

    with caplog.at_level(logging.INFO, logger="dejafix.github"):
        worker = await aiohttp_client(role_app(data_dir, "worker"))
        await wait_until(done(data_dir, "by-store"), "the stored job to be done",
                         timeout=DONE_TIMEOUT)
        # Queued by the receiver app while the worker runs.
        body, headers = signed(opened_payload(90003), "by-receiver")
        resp = await receiver.post("/webhook", data=body, headers=headers)
        assert resp.status == 202 and await resp.json() == {"status": "queued"}
        await wait_until(done(data_dir, "by-receiver"), "the received job to be done",
                         timeout=DONE_TIMEOUT)

    assert job_states(data_dir) == {"by-store": ("done", "done", 1),
                                    "by-receiver": ("done", "done", 1)}
    # Really run (matched, and in dry-run the comment logged instead of posted), once each.
    would = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("dry-run: would comment on")]
    assert len(would) == 2
    assert any(m.startswith(f"dry-run: would comment on {REPO}#90002") for m in would)
    assert any(m.startswith(f"dry-run: would comment on {REPO}#90003") for m in would)
    assert all("#52090" in m for m in would)

    # The worker takes no deliveries: no webhook route at all.
    body, headers = signed(opened_payload(90004), "to-worker")
    for path in ("/webhook", "/"):
        resp = await worker.post(path, data=body, headers=headers)
        assert resp.status in (404, 405), (path, resp.status)
    assert "to-worker" not in job_states(data_dir)
    health = await worker.get("/healthz")
    data = await health.json()
    assert health.status == 200
    assert (data["ok"], data["role"], data["worker"]) == (True, "worker", "running")
    assert (data["queued"], data["failed"], data["clusters"]) == (0, 0, 3)


async def test_only_a_worker_requeues_the_jobs_a_dead_worker_held(
        tmp_path: Path, aiohttp_client: Any) -> None:
    """A job left running (its worker died holding a long lease): a receiver starting must not
    take it from a worker that may be alive; a worker starting knows it is the only one
    (the data directory's lock) and runs it again at once."""
    data_dir = tmp_path / "data"
    with Store(data_dir) as dead:
        assert dead.accept_delivery("held", "issues", "opened", REPO, None,
                                    json.dumps(opened_payload(90005)).encode())
        job = dead.claim_job(lease_seconds=3600)
        assert job is not None
    await aiohttp_client(role_app(data_dir, "receiver"))
    await asyncio.sleep(5 * WORKER_POLL_SECONDS)
    assert job_states(data_dir) == {"held": ("running", "running", 1)}

    await aiohttp_client(role_app(data_dir, "worker"))
    await wait_until(done(data_dir, "held"), "the held job to be run again",
                     timeout=DONE_TIMEOUT)
    assert job_states(data_dir) == {"held": ("done", "done", 2)}


# -- real processes ---------------------------------------------------------------------------


class Processes:
    """``python -m bot serve --dry-run`` processes on one data directory; all stopped at the
    end of the test, whatever happened."""

    def __init__(self, tmp_path: Path, session: aiohttp.ClientSession) -> None:
        self.tmp_path = tmp_path
        self.session = session
        self.data_dir = tmp_path / "data"
        self.started: list[BotProcess] = []
        self.config = tmp_path / "bot.yml"
        self.config.write_text(yaml.safe_dump({
            "cluster_paths": [str(SAMPLE_CLUSTERS)], "cluster_reload": 0,
            "drain_seconds": 1.0}))

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DEJAFIX_") and k != "PORT"}
        env.update({"DEJAFIX_WEBHOOK_SECRET": SECRET, "DEJAFIX_DATA_DIR": str(self.data_dir),
                    "PYTHONUNBUFFERED": "1"})
        return env

    def spawn(self, role: str, *extra: str) -> BotProcess:
        port = free_port()
        log_path = self.tmp_path / f"{role}-{len(self.started) + 1}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "bot", "serve", "--dry-run", "--role", role,
                 "--host", "127.0.0.1", "--port", str(port), "--config", str(self.config),
                 *extra],
                cwd=ROOT, env=self.env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log)
        proc = BotProcess(popen, port, log_path)
        self.started.append(proc)
        return proc

    async def start(self, role: str, *extra: str) -> BotProcess:
        proc = self.spawn(role, *extra)
        await proc.wait_ready(self.session)
        return proc

    async def health(self, proc: BotProcess) -> dict[str, Any]:
        async with self.session.get(proc.url + "/healthz") as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data

    async def deliver(self, proc: BotProcess, number: int, delivery: str) -> tuple[int, Any]:
        body, headers = signed(opened_payload(number), delivery)
        async with self.session.post(proc.url + "/webhook", data=body,
                                     headers=headers) as resp:
            return resp.status, await resp.json()

    async def stop(self, proc: BotProcess) -> int:
        proc.signal(signal.SIGTERM)
        return await proc.wait_exit(20.0)

    async def cleanup(self) -> None:
        for proc in self.started:
            if proc.alive():
                proc.signal(signal.SIGTERM)
                with contextlib.suppress(AssertionError):
                    await proc.wait_exit(15.0)
            if proc.alive():
                proc.popen.kill()
                proc.popen.wait(10)


P = TypeVar("P", bound=Processes)


@contextlib.asynccontextmanager
async def harness(kind: type[P], tmp_path: Path) -> AsyncIterator[P]:
    """A ``Processes`` (or subclass) with its own HTTP session; everything it started is
    stopped, and the session closed, whatever the test did."""
    session = aiohttp.ClientSession()
    procs = kind(tmp_path, session)
    try:
        yield procs
    finally:
        try:
            await procs.cleanup()
        finally:
            await session.close()


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    async with harness(Processes, tmp_path) as procs:
        yield procs


async def test_receiver_and_worker_processes_share_the_queue(processes: Processes) -> None:
    opened_payload(0)  # skips here when the shared payloads are absent
    receiver = await processes.start("receiver")
    worker = await processes.start("worker", "--nice", "0")
    assert (await processes.health(receiver))["worker"] == "external"
    assert (await processes.health(worker))["role"] == "worker"

    delivery = f"proc-{uuid.uuid4()}"
    assert await processes.deliver(receiver, 90011, delivery) == (202, {"status": "queued"})
    await wait_until(done(processes.data_dir, delivery), "the worker process to run the job",
                     timeout=DONE_TIMEOUT, diagnose=worker.log_tail)
    assert job_states(processes.data_dir) == {delivery: ("done", "done", 1)}
    assert (await processes.health(receiver))["queued"] == 0  # it reads the shared file
    # Run by the worker, not by the receiver.
    line = f"dry-run: would comment on {REPO}#90011"
    assert line in worker.log(), worker.log_tail()
    assert line not in receiver.log()
    # Both leave cleanly on SIGTERM.
    assert await processes.stop(receiver) == 0
    assert await processes.stop(worker) == 0
    assert "shutdown complete" in worker.log() and "shutdown complete" in receiver.log()


async def test_one_worker_per_data_dir_but_several_receivers(processes: Processes) -> None:
    opened_payload(0)
    worker = await processes.start("worker", "--nice", "0")
    second = processes.spawn("worker", "--nice", "0")
    assert await second.wait_exit(READY_TIMEOUT) == 2
    refused = second.log()
    assert "cannot start" in refused
    assert f"{processes.data_dir} is in use by another Dejafix process (pid {worker.pid})" in (
        refused), refused
    assert worker.alive()

    # Receivers take no lock on the data directory: two at once, beside the worker, each
    # with its own journal slot.
    first_receiver = await processes.start("receiver")
    second_receiver = await processes.start("receiver")
    assert first_receiver.alive() and second_receiver.alive()
    slots = {(await processes.health(r))["journal"]["slot"]
             for r in (first_receiver, second_receiver)}
    assert slots == {0, 1}
    assert await processes.deliver(first_receiver, 90021, "via-first") == (
        202, {"status": "queued"})
    assert await processes.deliver(second_receiver, 90022, "via-second") == (
        202, {"status": "queued"})
    # One ledger. The second receiver does not read it on its loop, so its copy of the first
    # receiver's delivery is answered as new; its ingester drops the copy, and the job runs
    # once.
    await wait_until(lambda: bool(ledger(processes.data_dir, "SELECT 1 FROM deliveries WHERE"
                                         " delivery_id = ?", "via-first")),
                     "the first delivery in the ledger", timeout=DONE_TIMEOUT)
    assert await processes.deliver(second_receiver, 90021, "via-first") == (
        202, {"status": "queued"})
    # Its ingester reads in order: once a later delivery is recorded, the copy has been read.
    assert await processes.deliver(second_receiver, 90023, "after-copy") == (
        202, {"status": "queued"})
    await wait_until(done(processes.data_dir, "via-first", "via-second", "after-copy"),
                     "the worker process to run the jobs", timeout=DONE_TIMEOUT,
                     diagnose=worker.log_tail)
    assert job_states(processes.data_dir) == {"via-first": ("done", "done", 1),
                                              "via-second": ("done", "done", 1),
                                              "after-copy": ("done", "done", 1)}
    log = worker.log()
    assert log.count(f"dry-run: would comment on {REPO}#90021") == 1
    assert log.count(f"dry-run: would comment on {REPO}#90022") == 1
    assert worker.alive()


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[16])


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads niceness from /proc")
async def test_a_worker_lowers_its_priority_but_not_its_store_writers(
        processes: Processes) -> None:
    # The writer process takes the database's write lock that the receiver's rounds wait for:
    # at a lower priority it would make GitHub's requests wait behind the worker.
    worker = await processes.start("worker", "--nice", "7")
    base = _niceness(os.getpid())
    assert _niceness(worker.pid) == min(base + 7, 19)
    helpers = _descendants(worker.pid)
    assert helpers, "the worker started no writer process"
    assert {_niceness(pid) for pid in helpers} == {base}
