"""Config errors people see: a check run named "dejafix config" on every commit whose
``.github/dejafix.yml`` is present, on a push to the default branch and on a pull request
(opened, synchronize, reopened). A broken file fails the check with one annotation per problem
(key path and line, linked from the summary); a valid one passes. A push to the default branch
that changes the file also drops the cached config, so the next issue uses the new one."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

import gidgethub
from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.db.store import CHANGES
from bot.features.context import Context, resolve_config_text
from bot.features.upstreams import allowed_upstreams
from bot.github.client import rate_limit_wait
from bot.repo_config import CONFIG_PATH, ConfigProblem, RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.config_check")
router = Router()

CHECK_NAME = "dejafix config"
# GitHub lists at most this many commits in a push payload; a longer push may hide a change.
PUSH_COMMITS_LISTED = 20
_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def commit_sha(value: Any) -> str | None:
    return value if isinstance(value, str) and _SHA.fullmatch(value) else None


def push_changes_config(data: dict[str, Any]) -> bool:
    """Whether a push may have changed the file. Unknown means yes: a forced push, or one
    with more commits than the payload lists, can change it without naming it."""
    commits = data.get("commits")
    if data.get("forced") or not isinstance(commits, list) or not commits \
            or len(commits) >= PUSH_COMMITS_LISTED:
        return True
    for commit in commits:
        if not isinstance(commit, dict):
            return True
        for kind in ("added", "modified", "removed"):
            paths = commit.get(kind) or []
            if not isinstance(paths, list) or CONFIG_PATH in paths:
                return True
    return False


def _web_base(ctx: Context) -> str:
    """``https://github.com`` (or the Enterprise host), from the payload's html_url."""
    repo = ctx.payload.get("repository")
    html_url = repo.get("html_url") if isinstance(repo, dict) else None
    suffix = "/" + ctx.repo_name
    if isinstance(html_url, str) and html_url.lower().endswith(suffix.lower()):
        return html_url[: -len(suffix)]
    return "https://github.com"


# The one reason a check run gives for an unused upstream, whatever the log says: a check run
# of a public repository is public, and anyone's pull request can name any repository, so it
# must not tell a private repository of this installation from one that does not exist.
UNUSED_UPSTREAMS = (
    "Not used as upstreams: {names}. Dejafix uses an upstream only when its installation "
    "here can see it (one of the installation's repositories, or a public one) and it is no "
    "more private than this repository.")


def build_check(ctx: Context, sha: str, result: RepoConfig | RepoConfigError,
                extends_line: int | None, unused_upstreams: Sequence[str] = ()
                ) -> tuple[str, str, str, list[dict[str, Any]]]:
    """(conclusion, title, summary, annotations) for the file at ``sha``; a valid file naming
    upstreams it may not use is ``neutral`` (it works, without them), with the reason."""
    base = _web_base(ctx)
    own_source = f"{ctx.repo_name}:{CONFIG_PATH}"
    own_url = f"{base}/{ctx.repo_name}/blob/{sha}/{CONFIG_PATH}"
    if isinstance(result, RepoConfig):
        if unused_upstreams:
            names = ", ".join(f"`{name.replace('`', '')}`" for name in unused_upstreams)
            count = len(unused_upstreams)
            return ("neutral",
                    f"{CONFIG_PATH} is valid; {count} upstream{'s' if count != 1 else ''} "
                    "not used",
                    f"[`{CONFIG_PATH}`]({own_url}) is valid.\n\n"
                    + UNUSED_UPSTREAMS.format(names=names), [])
        return ("success", f"{CONFIG_PATH} is valid",
                f"[`{CONFIG_PATH}`]({own_url}) is valid.", [])
    problems: list[ConfigProblem] = list(result.problems)
    annotations: list[dict[str, Any]] = []
    lines = []
    for problem in problems:
        key = f"{problem.key_path}: " if problem.key_path else ""
        if problem.source == own_source:
            line = problem.line or 1
            message = f"{key}{problem.message}"
            where = f"[line {line}]({own_url}#L{line})"
        else:
            # A problem in the file named by _extends: shown at the _extends line here, and
            # linked to its own line there.
            line = extends_line or 1
            message = str(problem)
            other, _, path = problem.source.partition(":")
            anchor = f"#L{problem.line}" if problem.line else ""
            where = (f"[line {line}]({own_url}#L{line}), from "
                     f"[{problem.source}{':' + str(problem.line) if problem.line else ''}]"
                     f"({base}/{other}/blob/HEAD/{path}{anchor})")
        annotations.append({
            "path": CONFIG_PATH, "start_line": line, "end_line": line,
            "annotation_level": "failure", "title": problem.key_path or CHECK_NAME,
            "message": message,
        })
        lines.append(f"- {where}: {'`' + problem.key_path + '`: ' if problem.key_path else ''}"
                     f"{problem.message}")
    count = len(problems)
    title = f"{count} error{'s' if count != 1 else ''} in {CONFIG_PATH}"
    summary = (f"[`{CONFIG_PATH}`]({own_url}) cannot be used; Dejafix skips this repository "
               "until it is fixed:\n\n" + "\n".join(lines))
    if count > 50:
        summary += f"\n\n(GitHub shows the first 50 of {count} as annotations.)"
    return "failure", title, summary, annotations


async def check_config(ctx: Context, sha: str) -> str | None:
    """Post the check for the file at ``sha``; returns the conclusion, or None when the commit
    has no config file (nothing to check)."""
    text = await ctx.repo.read_file_from(ctx.repo_name, CONFIG_PATH, sha)
    if text is None:
        return None
    resolved = await resolve_config_text(ctx.repo, ctx.repo_name, text)
    unused: list[str] = []
    if isinstance(resolved.result, RepoConfig) and resolved.result.upstreams:
        # The owner learns here, not only from the operator's log, why an upstream is idle.
        check = await allowed_upstreams(ctx, resolved.result.upstreams)
        unused = [refusal.upstream for refusal in check.refused]
    conclusion, title, summary, annotations = build_check(ctx, sha, resolved.result,
                                                          resolved.extends_line, unused)
    await post_check(ctx, sha, CHECK_NAME, conclusion, title, summary, annotations)
    return conclusion


async def post_check(ctx: Context, sha: str, name: str, conclusion: str, title: str,
                     summary: str, annotations: list[dict[str, Any]]) -> None:
    """A completed check run on ``sha``; without the checks permission, one warning."""
    try:
        await ctx.repo.create_check_run(sha, name, conclusion, title, summary, annotations)
    except gidgethub.BadRequest as exc:
        if exc.status_code == 403 and rate_limit_wait(exc) is None:
            # Installed before the checks permission was added and not yet approved: the
            # owner sees the request in the installation settings. Retrying cannot help.
            log.warning("delivery %s: %s: no permission to create check runs (approve the "
                        "App's checks permission); %s is %s", ctx.delivery_id,
                        ctx.repo_name, name, conclusion)
            return
        raise
    log.info("delivery %s: %s@%s %s: %s (%s)", ctx.delivery_id, ctx.repo_name, sha[:12], name,
             conclusion, title)


@router.register("push")
async def on_push(event: Event, ctx: Context) -> None:
    data = event.data
    repo = data.get("repository")
    default = repo.get("default_branch") if isinstance(repo, dict) else None
    if not isinstance(default, str) or data.get("ref") != f"refs/heads/{default}":
        return
    if push_changes_config(data):
        dropped = ctx.services.forget_repo_config(ctx.repo_name)
        # Every other process drops its copy too (PostgreSQL: NOTIFY).
        await asyncio.to_thread(ctx.services.store.notify, CHANGES, "config:" + ctx.repo_name)
        log.info("delivery %s: %s: push may change %s; %d cached config(s) dropped",
                 ctx.delivery_id, ctx.repo_name, CONFIG_PATH, dropped)
    sha = commit_sha(data.get("after"))
    if sha is None or data.get("deleted") or set(sha) == {"0"}:
        return
    await check_config(ctx, sha)


@router.register("pull_request", action="opened")
@router.register("pull_request", action="synchronize")
@router.register("pull_request", action="reopened")
async def on_pull_request(event: Event, ctx: Context) -> None:
    pr = event.data.get("pull_request")
    head = pr.get("head") if isinstance(pr, dict) else None
    sha = commit_sha(head.get("sha")) if isinstance(head, dict) else None
    if sha is None:
        log.info("delivery %s: %s pull_request without a head sha, no config check",
                 ctx.delivery_id, ctx.repo_name)
        return
    await check_config(ctx, sha)
