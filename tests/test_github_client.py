"""The GitHub client against the fake server: token minting and caching, retries, 404s."""

from __future__ import annotations

import aiohttp
import pytest

from bot.github.app import GitHubApp
from bot.github.client import RepoClient
from bot.settings import PrivateKey
from tests.conftest import APP_ID
from tests.fake_github import FakeGitHub


@pytest.fixture
async def app_client(github: tuple[FakeGitHub, str], key_pair: tuple[str, str]):  # type: ignore[no-untyped-def]
    fake, base = github
    async with aiohttp.ClientSession() as session:
        yield fake, GitHubApp(session, base_url=base, app_id=APP_ID,
                              private_key=PrivateKey(key_pair[0], source="t"))


async def test_token_is_cached_per_installation(app_client) -> None:  # type: ignore[no-untyped-def]
    fake, app = app_client
    first = await app.installation_token(1)
    assert await app.installation_token(1) == first
    other = await app.installation_token(2)
    assert other != first
    assert len(fake.calls("POST", "/access_tokens")) == 2


async def test_token_close_to_expiry_is_refreshed(app_client) -> None:  # type: ignore[no-untyped-def]
    fake, app = app_client
    fake.token_lifetime = 120  # shorter than the refresh margin: never worth caching
    a = await app.installation_token(1)
    b = await app.installation_token(1)
    assert a != b and len(fake.calls("POST", "/access_tokens")) == 2


async def test_jwt_from_wrong_key_is_refused(github, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from gidgethub import BadRequest

    fake, base = github
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    async with aiohttp.ClientSession() as session:
        app = GitHubApp(session, base_url=base, app_id=APP_ID,
                        private_key=PrivateKey(other, source="t"))
        with pytest.raises(BadRequest) as info:
            await app.installation_token(1)
    assert info.value.status_code == 401
    assert fake.tokens == {}  # nothing was issued to the impostor


async def test_reads_retry_5xx_but_writes_do_not(app_client) -> None:  # type: ignore[no-untyped-def]
    from gidgethub import GitHubBroken

    fake, app = app_client
    repo = RepoClient(await app.for_installation(1), "o/r")
    fake.add_file("o/r", "a.txt", "hello")
    fake.failures["GET /repos/o/r/contents"] = [502, 503]
    assert await repo.read_file("a.txt") == "hello"
    assert len(fake.calls("GET", "/contents/a.txt")) == 3

    fake.failures["POST /repos/o/r/issues"] = [502]
    with pytest.raises(GitHubBroken):
        await repo.create_comment(1, "x")
    assert len(fake.calls("POST", "/issues/1/comments")) == 1


async def test_missing_file_and_folder(app_client) -> None:  # type: ignore[no-untyped-def]
    fake, app = app_client
    assert fake.files == {}
    repo = RepoClient(await app.for_installation(1), "o/r")
    assert await repo.read_file(".github/dejafix.yml") is None
    assert await repo.list_dir(".github/ISSUE_TEMPLATE") == []
    fake.add_file("o/r", ".github/ISSUE_TEMPLATE/bug.yml", "name: Bug")
    assert await repo.list_dir(".github/ISSUE_TEMPLATE") == [".github/ISSUE_TEMPLATE/bug.yml"]


async def test_app_slug(app_client) -> None:  # type: ignore[no-untyped-def]
    _fake, app = app_client
    assert await app.app_slug() == "dejafix-test"


async def test_the_app_jwt_is_signed_once_and_reused_until_near_its_expiry(
        app_client, key_pair) -> None:  # type: ignore[no-untyped-def]
    import time

    import jwt

    fake, app = app_client
    first = app.app_jwt()
    assert app.app_jwt() == first  # not signed again for the next token request
    claims = jwt.decode(first, key_pair[1], algorithms=["RS256"])
    assert claims["iss"] == APP_ID and claims["exp"] - claims["iat"] == 600
    assert claims["exp"] - time.time() <= 540
    # Both installations' tokens were asked for with it, and GitHub (the fake) took it.
    await app.installation_token(1)
    await app.installation_token(2)
    sent = {r.headers["Authorization"] for r in fake.calls("POST", "/access_tokens")}
    assert sent == {f"bearer {first}"}
    app._jwt = ("stale", int(time.time()) + 30)  # under a minute from its end: signed anew
    renewed = app.app_jwt()
    assert renewed != "stale" and jwt.decode(renewed, key_pair[1], algorithms=["RS256"])
