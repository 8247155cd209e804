"""Pydantic model of a cluster record (the seed schema).

Every model tolerates unknown fields (``extra="allow"``) so that a newer feed still loads; the
fields named here are the ones the bot reads. Values that real feeds leave out or set to null
(titles, merge dates, states of ``unknown``) are optional on purpose.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Statuses of ``landed_fix.status`` under which a fix counts as shipped. Anything else (``none``,
# ``open``, ``reverted``, ``attempted``...) means the cluster cannot be offered as "already fixed".
LANDED_STATUSES = frozenset({"merged_to_main", "merged", "released", "landed"})


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Counts(_Open):
    members: int = 0
    open_issues: int = 0
    open_issues_distinct: int = 0
    open_prs: int = 0
    closed_issues: int = 0
    merged_prs: int = 0
    attempt_prs: int = 0


class LandedFix(_Open):
    status: str = "none"
    basis: str | None = None
    pr: int | None = None
    merged_at: str | None = None
    released_in: str | None = None
    released_at: str | None = None
    reverted: bool = False

    @property
    def landed(self) -> bool:
        """True when the fix is on the main branch and was not reverted since."""
        return (
            self.pr is not None
            and self.status in LANDED_STATUSES
            and not self.reverted
            and "revert" not in self.status
        )


class Resolution(_Open):
    state: str | None = None
    by: str | None = None

    @property
    def deciding_pr(self) -> int | None:
        """The PR number in ``by`` (``pr-35381`` -> 35381), if it names one."""
        if self.by and self.by.startswith("pr-") and self.by[3:].isdigit():
            return int(self.by[3:])
        return None


class Freshness(_Open):
    state: str | None = None
    last_verified_at: str | None = None
    is_stale: bool | None = None

    @property
    def stale(self) -> bool:
        return bool(self.is_stale) or self.state == "stale"


class Grouping(_Open):
    backbone: str | None = None
    link_density: float | None = None
    source: str | None = None


class FixEdge(_Open):
    issue_number: int | None = None
    pr_number: int | None = None
    tier: str | None = None
    basis: str | None = None
    confidence: float | None = None
    recoverable_from_timeline: bool | None = None
    pr_merged_at: str | None = None


class CloseRef(_Open):
    kind: str | None = None
    value: str | None = None
    number: int | None = None


class CloseReason(_Open):
    category: str | None = None
    implication: str | None = None
    refs: list[CloseRef] = Field(default_factory=list)


class FixHunk(_Open):
    file: str
    hunks: list[str] = Field(default_factory=list)


class Member(_Open):
    kind: str = "issue"
    number: int
    title: str | None = None
    url: str | None = None
    state: str = "unknown"
    close_reason: CloseReason | None = None
    merged: bool | None = None
    is_fix_pr: bool | None = None
    fix_tier: str | None = None
    files_changed: list[str] = Field(default_factory=list)
    fix_hunks: list[FixHunk] = Field(default_factory=list)
    note: str | None = None

    @property
    def is_pr(self) -> bool:
        return self.kind == "pr"


class Trust(_Open):
    default_tier: str | None = None
    includes_suggested: bool | None = None


class Cluster(_Open):
    repo: str
    public_id: str
    display_label: str
    summary: str = ""
    subsystem: str | None = None
    cluster_kind: str | None = None
    counts: Counts = Field(default_factory=Counts)
    landed_fix: LandedFix = Field(default_factory=LandedFix)
    resolution: Resolution = Field(default_factory=Resolution)
    freshness: Freshness = Field(default_factory=Freshness)
    grouping: Grouping = Field(default_factory=Grouping)
    fix_edges: list[FixEdge] = Field(default_factory=list)
    members: list[Member] = Field(default_factory=list)
    trust: Trust = Field(default_factory=Trust)

    @field_validator("public_id", mode="before")
    @classmethod
    def _id_as_text(cls, value: Any) -> Any:
        # Some feeds write the id as a number; the bot always handles it as text.
        return str(value) if isinstance(value, int) else value

    @field_validator("repo")
    @classmethod
    def _repo_shape(cls, value: str) -> str:
        owner, sep, name = value.partition("/")
        if not sep or not owner or not name or "/" in name:
            raise ValueError(f"repo must be 'owner/name', got {value!r}")
        return value

    @property
    def key(self) -> tuple[str, str]:
        """Identity across sources: the same id in two repositories is two clusters."""
        return (self.repo.lower(), self.public_id)

    @property
    def fix_pr(self) -> Member | None:
        """The member that is the landed fix PR, when the record lists it."""
        pr = self.landed_fix.pr
        for member in self.members:
            if member.is_pr and member.number == pr:
                return member
        for member in self.members:
            if member.is_pr and member.is_fix_pr:
                return member
        return None

    @property
    def fix_prs(self) -> list[Member]:
        """Merged fix PRs (the landed one first), whose changes are the cluster's evidence."""
        found = [m for m in self.members if m.is_pr and (m.is_fix_pr or m.merged)]
        found.sort(key=lambda m: m.number != self.landed_fix.pr)
        return found

    @property
    def files_changed(self) -> list[str]:
        """Files changed by the merged fix PRs, in first-seen order, without repeats."""
        seen: dict[str, None] = {}
        for member in self.fix_prs:
            for path in member.files_changed:
                seen.setdefault(path, None)
            for fh in member.fix_hunks:
                seen.setdefault(fh.file, None)
        return list(seen)
