"""Group commit: many deliveries share a commit; each still learns whether it was new."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bot.intake import Intake
from bot.store import Claim, Delivery, Job, Store


def _delivery(i: int, installation: int | None = 1) -> tuple[str, str, str, str, int | None,
                                                             bytes]:
    return (f"d-{i}", "issues", "opened", "o/r", installation, b'{"x": 1}')


async def test_concurrent_deliveries_share_commits_and_duplicates_are_caught(
        tmp_path: Path) -> None:
    store = Store(tmp_path)
    batches: list[int] = []
    original = store.commit_round

    def counting(deliveries: list[Delivery], completed: list[int], claim: Claim | None
                 ) -> tuple[list[bool], list[bool], list[Job]]:
        batches.append(len(deliveries))
        return original(deliveries, completed, claim)

    store.commit_round = counting  # type: ignore[method-assign]
    intake = Intake(store)
    results = await asyncio.gather(*(intake.accept(_delivery(i % 150)) for i in range(300)))
    assert sum(results) == 150  # each id new exactly once, whatever batch it fell in
    assert store.pending_count() == 150
    assert sum(batches) == 300 and len(batches) < 300  # commits were shared
    store.close()


async def test_a_bad_row_fails_alone(tmp_path: Path) -> None:
    store = Store(tmp_path)
    intake = Intake(store)
    good, bad = _delivery(1), _delivery(2, installation=2**70)  # beyond SQLite INTEGER
    results = await asyncio.gather(intake.accept(good), intake.accept(bad),
                                   return_exceptions=True)
    assert results[0] is True
    assert isinstance(results[1], OverflowError)
    assert store.pending_count() == 1
    store.close()


async def test_a_cancelled_request_does_not_lose_the_others(tmp_path: Path) -> None:
    store = Store(tmp_path)
    intake = Intake(store)
    first = asyncio.create_task(intake.accept(_delivery(1)))
    second = asyncio.create_task(intake.accept(_delivery(2)))
    await asyncio.sleep(0)
    first.cancel()
    assert await second is True
    with pytest.raises(asyncio.CancelledError):
        await first
    # The cancelled caller's delivery was still committed: GitHub may not have seen the 202,
    # and a redelivery will be recognised.
    for _ in range(100):
        if store.pending_count() == 2:
            break
        await asyncio.sleep(0.01)
    assert store.pending_count() == 2
    store.close()
