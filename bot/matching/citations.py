"""What an issue says about each issue or PR it cites, read from the words around the citation.

A citation is not agreement. "Duplicate of #N" and "Closes #N" say the issue *is* #N's bug;
"distinct from #N", "a follow-up to #N", "#N's remainder", "#N did not fix it" say it is not, or
not any more; "regression from #N" says #N caused it. The matcher counts only the first kind for a
match (``CitationKind`` "same") and the contrasting, continuing and failing kinds against it; the
regression check (``bot/matching/regression.py``) reads the causal and failing kinds.

The cues are written from the language, as any tracker's users write them (one table, one test
per row in ``tests/test_citations.py``), never from a data set. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

# same: the issue says it is the cited one's bug (closing keywords, "duplicate of", "same as").
# contrast: a different bug ("distinct from", "unlike", "not the same as").
# continuation: what the cited one left ("follow-up to", "remainder", "still", "again").
# failure: the cited change did not work ("#N did not fix", "#N's tests fail").
# causal: the cited change caused it ("regression from #N", "#N broke").
# mention: none of these ("see #N", "related: #N", "(#N)").
CitationKind = Literal["same", "contrast", "continuation", "failure", "causal", "mention"]


@dataclass(frozen=True)
class Citation:
    number: int
    kind: CitationKind
    phrase: str  # the cue and the reference, as written (whitespace folded)


# A reference to an issue or PR: ``#123``, ``PR 123``, ``PR #123``, ``pull/123``, ``issues/123``.
REF = r"(?:#|\bPR\s*#?|\bpull/|\bissues/)(\d{1,7})\b"
_ANY_REF = re.compile(REF, re.IGNORECASE)
# ``owner/name#123``: a reference into another repository, which no cluster of ours is.
_FOREIGN = re.compile(r"[\w.-]+/[\w.-]+$")
# A body citing more than this many numbers is a list, not a story: the rest are not read.
_MAX_REFS = 50
# How far from a reference its cue may be: the words before it, and after it, within the
# sentence (a cue in the next sentence is about something else).
_BEFORE_CHARS = 80
_AFTER_CHARS = 50
# What may stand between a cue and the reference it governs: "the fix in", "PR", "issue".
_BRIDGE = (r"[\s:,(\[*_`\"']*(?:(?:the|a|an|this|that|its|their)\s+)?"
           r"(?:(?:fix|change|changes|pr|pull\s+request|commit|merge|issue|bug|report|ticket)"
           r"\s+(?:in\s+|from\s+|of\s+)?)?"
           # a link's address up to ``issues/N`` or ``pull/N``
           r"(?:https?://[^\s/]+(?:/[^\s/]+){0,3}?/(?=(?:issues|pull)/))?")
# What may stand between a reference and the cue after it: "#N's", "#N (the fix)".
# A comma ends the clause: "Same as #N, the bot still hangs" says nothing more of #N.
_AFTER_BRIDGE = r"(?:'s|’s)?[\s)\]*_`\"':]*(?:\([^)]{0,40}\)\s*)?(?:\w+\s+)?"

# (kind, cue before the reference, cue after it). The first row whose cue touches a reference
# decides it, so the stronger readings come first: a failure or a cause outranks a contrast,
# which outranks a continuation, which outranks "same as".
_CUES: tuple[tuple[CitationKind, str | None, str | None], ...] = (
    # A hedge says nothing either way: "not sure if this is the same as #N".
    ("mention",
     r"not\s+sure\s+(?:\w+\s+){0,4}?(?:same|duplicate|dup|dupe|related)\s+(?:\w+\s+)?(?:as|of|to)"
     r"|(?:may|might|could)\s+be\s+(?:\w+\s+){0,2}?(?:same|duplicate|dup|dupe|related)\s+"
     r"(?:\w+\s+)?(?:as|of|to)",
     None),
    ("causal",
     r"regress(?:ion|ed)?(?:\s+(?:from|of|in|since|after|by|caused\s+by|introduced\s+(?:by|in)))?"
     r"|since|(?<!even\s)after(?:\s+(?:merging|the\s+merge\s+of|applying|upgrading\s+to))?"
     r"|introduced\s+(?:by|in|with)|caused\s+by|broke(?:n)?\s+(?:by|in|since|after|with)"
     r"|started\s+(?:with|after|in)|bisect(?:ed|s)?\s+(?:\w+\s+){0,3}?to",
     r"broke|breaks|introduced|caused|regressed|引入|导致"),
    ("failure",
     r"(?:did\s*n[o']?t|does\s*n[o']?t|do\s+not|didn't|doesn't|not)\s+(?:fully\s+|actually\s+)?"
     r"(?:fix|fixed|solve|solved|resolve|resolved)(?:\s+by)?"
     r"|(?:not|never|wasn't|isn't|was\s+not|is\s+not)\s+(?:fully\s+|actually\s+)?"
     r"(?:fixed|solved|resolved)\s+by"
     r"|despite|even\s+(?:after|with)",
     r"(?:did\s*n[o']?t|does\s*n[o']?t|didn't|doesn't)\s+(?:fully\s+|actually\s+)?"
     r"(?:fix|solve|resolve|work|help)"
     r"|(?:is|was)\s+(?:not\s+enough|incomplete|insufficient)|fail|fails|failed|failing"
     r"|tests?\s+(?:fail|failed|failing)|(?:is\s+|was\s+)?reverted"),
    ("contrast",
     r"distinct\s+from|unlike|not\s+(?:\w+\s+){0,2}?same\s+(?:\w+\s+){0,2}?as|different\s+from"
     r"|differs\s+from|unrelated\s+to|not\s+related\s+to|separate\s+from"
     r"|(?:not|is\s*n[o']?t|isn't|was\s*n[o']?t|wasn't)\s+(?:\w+\s+){0,2}?(?:a\s+)?"
     r"(?:duplicate|dup|dupe)\s+of"
     r"|(?:is\s*n[o']?t|isn't|are\s*n[o']?t|aren't)\s+(?:\w+\s+){0,2}?same\s+(?:\w+\s+){0,2}?as"
     r"|(?:do\s*n[o']?t|don't|do\s+not)\s+think\s+(?:\w+\s+){0,4}?(?:duplicate|dup|dupe|same)"
     r"\s+(?:\w+\s+){0,2}?(?:of|as)"
     r"|other\s+than|rather\s+than",
     r"is\s+(?:a\s+)?different|is\s+unrelated|is\s+not\s+(?:the\s+)?same"),
    ("continuation",
     r"follow[\s-]?up\s+(?:to|of|on|for)|remainder\s+of|rest\s+of|leftover\s+(?:of|from)"
     r"|left\s+over\s+from|part\s+of|continuation\s+of|again"
     r"|(?:still|also\s+happens)(?:\s+\w+){0,3}?\s+(?:in|on|with|as|like)"
     r"|re-?open(?:s|ed|ing)?",
     r"remainder|leftovers?|follow[\s-]?up|still|again|also\s+happens|(?:is\s+)?back"),
    ("same",
     # "the same crash as #N" is identity; "the same class / pattern as #N" only likeness.
     r"(?:a\s+)?(?:duplicate|dup|dupe)\s+(?:of|to)"
     r"|same\s+(?:(?:\w+\s+){0,2}?(?:bug|issue|problem|crash|error|failure|behaviou?r|hang"
     r"|leak|regression|report|thing)\s+)?as"
     r"|identical\s+to|already\s+reported\s+(?:in|as|at)",
     r"(?:is\s+)?(?:the\s+)?same\s+(?:bug|issue|problem|thing)"),
)
# GitHub's closing keywords, as GitHub reads them: the verb right before the reference ("fixes
# #12", "Closes: #12"); "the fix (#12)" is a noun, and says nothing of the issue.
_CLOSING = re.compile(
    rf"(?<![\w-])(?<!the\s)(?<!a\s)(?<!this\s)(?<!that\s)(?<!its\s)(?<!our\s)(?<!my\s)"
    rf"(?<!not\s)(?<!n't\s)(?<!nt\s)(?<!never\s)(?<!to\s)"
    rf"(?:close[sd]?|fix(?:e[sd])?|resolve[sd]?)\s*:?\s+{REF}", re.IGNORECASE)
_BEFORE = tuple(
    (kind, re.compile(rf"\b(?:{before}){_BRIDGE}{REF}", re.IGNORECASE) if before else None)
    for kind, before, _ in _CUES)
_AFTER = tuple(
    (kind, re.compile(rf"{REF}{_AFTER_BRIDGE}(?:{after})\b", re.IGNORECASE) if after else None)
    for kind, _, after in _CUES)
# Where a sentence ends: a cue beyond it does not govern the reference.
# A line break ends one too: the title and the body are read as one text, and a list item or a
# heading is its own statement.
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)|\n")


def _window(text: str, start: int, end: int) -> tuple[int, int]:
    """The part of the sentence around ``text[start:end]`` the cues may take."""
    lo = max(0, start - _BEFORE_CHARS)
    for m in _SENTENCE_END.finditer(text, lo, start):
        lo = m.end()
    hi = min(len(text), end + _AFTER_CHARS)
    stop = _SENTENCE_END.search(text, end, hi)
    return lo, (stop.start() + 1 if stop else hi)


_LINK_REPO = re.compile(r"([\w.-]+)/([\w.-]+)/$")


def _ours(text: str, at: int, repos: Collection[str]) -> bool:
    """Whether the link whose ``issues/N`` or ``pull/N`` starts at ``at`` is into one of
    ``repos`` (a bare ``issues/N`` with no repository before it is taken as ours)."""
    if not repos:
        return True
    owner = _LINK_REPO.search(text, max(0, at - 200), at)
    if owner is None:
        return True
    return f"{owner.group(1)}/{owner.group(2)}".lower() in {r.lower() for r in repos}


def _before(pattern: re.Pattern[str], text: str, lo: int, ref_end: int) -> re.Match[str] | None:
    """The match of ``pattern`` that ends exactly at this reference (a cue governing an earlier
    reference is that one's)."""
    found = pattern.search(text, lo, ref_end)
    while found is not None and found.end() != ref_end:
        found = pattern.search(text, found.start() + 1, ref_end)
    return found


# The strength of each reading, in the table's order; a mere mention (and a hedge, which reads
# as one) is the weakest.
_RANK: dict[str, int] = {
    kind: i for i, kind in enumerate(dict.fromkeys(k for k, _, _ in _CUES if k != "mention"))}


def _reading(text: str, ref: re.Match[str], lo: int, hi: int) -> Citation:
    """What the sentence ``text[lo:hi]`` says of the reference ``ref``: a closing verb, else the
    first cue before it, else the first cue after it ("Same as #N, it still hangs" is a
    duplicate: what is written before a reference governs it first)."""
    number = int(ref.group(1))
    cue = _before(_CLOSING, text, lo, ref.end())
    if cue is not None:
        return Citation(number, "same", " ".join(cue.group(0).split())[:80])
    for kind, before in _BEFORE:
        cue = _before(before, text, lo, ref.end()) if before is not None else None
        if cue is not None:
            return Citation(number, kind, " ".join(cue.group(0).split())[:80])
    for kind, after in _AFTER:
        cue = after.match(text, ref.start(), hi) if after is not None else None
        if cue is not None:
            return Citation(number, kind, " ".join(cue.group(0).split())[:80])
    return Citation(number, "mention", " ".join(ref.group(0).split()))


def citations(text: str, repos: Collection[str] = ()) -> list[Citation]:
    """Each issue or PR ``text`` cites in this repository, with what it says of it, in order of
    first citation; a number cited twice keeps its strongest reading (the table's order). A
    link (``…/owner/name/issues/N``) counts only into one of ``repos`` (any, when empty)."""
    text = text or ""
    found: dict[int, Citation] = {}
    weakest = len(_RANK)
    for n, ref in enumerate(_ANY_REF.finditer(text)):
        if n >= _MAX_REFS:
            break
        if text[ref.start()] == "#" and _FOREIGN.search(text, max(0, ref.start() - 100),
                                                         ref.start()):
            continue
        if ref.group(0).lower().startswith(("pull/", "issues/")) and not _ours(text, ref.start(),
                                                                             repos):
            continue
        reading = _reading(text, ref, *_window(text, ref.start(), ref.end()))
        old = found.get(reading.number)
        if old is None or _RANK.get(reading.kind, weakest) < _RANK.get(old.kind, weakest):
            found[reading.number] = reading
    return list(found.values())


# What each reading means for a match with the cited issue's or PR's cluster.
FOR_MATCH: frozenset[CitationKind] = frozenset({"same"})
AGAINST_MATCH: frozenset[CitationKind] = frozenset({"contrast", "continuation", "failure"})
# Readings that make a match with the cited change's cluster a possible regression of it.
REGRESSION: frozenset[CitationKind] = frozenset({"causal", "failure"})
