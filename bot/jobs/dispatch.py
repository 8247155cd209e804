"""From a job to the features: each feature module has its own ``gidgethub.routing.Router``;
``dispatch`` runs every callback for an event itself, isolated, because ``Router.dispatch`` stops
at the first exception."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.features import ROUTERS
from bot.features.context import Context

log = logging.getLogger("dejafix.handlers")


def wants(event: str, payload: dict[str, Any], routers: Iterable[Router] = ROUTERS) -> bool:
    """Whether any feature takes this event and action."""
    probe = Event(payload, event=event, delivery_id="probe")
    return any(router.fetch(probe) for router in routers)


class HandlerFailures(Exception):
    """One or more handlers failed; the others ran. The job is retried."""

    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__("; ".join(describe_error(e) for e in errors))
        self.errors = errors
        # The first failure's traceback is the one logged when the job gives up.
        self.__cause__ = errors[0] if errors else None


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
    idempotent: comments are upserts). The worker logs the failure: one WARNING line per attempt,
    the traceback once, when the job gives up."""
    errors: list[BaseException] = []
    ran = 0
    for router in routers:
        for callback in router.fetch(event):
            ran += 1
            try:
                await callback(event, ctx)
            except Exception as exc:
                # The worker logs the job's failure (one line); here only which handler.
                log.debug("delivery %s: handler %s failed: %s", event.delivery_id,
                          getattr(callback, "__qualname__", callback), describe_error(exc))
                errors.append(exc)
    if errors:
        raise HandlerFailures(errors)
    return ran
