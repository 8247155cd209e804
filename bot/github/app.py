"""The App's identity: its JWT, installation tokens (cached until shortly before they expire),
and one gidgethub client per installation over the process's single ``ClientSession``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import MutableMapping
from datetime import datetime
from typing import Any

import aiohttp
import cachetools
import jwt

from bot.github.client import USER_AGENT, RetryingGitHubAPI, RetryPolicy
from bot.metrics import Metrics
from bot.settings import PrivateKey

log = logging.getLogger("dejafix.github")

# Refresh a token this long before GitHub says it expires, so a job never starts with a token
# that dies halfway through.
TOKEN_REFRESH_MARGIN = 300.0


def _expiry_epoch(expires_at: str) -> float:
    return datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()


class GitHubApp:
    """Everything that needs the App's identity. One per process."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        base_url: str,
        app_id: str | None,
        private_key: PrivateKey | None,
        max_installations: int = 10_000,
        retry: RetryPolicy | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.metrics = metrics
        self.session = session
        self.base_url = base_url
        self.app_id = app_id
        self._key = private_key
        # Per-entry lifetime: each token lives until its own expires_at minus the margin.
        self._tokens: cachetools.TLRUCache[int, tuple[str, float]] = cachetools.TLRUCache(
            maxsize=max_installations, ttu=self._token_deadline, timer=time.time
        )
        self._locks: dict[int, asyncio.Lock] = {}
        # Conditional GETs: a 304 costs no rate limit, so repeated config reads are free.
        self._etag_cache: MutableMapping[Any, Any] = cachetools.LRUCache(maxsize=2048)
        self._jwt: tuple[str, int] | None = None

    @staticmethod
    def _token_deadline(_key: int, value: tuple[str, float], _now: float) -> float:
        return value[1] - TOKEN_REFRESH_MARGIN

    @property
    def authenticated(self) -> bool:
        return self.app_id is not None and self._key is not None

    def _client(self, token: str | None) -> RetryingGitHubAPI:
        return RetryingGitHubAPI(
            self.session,
            USER_AGENT,
            oauth_token=token,
            base_url=self.base_url,
            cache=self._etag_cache,
            retry=self.retry,
            metrics=self.metrics,
        )

    def as_user(self, token: str) -> RetryingGitHubAPI:
        """A client acting as a signed-in user (the web page's user-to-server token)."""
        return self._client(token)

    def app_jwt(self) -> str:
        """The App's JWT (RS256, GitHub's ten-minute maximum less a minute of clock skew
        either side), signed once and reused until a minute before it expires: minting a new
        one per token request held the event loop for the PEM's parse."""
        if self.app_id is None or self._key is None:
            raise RuntimeError("no App credentials configured")
        now = int(time.time())
        if self._jwt is not None and self._jwt[1] - 60 > now:
            return self._jwt[0]
        expires = now + 540
        token = jwt.encode({"iat": now - 60, "exp": expires, "iss": self.app_id},
                           self._key.signing_key(), algorithm="RS256")
        self._jwt = (token, expires)
        return token

    async def installation_token(self, installation_id: int) -> str:
        cached = self._tokens.get(installation_id)
        if cached is not None:
            return cached[0]
        lock = self._locks.setdefault(installation_id, asyncio.Lock())
        async with lock:
            # Another task may have fetched it while this one waited for the lock.
            cached = self._tokens.get(installation_id)
            if cached is not None:
                return cached[0]
            if self.app_id is None or self._key is None:
                raise RuntimeError("no App credentials configured")
            response = await self._client(None).post(
                "/app/installations/{installation_id}/access_tokens",
                url_vars={"installation_id": str(installation_id)}, data=b"",
                jwt=self.app_jwt())
            token = str(response["token"])
            self._tokens[installation_id] = (token, _expiry_epoch(str(response["expires_at"])))
            log.info("installation %s: new token, expires %s", installation_id,
                     response["expires_at"])
            return token

    def forget_token(self, installation_id: int) -> None:
        """Drop a token GitHub refused (revoked, or the installation was removed)."""
        self._tokens.pop(installation_id, None)

    async def for_installation(self, installation_id: int | None) -> RetryingGitHubAPI:
        """A client acting as the installation; anonymous when the App has no credentials
        (dry-run on public repositories)."""
        if installation_id is None or not self.authenticated:
            return self._client(None)
        return self._client(await self.installation_token(installation_id))

    async def installation_for(self, repo: str) -> int:
        """The installation id of this App on a repository (for one-off commands)."""
        data = await self._client(None).getitem("/repos/{+repo}/installation", {"repo": repo},
                                                jwt=self.app_jwt())
        return int(data["id"])

    async def app_slug(self) -> str | None:
        if not self.authenticated:
            return None
        data = await self._client(None).getitem("/app", jwt=self.app_jwt())
        slug = data.get("slug")
        return str(slug) if slug else None
