"""Learning: merged PRs that close issues become clusters; reverts and duplicate closes update
them. The index picks the change up without a restart."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.clusters.models import Cluster
from bot.comment import body_hash, render_reverted
from bot.handlers.context import Context
from bot.learning import (
    add_duplicate,
    closing_refs,
    cluster_from_fix,
    duplicate_target,
    mark_reverted,
    reverted_number,
)

log = logging.getLogger("dejafix.learning")
router = Router()


async def _save(ctx: Context, cluster: Cluster) -> None:
    await asyncio.to_thread(ctx.services.store.put_learned, cluster)
    # Rebuilds only this repository's matcher (others are reused), in a thread.
    await ctx.services.index.refresh()


def _find_indexed(ctx: Context, kind: str, number: int) -> Cluster | None:
    """A file or feed cluster in the live index with this member (or fix PR)."""
    for cluster in ctx.services.index.current.clusters(ctx.repo_name):
        if kind == "pr" and cluster.landed_fix.pr == number:
            return cluster
        if any(m.kind == kind and m.number == number for m in cluster.members):
            return cluster
    return None


async def learn_from_merged_pr(ctx: Context, pr: dict[str, Any]) -> str:
    number = int(pr["number"])
    store = ctx.services.store
    reverted = reverted_number(pr.get("title"), pr.get("body"), ctx.repo_name)
    if reverted is not None:
        target = (await asyncio.to_thread(store.find_learned, ctx.repo_name, "pr", reverted)
                  or await asyncio.to_thread(store.find_learned, ctx.repo_name, "issue",
                                             reverted)
                  or _find_indexed(ctx, "pr", reverted))
        if target is None:
            return f"revert of #{reverted}: no known cluster"
        reverted_cluster = mark_reverted(target, number, pr.get("merged_at"))
        await _save(ctx, reverted_cluster)
        log.info("delivery %s: %s cluster %s marked reverted by #%s", ctx.delivery_id,
                 ctx.repo_name, target.public_id, number)
        await _correct_comments(ctx, reverted_cluster, number)
        return f"cluster {target.public_id} reverted"

    refs = closing_refs(f"{pr.get('title') or ''}\n{pr.get('body') or ''}", ctx.repo_name)
    for linked in await ctx.repo.closing_issue_numbers(number):
        if linked not in refs:
            refs.append(linked)
    if not refs:
        return "closes no issue"
    issues = []
    for ref in refs[:20]:
        issue = await ctx.repo.get_issue(ref)
        # A "fixes #N" that points at a pull request is not a bug report.
        if issue is not None and "pull_request" not in issue:
            issues.append(issue)
    if not issues:
        return "closing references are not issues"
    files = await ctx.repo.pr_files(number)
    existing = await asyncio.to_thread(store.find_learned, ctx.repo_name, "issue",
                                       int(issues[0]["number"]))
    cluster = cluster_from_fix(ctx.repo_name, pr, issues, files, existing=existing)
    await _save(ctx, cluster)
    log.info("delivery %s: %s learned cluster %s from #%s (%d issue(s), %d file(s))",
             ctx.delivery_id, ctx.repo_name, cluster.public_id, number, len(issues), len(files))
    return f"cluster {cluster.public_id} learned"


async def _correct_comments(ctx: Context, cluster: Cluster, revert_pr: int) -> None:
    """Issues already told "this is fixed" by this cluster are told the fix was reverted."""
    records = await asyncio.to_thread(ctx.services.store.comments_for_cluster, ctx.repo_name,
                                      cluster.public_id)
    body = render_reverted(cluster, issue_repo=ctx.repo_name, revert_pr=revert_pr)
    digest = body_hash(body)
    for record in records:
        if record.body_hash == digest:
            continue
        await ctx.repo.edit_comment(record.comment_id, body)
        if not ctx.services.dry_run:
            await asyncio.to_thread(ctx.services.store.record_comment, ctx.repo_name,
                                    record.issue, record.comment_id, cluster.public_id,
                                    record.score, digest)


@router.register("pull_request", action="closed")
async def on_pull_request_closed(event: Event, ctx: Context) -> None:
    pr = event.data.get("pull_request")
    if not isinstance(pr, dict) or not pr.get("merged") or not isinstance(pr.get("number"), int):
        return
    await learn_from_merged_pr(ctx, pr)


@router.register("issues", action="closed")
async def on_issue_closed(event: Event, ctx: Context) -> None:
    issue = event.data.get("issue")
    if not isinstance(issue, dict) or issue.get("state_reason") != "duplicate":
        return
    number = issue.get("number")
    if not isinstance(number, int):
        return
    comments = await ctx.repo.issue_comments(number)
    target = duplicate_target(c.get("body") for c in comments)
    if target is None:
        return
    cluster = await asyncio.to_thread(ctx.services.store.find_learned, ctx.repo_name, "issue",
                                      target)
    if cluster is None:
        indexed = _find_indexed(ctx, "issue", target)
        if indexed is None:
            log.info("delivery %s: %s#%s duplicate of #%s, which no cluster knows",
                     ctx.delivery_id, ctx.repo_name, number, target)
            return
        cluster = indexed
    updated = add_duplicate(cluster, issue)
    if updated is not cluster:
        await _save(ctx, updated)
        log.info("delivery %s: %s#%s added to cluster %s as a duplicate", ctx.delivery_id,
                 ctx.repo_name, number, cluster.public_id)
