"""Which of a repository's ``upstreams`` it may use. An upstream's clusters (titles, numbers,
fix PRs) end up in this repository's comments and on its page, so a repository may not name its
way into another's: an upstream counts only when this installation can see it (it is one of the
installation's repositories, or public) and it is no more private than the repository that
names it. Everything that plans a comment or shows one (``known_fix`` and ``answer_plan``,
the preview and the page through ``preview``) and the config check ask here, and nowhere else."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from bot.features.context import Context
from bot.github.client import Visibility, repo_visibility
from bot.repo_config import RepoConfig

log = logging.getLogger("dejafix.upstreams")

# How private each visibility is: an upstream may be as private as its reader, never more.
_RANK: dict[Visibility, int] = {"public": 0, "internal": 1, "private": 2}


@dataclasses.dataclass(frozen=True)
class Refusal:
    upstream: str
    reason: str


@dataclasses.dataclass(frozen=True)
class UpstreamCheck:
    """The upstreams a repository may use (in the order it named them) and those it may not,
    each with its reason (for the log; never shown to the repository's readers)."""

    allowed: list[str]
    refused: list[Refusal]


def _upstream_rank(shown: Visibility) -> int:
    # An upstream whose visibility GitHub does not state plainly counts as private.
    return _RANK.get(shown, _RANK["private"])


def _reader_rank(shown: Visibility) -> int:
    # A repository whose own visibility is not plain counts as public: it gets public upstreams.
    return _RANK.get(shown, _RANK["public"])


async def naming_visibility(ctx: Context) -> Visibility:
    """How the repository itself is shown: the more public of the delivery's ``repository``
    (GitHub's word, signed, but as of when it was sent: a job retried after the repository went
    public still says "private") and GitHub's answer now to the installation's token (cached a
    minute; the page has no delivery)."""
    known = [shown for shown in (repo_visibility(ctx.payload.get("repository")),
                                 await ctx.visibility(ctx.repo_name))
             if shown is not None and shown != "unknown"]
    return min(known, key=_reader_rank) if known else "unknown"


def decide(shown: Visibility | None, reader: str, reader_shown: Visibility) -> str | None:
    """Why an upstream shown to the installation as ``shown`` (None: hidden from it) may not
    serve the repository ``reader``, shown as ``reader_shown``; None when it may."""
    if shown is None:
        return ("not visible to this installation (private to another installation, or no "
                "such repository)")
    if _upstream_rank(shown) > _reader_rank(reader_shown):
        upstream_word = shown if shown != "unknown" else "not plainly public"
        reader_word = reader_shown if reader_shown != "unknown" else "not plainly private"
        return (f"it is {upstream_word} and {reader} is {reader_word}: its clusters would "
                "reach readers who may not see it")
    return None


async def allowed_upstreams(ctx: Context, named: Sequence[str]) -> UpstreamCheck:
    """Split ``named`` (the repository's ``upstreams``) into those ``ctx.repo_name`` may use
    and those it may not, each refusal logged with its reason (once per five minutes).
    Visibility is read with the installation's token (cached a minute); a GitHub error other
    than "hidden" raises, so the delivery is retried rather than answered without its
    upstreams."""
    allowed: list[str] = []
    refused: list[Refusal] = []
    # The repository itself is not an upstream of its own: its clusters are used anyway.
    wanted = [u for u in named if u.lower() != ctx.repo_name.lower()]
    if not wanted:
        return UpstreamCheck(allowed, refused)
    reader_shown = await naming_visibility(ctx)
    seen: set[str] = set()
    for upstream in wanted:
        if upstream.lower() in seen:
            continue
        seen.add(upstream.lower())
        reason = decide(await ctx.visibility(upstream), ctx.repo_name, reader_shown)
        if reason is None:
            allowed.append(upstream)
            continue
        refused.append(Refusal(upstream, reason))
        said = (ctx.installation_id, ctx.repo_name.lower(), upstream.lower(), reason)
        if said not in ctx.services.refusals_logged:
            ctx.services.refusals_logged[said] = True
            log.warning("delivery %s: %s: upstream %s not used: %s", ctx.delivery_id,
                        ctx.repo_name, upstream, reason)
    return UpstreamCheck(allowed, refused)


async def restrict_upstreams(ctx: Context, config: RepoConfig) -> tuple[RepoConfig,
                                                                        list[Refusal]]:
    """``config`` with only the upstreams ``allowed_upstreams`` lets ``ctx.repo_name`` use,
    and the refusals."""
    if not config.upstreams:
        return config, []
    check = await allowed_upstreams(ctx, config.upstreams)
    if check.allowed == config.upstreams:
        return config, check.refused
    return config.model_copy(update={"upstreams": check.allowed}), check.refused
