"""Our one comment on an issue: found (ledger, then marker), edited in place, or posted when
there is none, with the ledger kept in step. Every feature that writes that comment (the
known-fix answer, ``/dejafix same-as``, ``/dejafix not-this``, the correction after a revert)
comes here, so the rules are written once: a deleted comment is noticed by the edit's 404, and
a dry run writes no ledger row (its client posts nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

import gidgethub

from bot.db.store import CommentRecord
from bot.features.context import Context
from bot.render.comment import body_hash, has_marker

_log = logging.getLogger("dejafix.comments")

# commented: posted anew; edited: the existing one changed; unchanged: the ledger says it
# already reads so (no call); capped: a new one was needed and ``reserve`` refused it; gone:
# the edit got a 404 and the caller asked for no new comment.
WriteAction = Literal["commented", "edited", "unchanged", "capped", "gone"]


@dataclasses.dataclass(frozen=True)
class OwnComment:
    """Our comment on an issue: its id, and the ledger row it came from (None when it was
    found by its marker: a crash between posting and writing the ledger)."""

    comment_id: int
    record: CommentRecord | None = None

    @classmethod
    def of(cls, record: CommentRecord | None) -> OwnComment | None:
        return None if record is None else cls(record.comment_id, record)


@dataclasses.dataclass(frozen=True)
class Written:
    """What ``write_comment`` did. ``comment_id``: the comment that now reads the body (0 for
    a dry run's pretend post; None for ``capped`` and ``gone``). ``recorded``: a ledger row was
    written (never in a dry run, never for ``unchanged``, ``capped`` or ``gone``)."""

    action: WriteAction
    comment_id: int | None = None
    recorded: bool = False


async def find_own_comment(ctx: Context, number: int) -> OwnComment | None:
    """Our comment from the ledger, else from the issue's comments (our marker, posted by
    this App): the second look covers a crash between posting and writing the ledger."""
    record = await asyncio.to_thread(ctx.services.store.get_comment, ctx.repo_name, number)
    if record is not None:
        return OwnComment(record.comment_id, record)
    if ctx.payload.get("action") == "opened" and ctx.attempt == 1:
        # Nothing of ours can be on an issue opened this moment (a crash between posting and
        # writing the ledger shows up as a retry, which looks): one API call saved.
        return None
    slug = ctx.services.app_slug
    for comment in await ctx.repo.issue_comments(number):
        user = comment.get("user") or {}
        if not has_marker(comment.get("body")) or user.get("type") != "Bot":
            continue
        # Another bot quoting our comment carries the marker too; only our own can be edited.
        if slug and user.get("login") != f"{slug}[bot]":
            continue
        return OwnComment(int(comment["id"]))
    return None


async def write_comment(ctx: Context, number: int, body: str, *, cluster: str | None,
                        score: float | None, found: OwnComment | None = None,
                        always_edit: bool = False, repost_when_gone: bool = True,
                        reserve: Callable[[], Awaitable[bool]] | None = None,
                        log: logging.Logger = _log) -> Written:
    """Make our comment on issue ``number`` read ``body``, and record ``cluster`` and
    ``score`` with it in the ledger.

    ``found``: the comment already looked up (None: it is looked up here). ``always_edit``:
    edit even when the ledger's body hash says it already reads so (the commands do; the
    known-fix answer and the revert correction save the call). ``repost_when_gone``: post a
    fresh comment when the edit gets a 404 (False: leave the issue without one).
    ``reserve``: asked only before a new comment is posted (the daily cap); False means none
    is. ``log``: the caller's logger, for the line saying the comment was deleted, so it
    stays with the feature that wrote. Saying what was written is the caller's: it knows what
    the comment means."""
    digest = body_hash(body)
    if found is None:
        found = await find_own_comment(ctx, number)
    if found is not None:
        if not always_edit and found.record is not None and found.record.body_hash == digest:
            return Written("unchanged", found.comment_id)
        if await _edit(ctx, found.comment_id, body):
            recorded = await _record(ctx, number, found.comment_id, cluster, score, digest)
            return Written("edited", found.comment_id, recorded)
        # Someone deleted our comment: its ledger row is stale (a new post replaces it; with
        # none, the row stays, and the next edit gets its 404 too).
        log.info("delivery %s: %s#%s comment %s is gone, %s", ctx.delivery_id, ctx.repo_name,
                 number, found.comment_id,
                 "posting anew" if repost_when_gone else "nothing to edit")
        if not repost_when_gone:
            return Written("gone")
    if reserve is not None and not await reserve():
        return Written("capped")
    comment_id = await ctx.repo.create_comment(number, body)
    recorded = await _record(ctx, number, comment_id, cluster, score, digest)
    return Written("commented", comment_id, recorded)


async def _edit(ctx: Context, comment_id: int, body: str) -> bool:
    """Edit the comment; False when GitHub answers 404 (it was deleted)."""
    try:
        await ctx.repo.edit_comment(comment_id, body)
    except gidgethub.BadRequest as exc:
        if exc.status_code != 404:
            raise
        return False
    return True


async def _record(ctx: Context, number: int, comment_id: int, cluster: str | None,
                  score: float | None, digest: str) -> bool:
    """Write the ledger row; False in a dry run, which writes none."""
    if ctx.services.dry_run:
        # Nothing was posted: a ledger row would make a later live run edit a comment that
        # does not exist instead of posting one.
        return False
    await asyncio.to_thread(ctx.services.store.record_comment, ctx.repo_name, number,
                            comment_id, cluster, score, digest)
    return True
