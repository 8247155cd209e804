"""Guardrails that keep a wrong bot from getting loud: a per-repository cap on new comments per
day, and an automatic pause when people dismiss too many suggestions. Shared by the known-fix
handler (which obeys them) and the commands (which feed and lift them)."""

from __future__ import annotations

import asyncio
import hashlib
import logging

from bot.db.store import Pause
from bot.features.context import Context
from bot.render.comment import code
from bot.repo_config import CONFIG_PATH, RepoConfig

log = logging.getLogger("dejafix.guardrails")

DAY = 86400.0
PAUSE_TITLE = "Dejafix paused itself in this repository"


def config_hash(config: RepoConfig) -> str:
    """Identifies the repository's settings: a pause remembers it, and any change to
    ``.github/dejafix.yml`` that changes a setting lifts the pause."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()


async def reserve_comment(ctx: Context, config: RepoConfig, issue: int) -> bool:
    """Take one of the repository's ``max_comments_per_day`` new comments in 24 hours for
    ``issue``; False when none is left. Atomic over every process sharing the store. A dry run
    posts nothing and takes nothing (nothing would ever use the slot up)."""
    if ctx.services.dry_run:
        count = await asyncio.to_thread(ctx.services.store.comments_in_last, ctx.repo_name, DAY)
        return count < config.max_comments_per_day
    return await asyncio.to_thread(ctx.services.store.reserve_comment, ctx.repo_name, issue,
                                   config.max_comments_per_day, DAY)


async def pause_in_force(ctx: Context, config: RepoConfig, pause: Pause | None
                         ) -> Pause | None:
    """The pause in force, or None, from the repository's pause row ``pause`` (read with the
    issue's feedback by ``Store.issue_facts``: one thread hop). A pause taken under other
    settings is lifted here: changing the config file is the other way maintainers answer
    one."""
    if pause is None or not pause.paused:
        return None
    if pause.config_hash != config_hash(config):
        if await asyncio.to_thread(ctx.services.store.resume, ctx.repo_name, "config change"):
            log.info("delivery %s: %s resumed: %s changed", ctx.delivery_id, ctx.repo_name,
                     CONFIG_PATH)
        return None
    return pause


async def after_dismissal(ctx: Context, config: RepoConfig) -> Pause | None:
    """Pause the repository if the latest suggestions were dismissed too often; announce it
    once. Returns the pause in force, if any."""
    store = ctx.services.store
    existing = await asyncio.to_thread(store.get_pause, ctx.repo_name)
    if existing is None or not existing.paused:
        since = (existing.resumed_at or 0.0) if existing is not None else 0.0
        dismissed, total = await asyncio.to_thread(store.dismissal_rate, ctx.repo_name,
                                                   config.pause_window, since)
        if total < config.pause_window or dismissed / total <= config.pause_dismissal_rate:
            return None
        reason = (f"{dismissed} of the latest {total} suggestions were dismissed (the limit "
                  f"is {config.pause_dismissal_rate:.0%})")
        if ctx.services.dry_run:
            log.info("delivery %s: dry-run: would pause %s: %s", ctx.delivery_id,
                     ctx.repo_name, reason)
            return None
        await asyncio.to_thread(store.pause, ctx.repo_name, reason, config_hash(config))
        log.warning("delivery %s: %s paused: %s", ctx.delivery_id, ctx.repo_name, reason)
    pause = await asyncio.to_thread(store.get_pause, ctx.repo_name)
    if pause is None or not pause.paused:
        return None
    if not pause.announced and await asyncio.to_thread(store.claim_announcement,
                                                        ctx.repo_name):
        # Announced once, by whoever claims it: the flag is set right after the issue is
        # opened (a retry after a failed announcement announces; one after a success does
        # not).
        issue = None
        if config.pause_issue:
            try:
                issue = await ctx.repo.create_issue(PAUSE_TITLE, pause_issue_body(pause))
            except BaseException:
                # Not announced: the next caller (this job's retry included) may claim it.
                await asyncio.to_thread(store.release_announcement, ctx.repo_name)
                raise
        await asyncio.to_thread(store.mark_pause_announced, ctx.repo_name, issue)
    return pause


def pause_issue_body(pause: Pause) -> str:
    return "\n".join([
        "Dejafix has **stopped commenting on new issues** in this repository: "
        f"{pause.reason}.",
        "",
        "That many dismissals usually means the suggestions do not fit this repository (for "
        "example the match threshold is too low for it). Existing comments stay as they are.",
        "",
        "To resume:",
        "- comment `/dejafix resume` on this issue (anyone with triage or write access), or",
        f"- change {code(CONFIG_PATH)} (for example raise `threshold`, or tune "
        "`pause_dismissal_rate` / `pause_window`).",
        "",
        "The dismissal rate is measured afresh after a resume.",
    ]) + "\n"
