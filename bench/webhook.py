"""The delivery path, measured on each store backend: the receiver's req/s beside a bare aiohttp
handler, a worker's jobs done per second, delivery-to-comment latency against a GitHub that
takes 100 ms an answer, and the event loop's worst lag while a 100k-cluster index is rebuilt.

usage: python bench/webhook.py [--quick] [--backends sqlite,postgresql] [--database-url URL]
                               [--phases receiver,drain,e2e,lag] [--seconds 10] [--rounds 2]
                               [--connections 32] [--drain-jobs 2000] [--e2e-seconds 30]
                               [--e2e-rate 5] [--e2e-github-ms 100] [--lag-clusters 100000]
                               [--no-lag] [--keep] [--profile]

Every bot process is the real bot, ``python -m bot ...`` with App credentials (a key pair made
for the run), a webhook secret and the shipped sample clusters (``config/clusters``), logging at
INFO as deployed, default service settings otherwise (8 workers a process, 2 a repository).
Each gets a fresh store: a new data directory (SQLite) or a new schema in ``--database-url``
(PostgreSQL; created before and dropped after, ``?options=-csearch_path%3D<schema>`` as the
tests' ``schema_url`` does). Its stderr goes to a log file; when a phase fails, the last lines
are printed, and after each process its WARNING/ERROR lines are counted and shown.

The deliveries: the real ``issues.opened`` delivery (``../shared/github-payloads/issues/
opened.payload.json``, 13.5 kB) with an installation added (what GitHub sends an App), a new
issue number and a new X-GitHub-Delivery for every request, signed with X-Hub-Signature-256.
*Without clusters*: spread over 64 repositories (``dejafix-bench/repo-NN``) that have no
clusters. *With clusters*: all for NousResearch/hermes-agent with the title and body of
``RESET_HANG`` in tests/samples.py, an issue that matches the sample cluster of the
"Telegram /new confirm button hangs" bug and is answered with a comment (the repository's
``.github/dejafix.yml`` on the fake raises ``max_comments_per_day`` to 10,000: the default 20
would silence all but the first 20).

1. Receiver throughput: ``python -m bot serve --no-worker`` (signature check, parse, the
   delivery and its job committed in one transaction, 202), beside a bare aiohttp handler (read,
   HMAC, JSON parse, 202) in another process. The same load generator, in a process of its own:
   ``--connections`` keep-alive connections posting deliveries without clusters for
   ``--seconds`` after one second of warm-up; servers take turns, ``--rounds`` times each.
   Target: >= 500 req/s.
2. Jobs done per second: ``--drain-jobs`` deliveries accepted by a receiver (which is then
   stopped), then ``python -m bot worker`` started on that store with a fake GitHub answering at
   once (``tests/fake_github.py``, in this process); the ``jobs`` rows reaching ``done`` are
   counted every 50 ms. Once without clusters (a repository config read per repository, then
   "no clusters", silent), once with (each issue ranked against the index and commented).
3. Delivery to comment: ``python -m bot serve`` (receiver and worker in one process), the fake
   GitHub taking ``--e2e-github-ms`` (100) on every answer, deliveries with clusters sent at
   ``--e2e-rate`` a second for ``--e2e-seconds``; the latency of each is from its POST's 202 to
   the fake receiving the comment POST for its issue.
4. Loop lag (once; ``--no-lag`` skips it): in one process, a heartbeat task sleeps 5 ms and
   records how late it wakes while ``IndexHolder.refresh(force=True)`` rebuilds the index from
   a generated ``--lag-clusters`` cluster file (``bench/gen_clusters.py``) as the bot's reload
   does (a build process loads, validates, indexes and writes the arrays; this process maps
   them). Target: worst lag <= 50 ms.

``--quick``: 5-second rounds once, 1,000 jobs, 15 s of end-to-end deliveries, 10k clusters for
the loop lag: about two minutes. The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import copy
import hashlib
import hmac
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_PAYLOAD = ROOT.parent / "shared" / "github-payloads" / "issues" / "opened.payload.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
SAMPLE_CLUSTERS = ROOT / "config" / "clusters"
SECRET = "bench-webhook-secret"
APP_ID = "4242"
INSTALLATION = 77
CLUSTER_REPO = "NousResearch/hermes-agent"
PLAIN_REPOS = [f"dejafix-bench/repo-{i:02d}" for i in range(64)]
TARGET_RPS = 500.0
TARGET_LAG_MS = 50.0
BACKENDS = ("sqlite", "postgresql")
PHASES = ("receiver", "drain", "e2e", "lag")
# Stands for the issue number in a payload template; appears nowhere else in it.
_NUMBER_MARK = 987654321987


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# --- CPU accounting -------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent, command name, user + system CPU seconds so far), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                text = fh.read()
        except OSError:  # gone meanwhile
            continue
        head, _, rest = text.rpartition(")")
        fields = rest.split()
        table[int(entry)] = (int(fields[1]), head.partition("(")[2],
                             (int(fields[11]) + int(fields[12])) / ticks)
    return table


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """CPU seconds so far of these processes and all their descendants (the bot's index build
    processes are its children), and of every PostgreSQL server process on this machine (its
    backends are not our descendants; whatever else uses the server is counted too)."""
    table = _proc_table()
    tree = set(pids)
    grew = True
    while grew:
        children = {pid for pid, (parent, _, _) in table.items() if parent in tree} - tree
        grew = bool(children)
        tree |= children
    ours = sum(table[pid][2] for pid in tree if pid in table)
    postgres = sum(cpu for _, name, cpu in table.values() if name == "postgres")
    return ours, postgres


# --- deliveries -----------------------------------------------------------------------------


def reset_hang() -> dict[str, str]:
    """The issue text of tests/samples.py's RESET_HANG, read without importing the test
    module (which needs pytest): the bench answers the issue the end-to-end test does."""
    path = ROOT / "tests" / "samples.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "RESET_HANG" for t in node.targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in value.items()}
    raise SystemExit(f"bench/webhook.py: no RESET_HANG in {path}")


Template = tuple[bytes, bytes]  # the payload before and after its issue number


def templates(payload_path: str, workload: str) -> list[Template]:
    """One template a repository: ``plain`` (64 repositories without clusters, the payload's own
    issue text) or ``clusters`` (the cluster repository, RESET_HANG's text)."""
    payload = json.loads(Path(payload_path).read_bytes())
    payload["installation"] = {"id": INSTALLATION,
                               "node_id": "MDIzOkludGVncmF0aW9uSW5zdGFsbGF0aW9uNzc="}
    repos = PLAIN_REPOS
    if workload == "clusters":
        payload["issue"].update(reset_hang())
        payload["issue"]["labels"] = []
        repos = [CLUSTER_REPO]
    out = []
    for repo in repos:
        p = copy.deepcopy(payload)
        owner, name = repo.split("/")
        p["repository"].update(full_name=repo, name=name)
        p["repository"]["owner"]["login"] = owner
        p["issue"]["number"] = _NUMBER_MARK
        raw = json.dumps(p).encode()
        before, after = raw.split(str(_NUMBER_MARK).encode())
        out.append((before, after))
    return out


def delivery(tpl: list[Template], serial: int, number: int) -> bytes:
    before, after = tpl[serial % len(tpl)]
    return before + str(number).encode() + after


def sign(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


def headers_for(body: bytes) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-GitHub-Event": "issues",
            "User-Agent": "GitHub-Hookshot/bench", "X-GitHub-Delivery": str(uuid.uuid4()),
            "X-Hub-Signature-256": sign(body)}


# --- the bare handler -----------------------------------------------------------------------


def serve_bare(port: int) -> None:
    from aiohttp import web

    key = SECRET.encode()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        signature = request.headers.get("X-Hub-Signature-256", "")
        expected = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(signature, expected):
            return web.json_response({"error": "bad signature"}, status=401)
        payload = json.loads(body)
        if not isinstance(payload, dict):
            return web.json_response({"error": "not an object"}, status=400)
        return web.json_response({"status": "queued"}, status=202)

    app = web.Application(client_max_size=2 * 1024 * 1024)
    app.router.add_post("/webhook", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the load generator (a child process) ---------------------------------------------------


async def _load(port: int, tpl: list[Template], connections: int, *, warmup: float,
                seconds: float | None, count: int | None, number_base: int,
                server_pids: list[int]) -> dict[str, Any]:
    """``seconds`` (after ``warmup``): as many requests as answered; ``count``: exactly that many
    deliveries, as fast as they are answered. A minimal HTTP/1.1 client on asyncio streams
    (lighter than aiohttp's, so that it is not the bottleneck)."""
    head = (b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: GitHub-Hookshot/bench\r\n"
            b"Content-Type: application/json\r\nX-GitHub-Event: issues\r\n")
    key = SECRET.encode()
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from = start + warmup
    stop_at = measure_from + seconds if seconds is not None else float("inf")
    counts: dict[str, int] = {}
    done = errors = serial = 0
    latencies: list[float] = []

    async def connection() -> None:
        nonlocal done, errors, serial
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while True:
                now = loop.time()
                if now >= stop_at or (count is not None and serial >= count):
                    return
                n = serial
                serial += 1
                body = delivery(tpl, n, number_base + n)
                signature = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
                writer.write(head + b"X-Hub-Signature-256: sha256=" + signature
                             + b"\r\nX-GitHub-Delivery: " + str(uuid.uuid4()).encode()
                             + b"\r\nContent-Length: " + str(len(body)).encode()
                             + b"\r\n\r\n" + body)
                status_line = await reader.readline()
                length = 0
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                answer = await reader.readexactly(length) if length else b""
                end = loop.time()
                if not status_line:
                    raise ConnectionError("server closed the connection")
                if end < measure_from:
                    continue
                if end > stop_at:
                    return
                status = status_line.split(b" ", 2)[1].decode()
                try:
                    label = status + " " + str(json.loads(answer).get("status", ""))
                except (ValueError, AttributeError):
                    label = status
                counts[label] = counts.get(label, 0) + 1
                if label == "202 queued":
                    done += 1
                    latencies.append(end - now)
                else:
                    errors += 1
        finally:
            writer.close()

    window: dict[str, float] = {}

    def mark(name: str) -> None:
        window[name + "_client"] = time.process_time()
        window[name + "_time"] = loop.time()
        window[name + "_server"], window[name + "_pg"] = cpu_seconds(server_pids)

    if seconds is not None:
        loop.call_at(measure_from, mark, "start")
        loop.call_at(stop_at, mark, "stop")
    else:
        mark("start")
    results = await asyncio.gather(*(connection() for _ in range(connections)),
                                   return_exceptions=True)
    if seconds is None:
        mark("stop")
    failures = [repr(r) for r in results if isinstance(r, BaseException)]
    elapsed = window["stop_time"] - window["start_time"] if "stop_time" in window else None

    def share(key: str) -> float | None:
        if not elapsed:
            return None
        return 100.0 * (window["stop_" + key] - window["start_" + key]) / elapsed

    return {
        "rps": done / elapsed if elapsed else 0.0,
        "requests": done,
        "seconds": elapsed,
        "errors": errors,
        "answers": counts,
        "failures": failures[:3],
        "p50_ms": (_pct(latencies, 0.5) or 0.0) * 1000 if latencies else None,
        "p99_ms": (_pct(latencies, 0.99) or 0.0) * 1000 if latencies else None,
        "client_cpu_pct": share("client"),
        "server_cpu_pct": share("server"),
        "postgres_cpu_pct": share("pg"),
    }


def load_child(args: argparse.Namespace) -> None:
    tpl = templates(args.payload, args.workload)
    result = asyncio.run(_load(
        args.port, tpl, args.connections, warmup=0.0 if args.count else 1.0,
        seconds=None if args.count else args.seconds, count=args.count or None,
        number_base=args.number_base,
        server_pids=[int(p) for p in args.server_pid.split(",")] if args.server_pid else []))
    print(json.dumps(result))


# --- loop lag (a child process) -------------------------------------------------------------


async def _lag(paths: list[Path], idle_seconds: float) -> dict[str, Any]:
    import gc

    from bot.matching.index import IndexHolder

    holder = IndexHolder(paths)
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - before - 0.005)

    # Garbage collections run while the GIL is held: record how long each full one takes.
    gc_pauses: list[float] = []
    gc_started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            gc_started.append(time.perf_counter())
        elif gc_started:
            gc_pauses.append(time.perf_counter() - gc_started.pop())

    def summary(values: list[float]) -> dict[str, float]:
        ordered = sorted(values) or [0.0]
        return {"max_ms": ordered[-1] * 1000, "p99_ms": ordered[int(len(ordered) * 0.99)] * 1000,
                "over_50ms": sum(1 for v in ordered if v > 0.05), "beats": len(values)}

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(idle_seconds)  # the loop alone: what the machine itself adds
    idle = summary(lags)
    lags.clear()
    gc.callbacks.append(on_gc)
    t = time.perf_counter()
    swapped = await holder.refresh(force=True)
    build = time.perf_counter() - t
    gc.callbacks.remove(on_gc)
    stop.set()
    await beat
    during = summary(lags)
    return {
        "swapped": swapped,
        "clusters": holder.current.size,
        "rebuild_s": build,
        "beats": during["beats"],
        "max_loop_lag_ms": during["max_ms"],
        "p99_loop_lag_ms": during["p99_ms"],
        "over_50ms": during["over_50ms"],
        "idle_max_lag_ms": idle["max_ms"],
        "idle_p99_lag_ms": idle["p99_ms"],
        "idle_seconds": idle_seconds,
        "gc_full_collections": len(gc_pauses),
        "gc_max_pause_ms": max(gc_pauses, default=0.0) * 1000,
    }


def lag_child(args: argparse.Namespace) -> None:
    print(json.dumps(asyncio.run(_lag([Path(args.clusters_file)], args.idle_seconds))))


# --- the parent: processes, stores, the fake GitHub -----------------------------------------


class PhaseFailed(Exception):
    """A phase could not be measured; the message says why (with a log tail)."""


@dataclass
class Proc:
    """A child process whose stderr (and stdout) goes to a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int | None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"  (no log at {self.log_path})"
        return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:])

    def problems(self) -> list[str]:
        """The log's WARNING and ERROR lines and tracebacks."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines()
                if " WARNING " in line or " ERROR " in line or " CRITICAL " in line
                or line.startswith("Traceback")]

    async def wait_ready(self, timeout: float = 60.0, *, healthz: bool = True) -> None:
        """Until /healthz answers 200 (or, for the bare server, its port accepts)."""
        import aiohttp

        assert self.port is not None
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise PhaseFailed(f"{self.name} exited ({self.popen.returncode}) on start:\n"
                                      + self.tail())
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    if healthz:
                        async with session.get(f"http://127.0.0.1:{self.port}/healthz") as r:
                            if r.status == 200:
                                return
                    else:
                        _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                        writer.close()
                        return
                await asyncio.sleep(0.05)
        raise PhaseFailed(f"{self.name} was not ready within {timeout:g} s:\n" + self.tail())

    async def stop(self, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        return int(self.popen.returncode)


@dataclass
class Store:
    """One fresh store: a data directory, and for PostgreSQL a schema of its own."""

    backend: str
    data_dir: Path
    url: str | None
    schema: str | None

    def jobs(self) -> JobCounts:
        return JobCounts(self)


class JobCounts:
    """The store's jobs by state, read on a connection of its own (read-only for SQLite), in a
    thread: ``await counts.read()``."""

    def __init__(self, store: Store) -> None:
        self._conn: Any
        if store.url is not None:
            import psycopg

            self._conn = psycopg.connect(store.url, autocommit=True)
        else:
            import sqlite3

            from bot.db.sqlite import DB_FILENAME

            self._conn = sqlite3.connect(
                (store.data_dir / DB_FILENAME).resolve().as_uri() + "?mode=ro", uri=True,
                timeout=5, check_same_thread=False)

    def _read(self) -> dict[str, int]:
        rows = self._conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
        return {str(state): int(n) for state, n in rows}

    async def read(self) -> dict[str, int]:
        return await asyncio.to_thread(self._read)

    def close(self) -> None:
        self._conn.close()


class Stores:
    """Fresh stores for one run; every schema made is dropped by ``close``."""

    def __init__(self, workdir: Path, base_url: str) -> None:
        self.workdir = workdir
        self.base_url = base_url
        self.run = uuid.uuid4().hex[:8]
        self.made = 0
        self.schemas: list[str] = []

    @staticmethod
    def schema_url(url: str, schema: str) -> str:
        # As tests/conftest.py's schema_url: the schema first on the connections' search path.
        return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"

    def check_postgres(self) -> str | None:
        """None when the server answers, else why not."""
        import psycopg

        try:
            with psycopg.connect(self.base_url, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None

    def fresh(self, backend: str) -> Store:
        self.made += 1
        data_dir = self.workdir / f"data-{self.made}"
        if backend == "sqlite":
            return Store(backend, data_dir, None, None)
        import psycopg

        schema = f"dejafix_bench_{self.run}_{self.made}"
        with psycopg.connect(self.base_url, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        self.schemas.append(schema)
        return Store(backend, data_dir, self.schema_url(self.base_url, schema), schema)

    def drop(self, store: Store) -> None:
        shutil.rmtree(store.data_dir, ignore_errors=True)
        if store.schema is not None and store.schema in self.schemas:
            import psycopg

            with psycopg.connect(self.base_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{store.schema}" CASCADE')
            self.schemas.remove(store.schema)

    def close(self) -> None:
        if not self.schemas:
            return
        import psycopg

        with psycopg.connect(self.base_url, autocommit=True) as conn:
            for schema in self.schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        self.schemas.clear()


class FakeServer:
    """tests.fake_github.FakeGitHub on loopback, in this process's event loop, with the arrival
    time of the first comment POST on each issue (before the fake's ``latency``)."""

    def __init__(self, public_pem: str, latency: float) -> None:
        from tests.fake_github import FakeGitHub

        self.fake = FakeGitHub(app_id=APP_ID, public_key_pem=public_pem, latency=latency)
        # The daily cap (20 new comments a repository) would stop the bench's comments.
        self.fake.add_file(CLUSTER_REPO, ".github/dejafix.yml", "max_comments_per_day: 10000\n")
        self.arrivals: dict[tuple[str, int], float] = {}
        self.url = ""
        self._runner: Any = None

    async def start(self) -> FakeServer:
        from aiohttp import web

        arrivals = self.arrivals

        @web.middleware
        async def stamp(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
            parts = request.path.split("/")  # /repos/{owner}/{repo}/issues/{n}/comments
            if request.method == "POST" and len(parts) == 7 and parts[6] == "comments":
                arrivals.setdefault((f"{parts[2]}/{parts[3]}".lower(), int(parts[5])),
                                    time.monotonic())
            return await handler(request)

        app = self.fake.app()
        app.middlewares.insert(0, stamp)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = _free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.fake.close()
        if self._runner is not None:
            await self._runner.cleanup()


def key_pair() -> tuple[str, str]:
    """An App key pair, as tests/conftest.py makes one: (private PEM, public PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    stores: Stores
    private_pem: str
    public_pem: str
    me: str = str(Path(__file__).resolve())
    spawned: int = 0
    # name -> WARNING/ERROR lines in that process's log
    problems: dict[str, list[str]] = field(default_factory=dict)
    config_path: Path | None = None
    number_base: int = 1_000_000

    def next_numbers(self) -> int:
        """A block of issue numbers no other phase uses."""
        self.number_base += 1_000_000
        return self.number_base

    def config(self) -> Path:
        if self.config_path is None:
            self.config_path = self.workdir / "bot.yml"
            self.config_path.write_text(
                f"cluster_paths: [{json.dumps(str(SAMPLE_CLUSTERS))}]\n"
                "cluster_reload: 0\n"
                "stop_grace: 0\n"   # no load balancer to wait for
                "drain_seconds: 5\n")
        return self.config_path

    def env(self, store: Store, github_url: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DEJAFIX_") and k not in ("PORT", "DATABASE_URL")}
        env.update({
            "DEJAFIX_APP_ID": APP_ID,
            "DEJAFIX_PRIVATE_KEY": self.private_pem,
            "DEJAFIX_WEBHOOK_SECRET": SECRET,
            "DEJAFIX_GITHUB_URL": github_url,
            "DEJAFIX_DATA_DIR": str(store.data_dir),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),
        })
        if store.url is not None:
            env["DATABASE_URL"] = store.url
        return env

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              port: int | None = None) -> Proc:
        self.spawned += 1
        log_path = self.workdir / f"{self.spawned:02d}-{name.replace(' ', '_')}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT)
        return Proc(name, popen, log_path, port)

    def bot(self, name: str, command: list[str], store: Store, github_url: str,
            profile: Path | None = None) -> Proc:
        port = _free_port()
        prof = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
        cmd = [sys.executable, *prof, "-m", "bot", *command, "--port", str(port),
               "--config", str(self.config())]
        if command[0] == "serve":
            cmd += ["--host", "127.0.0.1"]
        return self.spawn(name, cmd, self.env(store, github_url), port)

    async def finish(self, proc: Proc) -> None:
        """Stop a process and keep its WARNING/ERROR lines for the report."""
        code = await proc.stop()
        lines = proc.problems()
        if code not in (0, -signal.SIGTERM):
            lines.append(f"(exit code {code})")
        if lines:
            self.problems[f"{proc.name} ({proc.log_path.name})"] = lines

    async def load(self, port: int, workload: str, *, pids: list[int],
                   count: int | None = None) -> dict[str, Any]:
        cmd = [sys.executable, self.me, "--load", "--port", str(port), "--payload",
               self.args.payload, "--workload", workload, "--connections",
               str(self.args.connections), "--seconds", str(self.args.seconds),
               "--number-base", str(self.next_numbers()), "--server-pid",
               ",".join(str(p) for p in pids)]
        if count:
            cmd += ["--count", str(count)]
        child = await asyncio.create_subprocess_exec(
            *cmd, cwd=str(ROOT), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await child.communicate()
        if child.returncode != 0:
            raise PhaseFailed("the load generator failed:\n" + err.decode(errors="replace"))
        result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return result

    # -- 1. receiver throughput ---------------------------------------------------------------

    async def throughput_round(self, kind: str, n: int) -> dict[str, Any]:
        """``bare``, or the receiver on a fresh store of backend ``kind``."""
        if kind == "bare":
            port = _free_port()
            proc = self.spawn("bare aiohttp", [sys.executable, self.me, "--serve-bare",
                                               "--port", str(port)], port=port)
            try:
                await proc.wait_ready(healthz=False)
                return await self.load(port, "plain", pids=[proc.pid])
            finally:
                await self.finish(proc)
        store = self.stores.fresh(kind)
        profile = self.workdir / f"receiver-{kind}-{n}.prof" if self.args.profile else None
        # The receiver calls no GitHub: a port nothing listens on would show in its log.
        proc = self.bot(f"receiver {kind}", ["serve", "--no-worker"], store,
                        f"http://127.0.0.1:{_free_port()}", profile)
        try:
            await proc.wait_ready()
            result = await self.load(proc.port or 0, "plain", pids=[proc.pid])
            if result["requests"] == 0:
                raise PhaseFailed(f"the receiver answered no request with 202 queued "
                                  f"({result['answers']}, {result['failures']}):\n"
                                  + proc.tail())
            return result
        finally:
            await self.finish(proc)
            self.stores.drop(store)
            os.sync()  # the next row starts with nothing of this one left to write back
            if profile is not None and profile.exists():
                _print_profile(profile, f"receiver on {kind}, round {n + 1}")

    # -- 2. jobs done per second ----------------------------------------------------------------

    async def drain(self, backend: str, workload: str) -> dict[str, Any]:
        jobs = self.args.drain_jobs
        store = self.stores.fresh(backend)
        fake = await FakeServer(self.public_pem, latency=0.0).start()
        receiver = worker = None
        counts: JobCounts | None = None
        try:
            receiver = self.bot(f"receiver {backend} (fill, {workload})",
                                ["serve", "--no-worker"], store, fake.url)
            await receiver.wait_ready()
            fill = await self.load(receiver.port or 0, workload, pids=[receiver.pid],
                                   count=jobs)
            await self.finish(receiver)
            counts = store.jobs()
            states = await counts.read()
            if states.get("queued", 0) != jobs:
                raise PhaseFailed(f"{jobs} deliveries sent, the queue holds {states} "
                                  f"(answers {fill['answers']}):\n" + receiver.tail())
            t0 = time.monotonic()
            worker = self.bot(f"worker {backend} ({workload})", ["worker"], store, fake.url)
            series: list[tuple[float, int, int]] = []  # (seconds since spawn, done, failed)
            cpu_first: tuple[float, float] | None = None
            fake_first = 0.0
            deadline = t0 + self.args.drain_timeout
            while True:
                states = await counts.read()
                now = time.monotonic()
                done, failed = states.get("done", 0), states.get("failed", 0)
                series.append((now - t0, done, failed))
                if done and cpu_first is None:
                    cpu_first = cpu_seconds([worker.pid])
                    fake_first = time.process_time()
                if done + failed >= jobs:
                    break
                if worker.popen.poll() is not None:
                    raise PhaseFailed(f"the worker exited ({worker.popen.returncode}) with "
                                      f"{states}:\n" + worker.tail())
                if now > deadline:
                    raise PhaseFailed(f"the queue was not drained in {self.args.drain_timeout:g}"
                                      f" s ({states}):\n" + worker.tail())
                await asyncio.sleep(0.05)
            cpu_end = cpu_seconds([worker.pid])
            fake_cpu = time.process_time() - fake_first
        finally:
            if counts is not None:
                counts.close()
            for proc in (receiver, worker):
                if proc is not None and proc.popen.returncode is None:
                    await self.finish(proc)
            await fake.stop()
            self.stores.drop(store)
        if cpu_first is None:  # not one job done: every one failed
            raise PhaseFailed(f"no job done ({series[-1][2]} failed):\n" + worker.tail())
        t_first, d_first = next((t, d) for t, d, _ in series if d > 0)
        t_end = series[-1][0]

        def at(share: float) -> tuple[float, int] | None:
            return next(((t, d) for t, d, _ in series if d >= share * jobs), None)

        p10, p90 = at(0.1), at(0.9)  # None when failures kept "done" below the mark
        span = t_end - t_first
        comments = sum(len(c) for c in fake.fake.comments.values())
        calls = len(fake.fake.requests)
        return {
            "jobs": jobs,
            "fill_rps": fill["rps"],
            "start_s": t_first,
            "rate_10_90": (p90[1] - p10[1]) / (p90[0] - p10[0])
            if p10 and p90 and p90[0] > p10[0] else None,
            "rate_overall": (jobs - d_first) / span if span > 0 else None,
            "drain_s": span,
            "done": series[-1][1],
            "failed": series[-1][2],
            "worker_cpu_pct": 100.0 * (cpu_end[0] - cpu_first[0]) / span if span > 0 else None,
            "postgres_cpu_pct": 100.0 * (cpu_end[1] - cpu_first[1]) / span
            if span > 0 else None,
            "fake_cpu_pct": 100.0 * fake_cpu / span if span > 0 else None,
            "github_calls": calls,
            "comments": comments,
        }

    # -- 3. delivery to comment -------------------------------------------------------------

    async def e2e(self, backend: str) -> dict[str, Any]:
        import aiohttp

        args = self.args
        store = self.stores.fresh(backend)
        fake = await FakeServer(self.public_pem, latency=args.e2e_github_ms / 1000).start()
        bot = None
        tpl = templates(args.payload, "clusters")
        base = self.next_numbers()
        total = max(1, round(args.e2e_rate * args.e2e_seconds))
        answered: dict[int, tuple[float, float, int, str]] = {}  # number -> sent, 202, status
        try:
            bot = self.bot(f"serve {backend} (e2e)", ["serve"], store, fake.url)
            await bot.wait_ready()
            url = f"http://127.0.0.1:{bot.port}/webhook"
            calls_at_start = len(fake.fake.requests)  # GET /app at start-up
            cpu_start = cpu_seconds([bot.pid])
            t_start = time.monotonic()
            async with aiohttp.ClientSession() as session:

                async def send(i: int) -> None:
                    number = base + i
                    body = delivery(tpl, i, number)
                    sent = time.monotonic()
                    try:
                        async with session.post(url, data=body,
                                                headers=headers_for(body)) as resp:
                            text = await resp.text()
                            answered[number] = (sent, time.monotonic(), resp.status, text)
                    except aiohttp.ClientError as exc:
                        answered[number] = (sent, time.monotonic(), 0, repr(exc))

                loop = asyncio.get_running_loop()
                start = loop.time() + 0.1
                tasks = []
                for i in range(total):
                    await asyncio.sleep(max(0.0, start + i / args.e2e_rate - loop.time()))
                    tasks.append(asyncio.create_task(send(i)))
                await asyncio.gather(*tasks)
            sent_end = time.monotonic()
            want = {(CLUSTER_REPO.lower(), base + i) for i in range(total)}
            deadline = sent_end + args.e2e_wait
            while not want <= fake.arrivals.keys() and time.monotonic() < deadline:
                if bot.popen.poll() is not None:
                    raise PhaseFailed(f"the bot exited ({bot.popen.returncode}):\n" + bot.tail())
                await asyncio.sleep(0.02)
            cpu_end = cpu_seconds([bot.pid])
            span = time.monotonic() - t_start
            counts = store.jobs()
            try:
                states = await counts.read()
            finally:
                counts.close()
        finally:
            if bot is not None:
                await self.finish(bot)
            await fake.stop()
            self.stores.drop(store)
        latencies = []
        accept = []
        bad_answers: dict[str, int] = {}
        for number, (sent, got, status, text) in answered.items():
            accept.append(got - sent)
            if status != 202 or "queued" not in text:
                label = f"{status} {text[:40]}"
                bad_answers[label] = bad_answers.get(label, 0) + 1
                continue
            arrived = fake.arrivals.get((CLUSTER_REPO.lower(), number))
            if arrived is not None:
                latencies.append(arrived - got)
        calls = len(fake.fake.requests) - calls_at_start
        return {
            "deliveries": total,
            "rate": args.e2e_rate,
            "github_ms": args.e2e_github_ms,
            "commented": len(latencies),
            "missing": total - len(latencies),
            "bad_answers": bad_answers,
            "p50_ms": (_pct(latencies, 0.5) or 0.0) * 1000 if latencies else None,
            "p99_ms": (_pct(latencies, 0.99) or 0.0) * 1000 if latencies else None,
            "max_ms": max(latencies) * 1000 if latencies else None,
            "min_ms": min(latencies) * 1000 if latencies else None,
            "accept_p50_ms": (_pct(accept, 0.5) or 0.0) * 1000 if accept else None,
            "github_calls_per_delivery": calls / total,
            "bot_cpu_pct": 100.0 * (cpu_end[0] - cpu_start[0]) / span if span > 0 else None,
            "jobs": states,
        }

    # -- 4. loop lag ----------------------------------------------------------------------------

    async def lag(self) -> dict[str, Any]:
        from bench.gen_clusters import write_jsonl

        t = time.perf_counter()
        file = await asyncio.to_thread(write_jsonl, self.workdir / "clusters.jsonl",
                                       self.args.lag_clusters, self.args.seed,
                                       include_real=True)
        print(f"  wrote {self.args.lag_clusters:,} generated clusters "
              f"({file.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - t:.0f}s",
              flush=True)
        child = await asyncio.create_subprocess_exec(
            sys.executable, self.me, "--lag", "--clusters-file", str(file), "--idle-seconds",
            str(self.args.idle_seconds), cwd=str(ROOT), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await child.communicate()
        file.unlink(missing_ok=True)
        if child.returncode != 0:
            raise PhaseFailed("the loop-lag run failed:\n" + err.decode(errors="replace")[-3000:])
        result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        return result


def _print_profile(path: Path, what: str, top: int = 25) -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print(f"\n  --profile: {what} (start-up and shutdown included; cProfile slows it, so its "
          f"req/s is not comparable)")
    for line in out.getvalue().splitlines():
        if line.strip():
            print("    " + line[:150])
    print(flush=True)


# --- the report -----------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> None:
    table = [head, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  " + "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _f(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _round(value: Any, digits: int = 1) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def report_backend(backend: str, phases: list[str], runs: dict[str, list[dict[str, Any]]],
                   drains: dict[str, dict[str, Any] | None], e2e: dict[str, Any] | None,
                   failures: list[str]) -> dict[str, Any]:
    print(f"\n=== {backend} " + "=" * (90 - len(backend)))
    bare = runs.get("bare", [])
    ours = runs.get(backend, [])
    bare_rps = _mean(bare, "rps")
    rps = _mean(ours, "rps")
    figures: dict[str, Any] = {
        "receiver_rps": _round(rps), "bare_rps": _round(bare_rps),
        "ratio": _round(rps / bare_rps, 3) if rps and bare_rps else None,
        "jobs_per_s_no_clusters": _round((drains.get("plain") or {}).get("rate_10_90")),
        "jobs_per_s_clusters": _round((drains.get("clusters") or {}).get("rate_10_90")),
        "e2e_p50_ms": _round(e2e["p50_ms"]) if e2e else None,
        "e2e_p99_ms": _round(e2e["p99_ms"]) if e2e else None,
        "e2e_commented": e2e["commented"] if e2e else None,
        "e2e_deliveries": e2e["deliveries"] if e2e else None,
    }

    if "receiver" in phases:
        print(f"\n1. POST /webhook, deliveries without clusters ({len(ours)} round(s))")

        def per_cpu(group: list[dict[str, Any]]) -> float | None:
            r, cpu = _mean(group, "rps"), _mean(group, "server_cpu_pct")
            return r / (cpu / 100.0) if r and cpu else None

        rows = []
        for label, group in (("bare aiohttp (HMAC + JSON parse, 202)", bare),
                             ("bot: serve --no-worker (verify, parse, commit, 202)", ours)):
            if not group:
                rows.append([label] + ["-"] * 8 + ["failed"])
                continue
            r = _mean(group, "rps")
            rows.append([
                label, _f(r), _f(r / bare_rps if r and bare_rps else None, ".2f"),
                _f(_mean(group, "p50_ms"), ".1f"), _f(_mean(group, "p99_ms"), ".1f"),
                _f(_mean(group, "server_cpu_pct")),
                _f(_mean(group, "postgres_cpu_pct"))
                if backend == "postgresql" and group is ours else "-",
                _f(_mean(group, "client_cpu_pct")), _f(per_cpu(group)),
                str(sum(g["errors"] + len(g["failures"]) for g in group)),
            ])
        _table(["server", "req/s", "vs bare", "p50 ms", "p99 ms", "server CPU %",
                "postgres CPU %", "client CPU %", "req per server CPU-s", "errors"], rows)
        for group_name, group in (("bare", bare), (backend, ours)):
            for i, g in enumerate(group):
                print(f"    round {i + 1} {group_name:<10} {g['rps']:>7,.0f} req/s  answers "
                      f"{g['answers']}"
                      + (f"  failures {g['failures']}" if g["failures"] else ""))

    if "drain" in phases:
        print("\n2. jobs done per second (python -m bot worker, fake GitHub answering at once)")
        rows = []
        labels = {"plain": f"without clusters ({len(PLAIN_REPOS)} repositories)",
                  "clusters": f"with clusters ({CLUSTER_REPO}, each commented)"}
        for workload, d in drains.items():
            if d is None:
                rows.append([labels[workload]] + ["-"] * 11 + ["failed"])
                continue
            rows.append([
                labels[workload], f"{d['jobs']:,}", _f(d["fill_rps"]), _f(d["start_s"], ".1f"),
                _f(d["rate_10_90"]), _f(d["rate_overall"]), _f(d["drain_s"], ".1f"),
                _f(d["worker_cpu_pct"]),
                _f(d["postgres_cpu_pct"]) if backend == "postgresql" else "-",
                _f(d["fake_cpu_pct"]), _f(d["github_calls"] / d["jobs"], ".2f"),
                f"{d['comments']:,}", f"{d['failed']}",
            ])
        _table(["deliveries", "jobs", "fill req/s", "start s", "done/s 10-90%", "done/s all",
                "drain s", "worker CPU %", "postgres CPU %", "fake GitHub CPU %", "calls/job",
                "comments", "failed"], rows)

    if "e2e" in phases:
        print("\n3. delivery -> comment (python -m bot serve, fake GitHub "
              + (f"{e2e['github_ms']:g} ms an answer)" if e2e else "delayed)"))
        if e2e is None:
            print("  failed")
        else:
            _table(["deliveries", "sent", "rate /s", "commented", "p50 ms", "p99 ms", "min ms",
                    "max ms", "POST->202 p50 ms", "GitHub calls/delivery", "bot CPU %"],
                   [[f"{CLUSTER_REPO}, RESET_HANG", f"{e2e['deliveries']}",
                     _f(e2e["rate"], "g"), f"{e2e['commented']}", _f(e2e["p50_ms"]),
                     _f(e2e["p99_ms"]), _f(e2e["min_ms"]), _f(e2e["max_ms"]),
                     _f(e2e["accept_p50_ms"], ".1f"),
                     _f(e2e["github_calls_per_delivery"], ".2f"), _f(e2e["bot_cpu_pct"])]])
            if e2e["missing"] or e2e["bad_answers"]:
                print(f"  {e2e['missing']} deliveries got no comment within the wait; answers "
                      f"not queued: {e2e['bad_answers']}; jobs by state at the end: "
                      f"{e2e['jobs']}")
    for failure in failures:
        print(f"  FAILED: {failure.splitlines()[0]}")
    return figures


async def run(args: argparse.Namespace) -> int:
    import aiohttp

    started = time.perf_counter()
    body = Path(args.payload).read_bytes()
    load = os.getloadavg()
    print(f"bench/webhook.py: {os.cpu_count()} cores, load average {load[0]:.2f} at start; "
          f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}; payload "
          f"{Path(args.payload).name} ({len(body):,} bytes, an installation and a new issue "
          f"number added to each); backends {', '.join(args.backends)}", flush=True)
    if load[0] > 0.5:
        print("  note: the machine is busy; throughput is lower than on an idle machine",
              flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="dejafix-bench-"))
    stores = Stores(workdir, args.database_url)
    backends = list(args.backends)
    failures: dict[str, list[str]] = {b: [] for b in backends}
    failures["bare"] = []
    failures["lag"] = []
    if "postgresql" in backends:
        why = stores.check_postgres()
        if why is not None:
            print(f"  postgresql: skipped, no server at {args.database_url}: {why}")
            backends.remove("postgresql")
            failures["postgresql"].append(f"no PostgreSQL server at {args.database_url}: {why}")
    private, public = key_pair()
    bench = Bench(args, workdir, stores, private, public)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ["bare", *backends]}
    drains: dict[str, dict[str, dict[str, Any] | None]] = {b: {} for b in backends}
    e2es: dict[str, dict[str, Any] | None] = {}
    lag: dict[str, Any] | None = None

    def failed(where: str, exc: BaseException) -> None:
        text = str(exc)
        print(f"  FAILED ({where}): {text}", flush=True)
        failures[where].append(text)

    try:
        if not backends:
            raise PhaseFailed("no backend to measure")
        if "receiver" in args.phases:
            print(f"\n1. receiver throughput: {args.connections} connections, {args.rounds} x "
                  f"{args.seconds:g}s per server, interleaved", flush=True)
        for n in range(args.rounds if "receiver" in args.phases else 0):
            for kind in runs:
                try:
                    r = await bench.throughput_round(kind, n)
                except PhaseFailed as exc:
                    failed(kind, exc)
                    continue
                runs[kind].append(r)
                print(f"  round {n + 1} {kind:<10} {r['rps']:>7,.0f} req/s  answers "
                      f"{r['answers']}", flush=True)
        if "drain" in args.phases:
            print(f"\n2. jobs done/s: {args.drain_jobs:,} deliveries queued, then a worker",
                  flush=True)
        for backend in backends if "drain" in args.phases else []:
            for workload in ("plain", "clusters"):
                try:
                    d = await bench.drain(backend, workload)
                    print(f"  {backend:<10} {workload:<8} {_f(d['rate_10_90'])} jobs done/s "
                          f"(10-90%), {d['done']:,} done, {d['failed']} failed, "
                          f"{d['comments']:,} comments", flush=True)
                except PhaseFailed as exc:
                    failed(backend, exc)
                    d = None
                drains[backend][workload] = d
        if "e2e" in args.phases:
            print(f"\n3. delivery -> comment: {args.e2e_rate:g}/s for {args.e2e_seconds:g}s, "
                  f"GitHub {args.e2e_github_ms:g} ms an answer", flush=True)
        for backend in backends if "e2e" in args.phases else []:
            try:
                e = await bench.e2e(backend)
                print(f"  {backend:<10} p50 {_f(e['p50_ms'])} ms, p99 {_f(e['p99_ms'])} ms, "
                      f"{e['commented']} of {e['deliveries']} commented", flush=True)
            except PhaseFailed as exc:
                failed(backend, exc)
                e = None
            e2es[backend] = e
        if "lag" in args.phases:
            print(f"\n4. loop lag during a {args.lag_clusters:,}-cluster rebuild", flush=True)
            try:
                lag = await bench.lag()
            except PhaseFailed as exc:
                failed("lag", exc)
    except PhaseFailed:
        pass  # said above
    finally:
        stores.close()
        if args.keep:
            print(f"\nlogs and data kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    summary: dict[str, Any] = {}
    for backend in args.backends:
        if backend not in backends:
            print(f"\n=== {backend}: not measured ({failures[backend][0]})")
            summary[backend] = None
            continue
        summary[backend] = report_backend(backend, args.phases, runs, drains[backend],
                                          e2es.get(backend),
                                          failures["bare"] + failures[backend])
    print("\nnotes: server CPU % is the process and its children (100 = one core); postgres "
          "CPU % is every PostgreSQL server process on the machine. 'start s' is from the "
          "worker's spawn to its first job done; 'done/s 10-90%' counts the jobs done between "
          "the 10% and the 90% marks of the queue over the time between them, 'done/s all' from "
          "the first job done to the last. 'calls/job' counts every request the fake GitHub "
          "got (token, config, comments). The end-to-end latency is from the 202 to the fake "
          "receiving the comment POST, so it holds the GitHub calls before the comment at "
          f"{args.e2e_github_ms:g} ms each, not the comment's own answer.")
    if lag is not None:
        print(f"\nloop lag while IndexHolder.refresh(force=True) rebuilt {lag['clusters']:,} "
              f"clusters in {lag['rebuild_s']:.1f}s (load + validate + index in a build "
              f"process whose arrays this process maps, as the bot does):\n"
              f"  during the rebuild: max {lag['max_loop_lag_ms']:.1f} ms, p99 "
              f"{lag['p99_loop_lag_ms']:.1f} ms, {lag['over_50ms']} of {lag['beats']:,} "
              f"heartbeats (5 ms sleeps) late by more than 50 ms\n"
              f"  idle loop, {lag['idle_seconds']:g}s before: max {lag['idle_max_lag_ms']:.1f} ms, "
              f"p99 {lag['idle_p99_lag_ms']:.1f} ms (what the machine itself adds)\n"
              f"  full garbage collections during the rebuild: {lag['gc_full_collections']}, "
              f"the longest {lag['gc_max_pause_ms']:.0f} ms")
    problems = bench.problems
    if problems:
        print("\nWARNING/ERROR lines in the processes' logs:")
        for name, lines in problems.items():
            print(f"  {name}: {len(lines)} line(s), e.g.")
            for line in list(dict.fromkeys(lines))[:3]:
                print(f"    {line[:220]}")
    else:
        print("\nno WARNING or ERROR line in any bot process's log")

    print("\ntargets:")
    met_all = True
    for backend in args.backends if "receiver" in args.phases else []:
        rps = (summary.get(backend) or {}).get("receiver_rps")
        met = rps is not None and rps >= TARGET_RPS
        met_all &= met
        print(f"  {backend + ' receiver req/s':<28} {_f(rps):>8}      target >= {TARGET_RPS:.0f}"
              f"      {'met' if met else 'MISSED'}")
    if lag is not None:
        met = lag["max_loop_lag_ms"] <= TARGET_LAG_MS
        met_all &= met
        at = "" if lag["clusters"] >= 100_000 else f" (at {lag['clusters']:,} clusters; the " \
            "target is for 100,000)"
        print(f"  {'max loop lag':<28} {lag['max_loop_lag_ms']:>8.1f} ms   target <= "
              f"{TARGET_LAG_MS:.0f} ms   {'met' if met else 'MISSED'}{at}")
    elif "lag" in args.phases:
        met_all = False
        print(f"  {'max loop lag':<28} {'-':>8}      target <= {TARGET_LAG_MS:.0f} ms   MISSED "
              "(not measured)")
    print("  (no target for the ratio to bare aiohttp, jobs done/s or the latency)")
    any_failed = any(failures.values())
    print(f"\ntotal {time.perf_counter() - started:.0f}s"
          + ("; some phases FAILED (see above)" if any_failed else ""))
    print(json.dumps({
        **summary,
        "max_loop_lag_ms": _round(lag["max_loop_lag_ms"]) if lag is not None else None,
        "lag_clusters": lag["clusters"] if lag is not None else None,
        "targets_met": met_all,
    }))
    return 1 if any_failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/webhook.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="short phases (about two minutes): --seconds 5 --rounds 1 "
                             "--drain-jobs 1000 --e2e-seconds 15 --lag-clusters 10000")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated: sqlite, postgresql")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help="PostgreSQL server; a schema is created in it and dropped")
    parser.add_argument("--seconds", type=float, default=None,
                        help="measured seconds a throughput round (10)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per server (2)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--payload", default=str(DEFAULT_PAYLOAD))
    parser.add_argument("--drain-jobs", type=int, default=None,
                        help="deliveries queued before the worker starts (2000)")
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--e2e-seconds", type=float, default=None,
                        help="seconds of end-to-end deliveries (30)")
    parser.add_argument("--e2e-rate", type=float, default=5.0, help="deliveries a second")
    parser.add_argument("--e2e-github-ms", type=float, default=100.0,
                        help="the fake GitHub's delay on every answer")
    parser.add_argument("--e2e-wait", type=float, default=60.0,
                        help="seconds to wait for the last comments after the last delivery")
    parser.add_argument("--lag-clusters", type=int, default=None,
                        help="clusters in the index rebuilt for the loop lag (100000)")
    parser.add_argument("--no-lag", action="store_true", help="skip the loop-lag phase")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated, of {', '.join(PHASES)} (default: all)")
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="heartbeat on the idle loop first, for comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the logs and data directories")
    parser.add_argument("--profile", action="store_true",
                        help="run the receivers under cProfile and print their top functions")
    # Internal roles.
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lag", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--number-base", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", help=argparse.SUPPRESS)  # comma-separated
    parser.add_argument("--clusters-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    quick = {"seconds": 5.0, "rounds": 1, "drain_jobs": 1000, "e2e_seconds": 15.0,
             "lag_clusters": 10_000}
    full = {"seconds": 10.0, "rounds": 2, "drain_jobs": 2000, "e2e_seconds": 30.0,
            "lag_clusters": 100_000}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    if args.serve_bare:
        serve_bare(args.port)
        return 0
    if args.load:
        load_child(args)
        return 0
    if args.lag:
        lag_child(args)
        return 0

    for package in ("aiohttp", "gidgethub", "psycopg", "jwt"):
        if importlib.util.find_spec(package) is None:
            print(f"bench/webhook.py: the Python package {package!r} is not installed; "
                  f"install the project (.venv/bin/pip install -e .)", file=sys.stderr)
            return 2
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if set(args.backends) - set(BACKENDS) or not args.backends:
        parser.error(f"--backends: one or more of {', '.join(BACKENDS)}")
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if set(args.phases) - set(PHASES) or not args.phases:
        parser.error(f"--phases: one or more of {', '.join(PHASES)}")
    if args.no_lag or args.lag_clusters <= 0:
        args.phases = [p for p in args.phases if p != "lag"]
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
