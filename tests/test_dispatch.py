"""Handlers are isolated: one that raises does not stop the others for the same event."""

from __future__ import annotations

from typing import Any

import pytest
from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.jobs.dispatch import HandlerFailures, dispatch, wants


async def test_a_failing_handler_does_not_stop_the_others() -> None:
    ran: list[str] = []
    first, second = Router(), Router()

    @first.register("issues", action="opened")
    async def boom(event: Event, ctx: Any) -> None:
        ran.append("boom")
        raise RuntimeError("handler bug")

    @second.register("issues", action="opened")
    async def fine(event: Event, ctx: Any) -> None:
        ran.append("fine")

    event = Event({"action": "opened"}, event="issues", delivery_id="d-1")
    with pytest.raises(HandlerFailures) as info:
        await dispatch(event, None, routers=(first, second))  # type: ignore[arg-type]
    assert sorted(ran) == ["boom", "fine"]
    assert "RuntimeError: handler bug" in str(info.value)


async def test_no_failure_reports_how_many_ran() -> None:
    router = Router()

    @router.register("issues")
    async def one(event: Event, ctx: Any) -> None:
        return None

    event = Event({"action": "labeled"}, event="issues", delivery_id="d-2")
    assert await dispatch(event, None, routers=(router,)) == 1  # type: ignore[arg-type]


def test_wants_knows_the_handled_actions() -> None:
    assert wants("issues", {"action": "opened"})
    assert wants("pull_request", {"action": "closed"})
    assert not wants("issues", {"action": "labeled"})
    assert not wants("star", {"action": "created"})
