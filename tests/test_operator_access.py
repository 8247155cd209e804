"""The operator is whoever holds the operator token, never whoever looks local: through a real
reverse proxy on the same host (Host rewritten to 127.0.0.1, no forwarding header: the default
of common proxies) the page and /setup are refused without the token and served with it; the
real process prints the link once, binds loopback by default, and a deleted token file makes a
new token that signs the old sessions out."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from bot.db.sqlite import DB_FILENAME
from tests.conftest import ROOT, BotFactory, BotUnderTest

# The operator token's file in the data directory (the README names it).
OPERATOR_TOKEN_FILE = "operator-token"


async def same_host_proxy(bot: BotUnderTest, aiohttp_server: Any) -> URL:
    """A reverse proxy on this host in front of the bot, as nginx's or Caddy's default
    ``proxy_pass`` to 127.0.0.1 makes one: it rewrites Host to the upstream's and adds no
    X-Forwarded-* header. Its peer address, as the bot sees it, is 127.0.0.1."""
    upstream = bot.client.make_url("/")
    session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(),
                                    auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        headers["Host"] = f"127.0.0.1:{upstream.port}"
        async with session.request(request.method, upstream.with_path(request.path)
                                   .with_query(request.query), headers=headers,
                                   data=await request.read(), allow_redirects=False) as resp:
            body = await resp.read()
            out = web.Response(status=resp.status, body=body)
            for name, value in resp.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "date",
                                        "server", "connection"):
                    out.headers.add(name, value)
            return out

    proxy = web.Application()
    proxy.router.add_route("*", "/{tail:.*}", forward)

    async def close(app: web.Application) -> None:
        await session.close()

    proxy.on_cleanup.append(close)
    server = await aiohttp_server(proxy)
    return URL(str(server.make_url("/")))


def visitor() -> aiohttp.ClientSession:
    # A browser's jar: keeps the cookies of an IP address.
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


@pytest.mark.parametrize("registered", [False, True], ids=["fresh", "registered"])
async def test_a_same_host_proxy_does_not_make_every_visitor_the_operator(
        make_bot: BotFactory, aiohttp_server: Any, registered: bool) -> None:
    # Fresh: no App yet, so /setup would let a stranger register their own App into it.
    bot = await make_bot(dry_run=True, with_credentials=registered)
    base = await same_host_proxy(bot, aiohttp_server)
    async with visitor() as stranger:
        for path in ("/", "/setup", "/repos/openclaw/openclaw"):
            async with stranger.get(base.with_path(path), allow_redirects=False) as resp:
                text = await resp.text()
                assert resp.status == 403, (path, resp.status, text[:300])
                assert "operator link" in text and str(bot.data_dir) not in text
        async with stranger.get(base.with_path("/").with_query(token="guess"),
                                allow_redirects=False) as resp:
            assert resp.status == 403
    # The operator, through the same proxy, with the link's token.
    token = (bot.data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    async with visitor() as operator:
        async with operator.get(base.with_path("/setup").with_query(token=token),
                                allow_redirects=False) as resp:
            assert resp.status == 302 and resp.headers["Location"] == "/setup"
        for path in ("/", "/setup"):
            async with operator.get(base.with_path(path), allow_redirects=False) as resp:
                text = await resp.text()
                assert resp.status == 200, (path, text[:300])
                assert token not in text
    # The bot's webhook and health still answer through the proxy as before.
    async with visitor() as anyone, anyone.get(base.with_path("/healthz")) as resp:
        assert resp.status == 200


# -- the real process ---------------------------------------------------------------------------

def _start(data_dir: Path, **env: str) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEJAFIX_")}
    # With a webhook secret, the old default bound every address.
    environ.update(DEJAFIX_DATA_DIR=str(data_dir), DEJAFIX_WEBHOOK_SECRET="s3cret", **env)
    return subprocess.Popen(
        [sys.executable, "-m", "bot", "serve", "--dry-run", "--port", "0"],
        cwd=ROOT, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)


def _read_until_link(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        if "operator link" in line:
            break
    return lines


async def _lines_until_ready(proc: subprocess.Popen[str]) -> list[str]:
    """The log up to the operator link; a process that never prints one is killed after a
    minute (which ends the read) and the test fails."""
    reading = asyncio.ensure_future(asyncio.to_thread(_read_until_link, proc))
    done, _ = await asyncio.wait([reading], timeout=60)
    if not done:
        proc.kill()
        lines = await reading
        raise AssertionError("no operator link in the start-up log:\n" + "".join(lines))
    return reading.result()


def _stop(proc: subprocess.Popen[str]) -> list[str]:
    """SIGTERM, and the rest of its log."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err.splitlines()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    async with session.get(url, allow_redirects=False) as resp:
        return resp.status, resp.headers.get("Location", ""), await resp.text()


async def test_the_process_prints_the_link_once_binds_loopback_and_rotates(
        tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    data_dir = tmp_path / "data"
    # A session key of the deployment's own, so that cookies outlive a restart: rotation, not
    # the restart, must be what signs the old session out.
    first = _start(data_dir, DEJAFIX_SESSION_SECRET="k" * 32)
    processes.append(first)
    lines = await _lines_until_ready(first)
    token = (data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    listening = [line for line in lines if "listening on" in line]
    assert listening and "http://127.0.0.1:" in listening[0], lines
    links = [line for line in lines if "operator link" in line]
    assert len(links) == 1, lines
    link = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", links[0])
    assert link is not None and link.group(0).endswith(f"?token={token}"), links
    # Owner-only, on a fresh data directory: the folder, the token, the database and its WAL.
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    db = data_dir / DB_FILENAME
    wal = [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm")]
    assert all(p.exists() for p in wal), "WAL mode makes both while the store is open"
    for path in (data_dir / OPERATOR_TOKEN_FILE, db, *wal):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    # Not reachable on another address of this host.
    port = URL(link.group(0)).port
    assert port is not None
    with socket.socket() as probe:
        probe.settimeout(5)
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            assert probe.connect_ex((other, port)) != 0

    async with visitor() as browser:
        status, location, _ = await _get(browser, link.group(0))
        assert status == 302 and location == "/"
        status, _, text = await _get(browser, link.group(0).split("?")[0])
        assert status == 200 and token not in text
        cookies = browser.cookie_jar.filter_cookies(URL(link.group(0)))
    rest = await asyncio.to_thread(_stop, first)
    log = "".join(lines) + "\n".join(rest)
    assert log.count(token) == 1, "the token appears only in the start-up link"

    # Rotation: delete the file; the next start makes a new token and the old session ends.
    (data_dir / OPERATOR_TOKEN_FILE).unlink()
    second = _start(data_dir, DEJAFIX_SESSION_SECRET="k" * 32)
    processes.append(second)
    lines = await _lines_until_ready(second)
    new_token = (data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    assert new_token != token
    new_link = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", "".join(lines))
    assert new_link is not None
    home = new_link.group(0).split("?")[0]
    async with visitor() as old_browser:
        old_browser.cookie_jar.update_cookies(cookies, URL(home))
        status, _, _ = await _get(old_browser, home)
        assert status == 403
        status, _, _ = await _get(old_browser, f"{home}?token={token}")
        assert status == 403
        status, location, _ = await _get(old_browser, new_link.group(0))
        assert status == 302
        status, _, _ = await _get(old_browser, home)
        assert status == 200
    await asyncio.to_thread(_stop, second)


def test_host_flag_chooses_another_address() -> None:
    from bot.__main__ import build_parser, operator_link

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert args.host == "0.0.0.0"
    assert build_parser().parse_args(["serve"]).host is None
    assert operator_link("0.0.0.0", 8000, "t/k") == "http://127.0.0.1:8000/?token=t%2Fk"
    assert operator_link("10.1.2.3", 80, "t") == "http://10.1.2.3:80/?token=t"
    assert operator_link("::1", 80, "t") == "http://[::1]:80/?token=t"


# -- the token's exchange sends the browser to this site only ----------------------------------

async def _raw_get(bot: BotUnderTest, target: str) -> tuple[int, dict[str, str]]:
    """One GET with ``target`` sent as written on the request line, as a crafted link makes a
    browser send it (a client library would normalise "//evil.example/")."""
    url = bot.client.make_url("/")
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{url.port}\r\n"
                     "Connection: close\r\n\r\n".encode())
        await writer.drain()
        head = (await reader.read()).split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    finally:
        writer.close()
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), headers


async def test_the_token_exchange_redirects_only_to_a_path_of_this_site(
        make_bot: BotFactory) -> None:
    bot = await make_bot(dry_run=True)
    token = (bot.data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    for target, where in [
        (f"//evil.example/?token={token}", "/"),  # was "////evil.example/": another site
        (f"/\\evil.example/?token={token}", "/"),
        (f"/repos/openclaw/openclaw?x=1&token={token}", "/repos/openclaw/openclaw?x=1"),
        (f"/setup?token={token}", "/setup"),
    ]:
        status, headers = await _raw_get(bot, target)
        assert (status, headers.get("Location")) == (302, where), target


# -- the data directory and the token file are checked, not trusted as found ------------------

def test_a_planted_or_linked_token_file_is_refused(tmp_path: Path) -> None:
    from bot.web.auth import read_or_make_token

    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    token = data_dir / OPERATOR_TOKEN_FILE
    token.write_text("planted-by-someone\n")
    os.chmod(token, 0o666)
    with pytest.raises(OSError) as refused:
        read_or_make_token(data_dir)
    message = str(refused.value)
    assert "is open to other users (mode 666)" in message and "delete it" in message
    assert OPERATOR_TOKEN_FILE in message and str(data_dir) not in message
    token.unlink()
    token.symlink_to("/etc/hostname")
    with pytest.raises(OSError, match="operator-token in the data directory is a symbolic "
                                      "link: delete it"):
        read_or_make_token(data_dir)
    token.unlink()
    os.mkfifo(token, 0o600)  # never waited on
    with pytest.raises(OSError, match="is not a regular file"):
        read_or_make_token(data_dir)
    token.unlink()
    if os.getuid() == 0:  # only root can give a file away
        token.write_text("someone-elses\n")
        os.chmod(token, 0o600)
        os.chown(token, 65534, 65534)
        with pytest.raises(OSError, match="belongs to another user"):
            read_or_make_token(data_dir)
        token.unlink()
    made = read_or_make_token(data_dir)  # none there: a new one, 0600, read back as it is
    assert read_or_make_token(data_dir) == made
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


async def test_the_process_refuses_a_planted_token_and_names_the_file_only(
        tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    (data_dir / OPERATOR_TOKEN_FILE).write_text("planted-by-someone\n")
    os.chmod(data_dir / OPERATOR_TOKEN_FILE, 0o666)
    proc = _start(data_dir)
    processes.append(proc)
    _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 2, err
    refusal = [line for line in err.splitlines() if "cannot start" in line]
    assert len(refusal) == 1 and "operator token file operator-token" in refusal[0], err
    assert "delete it" in refusal[0] and str(data_dir) not in refusal[0]
    assert "planted-by-someone" not in err


async def test_a_data_directory_open_to_others_is_made_owner_only_with_a_warning(
        tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if os.getuid() == 0:
        os.chown(data_dir, -1, 65534)  # a group of its own, not root's (0: see below)
    os.chmod(data_dir, 0o777)
    proc = _start(data_dir)
    processes.append(proc)
    lines = await _lines_until_ready(proc)
    warnings = [line for line in lines if "WARNING" in line and "DEJAFIX_DATA_DIR" in line]
    assert len(warnings) == 1 and "(mode 777): made 700" in warnings[0], lines
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    await asyncio.to_thread(_stop, proc)
    if os.getuid() != 0:
        return  # only root can give a directory away
    # The container image's volume: group 0 shares it with any uid (deploy.md); only the
    # others' bits go.
    os.chown(data_dir, -1, 0)
    os.chmod(data_dir, 0o777)
    proc = _start(data_dir)
    processes.append(proc)
    lines = await _lines_until_ready(proc)
    assert any("(mode 777): made 770" in line for line in lines), lines
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o770
    await asyncio.to_thread(_stop, proc)
    # Another user's directory, not shared through group 0: refused before anything starts.
    os.chown(data_dir, 65534, 65534)
    refused = _start(data_dir)
    processes.append(refused)
    _, err = await asyncio.to_thread(refused.communicate, timeout=60)
    assert refused.returncode == 2 and "belongs to another user (uid 65534)" in err, err
