"""GitHub access: App JWT, installation tokens (cached until shortly before they expire), one
gidgethub client per installation over the process's single ``ClientSession``, the retry policy,
and ``RepoClient``, the handful of calls the handlers make."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import MutableMapping
from datetime import datetime
from typing import Any

import aiohttp
import cachetools
import gidgethub
from gidgethub import apps
from gidgethub.aiohttp import GitHubAPI

from bot.settings import PrivateKey

log = logging.getLogger("dejafix.github")

USER_AGENT = "dejafix"
# Refresh a token this long before GitHub says it expires, so a job never starts with a token
# that dies halfway through.
TOKEN_REFRESH_MARGIN = 300.0
GET_RETRIES = 3


class RetryingGitHubAPI(GitHubAPI):
    """The retry policy, in one place: idempotent reads are retried on 5xx and on a rate limit
    that resets soon; writes never are, because a comment POST that reached GitHub but whose
    answer was lost would be posted twice."""

    max_rate_limit_wait = 60.0

    async def handle_rate_limit_error(
        self, *, method: str, url: str, exception: gidgethub.HTTPException, attempt: int
    ) -> bool:
        if method != "GET" or attempt >= GET_RETRIES:
            return False
        if isinstance(exception, gidgethub.GitHubBroken):
            await self.sleep(0.2 * 2**attempt)
            return True
        if isinstance(exception, gidgethub.RateLimitExceeded):
            wait = exception.rate_limit.reset_datetime.timestamp() - time.time()
            if 0 <= wait <= self.max_rate_limit_wait:
                await self.sleep(wait + 1)
                return True
        return False


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
    ) -> None:
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
        )

    def app_jwt(self) -> str:
        if self.app_id is None or self._key is None:
            raise RuntimeError("no App credentials configured")
        return apps.get_jwt(app_id=self.app_id, private_key=self._key.reveal())

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
            response = await apps.get_installation_access_token(
                self._client(None),
                installation_id=str(installation_id),
                app_id=self.app_id,
                private_key=self._key.reveal(),
            )
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

    async def app_slug(self) -> str | None:
        if not self.authenticated:
            return None
        data = await self._client(None).getitem("/app", jwt=self.app_jwt())
        slug = data.get("slug")
        return str(slug) if slug else None


class RepoClient:
    """The calls the handlers make on one repository."""

    def __init__(self, gh: GitHubAPI, repo: str) -> None:
        self.gh = gh
        self.repo = repo

    async def read_file(self, path: str) -> str | None:
        """A text file from the default branch, or None when it does not exist."""
        try:
            data = await self.gh.getitem(
                "/repos/{+repo}/contents/{+path}", {"repo": self.repo, "path": path}
            )
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return None
            raise
        if not isinstance(data, dict) or data.get("type") != "file":
            return None
        if data.get("encoding") == "base64":
            return base64.b64decode(data.get("content", "")).decode("utf-8", errors="replace")
        return str(data.get("content", ""))

    async def list_dir(self, path: str) -> list[str]:
        """Paths of the files in a folder of the default branch (empty when it does not exist)."""
        try:
            data = await self.gh.getitem(
                "/repos/{+repo}/contents/{+path}", {"repo": self.repo, "path": path}
            )
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return []
            raise
        if not isinstance(data, list):
            return []
        return [str(e["path"]) for e in data if isinstance(e, dict) and e.get("type") == "file"]

    async def issue_comments(self, number: int) -> list[dict[str, Any]]:
        url = "/repos/{+repo}/issues/{number}/comments?per_page=100"
        return [c async for c in self.gh.getiter(url, {"repo": self.repo, "number": number})]

    async def create_comment(self, number: int, body: str) -> int:
        data = await self.gh.post(
            "/repos/{+repo}/issues/{number}/comments",
            {"repo": self.repo, "number": number},
            data={"body": body},
        )
        return int(data["id"])

    async def edit_comment(self, comment_id: int, body: str) -> None:
        await self.gh.patch(
            "/repos/{+repo}/issues/comments/{comment_id}",
            {"repo": self.repo, "comment_id": comment_id},
            data={"body": body},
        )

    async def add_labels(self, number: int, labels: list[str]) -> None:
        await self.gh.post(
            "/repos/{+repo}/issues/{number}/labels",
            {"repo": self.repo, "number": number},
            data={"labels": labels},
        )


class DryRunRepoClient(RepoClient):
    """Reads like ``RepoClient``; every write is logged instead of sent."""

    async def create_comment(self, number: int, body: str) -> int:
        log.info("dry-run: would comment on %s#%s:\n%s", self.repo, number, body)
        return 0

    async def edit_comment(self, comment_id: int, body: str) -> None:
        log.info("dry-run: would edit comment %s on %s:\n%s", comment_id, self.repo, body)

    async def add_labels(self, number: int, labels: list[str]) -> None:
        log.info("dry-run: would label %s#%s with %s", self.repo, number, labels)


class OfflineRepoClient(DryRunRepoClient):
    """Dry-run without App credentials: nothing is read from GitHub either (private repositories
    would refuse, and a laptop may have no route to it), so every repository runs on defaults."""

    async def read_file(self, path: str) -> str | None:
        return None

    async def list_dir(self, path: str) -> list[str]:
        return []

    async def issue_comments(self, number: int) -> list[dict[str, Any]]:
        return []
