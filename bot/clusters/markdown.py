"""Markdown cluster reports (``cluster-<id>.md``) read into the same ``Cluster`` model as JSON.

The report is written for people, so the parser reads it the way a person would: the heading
gives the repository and label, the first plain paragraph is the summary, the member sections are
bullet lists, and the remaining facts (fix PR, verdict, grouping, counts, subsystem) are found by
their wording wherever they appear outside the member lists. A missing section leaves the
model's default in place; only a report without its heading or without any member is rejected,
because without those there is nothing to match against or to show.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bot.clusters.models import Cluster

__all__ = [
    "MarkdownReportError",
    "ReportProblem",
    "load_cluster_markdown",
    "parse_cluster_markdown",
    "unescape_markdown",
]


@dataclass(frozen=True)
class ReportProblem:
    """One reason a report was rejected, located by its 1-based line."""

    line: int
    field: str | None
    message: str


class MarkdownReportError(ValueError):
    """A report that cannot become a cluster. Carries every problem found, not only the first,
    so that whoever fixes the file sees all of them in one pass."""

    def __init__(self, path: str | None, problems: Sequence[ReportProblem]) -> None:
        if not problems:
            raise ValueError("MarkdownReportError needs at least one problem")
        self.path = path
        self.problems = list(problems)
        super().__init__(str(self))

    @property
    def line(self) -> int:
        return self.problems[0].line

    @property
    def field(self) -> str | None:
        return self.problems[0].field

    @property
    def message(self) -> str:
        return self.problems[0].message

    def __str__(self) -> str:
        first = self.problems[0]
        where = f"{self.path or '<report>'}:{first.line}: "
        what = f"{first.field}: {first.message}" if first.field else first.message
        more = len(self.problems) - 1
        return where + what + (f" (and {more} more)" if more else "")


# CommonMark lets any ASCII punctuation be backslash-escaped, but not inside code spans; the
# alternation consumes code spans whole so that a backslash in `C:\path` survives.
_ESCAPE_OR_CODE = re.compile(r"\\([!-/:-@\[-`{-~])|`[^`\n]*`")


def unescape_markdown(text: str) -> str:
    """``\\[Bug\\]: x`` -> ``[Bug]: x``; code spans are left as written."""
    return _ESCAPE_OR_CODE.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(0), text)


_HEADING = re.compile(r"^#\s+(.+?)(?:\s+#+)?\s*$")
_SECTION = re.compile(r"^##\s+(.+?)(?:\s+#+)?\s*$")
_BULLET = re.compile(r"^(\s*)[-*+]\s+(.*)$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_CODE = re.compile(r"`([^`]+)`")
# An issue item: "#35309: title", also "[#35309](url): title" and a bold variant.
_ISSUE_ITEM = re.compile(r"^(?:\*\*)?\[?#(\d+)\]?(?:\(([^)\s]*)\))?\s*:\s*(.*?)(?:\*\*)?$")
# A PR item: "**#35382: title**. merged to main · fix tier `verified`". The title is matched
# greedily up to the last "**" so that emphasis inside a title does not cut it short.
_PR_ITEM = re.compile(r"^\*\*\[?#(\d+)\]?(?:\(([^)\s]*)\))?\s*:\s*(.*)\*\*\.?\s*(.*)$")
_SUB_FIELD = re.compile(r"^([A-Za-z][A-Za-z ]*?)\s*:\s*(.*)$")

_COUNT_PATTERNS: dict[str, re.Pattern[str]] = {
    "members": re.compile(r"(\d+)\s+members?\b(?:\(s\))?", re.I),
    "open_issues": re.compile(r"(\d+)\s+open\s+issues?\b(?:\(s\))?", re.I),
    "closed_issues": re.compile(r"(\d+)\s+closed\s+issues?\b(?:\(s\))?", re.I),
    "open_prs": re.compile(r"(\d+)\s+open\s+PRs?\b(?:\(s\))?", re.I),
    "merged_prs": re.compile(r"(\d+)\s+merged\s+PRs?\b(?:\(s\))?", re.I),
    # The JSON records call a PR closed without merging an "attempt".
    "attempt_prs": re.compile(r"(\d+)\s+PRs?\b(?:\(s\))?\s+closed\s+without\s+merg", re.I),
}
_MERGED_IN = re.compile(r"merged\s+to\s+main\s+in\s+PR\s+#(\d+)(?:\s+(?:on|at)\s+`([^`]+)`)?", re.I)
_VERDICT = re.compile(r"verdict[^`]*`([^`]+)`", re.I)
_DECIDING = re.compile(r"deciding\s+PR(?:\(s\)|s)?\s*:\s*(.*)$", re.I)
_BACKBONE = re.compile(r"link\s+evidence\s*\(\s*`([^`]+)`\s*\)", re.I)
_DENSITY = re.compile(r"link\s+density\s*`?([0-9]*\.?[0-9]+)`?", re.I)
_SUBSYSTEM = re.compile(r"subsystem\s*:\s*`?([^`\s]+)`?", re.I)
_VERIFIED = re.compile(r"last\s+verified\s*(?:\(([^)]*)\))?\s*`([^`]+)`", re.I)
_TIER = re.compile(r"fix\s+tier\s*`([^`]+)`", re.I)
_FILE_NAME_ID = re.compile(r"^cluster-([A-Za-z0-9._-]+)\.md$", re.I)
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$", re.I)

# Section roles, decided from the "## " heading's wording.
_OPEN_ISSUES, _CLOSED_ISSUES, _PRS, _OTHER = "open", "closed", "prs", "other"


def _section_role(title: str) -> str:
    lowered = title.lower()
    if re.search(r"\bprs?\b|pull\s+requests?", lowered):
        return _PRS
    if lowered.startswith("closed") or "duplicate" in lowered:
        return _CLOSED_ISSUES
    if lowered.startswith("open"):
        return _OPEN_ISSUES
    return _OTHER


def _pr_state(status: str) -> tuple[str, bool | None]:
    lowered = status.lower()
    if re.search(r"without\s+merg|not\s+merged|unmerged", lowered):
        return "closed", False
    if "merged" in lowered:
        return "merged", True
    if "closed" in lowered:
        return "closed", False
    if "open" in lowered or "draft" in lowered:
        return "open", False
    return "unknown", None


def _close_ref(text: str) -> dict[str, Any]:
    # Same shape as the JSON records: "#N" refs are kind "pr" (issue or PR alike), commits
    # carry number 0.
    ref = text.strip()
    number = re.fullmatch(r"#?(\d+)", ref)
    if number:
        return {"kind": "pr", "value": f"#{number.group(1)}", "number": int(number.group(1))}
    if _COMMIT.match(ref):
        return {"kind": "commit", "value": ref, "number": 0}
    return {"kind": None, "value": ref, "number": None}


def _maintainer_direction(text: str) -> dict[str, Any]:
    reason: dict[str, Any] = {}
    for part in text.split(";"):
        name, _, value = part.strip().partition(" ")
        codes = _CODE.findall(value)
        key = name.lower()
        if key in ("category", "implication") and codes:
            reason[key] = codes[0]
        elif key == "refs":
            reason["refs"] = [_close_ref(code) for code in codes]
    return reason


def _diff_hunks(body: list[str]) -> list[str]:
    """Split a diff block into its ``@@`` hunks, header line included, as the JSON stores them."""
    hunks: list[list[str]] = []
    for line in body:
        if line.startswith("@@"):
            hunks.append([line])
        elif hunks:
            hunks[-1].append(line)
        # Lines before the first "@@" ("diff --git", "---", "+++") name the file, which the
        # report already gives above the block.
    out = []
    for hunk in hunks:
        while len(hunk) > 1 and not hunk[-1].strip():
            hunk.pop()
        out.append("\n".join(hunk))
    return out


class _ReportParser:
    def __init__(self, text: str, path: str | None) -> None:
        self.lines = text.splitlines()
        self.path = path
        self.problems: list[ReportProblem] = []
        self.record: dict[str, Any] = {}
        self.field_lines: dict[str, int] = {}
        self.members: list[dict[str, Any]] = []
        self.member_lines: list[int] = []
        self.summary: list[str] = []
        self.summary_done = False
        self.heading_line: int | None = None
        self.merged_in_fix_status = False
        self.role = _OTHER
        self.section = ""
        self.pr: dict[str, Any] | None = None
        self.hunk_file: str | None = None

    def parse(self) -> Cluster:
        index = 0
        while index < len(self.lines):
            index = self._line(index)
        return self._build()

    # -- line dispatch -------------------------------------------------------------------------

    def _line(self, index: int) -> int:
        raw = self.lines[index]
        lineno = index + 1
        fence = _FENCE.match(raw)
        if fence:
            return self._fenced_block(index, fence)
        if not raw.strip():
            if self.summary:
                self.summary_done = True
            return index + 1
        section = _SECTION.match(raw)
        if section:
            self.section = section.group(1).lower()
            self.role = _section_role(section.group(1))
            self.pr = None
            self.hunk_file = None
            return index + 1
        heading = _HEADING.match(raw)
        if heading:
            if self.heading_line is None:
                self._heading(heading.group(1), lineno)
            return index + 1
        if raw.lstrip().startswith("#"):
            return index + 1  # deeper headings only structure the text; the section stays
        bullet = _BULLET.match(raw)
        if bullet:
            self._bullet(len(bullet.group(1)), bullet.group(2).strip(), lineno)
            return index + 1
        if not raw[0].isspace() and not self.summary_done:
            self.summary.append(raw.strip())
            self.field_lines.setdefault("summary", lineno)
        return index + 1

    def _fenced_block(self, index: int, fence: re.Match[str]) -> int:
        indent = len(fence.group(1))
        marker = fence.group(2)
        language = fence.group(3).lower()
        body: list[str] = []
        index += 1
        while index < len(self.lines):
            raw = self.lines[index]
            stripped = raw.strip()
            if stripped.startswith(marker[0] * len(marker)) and not stripped.strip(marker[0]):
                index += 1
                break
            # Remove only the list-item indentation: the diff's own first column (" ", "+",
            # "-") must stay.
            lead = len(raw) - len(raw.lstrip(" "))
            body.append(raw[min(indent, lead) :])
            index += 1
        if self.pr is not None and self.hunk_file is not None and language in ("diff", "patch", ""):
            hunks = _diff_hunks(body)
            fix_hunks: list[dict[str, Any]] = self.pr.setdefault("fix_hunks", [])
            for entry in fix_hunks:
                if entry["file"] == self.hunk_file:
                    entry["hunks"].extend(hunks)
                    break
            else:
                fix_hunks.append({"file": self.hunk_file, "hunks": hunks})
        return index

    def _heading(self, text: str, lineno: int) -> None:
        self.heading_line = lineno
        self.field_lines["repo"] = self.field_lines["display_label"] = lineno
        repo, sep, label = text.partition("·")
        if not sep or not repo.strip() or not label.strip():
            self.problems.append(
                ReportProblem(lineno, None, "heading must read '# owner/name · Label'")
            )
            return
        self.record["repo"] = repo.strip()
        self.record["display_label"] = unescape_markdown(label.strip())

    def _bullet(self, indent: int, text: str, lineno: int) -> None:
        if self.role in (_OPEN_ISSUES, _CLOSED_ISSUES):
            if indent == 0:
                self._issue_item(text, lineno)
        elif self.role == _PRS:
            if indent == 0:
                self._pr_item(text, lineno)
            elif self.pr is not None:
                self._pr_detail(text)
        else:
            self._fact(text, lineno)

    # -- members -------------------------------------------------------------------------------

    def _add_member(self, member: dict[str, Any], lineno: int) -> None:
        self.members.append(member)
        self.member_lines.append(lineno)

    def _issue_item(self, text: str, lineno: int) -> None:
        item = _ISSUE_ITEM.match(text)
        if not item:
            return  # "Nothing open on GitHub." and similar notes
        state = "open" if self.role == _OPEN_ISSUES else "closed"
        member: dict[str, Any] = {
            "kind": "issue",
            "number": int(item.group(1)),
            "title": unescape_markdown(item.group(3).strip()) or None,
            "url": item.group(2) or None,
            "state": state,
        }
        self._add_member(member, lineno)

    def _pr_item(self, text: str, lineno: int) -> None:
        self.hunk_file = None
        item = _PR_ITEM.match(text)
        if item:
            number, url, title, status = item.groups()
        else:
            plain = _ISSUE_ITEM.match(text)
            if not plain:
                self.pr = None
                return
            # Without the bold title there is no telling title from status; keep it as title.
            number, url, title = plain.groups()
            status = ""
        state, merged = _pr_state(status)
        self.pr = {
            "kind": "pr",
            "number": int(number),
            "title": unescape_markdown(title.strip()) or None,
            "url": url or None,
            "state": state,
        }
        if merged is not None:
            self.pr["merged"] = merged
        tier = _TIER.search(status)
        if tier:
            self.pr["fix_tier"] = tier.group(1)
        self._add_member(self.pr, lineno)

    def _pr_detail(self, text: str) -> None:
        assert self.pr is not None
        lone_code = re.fullmatch(r"`([^`]+)`:?", text)
        if lone_code:
            # A file name alone on its line heads the diff block that follows it.
            self.hunk_file = lone_code.group(1)
            return
        detail = _SUB_FIELD.match(text)
        if not detail:
            return
        name, value = detail.group(1).strip().lower(), detail.group(2)
        if name == "maintainer direction":
            self.pr["close_reason"] = _maintainer_direction(value)
        elif name == "files":
            self.pr["files_changed"] = _CODE.findall(value)
        elif name == "fix hunks":
            self.hunk_file = None

    # -- facts ---------------------------------------------------------------------------------

    def _fact(self, text: str, lineno: int) -> None:
        if "member" in text.lower() and _COUNT_PATTERNS["members"].search(text):
            counts = {
                key: int(found.group(1))
                for key, pattern in _COUNT_PATTERNS.items()
                if (found := pattern.search(text))
            }
            if "open_issues" in counts:
                # The report gives no separate figure for distinct open issues.
                counts["open_issues_distinct"] = counts["open_issues"]
            self.record["counts"] = counts
            self.field_lines["counts"] = lineno
        merged = _MERGED_IN.search(text)
        # The "Fix status" section is the authoritative place; the TL;DR only repeats it.
        if merged and (not self.merged_in_fix_status or "fix status" in self.section):
            self.merged_in_fix_status = "fix status" in self.section
            landed: dict[str, Any] = {"status": "merged_to_main", "pr": int(merged.group(1))}
            if merged.group(2):
                landed["merged_at"] = merged.group(2)
            self.record["landed_fix"] = landed
            self.field_lines["landed_fix"] = lineno
        verdict = _VERDICT.search(text)
        if verdict:
            resolution: dict[str, Any] = {"state": verdict.group(1)}
            deciding = _DECIDING.search(text)
            prs = _CODE.findall(deciding.group(1)) if deciding else []
            # The model keeps one deciding PR; should the report list several, the first leads.
            resolution["by"] = prs[0] if prs else None
            self.record["resolution"] = resolution
            self.field_lines["resolution"] = lineno
        backbone = _BACKBONE.search(text)
        if backbone:
            self.record.setdefault("grouping", {})["backbone"] = backbone.group(1)
            self.field_lines.setdefault("grouping", lineno)
        density = _DENSITY.search(text)
        if density:
            self.record.setdefault("grouping", {})["link_density"] = float(density.group(1))
            self.field_lines.setdefault("grouping", lineno)
        subsystem = _SUBSYSTEM.search(text)
        if subsystem:
            self.record["subsystem"] = subsystem.group(1)
            self.field_lines["subsystem"] = lineno
        verified = _VERIFIED.search(text)
        if verified:
            basis = (verified.group(1) or "").strip() or None
            stale = "stale" in text.lower()
            self.record["freshness"] = {
                "state": "stale" if stale else "verified",
                "last_verified_at": verified.group(2),
                "is_stale": stale,
                "basis": basis,
            }
            self.field_lines["freshness"] = lineno

    # -- assembly ------------------------------------------------------------------------------

    def _build(self) -> Cluster:
        if self.heading_line is None:
            self.problems.append(ReportProblem(1, None, "no '# owner/name · Label' heading found"))
        if not self.members:
            self.problems.append(
                ReportProblem(
                    self.heading_line or 1,
                    "members",
                    "no members found: expected '- #N: title' under 'Closed / duplicate issues'"
                    " or 'Open', or '- **#N: title**. state' under 'Prior & competing PRs'",
                )
            )
        if self.problems:
            raise MarkdownReportError(self.path, self.problems)

        record = self.record
        if self.summary:
            record["summary"] = unescape_markdown(" ".join(self.summary))
        landed = record.get("landed_fix")
        freshness = record.get("freshness")
        # Short of an explicit merge date, the verification date counts when the report says it
        # was verified by the merge (or does not say by what).
        if (
            landed
            and "merged_at" not in landed
            and freshness
            and freshness.get("basis") in (None, "merged")
        ):
            landed["merged_at"] = freshness["last_verified_at"]
        if freshness:
            # The basis only served the choice above; the JSON records have no such field.
            freshness.pop("basis", None)
        fix_number = landed.get("pr") if landed else None
        for member in self.members:
            if member["kind"] == "pr" and member["number"] == fix_number:
                member["is_fix_pr"] = True
        record["members"] = self.members
        record["public_id"] = self._public_id()
        self.field_lines["public_id"] = self.heading_line or 1
        try:
            return Cluster.model_validate(record)
        except ValidationError as exc:
            raise MarkdownReportError(self.path, self._validation_problems(exc)) from None

    def _public_id(self) -> str:
        if self.path:
            named = _FILE_NAME_ID.match(Path(self.path).name)
            if named:
                return named.group(1)
        for state in ("closed", "open"):
            for member in self.members:
                if member["kind"] == "issue" and member["state"] == state:
                    return str(member["number"])
        return str(self.members[0]["number"])

    def _validation_problems(self, exc: ValidationError) -> list[ReportProblem]:
        problems = []
        for error in exc.errors():
            loc = error["loc"]
            line = self.heading_line or 1
            if loc and loc[0] == "members" and len(loc) > 1 and isinstance(loc[1], int):
                line = self.member_lines[loc[1]]
            elif loc and isinstance(loc[0], str):
                line = self.field_lines.get(loc[0], line)
            field = ".".join(str(part) for part in loc) or None
            problems.append(ReportProblem(line, field, error["msg"]))
        return problems


def parse_cluster_markdown(text: str, path: str | Path | None = None) -> Cluster:
    """Read a markdown cluster report. ``path`` names the file in errors and, when it is
    ``cluster-<id>.md``, gives the public id. Raises ``MarkdownReportError``."""
    return _ReportParser(text, str(path) if path is not None else None).parse()


def load_cluster_markdown(path: str | Path) -> Cluster:
    """Read the report at ``path`` (UTF-8). Raises ``MarkdownReportError`` or ``OSError``."""
    text = Path(path).read_text(encoding="utf-8-sig")
    return parse_cluster_markdown(text, path)
