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


class RecordingClaimer:
    """The worker's side of the intake, recording the jobs it is given."""

    def __init__(self, claim: Claim | None) -> None:
        self.claim = claim
        self.taken: list[tuple[Job, dict[str, object] | None]] = []

    def claim_request(self) -> Claim | None:
        return self.claim

    def leased(self, count: int) -> None:
        pass

    def take(self, jobs: list[tuple[Job, dict[str, object] | None]]) -> None:
        self.taken += jobs

    def claim_failed(self, exc: Exception) -> None:
        raise AssertionError(f"claim failed: {exc}")


async def test_a_job_gets_the_payload_parsed_from_its_own_body_and_no_other(
        tmp_path: Path) -> None:
    store = Store(tmp_path)
    intake = Intake(store)
    claimer = RecordingClaimer(Claim(60, 1, fresh_extra=10))
    intake.claimer = claimer
    original, other = b'{"n": 1}', b'{"n": 2}'
    # Recorded, redelivered with another body and leased, all in one round: the job is the
    # first delivery's, with what was parsed from its body.
    fresh = await asyncio.gather(
        intake.accept(("d-1", "issues", "opened", "o/r", 1, original), parsed={"n": 1}),
        intake.accept(("d-1", "issues", "opened", "o/r", 1, other), parsed={"n": 2}))
    assert fresh == [True, False]
    await intake.flush()
    [(job, parsed)] = claimer.taken
    assert (job.delivery_id, job.payload, parsed) == ("d-1", original, {"n": 1})

    # Recorded while the worker had no room; leased later, in the round of a redelivery: the
    # job reads its stored body (nothing parsed is handed over with it).
    claimer.claim = None
    assert await intake.accept(("d-2", "issues", "opened", "o/r", 1, b'{"n": 3}'),
                               parsed={"n": 3})
    await intake.flush()
    claimer.claim = Claim(60, 1, fresh_extra=10)
    assert not await intake.accept(("d-2", "issues", "opened", "o/r", 1, b'{"forged": 1}'),
                                   parsed={"forged": 1})
    await intake.flush()
    job, parsed = claimer.taken[-1]
    assert (job.delivery_id, job.payload, parsed) == ("d-2", b'{"n": 3}', None)
    store.close()


async def test_finished_jobs_and_new_deliveries_share_a_round(tmp_path: Path) -> None:
    store = Store(tmp_path)
    intake = Intake(store)
    claimer = RecordingClaimer(Claim(60, 4))
    intake.claimer = claimer
    assert await intake.accept(_delivery(1))
    await intake.flush()
    [(job, _)] = claimer.taken
    rounds: list[tuple[int, int]] = []
    original = store.commit_round

    def counting(deliveries: list[Delivery], completed: list[int], claim: Claim | None
                 ) -> tuple[list[bool], list[bool], list[Job]]:
        rounds.append((len(deliveries), len(completed)))
        return original(deliveries, completed, claim)

    store.commit_round = counting  # type: ignore[method-assign]
    done = intake.complete(job.id)
    assert await intake.accept(_delivery(2))
    assert await done is True
    assert rounds == [(1, 1)]
    assert [j.delivery_id for j, _ in claimer.taken] == ["d-1", "d-2"]
    store.close()


async def test_a_failing_claimer_does_not_hold_up_the_deliveries(tmp_path: Path) -> None:
    class Broken(RecordingClaimer):
        def claim_request(self) -> Claim | None:
            raise RuntimeError("a bug in the worker")

    store = Store(tmp_path)
    intake = Intake(store)
    intake.claimer = Broken(None)
    assert await asyncio.wait_for(intake.accept(_delivery(1)), timeout=10) is True
    assert store.pending_count() == 1  # recorded, left queued for a later claim
    store.close()
