"""A feed's conditional GET, bounded: the operator's feeds (``bot.jobs.feeds``) and the feeds a
repository lists under ``clusters:`` (``repo_clusters``) are fetched the same way."""

from __future__ import annotations

import aiohttp

ACCEPT = "application/x-ndjson, application/jsonl, */*"


class FetchRefused(Exception):
    """An answer that is not a feed's body: an error status, or larger than the bound."""


async def fetch_bounded(session: aiohttp.ClientSession, url: str, *, etag: str | None,
                        limit: int, timeout: float, redirects: bool = True
                        ) -> tuple[bytes | None, str | None]:
    """``(body, etag)``; ``body`` None when the server says it is unchanged (304, ``etag``
    sent). Raises FetchRefused, or aiohttp's and the socket's errors as they come (their text
    may carry the URL: the caller decides what of it to show)."""
    headers = {"Accept": ACCEPT}
    if etag:
        headers["If-None-Match"] = etag
    async with session.get(url, headers=headers, allow_redirects=redirects,
                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status == 304:
            return None, etag
        if resp.status != 200:
            raise FetchRefused(f"HTTP {resp.status}")
        if (resp.content_length or 0) > limit:
            raise FetchRefused(f"larger than {limit} bytes")
        data = await resp.content.read(limit + 1)
        if len(data) > limit:
            raise FetchRefused(f"larger than {limit} bytes")
        return data, resp.headers.get("ETag")
