"""What the bot would say on an issue, before anything is posted: ranking through the index,
the decision, the regression check and the rendered comment. The live path (``known_fix``) and
the web page's "what would Dejafix say?" (``preview``) both come here, so the page shows the
exact comment."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Literal

import aiohttp
import gidgethub

from bot.features.auto_mode import AutoState, auto_state
from bot.features.context import Context
from bot.features.upstreams import restrict_upstreams
from bot.matching import Boilerplate, IssueText, Match, MatchPolicy, decide
from bot.matching.index import ClusterIndex
from bot.matching.regression import (
    Regression,
    first_release_after,
    parse_version,
    regression_of,
    reporter_version,
)
from bot.render.comment import render, render_regression
from bot.repo_config import RepoConfig

# The known-fix answer's own logger: the plan is that answer's first half, and its lines kept
# the name they had when it lived there (log filters and dashboards select on it).
log = logging.getLogger("dejafix.known_fix")

# A full-size hostile body ranks in well under this (bench/hostile_text.py); the budget is
# loose so that a loaded machine does not log it for an ordinary issue.
MATCH_BUDGET_S = 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the bot would say on an issue, before anything is posted: the live path and the
    web page's "what would Dejafix say?" both come here, so the page shows the exact comment."""

    ranked: list[Match]
    best: Match | None = None
    regression: Regression | None = None
    # The comment it would post (the regression variant for a possible regression), or None.
    body: str | None = None
    reason: str = ""
    # ``mode: auto``: whether the repository's backtest has cleared it to comment, and why.
    auto: AutoState | None = None


def effective_policy(base: MatchPolicy, config: RepoConfig) -> MatchPolicy:
    update: dict[str, Any] = {}
    if config.threshold is not None:
        update["threshold"] = config.threshold
    if config.include_stale:
        update["include_stale"] = True
    return base.model_copy(update=update)


def mode(ctx: Context, config: RepoConfig) -> Literal["comment", "shadow", "auto"]:
    """``comment``, ``shadow`` or ``auto``: the repository's own ``mode``, else the
    deployment's."""
    return config.mode or ctx.services.config.default_mode


def shadowed(ctx: Context, config: RepoConfig, plan: Plan) -> bool:
    """Whether shadow mode keeps ``plan``'s answer off the issue (recorded, not posted). A
    possible regression under ``regressions: off`` is not one: that says nothing at all,
    in either mode. ``auto`` is shadow until the repository's own backtest has cleared it
    (``plan.auto``, read when the plan was made; none read: shadow)."""
    current = mode(ctx, config)
    if current == "auto":
        current = "comment" if plan.auto is not None and plan.auto.commenting else "shadow"
    return current == "shadow" and not (plan.regression is not None
                                        and config.regressions == "off")


async def plan_answer(ctx: Context, text: IssueText, config: RepoConfig,
                      feedback: dict[str, str], index: ClusterIndex | None = None) -> Plan:
    """Rank ``text`` on ``index`` (else a view of the repository and its upstreams), decide,
    tell a possible regression, render the comment. Only the upstreams the repository may use
    are ranked (``restrict_upstreams``), whatever ``index`` holds."""
    policy = effective_policy(ctx.services.config.matching, config)
    boilerplate = await ctx.boilerplate()
    # Checked here as well as by the caller: the comment is planned here, whoever asks.
    config, _ = await restrict_upstreams(ctx, config)
    repos = [ctx.repo_name, *config.upstreams]
    if index is None:
        index = await ctx.services.index.view(repos)
    # Ranking is CPU work; it must not hold the event loop while other deliveries arrive. A
    # regex holds the GIL for as long as one call runs, so the thread alone would not keep the
    # loop free: what bounds it is the matcher's cut of the text (scoring.MAX_BODY_CHARS) and
    # passes that are linear in it (tests/test_hostile_text.py). A ranking over
    # MATCH_BUDGET_S means one of them is not, and is logged for that.
    ranked, elapsed = await asyncio.to_thread(_timed_rank, index, text, repos, policy,
                                              boilerplate)
    if elapsed > MATCH_BUDGET_S:
        log.warning("delivery %s: %s#%s matching took %.2fs (budget %.2fs): a text pass is"
                    " slower than linear on this issue", ctx.delivery_id, ctx.repo_name,
                    text.number, elapsed, MATCH_BUDGET_S)
    # A cluster dismissed on this issue (/dejafix not-this) is never offered on it again; the
    # best of the others is, if it clears the threshold and the margin on its own.
    ranked = [m for m in ranked if feedback.get(m.public_id) != "dismissed"]
    best = decide(ranked, policy)
    if best is None:
        return Plan(ranked, reason="no match above the threshold")
    regression = await _regression(ctx, text, best)
    # In a thread too: the match reads its record and works out its evidence when first asked.
    if regression is not None:
        body = await asyncio.to_thread(render_regression, best, regression,
                                       issue_repo=ctx.repo_name,
                                       docs_url=ctx.services.docs_url)
    else:
        body = await asyncio.to_thread(render, best, issue_repo=ctx.repo_name,
                                       docs_url=ctx.services.docs_url)
    auto = None
    if mode(ctx, config) == "auto":
        auto = await asyncio.to_thread(auto_state, ctx.services.store, ctx.repo_name,
                                       ctx.services.config)
    return Plan(ranked, best, regression, body, auto=auto)


def _timed_rank(index: ClusterIndex, text: IssueText, repos: list[str], policy: MatchPolicy,
                boilerplate: Boilerplate | None) -> tuple[list[Match], float]:
    """The ranking and its time, measured in the thread (not the wait for one)."""
    started = time.perf_counter()
    ranked = index.rank(text, repos, policy=policy, boilerplate=boilerplate)
    return ranked, time.perf_counter() - started


async def _regression(ctx: Context, text: IssueText, best: Match) -> Regression | None:
    """Whether ``best`` is a possible regression of its fix rather than an already-fixed bug.
    The fix's first release is the record's ``released_in``, else the first release of the
    cluster's repository published after the merge; the repository's release tags also tell a
    version of ours from a runtime's or an OS's."""
    # Reading the record (JSON, validated) and the issue's text are CPU work: in a thread.
    cluster = await asyncio.to_thread(lambda: best.cluster)
    fix = cluster.landed_fix
    releases: list[tuple[str, str]] = []
    if cluster.repo.lower() != ctx.repo_name.lower():
        # An upstream's bug: its releases are numbered as the upstream's, the reporter's
        # version as this repository's; only the issue's own words can tell.
        return await asyncio.to_thread(regression_of, text, cluster, versions=False)
    if not (fix.released_in or fix.merged_at) or \
            await asyncio.to_thread(reporter_version, text.title, text.body) is None:
        # No release to compare a version with, or no version in the issue to compare: only
        # the issue's own words can tell (and the releases are not read: one call saved).
        return await asyncio.to_thread(regression_of, text, cluster)
    try:
        releases = await ctx.releases(cluster.repo)
    except (gidgethub.GitHubException, aiohttp.ClientError, TimeoutError, ValueError,
            KeyError) as exc:
        # Without releases only the record's release and the issue's own words count.
        log.info("delivery %s: %s releases unavailable (%s: %s); going on without them",
                 ctx.delivery_id, cluster.repo, type(exc).__name__, exc)
        if getattr(exc, "status_code", None) == 404:
            # A lasting answer (releases hidden or disabled), not a failure: remembered as
            # "none" for the releases' cache time, so it is asked, and said, once per that
            # time rather than on every delivery naming a version.
            ctx.services.releases[(ctx.installation_id, cluster.repo.lower())] = []
    fix_release = fix.released_in
    if fix_release is None and fix.merged_at:
        fix_release = first_release_after(fix.merged_at, releases)
    plausible = [v for tag, _ in releases if (v := parse_version(tag)) is not None]
    return await asyncio.to_thread(regression_of, text, cluster, fix_release, plausible)
