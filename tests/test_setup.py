"""One-click registration (issue 16, part 3): /setup posts app.yml's manifest to GitHub, the
callback exchanges the code and stores the App under the data directory, files 0600, and the
next start reads it. Run against the fake GitHub's new-App form and conversions endpoint."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from html import unescape
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bot.settings import PrivateKey, Settings, app_dir, stored_app
from bot.web.pages import install_templates
from bot.web.setup import SetupError, add_setup_routes, build_manifest, store_credentials
from tests.conftest import APP_ID, ROOT
from tests.fake_github import FakeGitHub

# The operator token's file in the data directory (the README names it).
OPERATOR_TOKEN_FILE = "operator-token"

FORWARDED = {"X-Forwarded-For": "203.0.113.9"}


def settings_for(base_url: str, data_dir: Path, **extra: Any) -> Settings:
    return Settings(github_url=base_url, github_web_url=base_url, data_dir=data_dir, **extra)


async def setup_client(aiohttp_client: Any, settings: Settings, *, operator: bool = True
                       ) -> TestClient:
    """/setup's routes; ``operator``: the client opens the operator's session first, with the
    token from the data directory, as the start-up link does."""
    app = web.Application()
    install_templates(app, settings)
    add_setup_routes(app, settings)
    server = TestServer(app)
    await server.start_server()
    # As a browser does: a Secure cookie is kept and sent on http://127.0.0.1 (a secure
    # context), which the cookie of an https DEJAFIX_PUBLIC_URL is.
    jar = aiohttp.CookieJar(unsafe=True, treat_as_secure_origin=[server.make_url("/").origin()])
    client: TestClient = await aiohttp_client(server, cookie_jar=jar)
    if operator:
        await open_operator_session(client, settings.data_dir)
    return client


async def open_operator_session(client: TestClient, data_dir: Path) -> None:
    token = (data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    resp = await client.get(f"/setup?token={token}", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/setup", await resp.text()


def form_of(html: str) -> tuple[str, dict[str, Any]]:
    """The manifest form's action and the manifest in its hidden input."""
    form = re.search(r'<form method="post" action="([^"]+)" id="manifest-form">(.*?)</form>',
                     html, re.S)
    assert form is not None, html
    manifest = re.search(r'name="manifest" value="([^"]*)"', form.group(2))
    assert manifest is not None
    return unescape(form.group(1)), json.loads(unescape(manifest.group(1)))


async def register(client: TestClient, fake_url: str, query: str = "") -> tuple[int, str]:
    """Open /setup, post its form to the fake GitHub as a browser would, follow the redirect
    back to /setup/callback."""
    page = await client.get(f"/setup{query}")
    assert page.status == 200, await page.text()
    action, manifest = form_of(await page.text())
    assert action.startswith(fake_url)
    resp = await client.session.post(action, data={"manifest": json.dumps(manifest)})
    return resp.status, await resp.text()


async def typed(client: TestClient, query: str) -> str:
    """``/setup?QUERY`` as the page's own form sends it: with the session's CSRF token."""
    first = await (await client.get("/setup")).text()
    token = re.search(r'name="csrf" value="([^"]+)"', first)
    assert token is not None, first
    return f"/setup?{query}&csrf={token.group(1)}"


def secrets_of(data_dir: Path) -> list[str]:
    folder = app_dir(data_dir)
    return [(folder / name).read_text().strip()
            for name in ("private-key.pem", "webhook-secret", "client-secret")]


async def test_setup_form_posts_the_manifest_with_this_deployments_url(
        github: tuple[FakeGitHub, str], tmp_path: Path, aiohttp_client: Any) -> None:
    _, fake_url = github
    client = await setup_client(aiohttp_client, settings_for(fake_url, tmp_path / "data"))
    resp = await client.get("/setup")
    assert resp.status == 200
    action, manifest = form_of(await resp.text())
    base = str(client.make_url("")).rstrip("/")
    assert re.fullmatch(re.escape(f"{fake_url}/settings/apps/new?state=") + r"[\w-]{20,}",
                        action), action
    assert manifest["hook_attributes"] == {"url": f"{base}/webhook", "active": True}
    assert manifest["redirect_url"] == f"{base}/setup/callback"
    assert manifest["callback_urls"] == [f"{base}/oauth/callback"]
    assert manifest["url"] == base
    # The permissions and events are app.yml's, as the manual path copies them.
    import yaml

    app_yml = yaml.safe_load((ROOT / "app.yml").read_text())
    assert manifest["default_permissions"] == app_yml["default_permissions"]
    assert manifest["default_events"] == app_yml["default_events"]
    # Two loads in one session keep one state, so an older tab's form still works.
    again, _ = form_of(await (await client.get("/setup")).text())
    assert again == action


async def test_setup_for_an_organisation_and_a_public_url(
        github: tuple[FakeGitHub, str], tmp_path: Path, aiohttp_client: Any) -> None:
    _, fake_url = github
    settings = settings_for(fake_url, tmp_path / "data", public_url="https://bot.example.org")
    client = await setup_client(aiohttp_client, settings)
    action, manifest = form_of(await (await client.get(await typed(client, "org=octo-org"))).text())
    assert action.startswith(f"{fake_url}/organizations/octo-org/settings/apps/new?state=")
    assert manifest["hook_attributes"]["url"] == "https://bot.example.org/webhook"
    assert manifest["callback_urls"] == ["https://bot.example.org/oauth/callback"]
    # Registering from another machine than the deployment: GitHub sends the browser back to
    # the machine it is on, which holds the flow's state.
    here = str(client.make_url("")).rstrip("/")
    assert manifest["redirect_url"] == f"{here}/setup/callback"
    # A URL typed on the page wins; a local one is flagged (GitHub cannot deliver there).
    html = await (await client.get(await typed(client, "url=http://127.0.0.1:8000/"))).text()
    assert form_of(html)[1]["hook_attributes"]["url"] == "http://127.0.0.1:8000/webhook"
    assert 'id="setup-local"' in html
    assert 'id="setup-local"' not in await (await client.get("/setup")).text()
    # A link from elsewhere cannot point the webhook at another host: without the form's
    # token what it typed is ignored.
    forged = await (await client.get("/setup?url=https://evil.example&org=evil")).text()
    assert form_of(forged)[1]["hook_attributes"]["url"] == "https://bot.example.org/webhook"
    assert "/organizations/" not in form_of(forged)[0]
    bad = await client.get(await typed(client, "org=no/such&url=ftp://x"))
    assert bad.status == 400 and "manifest-form" not in await bad.text()


async def test_the_manifest_flow_stores_the_app_for_the_next_start(
        github: tuple[FakeGitHub, str], tmp_path: Path, aiohttp_client: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    fake, fake_url = github
    data_dir = tmp_path / "data"
    client = await setup_client(aiohttp_client, settings_for(fake_url, data_dir))
    status, html = await register(client, fake_url)
    assert status == 200, html
    assert fake.calls("POST", "/conversions"), "the code was exchanged"

    folder = app_dir(data_dir)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == \
        ["app.json", "client-secret", "private-key.pem", "webhook-secret"]
    for path in folder.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    meta = json.loads((folder / "app.json").read_text())
    assert meta["id"] == int(APP_ID) and meta["slug"] == "dejafix"
    assert meta["client_id"] == fake.oauth_client_id
    assert meta["html_url"] == "https://github.com/apps/dejafix"
    assert (folder / "client-secret").read_text().strip() == fake.oauth_client_secret
    assert (folder / "webhook-secret").read_text().startswith("whsec-")
    assert "PRIVATE KEY-----" in (folder / "private-key.pem").read_text()
    assert not [p for p in data_dir.iterdir() if p.name.startswith(".github-app-")]

    stored = stored_app(data_dir)
    assert stored is not None and stored.app_id == APP_ID
    settings = Settings.from_env({"DEJAFIX_DATA_DIR": str(data_dir)})
    assert settings.has_app_credentials and settings.app_id == APP_ID
    assert settings.webhook_secret is not None and settings.has_oauth
    assert settings.credentials_source == str(folder)

    # The page says where, to restart, which variables, and where to install; no secret.
    assert str(folder) in html and "Restart dejafix" in html
    for name in ("DEJAFIX_APP_ID", "DEJAFIX_PRIVATE_KEY", "DEJAFIX_WEBHOOK_SECRET",
                 "DEJAFIX_OAUTH_CLIENT_SECRET"):
        assert name in html
    assert 'href="https://github.com/apps/dejafix/installations/new"' in html
    logs = "\n".join(r.getMessage() for r in caplog.records)
    for secret in secrets_of(data_dir):
        for line in secret.splitlines()[1:3] or [secret]:  # a PEM's body lines too
            assert line not in html and line not in logs

    # Once stored, /setup is still the operator's alone: others are refused, told where to
    # find the link, never shown a path on the deployment's disk.
    closed = await (await setup_client(aiohttp_client, settings_for(fake_url, data_dir),
                                       operator=False)).get("/setup")
    text = await closed.text()
    assert closed.status == 403 and "already has a GitHub App" in text
    assert str(data_dir) not in unescape(text)
    operator = await client.get("/setup")
    assert operator.status == 200 and 'id="setup-stored"' in await operator.text()
    assert "manifest-form" not in await operator.text()


async def test_a_callback_with_a_wrong_state_stores_nothing(
        github: tuple[FakeGitHub, str], tmp_path: Path, aiohttp_client: Any) -> None:
    fake, fake_url = github
    data_dir = tmp_path / "data"
    client = await setup_client(aiohttp_client, settings_for(fake_url, data_dir))
    action, manifest = form_of(await (await client.get("/setup")).text())
    forged = re.sub(r"state=[^&]+", "state=forged", action)
    resp = await client.session.post(forged, data={"manifest": json.dumps(manifest)})
    assert resp.status == 400 and "does not match" in await resp.text()
    # A browser with no session of its own (no state at all) is refused the same way.
    fresh = await setup_client(aiohttp_client, settings_for(fake_url, data_dir))
    missing = await fresh.get("/setup/callback?code=abc&state=")
    assert missing.status == 400
    odd = await client.get("/setup/callback", params={"code": "abc", "state": "é\u2603"})
    assert odd.status == 400
    assert not fake.calls("POST", "/conversions")
    assert not app_dir(data_dir).exists()


async def test_a_used_code_shows_an_error_and_stores_nothing(
        github: tuple[FakeGitHub, str], tmp_path: Path, aiohttp_client: Any) -> None:
    _, fake_url = github
    data_dir = tmp_path / "data"
    client = await setup_client(aiohttp_client, settings_for(fake_url, data_dir))
    action, manifest = form_of(await (await client.get("/setup")).text())
    resp = await client.session.post(action, data={"manifest": json.dumps(manifest)},
                                     allow_redirects=False)
    callback = resp.headers["Location"]
    code = re.search(r"code=(\w+)", callback)
    assert code is not None
    # Someone spent the code first (it works once).
    spent = await client.session.post(f"{fake_url}/app-manifests/{code.group(1)}/conversions")
    assert spent.status == 201
    again = await client.session.get(callback)
    text = await again.text()
    assert again.status == 502 and "works once" in text and "Nothing was stored" in text
    assert not app_dir(data_dir).exists()


async def test_github_unreachable_stores_nothing(tmp_path: Path, aiohttp_client: Any) -> None:
    data_dir = tmp_path / "data"
    client = await setup_client(aiohttp_client, settings_for("http://127.0.0.1:9", data_dir))
    action = form_of(await (await client.get("/setup")).text())[0]
    state = action.split("state=", 1)[1]
    resp = await client.get(f"/setup/callback?code=abc123&state={state}")
    assert resp.status == 502 and "cannot reach GitHub" in await resp.text()
    assert not app_dir(data_dir).exists()


async def test_setup_is_the_operators_alone_configured_or_not(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
        aiohttp_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake, fake_url = github
    data_dir = tmp_path / "data"
    caplog.set_level(logging.DEBUG)
    unconfigured = await setup_client(aiohttp_client, settings_for(fake_url, data_dir),
                                      operator=False)
    # Not on loopback's word, nor any Host: only with the operator's token from the data
    # directory (0600, never logged, never its path on the page).
    for headers in ({}, {"Host": "127.0.0.1:8000"}, FORWARDED):
        refused = await unconfigured.get("/setup", headers=headers)
        text = unescape(await refused.text())
        assert refused.status == 403 and "operator link" in text, headers
        assert str(data_dir) not in text and OPERATOR_TOKEN_FILE in text
    token = (data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    assert stat.S_IMODE(os.stat(data_dir / OPERATOR_TOKEN_FILE).st_mode) == 0o600
    assert (await unconfigured.get("/setup?token=wrong", headers=FORWARDED)).status == 403
    # The token is exchanged for a session and leaves the URL: the page never holds it.
    resp = await unconfigured.get(f"/setup?token={token}", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/setup"
    page = await unconfigured.get("/setup", headers=FORWARDED)
    assert page.status == 200 and token not in await page.text()
    leaked = [(r.name, r.getMessage()) for r in caplog.records if token in r.getMessage()]
    assert not leaked, leaked
    # The callback is reached without the token in its URL; refused to anyone else.
    stranger = await setup_client(aiohttp_client, settings_for(fake_url, data_dir),
                                  operator=False)
    assert (await stranger.get("/setup/callback?code=abc&state=x")).status == 403

    configured = await setup_client(aiohttp_client, settings_for(
        fake_url, data_dir, app_id=APP_ID, private_key=PrivateKey(key_pair[0], source="test"),
        credentials_source="environment"), operator=False)
    for path in ("/setup", "/setup/callback?code=abc&state=x"):
        resp = await configured.get(path)
        assert resp.status == 403, path
        assert "already has a GitHub App" in await resp.text()
    # The operator may still register (and is told the environment wins).
    await open_operator_session(configured, data_dir)
    operator = await configured.get("/setup")
    text = await operator.text()
    assert operator.status == 200 and "manifest-form" in text and 'id="setup-environment"' in text
    assert not fake.calls("POST", "/conversions")


async def test_an_app_already_stored_is_not_overwritten(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
        aiohttp_client: Any) -> None:
    fake, fake_url = github
    data_dir = tmp_path / "data"
    client = await setup_client(aiohttp_client, settings_for(fake_url, data_dir))
    action, manifest = form_of(await (await client.get("/setup")).text())
    # Another tab registers an App meanwhile; then this tab's registration comes back.
    first = store_credentials(data_dir, {"id": 1, "pem": key_pair[0], "webhook_secret": "w"})
    before = {p.name: p.read_text() for p in first.iterdir()}
    resp = await client.session.post(action, data={"manifest": json.dumps(manifest)})
    text = await resp.text()
    assert resp.status == 409 and str(first) in unescape(text), text
    # Refused before the code is spent: GitHub still holds the credentials for it.
    assert not fake.calls("POST", "/conversions")
    assert {p.name: p.read_text() for p in first.iterdir()} == before
    with pytest.raises(SetupError, match=re.escape(str(first))):
        store_credentials(data_dir, {"id": 2, "pem": key_pair[0]})
    assert {p.name: p.read_text() for p in first.iterdir()} == before


def test_store_credentials_writes_private_files_whatever_the_umask(
        tmp_path: Path, key_pair: tuple[str, str]) -> None:
    old = os.umask(0)
    try:
        folder = store_credentials(tmp_path / "d", {
            "id": 7, "slug": "x", "pem": key_pair[0], "webhook_secret": "w",
            "client_id": "Iv1.c", "client_secret": "c", "html_url": "https://github.com/apps/x"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {
        "app.json": 0o600, "private-key.pem": 0o600, "webhook-secret": 0o600,
        "client-secret": 0o600}
    # A bad answer (no key) writes nothing at all.
    with pytest.raises(SetupError):
        store_credentials(tmp_path / "e", {"id": 7, "pem": "not a key"})
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())


def test_build_manifest_keeps_only_what_github_reads(tmp_path: Path) -> None:
    app_yml = tmp_path / "app.yml"
    app_yml.write_text("name: X\nnotes: for humans\nhook_attributes:\n  url: old\n"
                       "default_events: [issues]\n")
    manifest = build_manifest(app_yml, "https://bot.example.org/")
    assert "notes" not in manifest
    assert manifest["hook_attributes"] == {"url": "https://bot.example.org/webhook",
                                           "active": True}
    assert manifest["redirect_url"] == "https://bot.example.org/setup/callback"
    assert build_manifest(app_yml, "https://bot.example.org", "http://127.0.0.1:8000/")[
        "redirect_url"] == "http://127.0.0.1:8000/setup/callback"
    with pytest.raises(SetupError, match="cannot read"):
        build_manifest(tmp_path / "missing.yml", "https://x")


async def test_the_running_app_serves_setup_until_an_app_is_configured(
        make_bot: Any) -> None:
    # Through create_app, as `make run` starts it: no App yet, so /setup shows GitHub's form.
    bot = await make_bot(dry_run=True, with_credentials=False)
    assert (await bot.client.get("/setup")).status == 403
    token = (bot.data_dir / OPERATOR_TOKEN_FILE).read_text().strip()
    page = await bot.client.get(f"/setup?token={token}")
    assert page.status == 200
    assert "/settings/apps/new?state=" in await page.text()
    configured = await make_bot()
    refused = await configured.client.get("/setup")
    assert refused.status == 403
