"""The bot as a real process for the fault tests: started with ``python -m bot serve`` against
the fake GitHub (which runs in the test's own event loop), polled on /healthz, signalled, waited
for, and always stopped. Its stderr goes to a file, read for log lines and scanned for secrets.

Nothing here sleeps a fixed time before an assertion: every wait polls a condition until a
deadline and fails with the process's log when the deadline passes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.conftest import APP_ID, ROOT, SAMPLE_CLUSTERS, SECRET, sign
from tests.fake_github import FakeGitHub

DB_FILENAME = "dejafix.sqlite3"  # bot.db.sqlite.DB_FILENAME; the ledger is read with plain sqlite3
READY_TIMEOUT = 30.0
# Small numbers so that retries and drains happen within a test's time. The fake GitHub shares
# the test's event loop, which is busy while a test floods the bot: tests about timeouts set
# their own (short) github_timeout, the others keep this one so a busy loop is not a timeout.
BASE_CONFIG: dict[str, Any] = {
    "cluster_paths": [str(SAMPLE_CLUSTERS)],
    "retry_base": 0.05,
    "github_timeout": 5.0,
    "drain_seconds": 1.0,
    # The default (2 s) holds every SIGTERM open for a balancer that these tests do not have;
    # the one test about a balancer's view of a stop (the rolling restart) sets its own.
    "stop_grace": 0.0,
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_until(check: Callable[[], bool | Awaitable[bool]], what: str, *,
                     timeout: float = 20.0, interval: float = 0.02,
                     diagnose: Callable[[], str] | None = None) -> None:
    """Poll ``check`` until it is true; fail naming ``what`` (and a diagnosis) at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() >= deadline:
            detail = f"\n{diagnose()}" if diagnose else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")
        await asyncio.sleep(interval)


@dataclass
class BotProcess:
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return f"--- {self.log_path.name} (pid {self.pid}) ---\n" + "\n".join(
            self.log().splitlines()[-lines:])

    def rss_kb(self) -> int:
        """Resident memory of the bot process, from /proc (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    async def wait_ready(self, session: aiohttp.ClientSession, *,
                         exit_ok: bool = False) -> bool:
        """Wait until /healthz answers 200 (True). A process that exits first fails the test,
        or, with ``exit_ok``, returns False."""

        async def ready() -> bool:
            if not self.alive():
                if exit_ok:
                    return True
                raise AssertionError(f"pid {self.pid} exited with {self.popen.returncode} "
                                     f"before it was ready\n{self.log_tail()}")
            try:
                async with session.get(self.url + "/healthz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(ready, f"pid {self.pid} to answer /healthz", timeout=READY_TIMEOUT,
                         interval=0.05, diagnose=self.log_tail)
        return self.alive()

    async def wait_exit(self, timeout: float) -> int:
        await wait_until(lambda: not self.alive(), f"pid {self.pid} to exit", timeout=timeout,
                         diagnose=self.log_tail)
        code = self.popen.returncode
        assert code is not None
        return code


@dataclass
class FaultHarness:
    """One fake GitHub, one data directory, any number of bot processes (restarts share the
    data directory), one client session for deliveries."""

    fake: FakeGitHub
    github_url: str
    private_pem: str
    tmp_path: Path
    session: aiohttp.ClientSession
    processes: list[BotProcess] = field(default_factory=list)
    # PostgreSQL for every process of the harness (DATABASE_URL); None: SQLite under data_dir.
    database_url: str | None = None

    @property
    def data_dir(self) -> Path:
        return self.tmp_path / "data"

    def write_config(self, **overrides: Any) -> Path:
        path = self.tmp_path / f"bot-{len(self.processes) + 1}.yml"
        path.write_text(yaml.safe_dump({**BASE_CONFIG, **overrides}))
        return path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DEJAFIX_") and k != "PORT"}
        env.update({
            "DEJAFIX_APP_ID": APP_ID,
            "DEJAFIX_PRIVATE_KEY": self.private_pem,
            "DEJAFIX_WEBHOOK_SECRET": SECRET,
            "DEJAFIX_GITHUB_URL": self.github_url,
            "DEJAFIX_DATA_DIR": str(self.data_dir),
            "PYTHONUNBUFFERED": "1",
        })
        if self.database_url is not None:
            env["DATABASE_URL"] = self.database_url
        return env

    def spawn(self, *args: str, command: str = "serve", data_dir: Path | None = None,
              **config: Any) -> BotProcess:
        """Start ``python -m bot serve`` (or ``worker``, with ``--port`` for its /healthz) on
        this harness's store; do not wait. ``args``: more command-line flags."""
        cfg = self.write_config(**config)
        port = free_port()
        log_path = self.tmp_path / f"bot-{len(self.processes) + 1}.log"
        env = self.env()
        if data_dir is not None:  # an instance's own disk (its index), the database shared
            env["DEJAFIX_DATA_DIR"] = str(data_dir)
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "bot", command, "--host", "127.0.0.1",
                 "--port", str(port), "--config", str(cfg), *args],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log,
            )
        proc = BotProcess(popen, port, log_path)
        self.processes.append(proc)
        return proc

    async def wait_ready(self, proc: BotProcess, *, exit_ok: bool = False) -> bool:
        """Wait until /healthz answers 200 (True). A process that exits first fails the test,
        or, with ``exit_ok``, returns False."""
        return await proc.wait_ready(self.session, exit_ok=exit_ok)

    async def start(self, *args: str, **config: Any) -> BotProcess:
        """Start the bot and wait until /healthz answers 200."""
        proc = self.spawn(*args, **config)
        await self.wait_ready(proc)
        return proc

    async def health(self, proc: BotProcess) -> dict[str, Any]:
        async with self.session.get(proc.url + "/healthz") as resp:
            data: dict[str, Any] = await resp.json()
            return data

    async def settle(self, proc: BotProcess, timeout: float = 30.0) -> None:
        """Wait until the process's queue is empty (every job done or given up on)."""

        async def drained() -> bool:
            return (await self.health(proc))["queued"] == 0

        await wait_until(drained, "the queue to drain", timeout=timeout, interval=0.05,
                         diagnose=proc.log_tail)

    async def stop(self, proc: BotProcess, timeout: float = 20.0) -> int:
        """SIGTERM, and wait for the exit code."""
        proc.signal(signal.SIGTERM)
        return await proc.wait_exit(timeout)

    def delivery(self, payload: dict[str, Any] | bytes, *, event: str = "issues",
                 delivery: str | None = None) -> tuple[bytes, dict[str, str]]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return body, {"Content-Type": "application/json", "X-GitHub-Event": event,
                      "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
                      "X-Hub-Signature-256": sign(body)}

    async def deliver(self, proc: BotProcess, payload: dict[str, Any] | bytes, *,
                      event: str = "issues", delivery: str | None = None
                      ) -> tuple[int, dict[str, Any]]:
        body, headers = self.delivery(payload, event=event, delivery=delivery)
        async with self.session.post(proc.url + "/webhook", data=body, headers=headers) as resp:
            return resp.status, await resp.json()

    def ledger(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """Rows from the bot's store, read directly: its SQLite file (read-only), or its
        PostgreSQL schema (``?`` parameters either way)."""
        if self.database_url is not None:
            import psycopg

            with psycopg.connect(self.database_url, autocommit=True) as pg:
                return [tuple(r) for r in pg.execute(sql.replace("?", "%s"), args).fetchall()]
        uri = f"file:{self.data_dir / DB_FILENAME}?mode=ro"
        conn = sqlite3.connect(uri, uri=True)
        try:
            return list(conn.execute(sql, args))
        finally:
            conn.close()

    # -- secrets ------------------------------------------------------------------------------

    def secrets(self) -> dict[str, str]:
        """Every credential the bot held or was given: the webhook secret, each line of the PEM
        body, each installation token the fake minted, each App JWT it was sent."""
        found = {"webhook secret": SECRET}
        body = [line for line in self.private_pem.splitlines()
                if line and not line.startswith("-----")]
        for i, line in enumerate(body):
            found[f"PEM body line {i + 1}"] = line
        for token in self.fake.tokens:
            found[f"installation token {token[:8]}..."] = token
        for request in self.fake.requests:
            scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
            if credential:
                found[f"{scheme} credential {credential[:8]}..."] = credential
        return found

    def leaks(self) -> list[str]:
        """"<secret> in <log file>" for each secret found in a process's stderr."""
        secrets = self.secrets()
        leaks = []
        for proc in self.processes:
            text = proc.log()
            leaks += [f"{name} in {proc.log_path.name}" for name, value in secrets.items()
                      if value in text]
        return leaks

    # -- teardown -----------------------------------------------------------------------------

    async def cleanup(self) -> None:
        """Kill every process still running, all at once, and wake the fake. The test is over
        and asserted nothing about how these stop (the tests about stopping stop their own
        processes first), so a drain or a grace here would only be waited out, one after
        another."""
        self.fake.close()
        running = [proc for proc in self.processes if proc.alive()]
        for proc in running:
            proc.popen.kill()  # SIGKILL ends a SIGSTOPped process too
        # Reaped before the session closes and before pg_url drops the schema their
        # connections were on; a process that outlives the wait is left to the OS, as before.
        await asyncio.gather(*(proc.wait_exit(10.0) for proc in running),
                             return_exceptions=True)
        await self.session.close()
