"""Handlers: the only place where GitHub calls, the store and the matcher meet.

Each feature module has its own ``gidgethub.routing.Router``; ``dispatch`` runs every callback
for an event itself, isolated, because ``Router.dispatch`` stops at the first exception.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.handlers import commands, config_check, known_fix, learning
from bot.handlers.context import Context

log = logging.getLogger("dejafix.handlers")

ROUTERS: tuple[Router, ...] = (
    known_fix.router, learning.router, commands.router, config_check.router,
)


def wants(event: str, payload: dict[str, Any], routers: Iterable[Router] = ROUTERS) -> bool:
    """Whether any handler takes this event and action."""
    probe = Event(payload, event=event, delivery_id="probe")
    return any(router.fetch(probe) for router in routers)


class HandlerFailures(Exception):
    """One or more handlers failed; the others ran. The job is retried."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__("; ".join(describe_error(e) for e in errors))
        self.errors = errors


def describe_error(exc: BaseException) -> str:
    """One line an operator can act on: the type, GitHub's status if any, and the message."""
    status = getattr(exc, "status_code", None)
    text = str(exc) or "(no message)"
    if isinstance(exc, TimeoutError):
        text = "no answer from GitHub in time"
    return f"{type(exc).__name__}" + (f" {int(status)}" if status is not None else "") + \
        f": {text}"


async def dispatch(event: Event, ctx: Context, routers: Iterable[Router] = ROUTERS) -> int:
    """Run every matching callback; returns how many ran. Raises HandlerFailures afterwards if
    any failed, so the job is retried while the ones that succeeded stay done (they are
    idempotent: comments are upserts)."""
    errors: list[BaseException] = []
    ran = 0
    for router in routers:
        for callback in router.fetch(event):
            ran += 1
            try:
                await callback(event, ctx)
            except Exception as exc:
                log.exception("delivery %s: handler %s failed", event.delivery_id,
                              getattr(callback, "__qualname__", callback))
                errors.append(exc)
    if errors:
        raise HandlerFailures(errors)
    return ran
