"""One-click registration, Probot's manifest flow.

``GET /setup`` shows a form that posts the manifest built from ``app.yml`` (with this
deployment's URL in it) to GitHub's new-App page; GitHub creates the App once the user confirms
and sends the browser to ``GET /setup/callback?code=...&state=...``, which exchanges the code
(``POST /app-manifests/{code}/conversions``) for the App's id, private key, webhook secret and
OAuth client, and writes them under the data directory's ``github-app/`` (files 0600, the folder
0700), where ``Settings.from_env`` reads them at the next start.

Both pages are the operator's: a session opened with the operator token (``bot.web.auth``; the
link in the start-up log, exchanged for a session cookie and dropped from the URL at once; it
stays valid until its file is deleted). No secret is ever shown on a page or written to a log:
a platform without a persistent disk registers from the operator's machine and copies the
files into its environment (README, "Registering the App").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
import aiohttp_session
import yaml
from aiohttp import web

from bot import __version__
from bot.settings import PrivateKey, Settings, SettingsError, app_dir, project_path
from bot.web.auth import WHERE_THE_LINK_IS, csrf_token, is_operator
from bot.web.pages import render

log = logging.getLogger("dejafix.web")

APP_YML = Path("app.yml")
# The session key holding the flow's state, checked on the callback.
STATE = "setup_state"
# What GitHub reads from a manifest; anything else in app.yml is a note for humans.
MANIFEST_KEYS = frozenset({
    "name", "url", "description", "hook_attributes", "redirect_url", "callback_urls",
    "setup_url", "public", "default_events", "default_permissions", "request_oauth_on_install",
    "setup_on_update",
})
# The files /setup writes (bot.settings.stored_app reads them) and the variable that sets the
# same thing instead, for a platform without a persistent disk.
FILES = {
    "app.json": "DEJAFIX_APP_ID (the App's id; its OAuth client id: DEJAFIX_OAUTH_CLIENT_ID)",
    "private-key.pem": "DEJAFIX_PRIVATE_KEY (the file's text) or DEJAFIX_PRIVATE_KEY_PATH",
    "webhook-secret": "DEJAFIX_WEBHOOK_SECRET",
    "client-secret": "DEJAFIX_OAUTH_CLIENT_SECRET",
}
CONVERSION_TIMEOUT = 20.0
_ORG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})")
_CODE = re.compile(r"[A-Za-z0-9_-]{1,128}")


class SetupError(Exception):
    """The flow cannot go on; the message is shown on the page (it never holds a secret)."""


def stored_app_exists(data_dir: Path) -> bool:
    """An App stored by /setup is there (``stored_app`` would read it)."""
    return (app_dir(data_dir) / "app.json").exists()


def app_configured(settings: Settings) -> bool:
    """An App is configured: from the environment, or stored by /setup (also since this process
    started: the file is looked at on every request, so /setup closes once it has run)."""
    return settings.has_app_credentials or stored_app_exists(settings.data_dir)


async def setup_allowed(request: web.Request) -> bool:
    """/setup is the operator's, whether or not an App is configured yet: a session opened with
    the operator token (``bot.web.auth``). Not the peer's address: on a fresh deployment behind
    a proxy on the same host, anyone would otherwise register an App of theirs into it."""
    return await is_operator(request)


def public_base(text: str) -> str:
    """A deployment's base URL as typed: http(s), a host, no query, no trailing slash."""
    try:
        url = urlsplit(text.strip())
        url.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise SetupError(f"{text!r} is not a URL") from None
    if url.scheme not in ("http", "https") or not url.hostname or "@" in url.netloc \
            or url.query or url.fragment or any(c.isspace() for c in text.strip()):
        raise SetupError(f"{text!r} is not this deployment's URL: it must be http:// or "
                         "https://, with a host and no query")
    return url.geturl().rstrip("/")


def build_manifest(app_yml: Path, base_url: str, setup_base: str | None = None
                   ) -> dict[str, Any]:
    """``app.yml`` as GitHub reads it, with this deployment's URLs: the homepage, the webhook
    (``/webhook``), the flow's callback (``/setup/callback``) and the sign-in's OAuth callback
    (``/oauth/callback``). The flow's callback is a browser redirect, so it goes to
    ``setup_base`` when given: the process the browser is on, which may be the operator's own
    machine registering for a deployment elsewhere."""
    try:
        raw: Any = yaml.safe_load(app_yml.read_text())
    except OSError as exc:
        raise SetupError(f"cannot read the App's manifest {app_yml}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SetupError(f"{app_yml} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SetupError(f"{app_yml}: expected a mapping at the top level")
    base = base_url.rstrip("/")
    manifest = {key: value for key, value in raw.items() if key in MANIFEST_KEYS}
    hook = dict(manifest.get("hook_attributes") or {})
    hook["url"] = f"{base}/webhook"
    hook.setdefault("active", True)
    back = (setup_base or base).rstrip("/")
    manifest.update(url=base, hook_attributes=hook, redirect_url=f"{back}/setup/callback",
                    callback_urls=[f"{base}/oauth/callback"])
    return manifest


def new_app_url(web_url: str, state: str, org: str | None = None) -> str:
    """GitHub's new-App page the manifest form posts to: the user's, or an organisation's."""
    owner = f"/organizations/{quote(org, safe='')}" if org else ""
    return f"{web_url.rstrip('/')}{owner}/settings/apps/new?state={quote(state, safe='')}"


def is_local(base_url: str) -> bool:
    """A URL GitHub cannot deliver to (it refuses such webhook URLs)."""
    host = (urlsplit(base_url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.") or \
        host.endswith(".localhost")


async def convert(session: aiohttp.ClientSession, api_url: str, code: str) -> dict[str, Any]:
    """Exchange the flow's one-time code for the App GitHub made: id, slug, html_url, pem,
    webhook_secret, client_id, client_secret. SetupError when GitHub says no or cannot be
    reached (the code is never logged)."""
    if not _CODE.fullmatch(code):
        raise SetupError("GitHub's code is malformed: start again at /setup")
    url = f"{api_url.rstrip('/')}/app-manifests/{code}/conversions"
    headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28",
               "User-Agent": f"dejafix/{__version__}"}
    try:
        async with session.post(url, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=CONVERSION_TIMEOUT)) as resp:
            status = resp.status
            try:
                body: Any = await resp.json(content_type=None)
            except ValueError:
                body = None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise SetupError(f"cannot reach GitHub at {api_url} to fetch the new App's "
                         f"credentials: {type(exc).__name__}") from None
    if status == 404:
        raise SetupError("GitHub does not know this code: it works once and for an hour only. "
                         "Nothing was stored; start again at /setup (an App GitHub created "
                         "meanwhile can be deleted in its settings).")
    if status != 201 or not isinstance(body, dict):
        message = body.get("message") if isinstance(body, dict) else None
        raise SetupError(f"GitHub answered {status} to the code's conversion"
                         + (f": {message}" if isinstance(message, str) else ""))
    return body


def _files(conversion: Mapping[str, Any]) -> dict[str, str]:
    """What to write, checked first, so that a bad answer writes nothing."""
    app_id = conversion.get("id")
    pem = conversion.get("pem")
    if not isinstance(app_id, int) or isinstance(app_id, bool) or not isinstance(pem, str):
        raise SetupError("GitHub's answer has no App id or private key: nothing was stored")
    try:
        PrivateKey(pem, source="the private key GitHub sent")
    except SettingsError as exc:
        raise SetupError(f"{exc}: nothing was stored") from None

    def text(key: str) -> str | None:
        value = conversion.get(key)
        return value if isinstance(value, str) and value else None

    owner = conversion.get("owner")
    record = {"id": app_id, "slug": text("slug"), "name": text("name"),
              "html_url": text("html_url"), "client_id": text("client_id"),
              "owner": owner.get("login") if isinstance(owner, dict) else None}
    files = {"app.json": json.dumps(record, indent=2) + "\n",
             "private-key.pem": pem if pem.endswith("\n") else pem + "\n"}
    for name, key in (("webhook-secret", "webhook_secret"), ("client-secret", "client_secret")):
        value = text(key)
        if value is not None:
            files[name] = value + "\n"
    return files


def _refuse_existing(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SetupError(f"{folder} already holds an App: move that folder away (or delete it) "
                         "to register another")


def _write_private(path: Path, text: str) -> None:
    # Created 0600, so never briefly readable by others whatever the umask; O_EXCL and
    # O_NOFOLLOW: never through a file or link that was already there.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store_credentials(data_dir: Path, conversion: Mapping[str, Any]) -> Path:
    """Write the App's credentials under ``data_dir/github-app/`` (files 0600, the folder 0700)
    and return that folder. The files are written in a private staging folder renamed into
    place, so a reader sees the whole App or none; an App already there is never overwritten
    (SetupError naming the folder)."""
    folder = app_dir(data_dir)
    files = _files(conversion)
    _refuse_existing(folder)
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".github-app-", dir=data_dir))
    except OSError as exc:
        raise SetupError(f"cannot write under {data_dir}: {exc.strerror}") from None
    try:
        os.chmod(staging, 0o700)
        for name, text in files.items():
            _write_private(staging / name, text)
        _fsync_dir(staging)
        try:
            # Atomic; fails on a non-empty folder (another callback stored an App meanwhile).
            os.rename(staging, folder)
        except OSError:
            _refuse_existing(folder)
            raise
        _fsync_dir(data_dir)
    except OSError as exc:
        raise SetupError(f"cannot write {folder}: {exc.strerror}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


# -- the pages -------------------------------------------------------------------------------

async def _refused(request: web.Request, status: int, title: str, message: str
                   ) -> web.Response:
    return await render("setup_error.html", request, {"title": title, "message": message},
                        status=status)


async def _closed(request: web.Request, settings: Settings) -> web.Response:
    configured = app_configured(settings)
    log.warning("web: %s refused: not the operator's session (%s)", request.path,
                "an App is configured" if configured else "no App yet")
    return await _refused(request, 403, "Setup needs the operator's token",
                          "This page registers the GitHub App this deployment runs as, so it "
                          "is the operator's"
                          + (" (this deployment already has a GitHub App)" if configured
                             else "") + ". " + WHERE_THE_LINK_IS)


def add_setup_routes(app: web.Application, settings: Settings) -> None:
    """``GET /setup`` and ``GET /setup/callback``; ``bot.web.pages.install_templates`` must
    have run on ``app`` (templates and sessions)."""
    folder = app_dir(settings.data_dir)

    async def setup_page(request: web.Request) -> web.Response:
        if not await setup_allowed(request):
            return await _closed(request, settings)
        session = await aiohttp_session.get_session(request)
        state = session.get(STATE)
        if not isinstance(state, str):
            state = session[STATE] = secrets.token_urlsafe(24)
        # What the form typed counts only with its CSRF token: a link from elsewhere must not
        # point the manifest's webhook at another host.
        typed_ok = hmac.compare_digest(request.query.get("csrf", ""), await csrf_token(request))
        org = (request.query.get("org", "").strip() or None) if typed_ok else None
        typed = request.query.get("url", "").strip() if typed_ok else ""
        default_base = settings.public_url or str(request.url.origin())
        context: dict[str, Any] = {
            "org": org or "", "base_url": typed or default_base, "folder": str(folder),
            "stored": stored_app_exists(settings.data_dir),
            "from_environment": settings.credentials_source == "environment",
            "public_url_set": settings.public_url is not None, "error": None, "action": None,
            "manifest_json": None, "manifest_pretty": None, "local": False,
        }
        try:
            if org is not None and not _ORG.fullmatch(org):
                raise SetupError(f"{org!r} is not a GitHub organisation name")
            base = public_base(typed or default_base)
            # GitHub sends the browser back to where it is now, unless that is the deployment
            # itself (its public URL has the scheme a proxy in front may hide from us).
            here = request.url.origin()
            back = base if urlsplit(base).hostname == (here.host or "").lower() \
                else str(here)
            manifest = build_manifest(project_path(APP_YML), base, back)
        except SetupError as exc:
            context["error"] = str(exc)
            return await render("setup.html", request, context, status=400)
        context.update(base_url=base, local=is_local(base),
                       action=new_app_url(settings.github_web_url, state, org),
                       manifest_json=json.dumps(manifest),
                       manifest_pretty=json.dumps(manifest, indent=2))
        return await render("setup.html", request, context)

    async def callback(request: web.Request) -> web.Response:
        if not await setup_allowed(request):
            return await _closed(request, settings)
        session = await aiohttp_session.get_session(request)
        expected = session.get(STATE)
        given = request.query.get("state", "")
        if not isinstance(expected, str) or \
                not hmac.compare_digest(expected.encode(), given.encode()):
            log.warning("web: /setup/callback refused: its state does not match this browser's "
                        "session")
            return await _refused(request, 400, "This registration was not started here",
                            "The callback's state does not match the one /setup gave this "
                            "browser (another browser, an expired session, or a forged link). "
                            "Nothing was stored: start again at /setup.")
        code = request.query.get("code", "")
        if not code:
            return await _refused(request, 400, "No code from GitHub",
                            "GitHub sends a code with this callback; there is none. Nothing was "
                            "stored: start again at /setup.")
        try:
            # Before the code is spent: GitHub hands the credentials out once.
            _refuse_existing(folder)
        except SetupError as exc:
            return await _refused(request, 409, "An App is already stored", str(exc))
        try:
            async with aiohttp.ClientSession() as http:
                conversion = await convert(http, settings.github_url, code)
        except SetupError as exc:
            log.warning("web: /setup/callback: the code's conversion failed: %s", exc)
            return await _refused(request, 502, "GitHub did not give the App's credentials",
                                  str(exc))
        html_url = conversion.get("html_url")
        made = f"GitHub created the App ({html_url}), but " if isinstance(html_url, str) else ""
        try:
            stored = await asyncio.to_thread(store_credentials, settings.data_dir, conversion)
        except SetupError as exc:
            log.error("web: /setup/callback: the new App's credentials were not stored: %s", exc)
            return await _refused(request, 500, "The App's credentials were not stored",
                            f"{made}{exc}. Generate a private key on the App's settings page "
                            "and set the variables the README lists, or delete the App there "
                            "and start again at /setup.")
        session.pop(STATE, None)
        app_id, slug = conversion.get("id"), conversion.get("slug")
        log.info("web: /setup registered the App %s (id %s); its credentials are in %s",
                 slug, app_id, stored)
        return await render("setup_done.html", request, {
            "folder": str(stored), "files": {name: FILES[name] for name in FILES
                                             if (stored / name).exists()},
            "app_id": app_id, "slug": slug, "client_id": conversion.get("client_id"),
            "html_url": html_url if isinstance(html_url, str) else None,
            "install_url": f"{html_url}/installations/new" if isinstance(html_url, str)
            else None,
            "from_environment": settings.credentials_source == "environment",
        })

    app.router.add_get("/setup", setup_page)
    app.router.add_get("/setup/callback", callback)

