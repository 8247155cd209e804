"""Clusters learned from the repository itself: a merged PR that closes issues is a fixed bug,
with the PR's files and diff as its evidence. Pure functions over plain API data; the handlers
and the backfill fetch, the store keeps the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from bot.clusters.models import (
    Cluster,
    Counts,
    FixEdge,
    FixHunk,
    Freshness,
    Grouping,
    LandedFix,
    Member,
    Resolution,
    Trust,
)

# GitHub's closing keywords, followed by a reference to an issue of this repository.
_KEYWORDS = r"(?:close[sd]?|fix(?:e[sd])?|resolve[sd]?)"
_CLOSING = re.compile(
    rf"\b{_KEYWORDS}\s*:?\s+"
    r"(?:(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+)#(?P<n1>\d+)"
    r"|#(?P<n2>\d+)"
    r"|https?://github\.com/(?P<uowner>[\w.-]+)/(?P<urepo>[\w.-]+)/issues/(?P<n3>\d+))",
    re.IGNORECASE,
)
_REVERT_TITLE = re.compile(r'^\s*Revert\s+"', re.IGNORECASE)
_REVERTS = re.compile(
    r"\breverts?\s+(?:(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+))?#(?P<n>\d+)"
    r"|\breverts?\s+https?://github\.com/(?P<uowner>[\w.-]+)/(?P<urepo>[\w.-]+)/pull/(?P<un>\d+)",
    re.IGNORECASE,
)
_TRAILING_REF = re.compile(r"\(#(\d+)\)\s*\"?\s*$")
_FENCE = re.compile(r"```.*?```", re.DOTALL)
_QUOTE = re.compile(r"^\s*>.*$", re.MULTILINE)

MAX_HUNKS_PER_FILE = 12
MAX_LINES_PER_HUNK = 40
MAX_FILES = 300


def _unquoted(text: str) -> str:
    # A keyword quoted from another thread or shown in a code block closes nothing.
    return _QUOTE.sub("", _FENCE.sub("", text))


def closing_refs(text: str | None, repo: str) -> list[int]:
    """Issue numbers this text closes in ``repo`` (other repositories' references ignored)."""
    found: dict[int, None] = {}
    for m in _CLOSING.finditer(_unquoted(text or "")):
        owner, name = m.group("owner") or m.group("uowner"), m.group("repo") or m.group("urepo")
        if owner and f"{owner}/{name}".lower() != repo.lower():
            continue
        number = int(m.group("n1") or m.group("n2") or m.group("n3"))
        found.setdefault(number, None)
    return list(found)


def reverted_number(title: str | None, body: str | None, repo: str) -> int | None:
    """The PR (or issue) number a revert PR undoes, or None when it is not a revert."""
    for m in _REVERTS.finditer(_unquoted(body or "")):
        owner = m.group("owner") or m.group("uowner")
        name = m.group("repo") or m.group("urepo")
        if owner and f"{owner}/{name}".lower() != repo.lower():
            continue
        return int(m.group("n") or m.group("un"))
    if title and _REVERT_TITLE.match(title):
        trailing = _TRAILING_REF.search(title)
        if trailing:
            return int(trailing.group(1))
    return None


def trim_patch(patch: str | None) -> list[str]:
    """Hunks of a unified diff, each its ``@@`` header plus changed lines only, bounded: what the
    matcher needs (function headers, identifiers on changed lines), not the whole diff."""
    if not patch:
        return []
    hunks: list[list[str]] = []
    for line in patch.splitlines():
        if line.startswith("@@"):
            if len(hunks) >= MAX_HUNKS_PER_FILE:
                break
            hunks.append([line])
        elif hunks and line[:1] in "+-" and len(hunks[-1]) <= MAX_LINES_PER_HUNK:
            hunks[-1].append(line)
    return ["\n".join(h) for h in hunks]


def _state(issue: Mapping[str, Any]) -> str:
    return str(issue.get("state") or "unknown")


# Kept with each learned issue (extra fields of the member record) so that a backtest can replay
# the report as it was opened; the matcher indexes titles only, so this never leaks into ranking.
MAX_BODY_EXCERPT = 2000


def _issue_member(issue: Mapping[str, Any]) -> Member:
    return Member.model_validate({
        "kind": "issue", "number": int(issue["number"]), "title": issue.get("title"),
        "url": issue.get("html_url"), "state": _state(issue),
        "created_at": issue.get("created_at"),
        "body_excerpt": str(issue.get("body") or "")[:MAX_BODY_EXCERPT] or None,
    })


def cluster_from_fix(
    repo: str,
    pr: Mapping[str, Any],
    issues: Iterable[Mapping[str, Any]],
    files: Iterable[Mapping[str, Any]],
    *,
    existing: Cluster | None = None,
) -> Cluster:
    """The cluster for a merged PR and the issues it closes: same model as the seeds.

    ``existing`` (the learned cluster of the same first issue, if any) keeps its members, so a
    second fix for the same bug adds to the record instead of replacing it."""
    issues = list(issues)
    pr_number = int(pr["number"])
    merged_at = pr.get("merged_at")
    file_list = list(files)[:MAX_FILES]
    paths = [str(f["filename"]) for f in file_list if f.get("filename")]
    hunks = [FixHunk(file=str(f["filename"]), hunks=trim_patch(f.get("patch")))
             for f in file_list if f.get("filename") and f.get("patch")]
    fix_member = Member(
        kind="pr", number=pr_number, title=pr.get("title"), url=pr.get("html_url"),
        state="merged", merged=True, is_fix_pr=True, fix_tier="verified",
        files_changed=paths, fix_hunks=hunks,
    )
    members: dict[tuple[str, int], Member] = {}
    if existing is not None:
        for m in existing.members:
            members[(m.kind, m.number)] = m
    for issue in issues:
        members[("issue", int(issue["number"]))] = _issue_member(issue)
    for key, m in list(members.items()):
        if m.is_pr and m.is_fix_pr and m.number != pr_number:
            # An earlier fix of the same bug stays as a member; the newest landed one leads.
            members[key] = m.model_copy(update={"is_fix_pr": False})
    members[("pr", pr_number)] = fix_member
    first_issue = int(issues[0]["number"]) if issues else pr_number
    public_id = existing.public_id if existing is not None else str(first_issue)
    label = (issues[0].get("title") if issues else None) or pr.get("title") or f"Fix #{pr_number}"
    body_summary = " ".join(str(pr.get("body") or "").split())[:400]
    ordered = sorted(members.values(), key=lambda m: (m.kind != "issue", m.number))
    return Cluster(
        repo=repo,
        public_id=public_id,
        display_label=str(label),
        summary=body_summary or str(pr.get("title") or ""),
        subsystem=None,
        counts=Counts(
            members=len(ordered),
            closed_issues=sum(1 for m in ordered if m.kind == "issue" and m.state == "closed"),
            open_issues=sum(1 for m in ordered if m.kind == "issue" and m.state == "open"),
            merged_prs=sum(1 for m in ordered if m.is_pr and m.merged),
        ),
        landed_fix=LandedFix(status="merged_to_main", basis="closing_ref", pr=pr_number,
                             merged_at=merged_at),
        resolution=Resolution(state="resolved", by=f"pr-{pr_number}"),
        freshness=Freshness(state="verified", last_verified_at=merged_at, is_stale=False),
        grouping=Grouping(backbone="CLOSING_REF", source="learned"),
        fix_edges=[FixEdge(issue_number=int(i["number"]), pr_number=pr_number, tier="verified",
                           basis="closing_ref", confidence=0.95, pr_merged_at=merged_at)
                   for i in issues],
        members=ordered,
        trust=Trust(default_tier="verified", includes_suggested=False),
    )


def mark_reverted(cluster: Cluster, revert_pr: int, merged_at: str | None) -> Cluster:
    """The cluster with its fix marked reverted: no longer offered as fixed."""
    fix = cluster.landed_fix.model_copy(update={"status": "reverted", "reverted": True})
    member = Member(kind="pr", number=revert_pr, title=f"Revert of #{cluster.landed_fix.pr}",
                    state="merged", merged=True, is_fix_pr=False)
    members = [m for m in cluster.members if m.number != revert_pr] + [member]
    fresh = cluster.freshness.model_copy(update={"last_verified_at": merged_at})
    return cluster.model_copy(update={"landed_fix": fix, "members": members, "freshness": fresh})


def add_duplicate(cluster: Cluster, issue: Mapping[str, Any]) -> Cluster:
    """The cluster with another report of the same bug as a member."""
    number = int(issue["number"])
    if any(m.number == number and m.kind == "issue" for m in cluster.members):
        return cluster
    return cluster.model_copy(update={"members": [*cluster.members, _issue_member(issue)]})


_DUPLICATE_OF = re.compile(r"^\s*duplicate\s+of\s+#(\d+)\b", re.IGNORECASE | re.MULTILINE)


def duplicate_target(comment_bodies: Iterable[str | None]) -> int | None:
    """N from the last "Duplicate of #N" comment (what GitHub writes on closing as duplicate)."""
    target = None
    for body in comment_bodies:
        m = _DUPLICATE_OF.search(_unquoted(body or ""))
        if m:
            target = int(m.group(1))
    return target
