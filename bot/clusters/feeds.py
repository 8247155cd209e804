"""Cluster feeds, the pure part: a feed's body (JSON Lines in the seed schema) checked line by
line, and how a feed's URL is named in logs. Polling and storing them is ``bot.jobs.feeds``."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from bot.clusters.load import validate_line


def shown(url: str) -> str:
    """The feed's URL as logs and problems name it: without a password or a query, where a
    tracker's access token would be."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(frozen=True)
class Parsed:
    """A feed's valid lines (joined, as stored), how many, and the problems of the others."""

    body: str
    clusters: int
    problems: list[str]


def parse_feed(url: str, data: bytes) -> Parsed:
    """``url`` names the feed in the problems (``URL:line: field: message``)."""
    url = shown(url)
    good: list[str] = []
    problems: list[str] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        cluster, errors = validate_line(raw, url, number)
        if cluster is None:
            problems.extend(str(e) for e in errors)
        else:
            problems.extend(str(e) for e in errors if e.level == "warning")
            good.append(raw.decode("utf-8", "replace").strip())
    return Parsed("\n".join(good) + ("\n" if good else ""), len(good), problems)
