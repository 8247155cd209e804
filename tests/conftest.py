"""Shared fixtures: an App key pair, the fake GitHub on loopback, and the bot's own server
started against it with real SQLite under tmp_path."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from bot.settings import PrivateKey, ServiceConfig, Settings
from bot.web.app import SERVICES, WORKER, create_app
from tests.fake_github import FakeGitHub

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SEEDS = SHARED / "seeds"
PAYLOADS = SHARED / "github-payloads"
SAMPLE_CLUSTERS = ROOT / "config" / "clusters"
APP_ID = "4242"
SECRET = "webhook-secret-for-tests"
REPO = "NousResearch/hermes-agent"


# PostgreSQL for the tests: a fresh schema per test in this database. Without a server the tests
# that need one are skipped, with one line saying why; .ci/run sets DEJAFIX_REQUIRE_POSTGRES so
# that there a missing server fails them instead.
PG_URL_VAR = "DEJAFIX_TEST_DATABASE_URL"
PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _pg_base_url() -> str:
    return os.environ.get(PG_URL_VAR, "").strip() or PG_DEFAULT_URL


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The test database's URL, or a skip when no server answers there."""
    import psycopg

    url = _pg_base_url()
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        reason = f"no PostgreSQL at {url} ({PG_URL_VAR}): {str(exc).splitlines()[0]}"
        if os.environ.get("DEJAFIX_REQUIRE_POSTGRES"):
            pytest.fail(reason)
        pytest.skip(reason)
    return url


def schema_url(url: str, schema: str) -> str:
    """``url`` with ``schema`` first on its search path."""
    return f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"


@contextmanager
def fresh_schema(server: str) -> Iterator[str]:
    """A URL whose connections use a fresh, empty schema, dropped afterwards."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield schema_url(server, schema)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A fresh schema for the test."""
    with fresh_schema(pg_server) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """Run a test against each backend: None (SQLite under tmp_path) or a PostgreSQL URL."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture(scope="session")
def key_pair() -> tuple[str, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


@pytest.fixture
async def github(key_pair: tuple[str, str], aiohttp_server: Any) -> tuple[FakeGitHub, str]:
    fake = FakeGitHub(app_id=APP_ID, public_key_pem=key_pair[1])
    server: TestServer = await aiohttp_server(fake.app())
    return fake, str(server.make_url("")).rstrip("/")


def sign(body: bytes, secret: str = SECRET) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def issue_payload(action: str = "opened", *, number: int = 90001, title: str = "",
                  body: str = "", repo: str = REPO, login: str = "reporter",
                  user_type: str = "User", labels: list[str] | None = None,
                  installation: int = 77, **extra: Any) -> dict[str, Any]:
    owner, name = repo.split("/")
    payload: dict[str, Any] = {
        "action": action,
        "issue": {
            "number": number, "title": title, "body": body, "state": "open",
            "user": {"login": login, "type": user_type},
            "labels": [{"name": n} for n in labels or []],
        },
        "repository": {"full_name": repo, "name": name, "owner": {"login": owner}},
        "sender": {"login": login, "type": user_type},
        "installation": {"id": installation},
    }
    payload.update(extra)
    return payload


@dataclass
class BotUnderTest:
    client: TestClient
    app: web.Application
    github: FakeGitHub
    data_dir: Path

    async def deliver(self, event: str, payload: dict[str, Any] | bytes, *,
                      delivery: str | None = None, secret: str | None = SECRET,
                      headers: dict[str, str] | None = None) -> ClientResponse:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        sent = {"Content-Type": "application/json", "X-GitHub-Event": event,
                "X-GitHub-Delivery": delivery or str(uuid.uuid4())}
        if secret is not None:
            sent["X-Hub-Signature-256"] = sign(body, secret)
        sent.update(headers or {})
        return await self.client.post("/webhook", data=body, headers=sent)

    async def settle(self, timeout: float = 15.0) -> None:
        """Wait until the worker has drained the queue (no sleeps in assertions)."""
        services = self.app[SERVICES]
        worker = self.app[WORKER]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            pending = await asyncio.to_thread(services.store.pending_count)
            if pending == 0 and not worker.running:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"queue did not drain in {timeout}s ({pending} pending)")


BotFactory = Callable[..., Awaitable[BotUnderTest]]


@pytest.fixture
def make_bot(github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
             aiohttp_client: Any) -> BotFactory:
    fake, base_url = github

    async def factory(*, dry_run: bool = False, config: ServiceConfig | None = None,
                      with_credentials: bool = True,
                      database_url: str | None = None, oauth: bool = False,
                      ) -> BotUnderTest:
        settings = Settings(
            app_id=APP_ID if with_credentials else None,
            private_key=PrivateKey(key_pair[0], source="test") if with_credentials else None,
            webhook_secret=None if dry_run and not with_credentials else _secret(),
            github_url=base_url,
            data_dir=tmp_path / "data",
            database_url=_secret(database_url) if database_url else None,
            # The fake serves GitHub's web side (OAuth, the new-App form) beside its API.
            github_web_url=base_url,
            oauth_client_id=fake.oauth_client_id if oauth else None,
            oauth_client_secret=_secret(fake.oauth_client_secret) if oauth else None,
        )
        cfg = config or ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)])
        app = create_app(settings, cfg, dry_run=dry_run)
        client: TestClient = await aiohttp_client(app)
        return BotUnderTest(client=client, app=app, github=fake, data_dir=tmp_path / "data")

    return factory


def _secret(value: str = SECRET) -> Any:
    from pydantic import SecretStr

    return SecretStr(value)


# Handler tests' fixtures (``handlers``, ``make_handlers``): a feature's Context on a real store
# and the fake GitHub, called without the webhook server.
pytest_plugins = ["tests.handler_support"]
