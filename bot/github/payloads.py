"""The parts of webhook payloads the handlers read, validated. GitHub's payloads are large and
change over time, so unknown fields are ignored; a missing or wrong-typed field the bot needs
makes the delivery a clear skip (logged with its delivery id), never a crash or a retry loop."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import from_json


def iso_seconds(stamp: Any) -> float | None:
    """GitHub's ISO 8601 time (``2026-06-24T19:04:21Z``) as epoch seconds; None when absent or
    unreadable."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_json(data: bytes | str) -> Any:
    """A delivery's JSON, parsed by pydantic-core's parser (already here for pydantic): a 13 kB
    ``issues`` payload in half the time of ``json.loads``, which the receiver spends on every
    request. What it refuses but the standard library reads (a lone surrogate escape, nesting
    deeper than 200, UTF-16 or UTF-32 bytes) goes to ``json.loads``, so the bot accepts exactly
    what it accepted before; the errors raised are the standard library's
    (``json.JSONDecodeError``, ``UnicodeDecodeError``, ``RecursionError``)."""
    try:
        return from_json(data)
    except ValueError:
        return json.loads(data)

# What the matcher reads of an issue. Titles are at most 256 characters on GitHub and bodies
# 65,536; a forged or future payload with more is cut, so one delivery cannot hold a worker.
MAX_TITLE = 1024
MAX_BODY = 65536


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class User(_Lenient):
    login: str = ""
    type: str = "User"


class Label(_Lenient):
    name: str = ""


class Issue(_Lenient):
    # GitHub's numbers are small; the bound keeps a forged one storable (SQLite INTEGER).
    number: int = Field(gt=0, lt=2**63)
    title: str = ""
    body: str | None = None
    state: str = "open"
    user: User = Field(default_factory=User)
    labels: list[Label] = Field(default_factory=list)
    pull_request: dict[str, object] | None = None

    @property
    def is_pull_request(self) -> bool:
        return self.pull_request is not None

    @property
    def clipped_title(self) -> str:
        return self.title[:MAX_TITLE]

    @property
    def clipped_body(self) -> str:
        return (self.body or "")[:MAX_BODY]


class IssuesEvent(_Lenient):
    action: str
    issue: Issue
    sender: User = Field(default_factory=User)
    changes: dict[str, object] = Field(default_factory=dict)


def describe(exc: ValidationError) -> str:
    """One line naming each bad field, for the log."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
    )
