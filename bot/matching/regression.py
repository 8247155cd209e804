"""Regressions are not duplicates: when an issue says a fix *caused* it ("regression from #N",
"broke since #N", "introduced by #N") or did not fix it ("#N didn't fix it"), when it cites the
fix at all (its reporter has seen it), or when the reporter's version already contains the fix,
the bug is not "already fixed" for that reporter. What a citation says is read in one place,
``bot/matching/citations.py``. It is a possible regression (or a case the fix
did not cover), and the answer is a label or a different comment, never "please update".

Pure: no clock, no I/O. The fix's first release comes from the cluster (``released_in``) or is
handed in by the caller (the bot asks the Releases API, ``first_release_after``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel

from bot.clusters.models import Cluster
from bot.matching.citations import citations
from bot.matching.types import IssueText

# Issue forms put the version under its own heading ("### Version", then the value on the next
# non-blank line). Read line by line: a pattern spanning lines backtracks quadratically on a
# hostile body, and this runs for every matched issue.
_HEADING = re.compile(r"#{1,6}\s*(.{0,60})")
_VALUE = re.compile(r"[`*\s]*v?(\d+\.\d+(?:\.\d+)?)\b")
_FORM_LINES = 400
# "Version: 1.4.0", "version 1.4.0", "v1.4.0" in running text.
_TEXT_VERSION = re.compile(
    r"\bversion[\s:=]{1,3}v?(\d+\.\d+(?:\.\d+)?)\b|(?<![\w.])v(\d+\.\d+\.\d+)\b", re.IGNORECASE
)
_RELEASE = re.compile(r"v?(\d+(?:\.\d+){1,3})")


class Regression(BaseModel):
    """Why a matched cluster is a possible regression rather than an already-fixed bug."""

    # caused_by_fix: the issue says the cluster's fix (or another of its PRs) caused it.
    # fix_failed: it says the fix (or another of the cluster's PRs) did not fix it.
    # cites_fix: it cites the cluster's fix PR, so the reporter has seen the fix.
    # version_contains_fix: the reporter's version already contains the fix.
    kind: Literal["caused_by_fix", "fix_failed", "cites_fix", "version_contains_fix"]
    # The cluster's fix or member the issue cites (every kind but ``version_contains_fix``).
    cited: int | None = None
    phrase: str | None = None
    reporter_version: str | None = None
    fix_version: str | None = None

    def reason(self) -> str:
        if self.kind == "caused_by_fix":
            return f"the issue says #{self.cited} caused it (“{self.phrase}”)"
        if self.kind == "fix_failed":
            return f"the issue says #{self.cited} did not fix it (“{self.phrase}”)"
        if self.kind == "cites_fix":
            return (f"the issue cites the fix #{self.cited} (“{self.phrase}”): its reporter has"
                    " seen it")
        return (f"the reporter's version {self.reporter_version} already contains the fix"
                f" (released in {self.fix_version})")


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``v2.7.1`` -> (2, 7, 1); None when it is not a dotted version."""
    if not text:
        return None
    m = _RELEASE.search(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _pad(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (4 - len(v))


def _form_versions(text: str) -> list[str]:
    """Values under an issue form's version headings, a bare "Version" heading first."""
    lines = text.splitlines()[:_FORM_LINES]
    exact: list[str] = []
    other: list[str] = []
    for i, line in enumerate(lines):
        heading = _HEADING.match(line.strip())
        if heading is None or "version" not in heading.group(1).lower():
            continue
        value = next((x for x in lines[i + 1:i + 4] if x.strip()), "")
        m = _VALUE.match(value)
        if m is None:
            continue
        words = heading.group(1).lower().replace(":", " ").split()
        (exact if words == ["version"] else other).append(m.group(1))
    return exact + other


def reporter_version(title: str, body: str | None,
                     plausible: Sequence[tuple[int, ...]] = ()) -> str | None:
    """The version the reporter runs, from an issue-form field or ``vX.Y.Z`` / ``version X.Y``
    in the text. ``plausible`` are this repository's known releases: a version whose major
    number is far past all of them belongs to something else (a runtime, an OS), not to us."""
    text = f"{title}\n{body or ''}"
    candidates = _form_versions(text)
    candidates += [m.group(1) or m.group(2) for m in _TEXT_VERSION.finditer(text)]
    top_major = max((v[0] for v in plausible), default=None)
    for cand in candidates:
        v = parse_version(cand)
        if v is None:
            continue
        if top_major is not None and v[0] > top_major + 1:
            continue
        return ".".join(map(str, v))
    return None


def version_contains(reporter: str, fix_release: str) -> bool:
    """Whether a build of ``reporter`` already has a fix first released in ``fix_release``."""
    r, f = parse_version(reporter), parse_version(fix_release)
    if r is None or f is None:
        return False
    return _pad(r) >= _pad(f)


def first_release_after(merged_at: str, releases: Iterable[tuple[str, str]]) -> str | None:
    """The first release (``(tag, published_at)``, ISO dates) published at or after a merge:
    the first release that can contain the fix."""
    later = sorted((published, tag) for tag, published in releases
                   if published and published >= merged_at)
    return later[0][1] if later else None


def regression_of(issue: IssueText, cluster: Cluster, fix_release: str | None = None,
                  plausible: Sequence[tuple[int, ...]] = (), *,
                  versions: bool = True) -> Regression | None:
    """Whether matching ``issue`` to ``cluster`` means a possible regression of its fix.
    ``versions=False`` reads only the issue's causal words: a cluster of an upstream
    repository is released under its own numbers, which the reporter's version (of the
    downstream package) cannot be compared with."""
    text = f"{issue.title}\n{issue.body or ''}"
    # A change causes a regression; an issue does not. "after #N" naming the bug's first report
    # is a duplicate telling its story, and gets the known-fix answer.
    prs = {m.number for m in cluster.members if m.is_pr}
    fixes = {m.number for m in cluster.members if m.is_fix_pr}
    if cluster.landed_fix.pr is not None:
        prs.add(cluster.landed_fix.pr)
        fixes.add(cluster.landed_fix.pr)
    cited = citations(text, [cluster.repo])
    for c in cited:
        if c.kind == "causal" and c.number in prs:
            return Regression(kind="caused_by_fix", cited=c.number, phrase=c.phrase[:80])
    for c in cited:
        if c.kind == "failure" and c.number in prs:
            return Regression(kind="fix_failed", cited=c.number, phrase=c.phrase[:80])
    for c in cited:
        # Whatever it says of the fix, a reporter who cites it has seen it: "already fixed"
        # would tell them what they know, and be wrong if they say it did not work.
        if c.number in fixes:
            return Regression(kind="cites_fix", cited=c.number, phrase=c.phrase[:80])
    release = cluster.landed_fix.released_in or fix_release
    if release and versions:
        known = list(plausible)
        if (v := parse_version(release)) is not None:
            known.append(v)
        version = reporter_version(issue.title, issue.body, known)
        if version and version_contains(version, release):
            return Regression(kind="version_contains_fix", reporter_version=version,
                              fix_version=release)
    return None
