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
import cachetools
import gidgethub
from aiohttp import web
from aiohttp_session.cookie_storage import EncryptedCookieStorage
from cryptography.fernet import Fernet

from bot.features.commands import TRIAGE_ROLES
from bot.features.context import Services
from bot.features.preview import installation_of
from bot.github.client import RepoClient
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


class _Cookies(EncryptedCookieStorage):
    """The session cookie, ``Secure`` on each response that went over https: directly, or
    through the proxy of an https ``DEJAFIX_PUBLIC_URL``. Not on the operator's direct http
    request to loopback, where a browser would drop it (and the sign-in or setup state with
    it)."""

    def __init__(self, key: bytes, https_public: bool) -> None:
        # A Fernet, not the key: given bytes, aiohttp-session base64-encodes them once more.
        super().__init__(Fernet(key), cookie_name=COOKIE, httponly=True, samesite="Lax",
                         max_age=SESSION_SECONDS)
        self._https_public = https_public

    async def save_session(self, request: web.Request, response: web.StreamResponse,
                           session: aiohttp_session.Session) -> None:
        # No await before the cookie is written: no other request runs in between.
        self._cookie_params["secure"] = request.secure or (
            self._https_public and not is_loopback(request))
        await super().save_session(request, response, session)


def install_sessions(app: web.Application, settings: Settings) -> None:
    https_public = (settings.public_url or "").startswith("https://")
    aiohttp_session.setup(app, _Cookies(session_key(settings), https_public))


# Headers a proxy adds: a request carrying any came through one, whatever its peer address.
PROXY_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP", "X-Forwarded-Host",
                 "X-Forwarded-Proto", "Via")
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_loopback(request: web.Request) -> bool:
    """A request from this machine, to this machine by name, not relayed. The peer address
    alone is not enough: a proxy on the same host makes every visitor look local (so any proxy
    header disqualifies), and a page on another site can reach 127.0.0.1 through DNS
    rebinding, which its Host header gives away."""
    if any(name in request.headers for name in PROXY_HEADERS):
        return False
    host = (request.host or "").lower()
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if name not in LOCAL_HOSTS and host not in LOCAL_HOSTS:
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


class TokenRefused(Exception):
    """GitHub no longer accepts the signed-in user's token (expired or revoked)."""


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in GitHub user, or the operator on loopback (no sign-in)."""

    login: str | None
    token: str | None = None

    @property
    def operator(self) -> bool:
        return self.login is None


class Access:
    """Whether a viewer may see a repository: the operator always; a signed-in user when GitHub
    shows them the repository (a private one answers 404 to anyone else) and gives them triage
    or more on it, read as the App's installation. Answers are cached for ``ttl`` seconds, so a
    removed collaborator loses the page within minutes."""

    def __init__(self, ttl: float = 120.0) -> None:
        # (login, repo lower) -> "ok" | "forbidden" | "hidden"
        self._answers: cachetools.TTLCache[tuple[str, str], str] = cachetools.TTLCache(
            maxsize=10_000, ttl=ttl)

    def forget(self, login: str) -> None:
        for key in [k for k in list(self._answers) if k[0] == login.lower()]:
            self._answers.pop(key, None)

    async def check(self, services: Services, viewer: Viewer, repo: str) -> str:
        if viewer.operator:
            return "ok"
        assert viewer.login is not None and viewer.token is not None
        key = (viewer.login.lower(), repo.lower())
        cached = self._answers.get(key)
        if cached is None:
            cached = self._answers[key] = await self._ask(services, viewer, repo)
        return cached

    @staticmethod
    async def _ask(services: Services, viewer: Viewer, repo: str) -> str:
        assert viewer.token is not None and viewer.login is not None
        try:
            await services.github.as_user(viewer.token).getitem("/repos/{+repo}",
                                                                {"repo": repo})
        except gidgethub.BadRequest as exc:
            if exc.status_code == 401:
                raise TokenRefused() from exc
            if exc.status_code in (403, 404):
                return "hidden"
            raise
        installation = await installation_of(services, repo)
        if installation is None:
            return "hidden"  # Dejafix is not installed there: it has nothing to show
        gh = await services.github.for_installation(installation)
        role = await RepoClient(gh, repo).collaborator_permission(viewer.login)
        return "ok" if role in TRIAGE_ROLES else "forbidden"
