"""The matcher on small synthetic clusters: ranking, evidence, the decision, the filters."""

from __future__ import annotations

from typing import Any

import pytest

from bot.clusters.models import Cluster
from bot.matching import IssueText, Matcher, MatchPolicy, decide, learn_boilerplate

REPO = "acme/widget"


def cluster(
    cid: str,
    label: str,
    *,
    summary: str = "",
    titles: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
    hunks: dict[str, list[str]] | None = None,
    repo: str = REPO,
    status: str = "merged",
    stale: bool = False,
    pr: int | None = None,
    subsystem: str | None = None,
) -> Cluster:
    number = int(cid)
    pr_number = pr if pr is not None else number + 1000
    members: list[dict[str, Any]] = [
        {"kind": "issue", "number": number, "title": t, "state": "closed"} for t in titles
    ]
    members.append(
        {
            "kind": "pr",
            "number": pr_number,
            "title": None,
            "state": "merged",
            "merged": True,
            "is_fix_pr": True,
            "files_changed": list(files),
            "fix_hunks": [{"file": f, "hunks": h} for f, h in (hunks or {}).items()],
        }
    )
    return Cluster.model_validate(
        {
            "repo": repo,
            "public_id": cid,
            "display_label": label,
            "summary": summary,
            "subsystem": subsystem,
            "landed_fix": {"status": status, "pr": pr_number},
            "freshness": {"state": "stale" if stale else "verified", "is_stale": stale},
            "members": members,
        }
    )


FRAME_HUNK = (
    "@@ -40,7 +40,9 @@ def compute_frame_budget(self, fps: float) -> float:\n"
    "-    return 1000 / fps\n"
    "+    if fps <= 0:\n"
    "+        return DEFAULT_FRAME_BUDGET_MS\n"
    "+    return 1000 / fps\n"
)

FILLER = [
    cluster("201", "Tooltip flickers on hover over toolbar icons", files=("widget/ui/tooltip.py",)),
    cluster("202", "Settings dialog forgets window size", files=("widget/ui/settings.py",)),
    cluster("203", "Export to PDF drops embedded fonts", files=("widget/export/pdf.py",)),
    cluster("204", "Clipboard paste of rich text loses colours"),
    cluster("205", "Plugin loader ignores disabled flag", files=("widget/plugins/loader.py",)),
    cluster("206", "Keyboard shortcut for undo does nothing on Linux"),
    cluster("207", "Autosave writes a corrupt backup file when the disk is full"),
    cluster("208", "Spellchecker marks every word after a hyphen"),
]

TARGET = cluster(
    "101",
    "Renderer crashes with ZeroDivisionError when the frame rate is zero",
    summary="compute_frame_budget divided by fps without a guard; paused animations set fps=0.",
    titles=("Crash: division by zero in renderer while animation paused",),
    files=("widget/render/frame.py", "tests/render/test_frame.py"),
    hunks={"widget/render/frame.py": [FRAME_HUNK]},
    subsystem="render",
)
# Same subsystem, same words, a different bug in a different file.
LOOKALIKE = cluster(
    "102",
    "Renderer crashes when the frame rate is too high on external monitors",
    summary="Vsync negotiation overflowed the swap interval on 240 Hz displays.",
    titles=("Crash in renderer at high frame rate",),
    files=("widget/render/vsync.py",),
    hunks={
        "widget/render/vsync.py": ["@@ -5,3 +5,4 @@ def negotiate_swap_interval(mode):\n+    x\n"]
    },
    subsystem="render",
)

ISSUE = IssueText(
    number=9001,
    title="Renderer crashes with ZeroDivisionError when animation is paused",
    body="""### Steps to Reproduce
1. Pause any animation.

Traceback (most recent call last):
  File "/home/u/.venv/lib/python3.12/site-packages/widget/render/frame.py", line 41, in \
compute_frame_budget
    return 1000 / fps
ZeroDivisionError: division by zero
""",
)


@pytest.fixture
def matcher() -> Matcher:
    return Matcher([TARGET, LOOKALIKE, *FILLER])


def test_right_cluster_ranks_first_and_gets_a_comment(matcher: Matcher) -> None:
    matches = matcher.rank(ISSUE)
    assert matches[0].public_id == "101"
    assert all(0.0 <= m.score <= 1.0 for m in matches)
    assert [m.score for m in matches] == sorted((m.score for m in matches), reverse=True)
    chosen = decide(matches, MatchPolicy())
    assert chosen is not None and chosen.public_id == "101"


def test_evidence_lists_shared_file_and_symbol(matcher: Matcher) -> None:
    ev = matcher.rank(ISSUE)[0].evidence
    assert "widget/render/frame.py" in ev.shared_files
    assert "tests/render/test_frame.py" not in ev.shared_files
    assert "compute_frame_budget" in ev.shared_symbols
    assert ev.parts["files"] > 0 and ev.parts["symbols"] > 0
    assert "compute_frame_budget" in ev.matched_terms
    assert ev.title_similarity > 0


def test_lookalike_with_different_files_and_symbols_stays_silent() -> None:
    # Only the look-alike is known: the words agree, the evidence does not.
    matcher = Matcher([LOOKALIKE, *FILLER])
    matches = matcher.rank(ISSUE)
    assert matches and matches[0].public_id == "102"
    assert not matches[0].evidence.shared_files
    assert decide(matches, MatchPolicy()) is None


def test_unrelated_issue_stays_silent(matcher: Matcher) -> None:
    issue = IssueText(title="Dark mode colours wrong in the print preview", body="Too bright.")
    assert decide(matcher.rank(issue), MatchPolicy()) is None


def test_unlanded_and_stale_clusters_excluded_unless_policy_allows() -> None:
    unlanded = cluster(
        "101",
        TARGET.display_label,
        summary=TARGET.summary,
        files=("widget/render/frame.py",),
        status="open",
    )
    stale = cluster(
        "101",
        TARGET.display_label,
        summary=TARGET.summary,
        files=("widget/render/frame.py",),
        stale=True,
    )
    for only, flag in ((unlanded, "include_unlanded"), (stale, "include_stale")):
        matcher = Matcher([only, *FILLER])
        assert all(m.public_id != "101" for m in matcher.rank(ISSUE))
        allowed = matcher.rank(ISSUE, policy=MatchPolicy(**{flag: True}))
        assert allowed[0].public_id == "101"


def test_repo_restriction_is_case_insensitive() -> None:
    other = cluster(
        "101",
        TARGET.display_label,
        summary=TARGET.summary,
        files=("widget/render/frame.py",),
        repo="other/widget",
    )
    matcher = Matcher([other, *FILLER])
    assert matcher.rank(ISSUE)[0].cluster.repo == "other/widget"
    assert all(m.cluster.repo == REPO for m in matcher.rank(ISSUE, repos=["ACME/Widget"]))
    assert matcher.rank(ISSUE, repos=["Other/Widget"])[0].public_id == "101"
    assert matcher.rank(ISSUE, repos=[]) == []


def test_margin_abstains_between_two_equal_candidates() -> None:
    twin = cluster(
        "103",
        TARGET.display_label,
        summary=TARGET.summary,
        titles=(TARGET.members[0].title and (TARGET.members[0].title,)) or (),
        files=("widget/render/frame.py",),
        hunks={"widget/render/frame.py": [FRAME_HUNK]},
    )
    matcher = Matcher([TARGET, twin, *FILLER])
    matches = matcher.rank(ISSUE)
    assert {matches[0].public_id, matches[1].public_id} == {"101", "103"}
    assert decide(matches, MatchPolicy(threshold=0.0, margin=0.05)) is None
    assert decide(matches, MatchPolicy(threshold=0.0, margin=0.0)) is not None


def test_decide_threshold() -> None:
    matcher = Matcher([TARGET, LOOKALIKE, *FILLER])
    matches = matcher.rank(ISSUE)
    best = matches[0].score
    assert decide(matches, MatchPolicy(threshold=best)) is matches[0]
    if best < 1.0:
        assert decide(matches, MatchPolicy(threshold=min(1.0, best + 1e-4))) is None
    assert decide(matches[1:], MatchPolicy()) is None
    assert decide([], MatchPolicy()) is None


def test_reference_to_fix_pr_counts() -> None:
    matcher = Matcher([TARGET, LOOKALIKE, *FILLER])
    plain = IssueText(title="Renderer crash when paused", body="It crashes.")
    cited = IssueText(title="Renderer crash when paused", body="It crashes, like #1101 said.")
    before = next(m for m in matcher.rank(plain) if m.public_id == "101")
    after = next(m for m in matcher.rank(cited) if m.public_id == "101")
    assert after.score > before.score
    assert after.evidence.parts.get("ref", 0) > 0


def test_boilerplate_is_stripped_before_scoring() -> None:
    # A template line that happens to share words with a cluster must not pull it up.
    template = (
        "name: Bug\nbody:\n  - type: input\n    attributes:\n"
        "      label: Clipboard paste rich text colours\n"
    )
    issue = IssueText(
        title="Spline editor hangs", body="Clipboard paste rich text colours\nIt hangs."
    )
    matcher = Matcher([TARGET, LOOKALIKE, *FILLER])
    without = matcher.rank(issue)
    stripped = matcher.rank(issue, boilerplate=learn_boilerplate([template]))
    assert without and without[0].public_id == "204"
    assert all(m.public_id != "204" for m in stripped)


def test_release_note_cluster_without_titles_or_files_still_matches() -> None:
    note = cluster(
        "301",
        "Guard frame budget against zero fps in the renderer",
        summary="Fix listed in the release notes.",
    )
    matcher = Matcher([note, LOOKALIKE, *FILLER])
    issue = IssueText(title="Frame budget breaks at zero fps", body="The renderer divides by fps.")
    matches = matcher.rank(issue)
    assert matches[0].public_id == "301"


def test_empty_index_and_empty_issue() -> None:
    assert Matcher([]).rank(ISSUE) == []
    assert decide(Matcher([TARGET]).rank(IssueText(title="", body="")), MatchPolicy()) is None


def test_error_text_named_by_cluster_is_shared_evidence(matcher: Matcher) -> None:
    ev = matcher.rank(ISSUE)[0].evidence
    assert "zerodivisionerror" in ev.shared_errors
