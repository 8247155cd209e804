"""The matcher on small synthetic clusters: ranking, evidence, the decision, the filters."""

from __future__ import annotations

import pytest

from bot.matching import IssueText, Match, Matcher, MatchPolicy, decide, learn_boilerplate
from tests.samples import FILLER, FRAME_HUNK, ISSUE, LOOKALIKE, MATCH_REPO, TARGET, cluster


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
    assert all(m.cluster.repo == MATCH_REPO for m in matcher.rank(ISSUE, repos=["ACME/Widget"]))
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


def test_a_citation_counts_as_the_issue_reads_it() -> None:
    """For the match only where the issue says it is the cited bug, against it where it says it
    is another, for neither where it only mentions it (bot/matching/citations.py)."""
    matcher = Matcher([TARGET, LOOKALIKE, *FILLER])

    def target(body: str) -> Match:
        issue = IssueText(title="Renderer crash when paused", body=body)
        return next(m for m in matcher.rank(issue) if m.public_id == "101")

    plain = target("It crashes.")
    same = target("It crashes. Duplicate of #101.")
    mention = target("It crashes, like #1101 said.")
    unknown = target("It crashes, like #9999 said.")  # the same words, a number no bug has
    apart = target("It crashes. This is distinct from #1101.")
    assert same.score > plain.score and same.evidence.parts.get("ref", 0) > 0
    assert mention.score == unknown.score and "ref" not in mention.evidence.parts
    assert apart.score < plain.score and apart.evidence.parts.get("ref_against", 0) < 0


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
