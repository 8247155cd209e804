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
# Words saying the referenced change *caused* what is reported (before the reference) ...
_CAUSE_BEFORE = (
    r"regress(?:ion|ed)?(?:\s+(?:from|of|in|since|after|by|caused\s+by|introduced\s+(?:by|in)))?"
    r"|since|after(?:\s+(?:merging|the\s+merge\s+of|the\s+fix\s+in|applying|upgrading\s+to))?"
    r"|introduced\s+(?:by|in|with)|caused\s+by|broke(?:n)?\s+(?:by|in|since|after|with)"
    r"|started\s+(?:with|after|in)|follow[- ]?up\s+(?:to|of|for|on)|remainder\s+of"
    r"|still\s+(?:broken|happens|occurs|fails|present)\s+(?:after|with|since|despite)"
    r"|not\s+(?:fully\s+)?fixed\s+(?:by|in)|incomplete\s+fix\s+(?:in|from|of)"
    r"|even\s+(?:after|with)|despite"
    r"|回归|引入|之后|以后"
)
# ... or after it: "#123 broke ...", "#123 introduced ...", "(#123 remainder)".
_CAUSE_AFTER = (
    r"broke|breaks|introduced|caused|regressed|remainder|follow[- ]?up|did\s+not\s+fix"
    r"|didn't\s+fix|doesn't\s+fix|does\s+not\s+fix|引入|导致"
    # The fix (or its tests) failing for the reporter: the bug is not fixed for them.
    r"|fail(?:s|ed)?|didn't\s+help|did\s+not\s+help|doesn't\s+work|does\s+not\s+work"
)
_BEFORE = re.compile(
    rf"(?P<cue>{_CAUSE_BEFORE})[\s:,(]*(?:(?:the\s+)?(?:fix|change|pr|commit|merge)\s+(?:in\s+)?)?"
    rf"{_REF}",
    re.IGNORECASE,
)
_AFTER = re.compile(rf"{_REF}[\s)'\"]*(?:\w+\s+){{0,1}}(?P<cue>{_CAUSE_AFTER})\b", re.IGNORECASE)

# Issue forms put the version under its own heading: "### Version\n\n0.20.0".
_FORM_VERSION = re.compile(
    r"^#{1,6}\s*[^\n]*\bversion\b[^\n]*\n+\s*[`*]*v?(\d+\.\d+(?:\.\d+)?)",
    re.IGNORECASE | re.MULTILINE,
)
# "Version: 0.20.0", "version 0.20.0", "v0.20.0".
_TEXT_VERSION = re.compile(
    r"\bversion[\s:=]+v?(\d+\.\d+(?:\.\d+)?)\b|(?<![\w.])v(\d+\.\d+\.\d+)\b", re.IGNORECASE
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
    Only the text around each reference is read: most bodies cite nothing."""
    found: dict[int, str] = {}
    for ref in _ANY_REF.finditer(text or ""):
        window = text[max(0, ref.start() - _BEFORE_CHARS): ref.end() + _AFTER_CHARS]
        for pattern in (_BEFORE, _AFTER):
            for m in pattern.finditer(window):
                number = int(next(g for g in m.groups() if g and g.isdigit()))
                found.setdefault(number, " ".join(m.group(0).split()))
    return list(found.items())


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``v0.13.0`` -> (0, 13, 0); None when it is not a dotted version."""
    if not text:
        return None
    m = _RELEASE.search(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _pad(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (4 - len(v))


def reporter_version(title: str, body: str | None,
                     plausible: Sequence[tuple[int, ...]] = ()) -> str | None:
    """The version the reporter runs, from an issue-form field or ``vX.Y.Z`` / ``version X.Y``
    in the text. ``plausible`` are this repository's known releases: a version whose major
    number is far past all of them belongs to something else (a runtime, an OS), not to us."""
    text = f"{title}\n{body or ''}"
    candidates = [m.group(1) for m in _FORM_VERSION.finditer(text)]
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
    own = {m.number for m in cluster.members}
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
