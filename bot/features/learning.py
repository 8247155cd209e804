"""Learning: merged PRs that close issues become clusters; reverts and duplicate closes update
them. The index picks the change up without a restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeGuard

from gidgethub.routing import Router
from gidgethub.sansio import Event

from bot.clusters.learning import (
    MAX_FILES,
    add_duplicate,
    closing_refs,
    cluster_from_fix,
    duplicate_target,
    mark_reverted,
    reverted_number,
    trim_patch,
)
from bot.clusters.models import Cluster, FixHunk
from bot.db.store import Store
from bot.features.comment_writer import OwnComment, write_comment
from bot.features.context import Context
from bot.github.client import RepoClient
from bot.render.comment import render_reverted

log = logging.getLogger("dejafix.learning")
router = Router()


async def _lookup(indexed: Callable[[str, int], Cluster | None] | None, kind: str,
                  number: int) -> Cluster | None:
    # A scan of every cluster of the repository: in a thread, not on the event loop.
    return None if indexed is None else await asyncio.to_thread(indexed, kind, number)


def _find_indexed(ctx: Context, kind: str, number: int) -> Cluster | None:
    """A file or feed cluster in the live index with this member (or fix PR)."""
    # The index looks it up; scanning clusters() would rebuild every cluster of the repository.
    return ctx.services.index.current.find(ctx.repo_name, kind=kind, number=number)


async def learn_pr(client: RepoClient, store: Store, repo: str, pr: dict[str, Any],
                   indexed: Callable[[str, int], Cluster | None] | None = None
                   ) -> tuple[str, Cluster | None]:
    """Learn from one merged PR. Returns ("learned" | "reverted" | "skipped", the cluster
    written). The live handler and the REST backfill both call it. ``indexed`` finds a file or
    feed cluster by member, for a revert of a fix the repository did not learn itself."""
    number = int(pr["number"])
    reverted = await learn_revert(store, repo, pr, indexed)
    if reverted is not None:
        return reverted
    refs = pr_refs(pr, repo, await client.closing_issue_numbers(number))
    issues = [issue for issue in [await client.get_issue(ref) for ref in refs]
              if fix_issue(issue)]
    if not issues:
        return "skipped", None
    return "learned", await learn_fix(store, repo, pr, issues, await client.pr_files(number))


async def learn_revert(store: Store, repo: str, pr: dict[str, Any],
                       indexed: Callable[[str, int], Cluster | None] | None = None
                       ) -> tuple[str, Cluster | None] | None:
    """A revert PR marks the fix it undoes reverted ("reverted", or "skipped" when that fix is
    not known); None when the PR is not a revert."""
    target_number = reverted_number(pr.get("title"), pr.get("body"), repo)
    if target_number is None:
        return None
    target = (await asyncio.to_thread(store.find_learned, repo, "pr", target_number)
              or await asyncio.to_thread(store.find_learned, repo, "issue", target_number)
              or await _lookup(indexed, "pr", target_number))
    if target is None:
        return "skipped", None
    cluster = mark_reverted(target, int(pr["number"]), pr.get("merged_at"))
    await asyncio.to_thread(store.put_learned, cluster)
    return "reverted", cluster


MAX_REFS = 20


def pr_refs(pr: dict[str, Any], repo: str, linked: list[int]) -> list[int]:
    """The issue numbers a merged PR may fix, in the order learning reads them: its closing
    keywords first, then what GitHub links as closed by it; at most ``MAX_REFS``."""
    refs = closing_refs(f"{pr.get('title') or ''}\n{pr.get('body') or ''}", repo)
    for number in linked:
        if number not in refs:
            refs.append(number)
    return refs[:MAX_REFS]


def fix_issue(issue: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    # A "fixes #N" that points at a pull request (or at nothing) is not a bug report.
    return issue is not None and "pull_request" not in issue


async def learn_fix(store: Store, repo: str, pr: dict[str, Any], issues: list[dict[str, Any]],
                    files: list[dict[str, Any]]) -> Cluster:
    """The cluster of a merged PR and the issues it fixes, written to the store (joined with the
    cluster its first issue already has)."""
    existing = await asyncio.to_thread(store.find_learned, repo, "issue",
                                       int(issues[0]["number"]))
    cluster = cluster_from_fix(repo, pr, issues, files, existing=existing)
    await asyncio.to_thread(store.put_learned, cluster)
    return cluster


def fix_hunks(files: list[dict[str, Any]]) -> list[FixHunk]:
    """A fix's trimmed diff hunks from its files (REST, with patches): what ``cluster_from_fix``
    keeps, so that filling them in later gives the record learning with them would have."""
    return [FixHunk(file=str(f["filename"]), hunks=trim_patch(f.get("patch")))
            for f in files[:MAX_FILES] if f.get("filename") and f.get("patch")]


async def learn_fix_hunks(store: Store, repo: str, pr_number: int,
                          files: list[dict[str, Any]]) -> Cluster | None:
    """The diff hunks of fix PR ``pr_number`` written into the cluster that has it as a member,
    as it is now: later fixes of the same bug and duplicates added since stay (rebuilding the
    record from this PR alone would undo them). The updated cluster, or None when there is no
    such member or nothing changed."""
    hunks = fix_hunks(files)

    def update() -> Cluster | None:
        # Read and written in one thread call, so the record written is the one just read.
        cluster = store.find_learned(repo, "pr", pr_number)
        if cluster is None:
            return None
        members = [m.model_copy(update={"fix_hunks": hunks})
                   if m.is_pr and m.number == pr_number and m.fix_hunks != hunks else m
                   for m in cluster.members]
        if all(new is old for new, old in zip(members, cluster.members, strict=True)):
            return None
        updated = cluster.model_copy(update={"members": members})
        store.put_learned(updated)
        return updated

    return await asyncio.to_thread(update)


async def learn_from_merged_pr(ctx: Context, pr: dict[str, Any]) -> str:
    outcome, cluster = await learn_pr(ctx.repo, ctx.services.store, ctx.repo_name, pr,
                                      lambda kind, n: _find_indexed(ctx, kind, n))
    if cluster is None:
        return outcome
    # Rebuilds only this repository's index, in a thread, if this process holds it.
    await ctx.services.index.learned_changed(ctx.repo_name)
    log.info("delivery %s: %s cluster %s %s from #%s", ctx.delivery_id, ctx.repo_name,
             cluster.public_id, outcome, pr["number"])
    if outcome == "reverted":
        await _correct_comments(ctx, cluster, int(pr["number"]))
    return f"cluster {cluster.public_id} {outcome}"


async def _correct_comments(ctx: Context, cluster: Cluster, revert_pr: int) -> None:
    """Issues already told "this is fixed" by this cluster are told the fix was reverted."""
    records = await asyncio.to_thread(ctx.services.store.comments_for_cluster, ctx.repo_name,
                                      cluster.public_id)
    body = render_reverted(cluster, issue_repo=ctx.repo_name, revert_pr=revert_pr)
    for record in records:
        # Only the comment the ledger names is corrected (one already saying so is left
        # alone); one deleted since stays deleted, and the issues after it are still told.
        await write_comment(ctx, record.issue, body, cluster=cluster.public_id,
                            score=record.score, found=OwnComment(record.comment_id, record),
                            repost_when_gone=False, log=log)


@router.register("pull_request", action="closed")
async def on_pull_request_closed(event: Event, ctx: Context) -> None:
    pr = event.data.get("pull_request")
    if not isinstance(pr, dict) or not pr.get("merged") or not isinstance(pr.get("number"), int):
        return
    await learn_from_merged_pr(ctx, pr)


async def learn_duplicate(client: RepoClient, store: Store, repo: str, issue: dict[str, Any],
                          indexed: Callable[[str, int], Cluster | None] | None = None
                          ) -> tuple[int | None, Cluster | None]:
    """An issue closed as a duplicate joins the cluster of the issue it duplicates ("Duplicate
    of #N" in its comments). Returns (N, the updated cluster, or None when nothing changed).
    The live handler and the REST backfill both call it."""
    comments = await client.issue_comments(int(issue["number"]))
    target = duplicate_target(c.get("body") for c in comments)
    return target, await learn_duplicate_of(store, repo, issue, target, indexed)


async def learn_duplicate_of(store: Store, repo: str, issue: dict[str, Any], target: int | None,
                             indexed: Callable[[str, int], Cluster | None] | None = None
                             ) -> Cluster | None:
    """``issue`` joins the cluster of ``target``: the updated cluster, or None when nothing
    changed (no target, no cluster of it, already a member)."""
    if target is None:
        return None
    cluster = (await asyncio.to_thread(store.find_learned, repo, "issue", target)
               or await _lookup(indexed, "issue", target))
    if cluster is None:
        return None
    updated = add_duplicate(cluster, issue)
    if updated is cluster:
        return None
    await asyncio.to_thread(store.put_learned, updated)
    return updated


@router.register("issues", action="closed")
async def on_issue_closed(event: Event, ctx: Context) -> None:
    issue = event.data.get("issue")
    if not isinstance(issue, dict) or issue.get("state_reason") != "duplicate":
        return
    if not isinstance(issue.get("number"), int):
        return
    target, updated = await learn_duplicate(ctx.repo, ctx.services.store, ctx.repo_name, issue,
                                            lambda kind, n: _find_indexed(ctx, kind, n))
    if updated is None:
        if target is not None:
            log.info("delivery %s: %s#%s duplicate of #%s: no cluster to add it to",
                     ctx.delivery_id, ctx.repo_name, issue["number"], target)
        return
    await ctx.services.index.learned_changed(ctx.repo_name)
    log.info("delivery %s: %s#%s added to cluster %s as a duplicate", ctx.delivery_id,
             ctx.repo_name, issue["number"], updated.public_id)
