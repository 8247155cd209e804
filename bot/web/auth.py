"""Who may see the web page: GitHub sign-in (the App's OAuth client, a user-to-server token),
triage permission per repository asked of GitHub and cached briefly, sessions in an encrypted,
signed, HttpOnly, SameSite cookie, and a CSRF token on every form. The operator is whoever holds
the operator token: a secret made at first start in the data directory (0600), printed once per
start as a link, exchanged for a session. Never the peer's address: a proxy on the same host
makes every visitor look local."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
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
from bot.logs import quiet_bad_requests
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
    """The session cookie, ``Secure`` on each response that went over https, and on every
    response when ``DEJAFIX_PUBLIC_URL`` is https: a request that looks local may be a
    same-host proxy's that rewrote Host to 127.0.0.1, and its visitor's cookie must not travel
    over http. Browsers keep a Secure cookie from http://127.0.0.1 and http://localhost (a
    secure context), so the operator's direct loopback page still works."""

    def __init__(self, key: bytes, https_public: bool) -> None:
        # A Fernet, not the key: given bytes, aiohttp-session base64-encodes them once more.
        super().__init__(Fernet(key), cookie_name=COOKIE, httponly=True, samesite="Lax",
                         max_age=SESSION_SECONDS)
        self._https_public = https_public

    async def save_session(self, request: web.Request, response: web.StreamResponse,
                           session: aiohttp_session.Session) -> None:
        # No await before the cookie is written: no other request runs in between.
        self._cookie_params["secure"] = request.secure or self._https_public
        await super().save_session(request, response, session)


def install_sessions(app: web.Application, settings: Settings) -> None:
    """The session cookie, and the operator token's exchange for an operator session (read
    from the data directory at start-up, made there on the first)."""
    https_public = (settings.public_url or "").startswith("https://")
    aiohttp_session.setup(app, _Cookies(session_key(settings), https_public))
    operator = app[OPERATOR] = OperatorToken(settings.data_dir)

    async def load(app: web.Application) -> None:
        await asyncio.to_thread(operator.load)

    app.on_startup.append(load)
    app.middlewares.append(_token_exchange)
    quiet_bad_requests()  # and keep the token out of an access log


# -- the operator token ------------------------------------------------------------------------

OPERATOR_TOKEN_FILE = "operator-token"
# The session key holding a hash of the operator token the session was opened with.
OPERATOR_SESSION = "operator"
TOKEN_PARAM = "token"
# Where a refused visitor is told to look; never the file's absolute path (it tells a stranger
# about the host's layout).
WHERE_THE_LINK_IS = (
    "Open the operator link Dejafix printed in its start-up log (\"operator link: "
    "http://127.0.0.1:PORT/?token=...\"), or add ?token= with the contents of the file "
    f"{OPERATOR_TOKEN_FILE} in its data directory. Deleting that file and restarting makes a "
    "new token and signs every operator session out.")


def _refused(why: str) -> OSError:
    # The file's name, never its absolute path: the message reaches the log.
    return OSError(f"the operator token file {OPERATOR_TOKEN_FILE} in the data directory "
                   f"{why}: delete it and restart, and a new one is made")


def _read_token(path: Path) -> str | None:
    """The token file's contents, None when there is none. Only a regular file of ours that
    nobody else may read or write is trusted: a token someone else could plant, read or point
    elsewhere (a link to /etc/hostname) is no secret."""
    try:
        # Not following a link, and not waiting on a FIFO planted there.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # Linux, BSD: a symbolic link
            raise _refused("is a symbolic link") from None
        raise
    with os.fdopen(fd, encoding="utf-8", errors="replace") as file:
        found = os.fstat(file.fileno())
        if not stat.S_ISREG(found.st_mode):
            raise _refused("is not a regular file")
        if found.st_uid != os.getuid():
            raise _refused(f"belongs to another user (uid {found.st_uid})")
        if stat.S_IMODE(found.st_mode) & 0o077:
            raise _refused(f"is open to other users (mode {stat.S_IMODE(found.st_mode):03o})")
        return file.read().strip()


def read_or_make_token(data_dir: Path) -> str:
    """The operator token in ``data_dir``: created on first use with O_EXCL and mode 0600, so
    never briefly readable by others and never through a file or link already there; one found
    there is read only if it is a regular file of ours, mode 0600 or tighter. Blocking: call it
    in a thread. Never logged except in the start-up link."""
    path = data_dir / OPERATOR_TOKEN_FILE
    token = _read_token(path)
    if token:
        return token
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        # Another process made it first, or an empty file is there: theirs wins; an empty
        # one is refused rather than accepting an empty token.
        token = _read_token(path) or ""
        if not token:
            raise _refused("is empty") from None
        return token
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token


def token_hash(token: str) -> str:
    return hashlib.sha256(b"dejafix-operator:" + token.encode()).hexdigest()


class OperatorToken:
    """The operator token of this process, read once at start-up (``load``): deleting the file
    and restarting rotates it, and sessions opened with the old one no longer count."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._token: str | None = None
        self._hash: str | None = None

    def load(self) -> str:
        if self._token is None:
            self._token = read_or_make_token(self.data_dir)
            self._hash = token_hash(self._token)
        return self._token

    @property
    def token(self) -> str:
        """The token, for the start-up link only."""
        return self.load()

    def matches(self, given: str) -> bool:
        if self._token is None or not given:
            return False
        return hmac.compare_digest(given.encode(), self._token.encode())

    def session_is_operator(self, session: aiohttp_session.Session) -> bool:
        held = session.get(OPERATOR_SESSION)
        return self._hash is not None and isinstance(held, str) and \
            hmac.compare_digest(held, self._hash)

    def open_session(self, session: aiohttp_session.Session) -> None:
        assert self._hash is not None
        session[OPERATOR_SESSION] = self._hash


OPERATOR = web.AppKey("operator_token", OperatorToken)


# A path on this site: printable ASCII, no spaces (browsers and yarl drop tabs and
# newlines, which would turn "/\t/evil" into "//evil"), never "//" or "/\\" (another host).
_LOCAL = re.compile(r"/(?![/\\])[\x21-\x7e]*")


def local_path(target: str) -> str:
    """``target`` when it is a path on this site, else ``/``: where a sign-in or the operator
    token's exchange may send the browser."""
    return target if _LOCAL.fullmatch(target) else "/"


@web.middleware
async def _token_exchange(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """``GET any-page?token=T``: with the operator token, the session becomes the operator's
    and the browser is sent to the same URL without it, so that the token leaves the address
    bar, the history and any Referer. A wrong token is refused, and never logged."""
    if request.method not in ("GET", "HEAD") or TOKEN_PARAM not in request.query:
        return await handler(request)
    operator = request.app[OPERATOR]
    # "//evil.example/?token=T" is a path here, but "//evil.example/" in a Location is
    # another site: only a path of this site is sent back.
    clean = local_path(str(request.rel_url.without_query_params(TOKEN_PARAM)))
    if not operator.matches(request.query.get(TOKEN_PARAM, "")):
        log.warning("web: %s refused: its operator token is wrong", request.path)
        return web.Response(status=403, text="This link's operator token is not this "
                                             "deployment's (it changes when its file is "
                                             "deleted). " + WHERE_THE_LINK_IS,
                            headers={"Referrer-Policy": "no-referrer",
                                     "Cache-Control": "no-store"})
    session = await aiohttp_session.get_session(request)
    operator.open_session(session)
    log.info("web: an operator session was opened (%s)", request.path)
    raise web.HTTPFound(clean, headers={"Referrer-Policy": "no-referrer",
                                             "Cache-Control": "no-store"})


async def is_operator(request: web.Request) -> bool:
    """The request's session was opened with this process's operator token."""
    operator = request.app.get(OPERATOR)
    if operator is None:
        return False
    return operator.session_is_operator(await aiohttp_session.get_session(request))


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
    """Who is looking: a signed-in GitHub user, or the operator (the operator token's session)."""

    login: str | None
    token: str | None = None

    @property
    def operator(self) -> bool:
        return self.login is None


def _token_key(token: str) -> str:
    # The cache is keyed by the token, never by the login: a signed-out (revoked) copy of a
    # cookie, or a cookie whose login is not its token's, must not ride on another session's
    # answer. Hashed, so the cache holds no usable token.
    return hashlib.sha256(token.encode()).hexdigest()


class Access:
    """Whether a viewer may see a repository: the operator always; a signed-in user when the
    token's owner is the session's login, GitHub shows them the repository (a private one
    answers 404 to anyone else) and gives them triage or more on it, read as the App's
    installation. Answers are cached per token for ``ttl`` seconds, so a removed collaborator
    loses the page within minutes and a revoked token loses it at once."""

    def __init__(self, ttl: float = 120.0) -> None:
        # (token hash, repo lower) -> "ok" | "forbidden" | "hidden"
        self._answers: cachetools.TTLCache[tuple[str, str], str] = cachetools.TTLCache(
            maxsize=10_000, ttl=ttl)
        # token hash -> the login GitHub says owns it (lower case)
        self._owners: cachetools.TTLCache[str, str] = cachetools.TTLCache(
            maxsize=10_000, ttl=ttl)

    def forget(self, token: str) -> None:
        key = _token_key(token)
        self._owners.pop(key, None)
        for cached in [k for k in list(self._answers) if k[0] == key]:
            self._answers.pop(cached, None)

    def owned(self, token: str, login: str) -> None:
        """GitHub just said ``login`` owns ``token`` (the sign-in read ``/user`` with it)."""
        self._owners[_token_key(token)] = login.lower()

    async def check(self, services: Services, viewer: Viewer, repo: str) -> str:
        if viewer.operator:
            return "ok"
        assert viewer.login is not None and viewer.token is not None
        key = _token_key(viewer.token)
        owner = self._owners.get(key)
        if owner is None:
            owner = await self._owner(services, viewer.token)
        if owner != viewer.login.lower():
            log.warning("web: a session's login is not its token's owner: refused")
            raise TokenRefused()
        self._owners[key] = owner
        cached = self._answers.get((key, repo.lower()))
        if cached is None:
            cached = self._answers[(key, repo.lower())] = await self._ask(services, viewer,
                                                                          repo)
        return cached

    @staticmethod
    async def _owner(services: Services, token: str) -> str:
        try:
            user = await services.github.as_user(token).getitem("/user")
        except gidgethub.BadRequest as exc:
            if exc.status_code == 401:
                raise TokenRefused() from exc
            raise
        return str(user.get("login", "")).lower() if isinstance(user, dict) else ""

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
