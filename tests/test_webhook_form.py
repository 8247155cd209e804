"""The receiver's form-encoded deliveries (the App's other content type): a form past the
field limit is the sender's mistake, answered 400 with its reason, and nothing is recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from urllib.parse import urlencode

from bot.web.app import SERVICES
from tests.conftest import BotFactory, issue_payload
from tests.samples import RESET_HANG

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _rows(path: object, delivery: str) -> tuple[int, int]:
    """(delivery rows, job rows) held for ``delivery`` in the SQLite file."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        deliveries = conn.execute("SELECT count(*) FROM deliveries WHERE delivery_id = ?",
                                  (delivery,)).fetchone()[0]
        jobs = conn.execute("SELECT count(*) FROM jobs WHERE delivery_id = ?",
                            (delivery,)).fetchone()[0]
    return int(deliveries), int(jobs)


async def test_a_signed_form_with_eleven_fields_is_a_400_with_a_reason(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    store_path = bot.app[SERVICES].store.path
    payload = json.dumps(issue_payload(**RESET_HANG))
    fields = [("payload", payload)] + [(f"extra{i}", "x") for i in range(10)]
    assert len(fields) == 11
    resp = await bot.deliver("issues", urlencode(fields).encode(), delivery="form-eleven",
                             headers=FORM)
    assert resp.status == 400
    assert "more than 10 fields" in (await resp.json())["error"]
    await bot.settle()
    assert await asyncio.to_thread(_rows, store_path, "form-eleven") == (0, 0)
    assert bot.github.repo_requests() == []

    # Control: the same payload as the one field GitHub sends (and ten fields in all) is queued
    # and answered.
    resp = await bot.deliver("issues", urlencode([("payload", payload)]).encode(),
                             delivery="form-one", headers=FORM)
    assert resp.status == 202
    resp = await bot.deliver("issues", urlencode(fields[:10]).encode(), delivery="form-ten",
                             headers=FORM)
    assert resp.status == 202
    await bot.settle()
    assert await asyncio.to_thread(_rows, store_path, "form-one") == (1, 1)
    assert len(bot.github.calls("POST", "/issues/90001/comments")) == 1
