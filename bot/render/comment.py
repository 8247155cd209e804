"""The one comment Dejafix posts on an issue: rendered from a match, found again by its marker.

Pure: no I/O. Everything that came from an issue or a cluster record goes through ``neutralise``
so that a title such as ``@org/everyone`` cannot ping anyone and raw HTML cannot render.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Collection

from bot.clusters.models import Cluster, Member
from bot.matching.evidence import normalise_error, normalise_path
from bot.matching.regression import Regression
from bot.matching.signals import ROW_OF, ROWS, WORDS
from bot.matching.text import clean_title, tokens
from bot.matching.types import Match

MARKER = "<!-- dejafix:known-fix -->"

_MENTION = re.compile(r"@(?=[A-Za-z0-9_-])")
# "fixes #12", "Closes owner/repo#3", "resolved: https://github.com/...": closing keywords are
# honoured in PR bodies and commit messages; a quoted title must never carry one anywhere.
_CLOSING = re.compile(
    r"\b(close[sd]?|fix(?:e[sd])?|resolve[sd]?)(\s*:?\s+)(?=#|[\w.-]+/[\w.-]+#|https?://)",
    re.IGNORECASE,
)
# GitHub refuses comments over 65,536 characters; stay well inside it.
MAX_COMMENT = 60000
MAX_FIELD = 300
# A code span as CommonMark reads it: a whole backtick run (not the tail of a longer one, not
# escaped) closed by the next run of the same length.
_CODE_SPAN = re.compile(r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)")


def neutralise(text: str | None, *, table: bool = False) -> str:
    """Make untrusted text inert: no mentions, no HTML, no links or images, no closing keywords,
    one line, bounded length; pipes escaped inside tables. Code spans are kept as written,
    since GitHub renders nothing inside them (escapes would show as backslashes there)."""
    if not text:
        return ""
    out = " ".join(text.split())
    if len(out) > MAX_FIELD:
        out = out[:MAX_FIELD].rstrip() + "…"
    parts: list[str] = []
    last = 0
    for code in _CODE_SPAN.finditer(out):
        parts.append(_inert(out[last:code.start()]))
        parts.append(code.group(0))
        last = code.end()
    parts.append(_inert(out[last:]))
    joined = "".join(parts)
    return joined.replace("|", "\\|") if table else joined


def code(text: str | None, *, table: bool = False) -> str:
    """Untrusted text as one inline code span, which GitHub renders inert: fenced with more
    backticks than any run inside it, one line, bounded; pipes escaped inside tables."""
    out = " ".join((text or "").split())
    if len(out) > MAX_FIELD:
        out = out[:MAX_FIELD].rstrip() + "…"
    if not out:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", out)), default=0) + 1)
    pad = " " if out.startswith("`") or out.endswith("`") else ""
    out = f"{fence}{pad}{out}{pad}{fence}"
    return out.replace("|", "\\|") if table else out


def _inert(text: str) -> str:
    # Backslashes first: "\\[x\\](u)" must not become an escaped backslash before a real bracket.
    # A backtick left here is unpaired in this field; escaped, it cannot pair with one in the
    # next field of the same table cell.
    out = text.replace("\\", "\\\\").replace("`", "\\`")
    out = out.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    # Escaped brackets cannot open a link or an image (![x](https://tracker.example/pixel)).
    out = out.replace("[", "\\[").replace("]", "\\]")
    # A zero-width space after "@" breaks GitHub's mention parser; the text still reads the same.
    out = _MENTION.sub("@&#8203;", out)
    return _CLOSING.sub(lambda m: m.group(1) + "&#8203;" + m.group(2), out)


def body_hash(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def has_marker(body: str | None) -> bool:
    return bool(body) and MARKER in (body or "")


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _day(iso: str | None) -> str | None:
    # Only a date is printed: the field comes from the cluster record like any other text.
    return iso[:10] if iso and _DATE.fullmatch(iso[:10]) else None


def _ref(number: int, cluster_repo: str, issue_repo: str) -> str:
    # A bare #N links inside the same repository only; an upstream's items need owner/name#N.
    if cluster_repo.lower() == issue_repo.lower():
        return f"#{number}"
    return f"{neutralise(cluster_repo, table=True)}#{number}"


def _member_line(member: Member, cluster: Cluster, issue_repo: str) -> str:
    kind = "PR" if member.is_pr else "issue"
    state = "merged" if member.merged else neutralise(member.state, table=True)
    title = neutralise(member.title, table=True)
    ref = _ref(member.number, cluster.repo, issue_repo)
    return f"{ref} ({kind}, {state})" + (f" {title}" if title else "")


def _fix_line(cluster: Cluster, issue_repo: str) -> str:
    fix = cluster.landed_fix
    if fix.pr is None:
        return "no fix PR recorded"
    parts = [_ref(fix.pr, cluster.repo, issue_repo)]
    member = cluster.fix_pr
    if member is not None and member.title:
        parts.append(neutralise(member.title, table=True))
    if fix.reverted or "revert" in fix.status:
        parts.append("**reverted since**: the bug may be back")
        return " · ".join(parts)
    merged = _day(fix.merged_at)
    if merged:
        parts.append(f"merged {merged}")
    elif fix.landed:
        parts.append("merged")
    if fix.released_in:
        parts.append(f"released in {neutralise(fix.released_in, table=True)}")
    return " · ".join(parts)


def _verdict_line(cluster: Cluster, issue_repo: str) -> str | None:
    res = cluster.resolution
    if not res.state:
        return None
    line = code(res.state, table=True)
    deciding = res.deciding_pr
    if deciding is not None:
        line += f", decided by {_ref(deciding, cluster.repo, issue_repo)}"
        if deciding != cluster.landed_fix.pr:
            # The report format shows this too: the verdict rests on a different PR than the fix.
            line += " (not the fix PR above: weigh both)"
    elif res.by:
        line += f", decided by {neutralise(res.by, table=True)}"
    return line


def _freshness_line(cluster: Cluster) -> str | None:
    fresh = cluster.freshness
    if not fresh.state and not fresh.last_verified_at:
        return None
    state = neutralise(fresh.state or "unknown", table=True)
    when = _day(fresh.last_verified_at)
    line = f"{state}" + (f", last checked {when}" if when else "")
    if fresh.stale:
        line += " — stale: the code may have moved since"
    return line


# The comment's evidence rows, their pieces and how many of each it shows come from the registry
# of signals (bot/matching/signals.py). The three word signals (how much of the issue's title,
# of the best-described title and of the issue's text the bug's text says) rest on the same
# shared words: they are one row, ``WORDS``, whose weight is theirs together.
_WORD_ROW = ROWS[WORDS]
# Rows that list pieces of their own (files, functions, error texts), in the registry's order:
# a piece is claimed by the first of them that has it.
_PIECE_ROWS = tuple(row for row in ROWS.values()
                    if row.pieces is not None and row.pieces != _WORD_ROW.pieces)
# The smallest share of the evidence a row of the table may have: below it, it would read 0.00.
_MIN_SHARE = 0.005
# What prose wraps a word in ("(hangs,", "`raises`"): stripped to find the word a title says.
_WRAPPING = "()[]{}<>,.;:!?\"'`*#"


class _Sources:
    """Where in a cluster's record a piece of evidence can come from: its member titles, its
    label, summary and subsystem (as the index read them, so that a matched term is found in the
    text it matched), and the files its fix PRs changed and their diffs."""

    def __init__(self, cluster: Cluster, issue_repo: str) -> None:
        self.cluster = cluster
        self.issue_repo = issue_repo
        self._tokens: dict[str, frozenset[str]] = {}

    def ref(self, number: int) -> str:
        return _ref(number, self.cluster.repo, self.issue_repo)

    @functools.cached_property
    def texts(self) -> list[tuple[str, str, str]]:
        """(where, text as indexed, text as written) of each distinct text: member titles first,
        then the label (the comment's headline already shows it), the summary, the subsystem."""
        cluster = self.cluster
        found: dict[str, tuple[str, str]] = {}
        for m in cluster.members:
            if m.title:
                found.setdefault(clean_title(m.title),
                                 (f"the title of {self.ref(m.number)}", m.title))
        found.setdefault(clean_title(cluster.display_label),
                         ("the bug's label", cluster.display_label))
        for where, text in (("the bug's summary", cluster.summary),
                            ("the bug's subsystem", cluster.subsystem or "")):
            found.setdefault(text, (where, text))
        return [(where, text, raw) for text, (where, raw) in found.items() if text]

    @functools.cached_property
    def fix_paths(self) -> list[tuple[int, str]]:
        """(fix PR, path as indexed) of each file a merged fix PR changed, the landed one first."""
        return [(m.number, normalise_path(p)) for m in self.cluster.fix_prs
                for p in dict.fromkeys([*m.files_changed, *(fh.file for fh in m.fix_hunks)])]

    def tokens(self, text: str) -> frozenset[str]:
        found = self._tokens.get(text)
        if found is None:
            found = self._tokens[text] = frozenset(tokens(text))
        return found

    def of(self, pieces: str) -> Callable[[str], str]:
        """Where a piece of the ``MatchEvidence`` field ``pieces`` came from in the record."""
        return {"shared_files": self.of_file, "shared_symbols": self.of_symbol,
                "shared_errors": self.of_error}.get(pieces, lambda _: "in this bug's record")

    def of_file(self, path: str) -> str:
        low = normalise_path(path)
        number = next((n for n, fixed in self.fix_paths if fixed == low), None)
        return "changed by the fix" if number is None else f"changed by {self.ref(number)}"

    def of_symbol(self, symbol: str) -> str:
        low = symbol.lower()
        for m in self.cluster.fix_prs:
            if any(low in hunk.lower() for fh in m.fix_hunks for hunk in fh.hunks):
                return f"in the diff of {self.ref(m.number)}"
        where = next((w for w, _, raw in self.texts if low in raw.lower()), None)
        return f"named in {where}" if where else "named in this bug's reports"

    def of_error(self, error: str) -> str:
        low = normalise_error(error)
        where = next((w for w, _, raw in self.texts if low in normalise_error(raw)), None)
        return f"quoted in {where}" if where else "quoted in this bug's reports"

    def of_words(self, terms: list[str]) -> list[tuple[str, list[str]]]:
        """The texts the terms were found in, as few as can hold them: the text with most of
        them, then the one with most of the rest, and so on (the earlier text wins a tie). Each
        term once, as the word that text says when it says it as a plain word ("hangs" for the
        term "hang")."""
        candidates = [(where, text) for where, text, _ in self.texts]
        candidates += [("", path) for path in dict.fromkeys(p for _, p in self.fix_paths)]
        left = list(terms)
        groups: list[tuple[str, list[str]]] = []
        while left:
            best: tuple[str, str, list[str]] | None = None
            for where, text in candidates:
                have = self.tokens(text)
                hits = [t for t in left if t in have]
                if hits and (best is None or len(hits) > len(best[2])):
                    best = (where, text, hits)
            if best is None:
                groups.append(("elsewhere in this bug's record", left))
                break
            where, text, hits = best
            if not where:  # a changed file's path; named unless the path itself is the term
                where = "a file the fix changed" if text in hits else \
                    f"the path of {code(text, table=True)}, which the fix changed"
            groups.append((where, [_said_as(term, text) for term in hits]))
            left = [t for t in left if t not in hits]
        return groups


def _said_as(term: str, text: str) -> str:
    """The word ``text`` says for ``term`` when it says it as a plain word (a title's "raises"
    for the term "rais"), else the term."""
    for chunk in text.split():
        word = chunk.strip(_WRAPPING)
        if word.isalpha() and tokens(word) == [term]:
            return word
    return term


def _pieces(match: Match, sources: _Sources, rows: Collection[str]
            ) -> dict[str, list[tuple[str, str]]]:
    """(where it came from, piece) for each piece of the evidence rows named in ``rows``, each
    piece under one row only, the first in the registry's order: a file the fix changed, then
    a function or class in the fix's diff, then an error text the bug's reports share."""
    ev = match.evidence
    seen: set[str] = set()
    found: dict[str, list[tuple[str, str]]] = {}
    for row in _PIECE_ROWS:
        if row.name not in rows or row.pieces is None:
            continue
        fresh: list[str] = []
        for item in getattr(ev, row.pieces):
            if item and item.lower() not in seen and len(fresh) < row.shown:
                seen.add(item.lower())
                fresh.append(item)
        source = sources.of(row.pieces)
        found[row.name] = [(source(item), item) for item in fresh]
    return found


def _grouped(pieces: list[tuple[str, str]]) -> str:
    """``where: `a`, `b`; elsewhere: `c``` for (where, piece) pairs, in first-seen order."""
    by_where: dict[str, list[str]] = {}
    for where, piece in pieces:
        by_where.setdefault(where, []).append(code(piece, table=True))
    return "; ".join(f"{where}: {', '.join(items)}" for where, items in by_where.items())


def _words(match: Match, sources: _Sources, shown: list[str]) -> str:
    """The shared words that are neither a piece shown in another row nor a part of one (the
    index splits ``_handle_reset_command`` into ``handle``, ``reset``, ``command``), grouped by
    the title, summary or changed file's path they were found in."""
    taken = {piece.lower() for piece in shown}
    for piece in shown:
        taken |= sources.tokens(piece)
    terms: list[str] = []
    for term in match.evidence.matched_terms:
        if term and term.lower() not in taken and len(terms) < _WORD_ROW.shown:
            taken.add(term.lower())
            terms.append(term)
    if not terms:
        return "only the words of the rows above" if match.evidence.matched_terms else "—"
    return _grouped([(where, word) for where, words in sources.of_words(terms)
                     for word in words])


def evidence_rows(match: Match, issue_repo: str | None = None) -> list[tuple[str, str, float]]:
    """(signal, what matched and where it came from, weight) for each signal, strongest first;
    each piece of evidence in one row only."""
    ev = match.evidence
    cluster = match.cluster
    sources = _Sources(cluster, issue_repo or cluster.repo)
    positive: dict[str, float] = {}
    for part, value in ev.parts.items():
        if value > 0:
            # A part no signal declares (a suggestion stored by an older version) is a row
            # of its own.
            kind = ROW_OF.get(part, part)
            positive[kind] = positive.get(kind, 0.0) + value
    # A row that would read 0.00 is no evidence: the model found that it adds next to nothing
    # once the other rows have counted, so it is not shown (its pieces stay with the words).
    total = sum(positive.values())
    positive = {kind: v for kind, v in positive.items() if total and v / total >= _MIN_SHARE}
    total = sum(positive.values())
    # Only a row that is shown claims its pieces: the words of a shared file whose signal added
    # nothing stay in the words row.
    pieces = _pieces(match, sources, positive)
    shown = [piece for found in pieces.values() for _, piece in found]
    rows: list[tuple[str, str, float]] = []
    # Weight = the signal's share of the evidence, so the column reads the same whatever the
    # model's scale; the score above the table is the calibrated probability.
    for kind, value in sorted(positive.items(), key=lambda kv: -kv[1]):
        row = ROWS.get(kind)
        if kind == WORDS:
            what = _words(match, sources, shown)
        elif kind in pieces:
            what = _grouped(pieces[kind]) or "—"
        else:
            what = (row.about if row else None) or "—"
        rows.append((kind, what, value / total))
    return rows


def why_line(match: Match, issue_repo: str | None = None) -> str:
    """One line of why, for logs and the CLI: the files, functions and error texts, each once
    with where it came from. Plain text: neutralise it before it goes into markdown."""
    cluster = match.cluster
    sources = _Sources(cluster, issue_repo or cluster.repo)
    bits = []
    for found in _pieces(match, sources, [row.name for row in _PIECE_ROWS]).values():
        by_where: dict[str, list[str]] = {}
        for where, piece in found[:3]:
            by_where.setdefault(where, []).append(piece)
        bits += [f"{where}: {', '.join(items)}" for where, items in by_where.items()]
    bits.append(f"title similarity {match.evidence.title_similarity:.2f}")
    return "; ".join(bits)


def render(match: Match, *, issue_repo: str, docs_url: str | None = None) -> str:
    cluster = match.cluster
    label = neutralise(cluster.display_label, table=True)
    lines = [
        MARKER,
        f"**This looks like a known bug that already has a fix:** {label}",
        "",
        "| | |",
        "|---|---|",
        f"| **Fix** | {_fix_line(cluster, issue_repo)} |",
    ]
    verdict = _verdict_line(cluster, issue_repo)
    if verdict:
        lines.append(f"| **Maintainers' verdict** | {verdict} |")
    freshness = _freshness_line(cluster)
    if freshness:
        lines.append(f"| **Freshness** | {freshness} |")
    others = [m for m in cluster.members if m.number != cluster.landed_fix.pr]
    if others:
        shown = "<br>".join(_member_line(m, cluster, issue_repo) for m in others[:6])
        more = f"<br>and {len(others) - 6} more" if len(others) > 6 else ""
        lines.append(f"| **Related** | {shown}{more} |")
    lines += _evidence_lines(match, issue_repo)
    lines += [
        "",
        "If you are on a version with this fix and still see the problem, please say so here: "
        "it may be a different bug. Dejafix never closes issues.",
        "",
        f"<sub>Dejafix · cluster {code(cluster.public_id)}"
        + (f" · [how to read this comment]({docs_url})" if docs_url else "")
        + "</sub>",
    ]
    return _bounded(lines)


def _evidence_lines(match: Match, issue_repo: str) -> list[str]:
    """"Why Dejafix thinks so": the score and the table of signals, strongest first."""
    rows = evidence_rows(match, issue_repo)
    lines = ["", f"**Why Dejafix thinks so** (match score {match.score:.2f}):", ""]
    if rows:
        lines += ["| signal | what matched | weight |", "|---|---|---|"]
        lines += [f"| {name} | {what} | {weight:.2f} |" for name, what, weight in rows]
    else:
        lines.append(neutralise(why_line(match, issue_repo)))
    return lines


def _bounded(lines: list[str]) -> str:
    body = "\n".join(lines) + "\n"
    # Every field is capped, so only a record with absurdly many long names gets here.
    if len(body) > MAX_COMMENT:
        body = body[: MAX_COMMENT - 200].rsplit("\n", 1)[0] + "\n\n*(shortened)*\n"
    return body


def fix_area(cluster: Cluster) -> str | None:
    """The part of the code a fix belongs to, as words: the cluster's subsystem and the top
    folders of the files its fix PRs changed (``network (net/, tests/)``)."""
    folders: dict[str, None] = {}
    for path in cluster.files_changed:
        top, sep, _ = path.strip("/").partition("/")
        if sep and top:
            folders.setdefault(top + "/", None)
    shown = ", ".join(list(folders)[:4])
    subsystem = (cluster.subsystem or "").strip()
    if subsystem and shown:
        return f"{subsystem} ({shown})"
    return subsystem or shown or None


def render_regression(match: Match, regression: Regression, *, issue_repo: str,
                      docs_url: str | None = None) -> str:
    """The comment for a match that is a possible regression of its fix: never "already
    fixed" (updating cannot help someone whose version has the fix, or whom the fix broke)."""
    cluster = match.cluster
    fix = cluster.landed_fix
    fix_ref = _ref(fix.pr, cluster.repo, issue_repo) if fix.pr is not None else "the fix"
    if regression.kind == "caused_by_fix":
        headline = (f"**This looks like the bug fixed in {fix_ref}, which this issue says "
                    f"caused it: possibly a regression of {fix_ref}**")
    elif regression.kind == "fix_failed":
        headline = (f"**This looks like the bug fixed in {fix_ref}, which this issue says did "
                    "not fix it: possibly a regression, or a case the fix missed**")
    elif regression.kind == "cites_fix":
        headline = (f"**This looks like the bug fixed in {fix_ref}, which this issue cites: "
                    "if it still happens with that fix, possibly a regression**")
    else:
        headline = (f"**This looks like the bug fixed in {fix_ref}, which your version "
                    "already contains: possibly a regression**")
    lines = [
        MARKER,
        headline,
        "",
        "| | |",
        "|---|---|",
        f"| **Known bug** | {neutralise(cluster.display_label, table=True)} |",
        f"| **Fix** | {_fix_line(cluster, issue_repo)} |",
        f"| **Why a regression** | {neutralise(regression.reason(), table=True)} |",
    ]
    lines += _evidence_lines(match, issue_repo)
    if regression.kind == "cites_fix":
        why = ("You cite the fix, so you may already have it: if you are on a version with it "
               "and still see the problem, it may have regressed or missed this case")
    else:
        why = ("Updating will not help here: the fix is either what changed the behaviour or "
               "already in your version. It may have regressed, or missed this case")
    lines += ["", f"{why}; a maintainer should compare this report with the fix. Dejafix "
                  "never closes issues."]
    area = fix_area(cluster)
    if area:
        # Words only: naming people or teams here would ping them.
        lines += ["", neutralise(f"cc: whoever looks after {area}, where the fix changed code.")]
    lines += [
        "",
        f"<sub>Dejafix · cluster {code(cluster.public_id)} · possible regression"
        + (f" · [how to read this comment]({docs_url})" if docs_url else "")
        + "</sub>",
    ]
    return _bounded(lines)


def render_reverted(cluster: Cluster, *, issue_repo: str, revert_pr: int | None) -> str:
    """The correction that replaces an earlier comment once the fix it pointed to is reverted."""
    fix = cluster.landed_fix
    fix_ref = _ref(fix.pr, cluster.repo, issue_repo) if fix.pr is not None else "the fix"
    by = f" by {_ref(revert_pr, cluster.repo, issue_repo)}" if revert_pr is not None else ""
    return "\n".join([
        MARKER,
        f"**Update:** the fix Dejafix pointed to here ({fix_ref}, for "
        f"*{neutralise(cluster.display_label)}*) was reverted{by}. This issue may not be fixed "
        "after all; a maintainer will take a look.",
        "",
        f"<sub>Dejafix · cluster {code(cluster.public_id)}</sub>",
    ]) + "\n"


def _suggestion_line(cluster: Cluster | None, public_id: str, issue_repo: str) -> str:
    if cluster is None:
        return f"cluster {code(public_id)}"
    label = neutralise(cluster.display_label)
    fix = _fix_line(cluster, issue_repo).replace("\\|", "|")
    return f"*{label}* (fix: {fix}; cluster {code(public_id)})"


def render_dismissed(cluster: Cluster | None, public_id: str, *, issue_repo: str,
                     by: str) -> str:
    """What our comment becomes after ``/dejafix not-this``: the link stays for the record."""
    return "\n".join([
        MARKER,
        f"**Suggestion dismissed** by {code(by)}: this is not the known bug Dejafix suggested, "
        "and Dejafix will not suggest it on this issue again.",
        "",
        f"For the record, the suggestion was {_suggestion_line(cluster, public_id, issue_repo)}.",
        "",
        f"<sub>Dejafix · cluster {code(public_id)} · dismissed</sub>",
    ]) + "\n"


def render_confirmed(cluster: Cluster, *, issue_repo: str, by: str) -> str:
    """What our comment becomes after ``/dejafix same-as #N``."""
    return "\n".join([
        MARKER,
        f"**Confirmed by {code(by)}:** this issue is another report of "
        f"{_suggestion_line(cluster, cluster.public_id, issue_repo)}.",
        "",
        "It is now one of that bug's reports, so Dejafix can recognise the next one better.",
        "",
        f"<sub>Dejafix · cluster {code(cluster.public_id)} · confirmed</sub>",
    ]) + "\n"
