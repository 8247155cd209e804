"""Regressions are not duplicates: when an issue says a fix *caused* it ("regression from #N",
"broke since #N", "introduced by #N"), or when the reporter's version already contains the fix,
the bug is not "already fixed" for that reporter. It is a possible regression (or a case the fix
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
from bot.matching.types import IssueText

# A reference to an issue or PR: ``#123``, ``PR 123``, ``pull/123``, ``issues/123``.
_REF = r"(?:#|\bPR\s*#?|\bpull/|\bissues/)(\d{1,7})\b"
# Words saying the referenced change *caused* what is reported, before the reference: the
# causal contexts of a regression report ("regression from #N", "since #N", "after #N",
# "introduced by #N", "broke in #N") and their plain synonyms. Nothing here was written from an
# example issue; phrases that say only that a fix was incomplete are left out on purpose.
_CAUSE_BEFORE = (
    r"regress(?:ion|ed)?(?:\s+(?:from|of|in|since|after|by|caused\s+by|introduced\s+(?:by|in)))?"
    r"|since|after(?:\s+(?:merging|the\s+merge\s+of|the\s+fix\s+in|applying|upgrading\s+to))?"
    r"|introduced\s+(?:by|in|with)|caused\s+by|broke(?:n)?\s+(?:by|in|since|after|with)"
    r"|started\s+(?:with|after|in)"
)
# ... or after it: "#123 broke ...", "#123 introduced ...", "#123 引入 / 导致".
_CAUSE_AFTER = r"broke|breaks|introduced|caused|regressed|引入|导致"
_BEFORE = re.compile(
    rf"\b(?P<cue>{_CAUSE_BEFORE})[\s:,(]*(?:(?:the\s+)?(?:fix|change|pr|commit|merge)\s+"
    rf"(?:in\s+)?)?{_REF}",
    re.IGNORECASE,
)
_AFTER = re.compile(rf"{_REF}[\s)'\"]*(?:\w+\s+){{0,1}}(?P<cue>{_CAUSE_AFTER})", re.IGNORECASE)
# ``owner/name#123``: a reference into another repository, which no cluster of ours is.
_FOREIGN = re.compile(r"[\w.-]+/[\w.-]+$")
# A body citing more than this many numbers is a list, not a story: the rest are not read.
_MAX_REFS = 50

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

    kind: Literal["caused_by_fix", "version_contains_fix"]
    # The cluster's fix or member the issue cites in a causal phrase (``caused_by_fix``).
    cited: int | None = None
    phrase: str | None = None
    reporter_version: str | None = None
    fix_version: str | None = None

    def reason(self) -> str:
        if self.kind == "caused_by_fix":
            return f"the issue says #{self.cited} caused it (“{self.phrase}”)"
        return (f"the reporter's version {self.reporter_version} already contains the fix"
                f" (released in {self.fix_version})")


_ANY_REF = re.compile(_REF, re.IGNORECASE)
# How much text around a reference the cue phrases may take.
_BEFORE_CHARS = 80
_AFTER_CHARS = 40


def causal_citations(text: str) -> list[tuple[int, str]]:
    """The numbers ``text`` cites as the cause of what it reports, with the phrase, in order.
    Only the text around each reference is read (most bodies cite nothing), and a cue counts
    only when the reference it ends or starts with is that very reference."""
    found: dict[int, str] = {}
    text = text or ""
    for n, ref in enumerate(_ANY_REF.finditer(text)):
        if n >= _MAX_REFS:
            break
        if text[ref.start()] == "#" and _FOREIGN.search(text, max(0, ref.start() - 100),
                                                         ref.start()):
            continue
        number = int(ref.group(1))
        before = _BEFORE.search(text, max(0, ref.start() - _BEFORE_CHARS), ref.end())
        while before is not None and before.end() != ref.end():
            before = _BEFORE.search(text, before.start() + 1, ref.end())
        if before is not None:
            found.setdefault(number, " ".join(before.group(0).split()))
            continue
        after = _AFTER.match(text, ref.start(), min(len(text), ref.end() + _AFTER_CHARS))
        if after is not None:
            found.setdefault(number, " ".join(after.group(0).split()))
    return list(found.items())


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
    own = {m.number for m in cluster.members if m.is_pr}
    if cluster.landed_fix.pr is not None:
        own.add(cluster.landed_fix.pr)
    for number, phrase in causal_citations(text):
        if number in own:
            return Regression(kind="caused_by_fix", cited=number, phrase=phrase[:80])
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
