"""The HTTP server against hostile clients, over real sockets to the real app: a client trickling
its request head or its body one byte at a time is cut off (closed, or 408) while others are
served; a malformed request is one WARNING line, not a traceback; the data directory and the
SQLite files are the owner's only, whatever the umask."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bot.db.sqlite import DB_FILENAME, SQLiteStore
from bot.settings import ServiceConfig, Settings
from bot.web.app import create_app, server_runner
from tests.conftest import SAMPLE_CLUSTERS
from tests.fake_github import FakeGitHub

TIMEOUT = 0.3
# A slow client sends a byte every STEP seconds, up to BYTES of them: ten times the timeout, so
# a server that never cuts it off lets it finish.
STEP = 0.05
BYTES = int(10 * TIMEOUT / STEP)


@pytest.fixture
async def server(github: tuple[FakeGitHub, str], tmp_path: Path) -> AsyncIterator[int]:
    """The app as ``serve`` runs it (``server_runner``), with short timeouts; its port."""
    _, base_url = github
    settings = Settings(github_url=base_url, github_web_url=base_url, data_dir=tmp_path / "d")
    app = create_app(settings, ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)]),
                     dry_run=True, body_timeout=TIMEOUT)
    runner = server_runner(app, header_timeout=TIMEOUT)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield port
    finally:
        await runner.cleanup()


async def trickle(port: int, head: bytes, byte: bytes) -> tuple[int, bytes]:
    """Send ``head`` at once, then ``byte`` every STEP seconds until the server answers or
    closes, at most BYTES times; how many were sent, and what the server said."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # The first bytes of an answer, or b"" once the server closed.
    answer = asyncio.ensure_future(reader.read(200))
    sent = 0
    try:
        writer.write(head)
        while sent < BYTES and not answer.done():
            await asyncio.sleep(STEP)
            try:
                writer.write(byte)
                await writer.drain()
            except ConnectionError:
                break
            sent += 1
        if not answer.done():
            return sent, b""
        return sent, await answer
    finally:
        answer.cancel()
        writer.close()


async def test_slow_clients_are_cut_off_and_others_are_served(server: int) -> None:
    port = server
    slow_heads = [trickle(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ", b"a")
                  for _ in range(20)]
    body_head = (b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nX-GitHub-Event: ping\r\nX-GitHub-Delivery: slow\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    slow_bodies = [trickle(port, body_head, b" ") for _ in range(5)]
    slow = asyncio.gather(*slow_heads, *slow_bodies)

    # Meanwhile everyone else is served as usual.
    served = 0
    async with aiohttp.ClientSession() as http:
        while not slow.done():
            async with http.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
                served += 1
            await asyncio.sleep(STEP)
    results = await slow
    assert served >= 2
    for sent, said in results[:20]:
        # Closed before the head was done: no answer, and well before the client gave up.
        assert sent < BYTES, "a trickled request head holds its connection"
        assert said == b"" or said.startswith(b"HTTP/1.1 408"), said[:80]
    for sent, said in results[20:]:
        assert sent < BYTES, "a trickled body holds its connection"
        assert said.startswith(b"HTTP/1.1 408"), said[:80]


async def test_a_malformed_request_is_one_warning_line(
        server: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for raw in (b"GET / HTTP/1.1 x\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", server)
        writer.write(raw)
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0]
        loud = [r for r in caplog.records if r.name == "aiohttp.server"
                and r.levelno >= logging.WARNING]
        assert [r.levelname for r in loud] == ["WARNING"], [r.getMessage() for r in loud]
        assert loud[0].exc_info is None and "\n" not in loud[0].getMessage()
        assert loud[0].getMessage().startswith("bad HTTP request from 127.0.0.1: ")
        assert "Traceback" not in caplog.text


async def test_a_malformed_request_never_logs_its_token(
        server: int, caplog: pytest.LogCaptureFixture) -> None:
    # The warning quotes what the client sent; an operator link's token must not reach the log
    # through it, wherever the quote is cut.
    caplog.set_level(logging.DEBUG)
    secret = "opTokenSecret123"
    for raw in (f"GET /?token={secret}\x00 HTTP/1.1\r\n\r\n".encode(),
                f"GET /?a=1&token={secret} HTTP/1.1 x\r\n\r\n".encode(),
                f"GET /{'p' * 170}?token={secret} HTTP/1.1 x\r\n\r\n".encode()):
        caplog.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", server)
        writer.write(raw)
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert b" 400 " in answer.split(b"\r\n")[0], answer[:80]
        loud = [r.getMessage() for r in caplog.records if r.name == "aiohttp.server"
                and r.levelno >= logging.WARNING]
        assert len(loud) == 1 and loud[0].startswith("bad HTTP request from 127.0.0.1: "), loud
        assert "token=***" in loud[0] or "token=" not in loud[0], loud
        assert secret[:4] not in caplog.text, loud


def test_the_store_is_the_owners_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        data_dir = tmp_path / "fresh" / "data"
        store = SQLiteStore(data_dir)
        try:
            store.pending_count()
            db = data_dir / DB_FILENAME
            files = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
            assert all(f.exists() for f in files)
            assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
            assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {
                f.name: 0o600 for f in files}
        finally:
            store.close()
        # A database an earlier version left readable by others is tightened when opened.
        os.chmod(db, 0o644)
        SQLiteStore(data_dir).close()
        assert stat.S_IMODE(db.stat().st_mode) == 0o600
    finally:
        os.umask(old)
