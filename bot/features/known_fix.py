"""Known fix: answer a newly opened (or reopened, or edited) issue with the fix that already
landed for the same bug, in one comment that is edited rather than posted twice."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Literal

from gidgethub.routing import Router
from gidgethub.sansio import Event
from pydantic import ValidationError

from bot.features import guardrails, repo_clusters
from bot.features.answer_plan import plan_answer, shadowed
from bot.features.comment_writer import write_comment
from bot.features.context import Context
from bot.features.installs import backfill_unseen
from bot.features.upstreams import restrict_upstreams
from bot.github.client import delivery_kind
from bot.github.payloads import Issue, IssuesEvent, User, describe
from bot.matching import IssueText, Match
from bot.matching.index import ClusterIndex
from bot.matching.regression import Regression
from bot.metrics import current_metrics
from bot.repo_config import RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.known_fix")
router = Router()
Action = Literal["commented", "edited", "unchanged", "labelled", "shadow", "silent", "skipped"]
# Outcomes of an issue that matched a known bug (the calls-per-delivery metric's kind).
MATCHED: frozenset[Action] = frozenset({"commented", "edited", "unchanged", "labelled",
                                        "shadow"})


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the handler did, for logs and tests."""

    action: Action
    reason: str = ""
    cluster: str | None = None
    score: float | None = None
    comment_id: int | None = None
    # Set when the match is a possible regression of its fix (never answered "already fixed").
    regression: Regression | None = None


def skip_reason(issue: Issue, sender: User, ctx: Context) -> str | None:
    """Why this issue is none of Dejafix's business, or None."""
    if issue.is_pull_request:
        return "pull request"
    if issue.user.type == "Bot":
        return "opened by a bot"
    slug = ctx.services.app_slug
    if slug and sender.login == f"{slug}[bot]":
        return "our own event"
    if issue.state == "closed":
        return "closed"
    return None


def config_skip_reason(issue: Issue, config: RepoConfig) -> str | None:
    if not config.enabled:
        return "disabled in .github/dejafix.yml"
    login = issue.user.login
    if login.lower() in {a.lower() for a in config.skip_authors}:
        return f"author {login} is in skip_authors"
    labels = {label.name.lower() for label in issue.labels}
    hit = labels & {s.lower() for s in config.skip_labels}
    if hit:
        return f"labelled {sorted(hit)[0]} (skip_labels)"
    return None


async def _suggestion(ctx: Context, number: int, best: Match, mode: str, body: str,
                      regression: Regression | None = None) -> None:
    """Record the issue's latest suggestion, posted (``comment``), not (``shadow``) or a
    labelled possible regression (``label``): its evidence is worked out and written in one
    thread hop."""
    store = ctx.services.store

    def write() -> None:
        store.record_suggestion(ctx.repo_name, number, best.public_id, best.score, mode, body,
                                best.evidence.model_dump_json(),
                                regression.reason() if regression is not None else None)

    await asyncio.to_thread(write)


async def _add_label(ctx: Context, issue: Issue, name: str | None) -> None:
    if name and name.lower() not in {label.name.lower() for label in issue.labels}:
        await ctx.repo.add_labels(issue.number, [name])


async def answer_issue(ctx: Context, issue: Issue, sender: User) -> Outcome:
    outcome = await _answer_issue(ctx, issue, sender)
    if (metrics := current_metrics()) is not None:
        metrics.matches.inc(outcome=outcome.action)
        if outcome.regression is not None:
            metrics.regressions.inc(kind=outcome.regression.kind, action=outcome.action)
        if outcome.action == "shadow":
            metrics.comments.inc(action="would_comment")
        elif outcome.action in ("commented", "edited"):
            # A dry run posts nothing: counted apart, never as a comment made.
            action = "created" if outcome.action == "commented" else "edited"
            metrics.comments.inc(action="would_comment" if ctx.services.dry_run else action)
    return outcome


async def _answer_issue(ctx: Context, issue: Issue, sender: User) -> Outcome:
    reason = skip_reason(issue, sender, ctx)
    if reason:
        return Outcome("skipped", reason)
    if ctx.installation_id is None and ctx.services.github.authenticated \
            and not ctx.services.dry_run:
        # GitHub sends an App every delivery with its installation; without one nothing can be
        # written (every call would be refused, and retried for nothing).
        return Outcome("skipped", "no installation in the delivery")
    # The repository's index is taken (built, on a cold repository) while its config is read,
    # and a repository with clusters reads its templates meanwhile: on a cold repository the
    # three happen at once, from the caches after. The index is never cancelled: a build in a
    # thread cannot be stopped, and one left to finish is kept for the repository's next issue.
    early = asyncio.ensure_future(ctx.services.index.view([ctx.repo_name]))
    early.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def templates_if_needed() -> None:
        if (await asyncio.shield(early)).size:
            await ctx.boilerplate()

    templates = asyncio.ensure_future(templates_if_needed())
    try:
        return await _answer_configured(ctx, issue, early)
    finally:
        if not templates.done():
            templates.cancel()
        # Its error, if any, is the later read's to report (it reads again).
        templates.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _answer_configured(ctx: Context, issue: Issue,
                             early: asyncio.Future[ClusterIndex]) -> Outcome:
    number = issue.number
    try:
        config = await ctx.repo_config()
    except RepoConfigError as exc:
        # Never fall back to defaults for a broken file: the owner asked for something specific.
        log.error("delivery %s: %s skipped, invalid config: %s", ctx.delivery_id, ctx.repo_name,
                  exc)
        return Outcome("skipped", f"invalid config: {exc}")
    reason = config_skip_reason(issue, config)
    if reason:
        return Outcome("skipped", reason)
    # Its own ``clusters:`` (files of its default branch, feeds), read when new or due; the
    # view taken at the start predates them when they changed.
    refreshed = await repo_clusters.ensure(ctx, config)
    # A repository seen with nothing learned gets its history learned, once (queued jobs).
    await backfill_unseen(ctx)
    # An upstream this repository may not use (hidden from its installation, or more private
    # than it) is dropped here, before any of its clusters is read.
    config, _ = await restrict_upstreams(ctx, config)
    # The upstreams' own ``clusters:`` too (an upstream the App is not installed on has no
    # event of its own to read them on).
    for upstream in config.upstreams:
        await repo_clusters.ensure_upstream(ctx, upstream)
    repos = [ctx.repo_name, *config.upstreams]
    # One version for the whole delivery; a cluster learned by another process is in it. The
    # one taken at the start serves unless upstreams are wanted too.
    index = await (ctx.services.index.view(repos) if config.upstreams or refreshed
                   else asyncio.shield(early))
    if not index.size:
        # Nothing could be suggested, whatever the issue says: no reads, no matching. (A pause
        # changed in .github/dejafix.yml is lifted by the next issue that has candidates.)
        _note_no_clusters(ctx, index.version)
        log.debug("delivery %s: %s#%s silent: no clusters for %s", ctx.delivery_id,
                  ctx.repo_name, number, ", ".join(repos))
        return Outcome("silent", "no clusters for this repository")
    store = ctx.services.store
    feedback, pause_row = await asyncio.to_thread(store.issue_facts, ctx.repo_name, number)
    confirmed = sorted(c for c, kind in feedback.items() if kind == "confirmed")
    if confirmed:
        # A maintainer said which bug this is (/dejafix same-as); the matcher does not argue.
        return Outcome("skipped", f"confirmed by a maintainer as cluster {confirmed[0]}",
                       confirmed[0])
    pause = await guardrails.pause_in_force(ctx, config, pause_row)
    if pause is not None:
        return Outcome("skipped", f"paused: {pause.reason}")

    plan = await plan_answer(ctx, IssueText(number=number, title=issue.clipped_title,
                                            body=issue.clipped_body), config, feedback,
                             index)
    best, regression = plan.best, plan.regression
    if best is None or plan.body is None:
        top = plan.ranked[0] if plan.ranked else None
        log.info("delivery %s: %s#%s silent (best %s at %.2f)", ctx.delivery_id, ctx.repo_name,
                 number, top.public_id if top else None, top.score if top else 0.0)
        return Outcome("silent", plan.reason, top.public_id if top else None,
                       top.score if top else None)
    if shadowed(ctx, config, plan):
        return await _shadow(ctx, issue, config, best, regression, plan.body)
    if regression is not None:
        return await _answer_regression(ctx, issue, config, best, regression, plan.body)
    return await _publish(ctx, issue, config, best, plan.body, config.label)


async def _shadow(ctx: Context, issue: Issue, config: RepoConfig, best: Match,
                  regression: Regression | None, body: str) -> Outcome:
    """Shadow mode: what would have been posted is recorded, with its score and evidence;
    nothing is posted or labelled."""
    number = issue.number
    reason = ""
    if regression is not None and config.regressions != "comment":
        reason = (f"possible regression ({regression.reason()}); regressions: "
                  f"{config.regressions}")
    await _suggestion(ctx, number, best, "shadow", body, regression)
    log.info("delivery %s: %s#%s shadow: would comment (cluster %s, %.2f)%s", ctx.delivery_id,
             ctx.repo_name, number, best.public_id, best.score,
             f"; {reason}" if reason else "")
    return Outcome("shadow", reason, best.public_id, best.score, regression=regression)


async def _answer_regression(ctx: Context, issue: Issue, config: RepoConfig, best: Match,
                             regression: Regression, body: str) -> Outcome:
    """A possible regression never gets "already fixed". ``label`` (the default): the
    regression label, nothing posted, and an earlier comment of ours is left as it is.
    ``comment``: our one comment (posted, or the earlier one edited) becomes the regression
    variant, plus the label. ``off``: nothing at all."""
    number = issue.number
    reason = regression.reason()
    log.info("delivery %s: %s#%s possible regression of cluster %s (%s): %s",
             ctx.delivery_id, ctx.repo_name, number, best.public_id, config.regressions, reason)
    if config.regressions == "off":
        return Outcome("silent", f"possible regression ({reason}); regressions: off",
                       best.public_id, best.score, regression=regression)
    if config.regressions == "label":
        await _add_label(ctx, issue, config.regression_label)
        if not ctx.services.dry_run and await asyncio.to_thread(
                ctx.services.store.get_comment, ctx.repo_name, number) is None:
            # Kept for the web page's "fixes that look incomplete", with what a comment
            # would have said; an issue we commented on keeps its posted suggestion.
            await _suggestion(ctx, number, best, "label", body, regression)
        return Outcome("labelled", reason, best.public_id, best.score, regression=regression)
    outcome = await _publish(ctx, issue, config, best, body, config.regression_label,
                             regression)
    return dataclasses.replace(outcome, reason=outcome.reason or reason, regression=regression)


async def _publish(ctx: Context, issue: Issue, config: RepoConfig, best: Match, body: str,
                   label: str | None, regression: Regression | None = None) -> Outcome:
    """Post ``body`` as our one comment, or edit the one already there (found by the ledger or
    the marker; not edited when the ledger says it reads so already), then add ``label``."""
    number = issue.number
    written = await write_comment(
        ctx, number, body, cluster=best.public_id, score=best.score,
        reserve=lambda: guardrails.reserve_comment(ctx, config, number), log=log)
    if written.action == "capped":
        log.warning("delivery %s: %s#%s not commented: %s new comments in 24 hours "
                    "(max_comments_per_day)", ctx.delivery_id, ctx.repo_name, number,
                    config.max_comments_per_day)
        return Outcome("skipped", "max_comments_per_day reached", best.public_id, best.score)
    if written.recorded or ctx.services.dry_run:
        # The suggestion goes with the ledger row; a dry run records the suggestion (the page
        # marks it: no ledger row) but no ledger row.
        await _suggestion(ctx, number, best, "comment", body, regression)
    # Labelled even when unchanged: a retry after a failed label call lands there.
    await _add_label(ctx, issue, label)
    if written.action == "unchanged":
        return Outcome("unchanged", cluster=best.public_id, score=best.score,
                       comment_id=written.comment_id)
    if written.action == "edited":
        log.info("delivery %s: %s#%s comment %s edited (cluster %s, %.2f)",
                 ctx.delivery_id, ctx.repo_name, number, written.comment_id, best.public_id,
                 best.score)
        return Outcome("edited", cluster=best.public_id, score=best.score,
                       comment_id=written.comment_id)
    # "commented" ("gone" cannot be: a deleted comment is posted anew).
    log.info("delivery %s: %s#%s %s (cluster %s, %.2f)", ctx.delivery_id, ctx.repo_name,
             number, "would comment (dry-run)" if ctx.services.dry_run else "commented",
             best.public_id, best.score)
    return Outcome("commented", cluster=best.public_id, score=best.score,
                   comment_id=written.comment_id)


def _note_no_clusters(ctx: Context, version: str) -> None:
    """Say once per repository and cluster version, not once per issue, that a repository's
    issues cannot get a suggestion."""
    key = ctx.repo_name.lower()
    if ctx.services.no_clusters_logged.get(key) != version:
        ctx.services.no_clusters_logged[key] = version
        log.info("%s: no clusters for this repository or its upstreams; its issues get no "
                 "suggestion until some are loaded or learned", ctx.repo_name)


def _parse(event: Event, ctx: Context) -> IssuesEvent | None:
    try:
        return IssuesEvent.model_validate(event.data)
    except ValidationError as exc:
        # Retrying cannot fix a payload: skip it, once, with the delivery id and the field.
        log.warning("delivery %s: %s payload skipped, %s", ctx.delivery_id, event.event,
                    describe(exc))
        return None


@router.register("issues", action="opened")
@router.register("issues", action="reopened")
async def on_issue_opened(event: Event, ctx: Context) -> None:
    parsed = _parse(event, ctx)
    if parsed is not None:
        outcome = await answer_issue(ctx, parsed.issue, parsed.sender)
        delivery_kind("opened_matched" if outcome.action in MATCHED else "opened_silent")
        _log_outcome(ctx, parsed.issue, outcome)


@router.register("issues", action="edited")
async def on_issue_edited(event: Event, ctx: Context) -> None:
    parsed = _parse(event, ctx)
    if parsed is None:
        return
    if "title" not in parsed.changes and "body" not in parsed.changes:
        return
    delivery_kind("edited")
    _log_outcome(ctx, parsed.issue, await answer_issue(ctx, parsed.issue, parsed.sender))


def _log_outcome(ctx: Context, issue: Issue, outcome: Outcome) -> None:
    if outcome.action == "skipped":
        log.info("delivery %s: %s#%s skipped: %s", ctx.delivery_id, ctx.repo_name,
                 issue.number, outcome.reason)
