"""What Dejafix would say on an issue that is not opened yet: the web page's form. The same
plan as the live path (``answer_plan.plan_answer``: config, ranking, decision, regression,
rendering), read through a client that never writes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp
import gidgethub

from bot.features.answer_plan import effective_policy, mode, plan_answer, shadowed
from bot.features.context import Context, Services
from bot.features.upstreams import restrict_upstreams
from bot.github.client import DryRunRepoClient, OfflineRepoClient, RepoClient
from bot.github.payloads import MAX_BODY, MAX_TITLE
from bot.matching import IssueText, Match
from bot.repo_config import RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.preview")


async def installation_of(services: Services, repo: str) -> int | None:
    """The App's installation on ``repo`` (None: not installed, or no App credentials),
    asked of GitHub and cached for minutes."""
    key = repo.lower()
    if key in services.installations:
        return services.installations[key]
    installation: int | None = None
    if services.github.authenticated:
        try:
            installation = await services.github.installation_for(repo)
        except gidgethub.BadRequest as exc:
            if exc.status_code != 404:
                raise
    services.installations[key] = installation
    return installation


async def page_context(services: Services, repo: str, purpose: str) -> Context:
    """A context for ``repo`` outside any delivery: it reads as the App's installation (the
    repository's config, templates, releases) and writes nothing."""
    installation = await installation_of(services, repo)
    gh = await services.github.for_installation(installation)
    client: RepoClient = (DryRunRepoClient(gh, repo) if services.github.authenticated
                          else OfflineRepoClient(gh, repo))
    payload = {"installation": {"id": installation}} if installation is not None else {}
    return Context(delivery_id=purpose, repo_name=repo, repo=client, services=services,
                   payload=payload)


@dataclass(frozen=True)
class Preview:
    """``action``: ``comment`` (it would post ``comment``), ``label`` (a possible regression:
    the label, no comment), or ``silent``; ``notes`` say what else holds it back (a pause,
    shadow mode)."""

    action: str
    reason: str
    comment: str | None = None
    best: Match | None = None
    candidates: list[Match] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def repo_config_or_error(ctx: Context) -> tuple[RepoConfig, list[str]]:
    """The repository's config and, when it cannot be used, the problems (the same messages
    as the check run) with the defaults in its place. Its ``upstreams`` are only those the
    repository may use (``restrict_upstreams``): the page shows their clusters too."""
    try:
        config = await ctx.repo_config()
    except RepoConfigError as exc:
        return RepoConfig(), [str(p) for p in exc.problems] or [str(exc)]
    except (gidgethub.GitHubException, aiohttp.ClientError, TimeoutError) as exc:
        return RepoConfig(), [f".github/dejafix.yml could not be read: {type(exc).__name__}"]
    config, _ = await _checked_upstreams(ctx, config, "the page")
    return config, []


async def _checked_upstreams(ctx: Context, config: RepoConfig, who: str
                             ) -> tuple[RepoConfig, bool]:
    """``config`` with the upstreams it may use; with none, and False, when GitHub could not
    say which (unchecked upstreams are never shown: the repository's own clusters still
    are)."""
    try:
        config, _ = await restrict_upstreams(ctx, config)
    except (gidgethub.GitHubException, aiohttp.ClientError, TimeoutError) as exc:
        log.warning("%s: upstreams not checked (%s); %s shows none", ctx.repo_name,
                    type(exc).__name__, who)
        return config.model_copy(update={"upstreams": []}), False
    return config, True


async def preview(services: Services, repo: str, title: str, body: str) -> Preview:
    ctx = await page_context(services, repo, "preview")
    try:
        config = await ctx.repo_config()
    except RepoConfigError as exc:
        return Preview("silent", f"the repository's config is invalid, so it skips every "
                                 f"issue: {exc}")
    if not config.enabled:
        return Preview("silent", "disabled in .github/dejafix.yml (enabled: false)")
    notes: list[str] = []
    config, checked = await _checked_upstreams(ctx, config, "the preview")
    if not checked:
        notes.append("GitHub could not say just now which of the repository's upstreams it may "
                     "use, so this preview leaves them out; a new issue would wait for GitHub "
                     "and use those it may.")
    repos = [repo, *config.upstreams]
    index = await services.index.view(repos)
    if not index.size:
        return Preview("silent", "no clusters are known for this repository or its upstreams: "
                                 "load a cluster file or learn its history (backfill)",
                       notes=notes)
    text = IssueText(title=title[:MAX_TITLE], body=body[:MAX_BODY])
    plan = await plan_answer(ctx, text, config, {}, index)
    pause = await asyncio.to_thread(services.store.get_pause, repo)
    if pause is not None and pause.paused:
        notes.append(f"Dejafix is paused on this repository ({pause.reason}): it would stay "
                     "silent until `/dejafix resume`.")
    if shadowed(ctx, config, plan):
        notes.append("This repository is in shadow mode: the comment would be recorded on this "
                     "page, not posted.")
    used = await asyncio.to_thread(services.store.comments_in_last, repo, 24 * 3600)
    if used >= config.max_comments_per_day and mode(ctx, config) != "shadow":
        notes.append(f"The daily cap is reached ({used} of max_comments_per_day "
                     f"{config.max_comments_per_day} in 24 hours): a new issue would get no "
                     "comment until the oldest is a day old.")
    candidates = plan.ranked[:3]
    if plan.best is None or plan.body is None:
        top = plan.ranked[0] if plan.ranked else None
        threshold = effective_policy(services.config.matching, config).threshold
        why = plan.reason + (f" (best: cluster {top.public_id} at {top.score:.2f}, threshold "
                             f"{threshold:.2f})" if top else "")
        return Preview("silent", why, candidates=candidates, notes=notes)
    if plan.regression is not None and config.regressions != "comment":
        reason = f"a possible regression of the fix ({plan.regression.reason()})"
        if config.regressions == "off":
            return Preview("silent", reason + "; regressions: off", plan.body, plan.best,
                           candidates, notes)
        return Preview("label", reason + f"; it would add the label {config.regression_label}"
                       " and post nothing (regressions: label). Were regressions: comment, it"
                       " would post:", plan.body, plan.best, candidates, notes)
    if plan.regression is not None:
        return Preview("comment", f"a possible regression of the fix "
                       f"({plan.regression.reason()}); regressions: comment posts this, and the "
                       f"label {config.regression_label}", plan.body, plan.best, candidates,
                       notes)
    return Preview("comment", "it would post this comment", plan.body, plan.best, candidates,
                   notes)
