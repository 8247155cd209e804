"""Who may see the web page: GitHub sign-in (the App's OAuth client, a user-to-server token),
triage permission per repository asked of GitHub and cached briefly, sessions in an encrypted,
signed, HttpOnly, SameSite cookie, and a CSRF token on every form. Without OAuth settings the
page is the operator's, on loopback only."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import aiohttp_session
from aiohttp import web
from aiohttp_session.cookie_storage import EncryptedCookieStorage

from bot.settings import Settings

log = logging.getLogger("dejafix.web")

COOKIE = "dejafix_session"
# A session lasts a working day; the permission behind it is asked again every few minutes.
SESSION_SECONDS = 12 * 3600


def session_key(settings: Settings) -> bytes:
    """The cookie's Fernet key: from DEJAFIX_SESSION_SECRET, else from the OAuth client secret
    (every instance of a deployment then reads the others' cookies), else random for this
    process (the operator's loopback page, whose session only carries CSRF and setup state)."""
    if settings.session_secret is not None:
        material = settings.session_secret.get_secret_value().encode()
    elif settings.oauth_client_secret is not None:
        material = b"dejafix-session:" + settings.oauth_client_secret.get_secret_value().encode()
    else:
        material = secrets.token_bytes(32)
    return base64.urlsafe_b64encode(hashlib.sha256(material).digest())


def install_sessions(app: web.Application, settings: Settings) -> None:
    secure = (settings.public_url or "").startswith("https://")
    storage = EncryptedCookieStorage(session_key(settings), cookie_name=COOKIE, httponly=True,
                                     samesite="Lax", secure=secure, max_age=SESSION_SECONDS)
    aiohttp_session.setup(app, storage)


def is_loopback(request: web.Request) -> bool:
    """A request from this machine, not relayed: a proxy on the same host would make every
    visitor look local, so a forwarded request never counts."""
    if "X-Forwarded-For" in request.headers or "Forwarded" in request.headers:
        return False
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


async def csrf_token(request: web.Request) -> str:
    """The session's CSRF token, made on first use; every form carries it."""
    session = await aiohttp_session.get_session(request)
    token = session.get("csrf")
    if not isinstance(token, str):
        token = session["csrf"] = secrets.token_urlsafe(24)
    return token


async def check_csrf(request: web.Request) -> dict[str, Any]:
    """The posted form, once its CSRF token matches the session's; 403 otherwise."""
    form = dict(await request.post())
    session = await aiohttp_session.get_session(request)
    expected = session.get("csrf")
    given = form.get("csrf")
    if not isinstance(expected, str) or not isinstance(given, str) or \
            not hmac.compare_digest(expected, given):
        log.warning("web: %s %s refused: the form's CSRF token is missing or wrong",
                    request.method, request.path)
        raise web.HTTPForbidden(text="This form is out of date or was not sent by this page: "
                                     "reload the page and try again.")
    return form


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in GitHub user, or the operator on loopback (no sign-in)."""

    login: str | None
    token: str | None = None

    @property
    def operator(self) -> bool:
        return self.login is None
