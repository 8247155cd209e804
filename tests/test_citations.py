"""Citations read in context: one example per cue of the table in bot/matching/citations.py,
written as a tracker's users write, and the rules around them (sentences, foreign references,
the strongest reading of a number cited twice)."""

from __future__ import annotations

import pytest

from bot.matching.citations import AGAINST_MATCH, FOR_MATCH, REGRESSION, Citation, citations

# (what an issue says, the kind it gives #123)
TABLE = [
    # same: closing keywords, duplicate of, same as
    ("Closes #123", "same"),
    ("This PR fixes #123 by bounding the queue.", "same"),
    ("Resolved #123 upstream", "same"),
    ("Duplicate of #123", "same"),
    ("Looks like a dup of #123", "same"),
    ("Same problem as #123, on my machine too.", "same"),
    ("This is the same crash as issue #123", "same"),
    ("Identical to #123", "same"),
    ("Already reported in #123 I think", "same"),
    ("#123 is the same bug, reproduced here", "same"),
    ("Same as #123, the bot still hangs.", "same"),  # a comma ends what is said of #123
    ("Duplicate of #123, failing to connect", "same"),
    # contrast
    ("This is distinct from #123: the proxy is not involved.", "contrast"),
    ("Unlike #123, this happens without TLS.", "contrast"),
    ("Not the same as #123", "contrast"),
    ("Not quite the same issue as #123", "contrast"),
    ("Different from #123 because the timeout never fires", "contrast"),
    ("It differs from #123 in that it needs no proxy", "contrast"),
    ("Unrelated to #123", "contrast"),
    ("Not related to #123 as far as I can tell", "contrast"),
    ("Separate from #123", "contrast"),
    ("Not a duplicate of #123", "contrast"),
    ("A cause other than #123", "contrast"),
    ("The session itself, rather than #123", "contrast"),
    ("#123 is different: it was about the reader.", "contrast"),
    ("#123 is unrelated though", "contrast"),
    ("#123 is not the same", "contrast"),
    ("This isn't a duplicate of #123.", "contrast"),
    ("This isnt a duplicate of #123.", "contrast"),
    ("This is not really a duplicate of #123.", "contrast"),
    ("I don't think this is a duplicate of #123", "contrast"),
    ("This isn't the same as #123", "contrast"),
    # continuation
    ("Follow-up to #123", "continuation"),
    ("A follow up on #123 for the writer side", "continuation"),
    ("The remainder of #123", "continuation"),
    ("Fixes the rest of #123", "continuation"),
    ("Leftover from #123", "continuation"),
    ("Left over from #123 after the rewrite", "continuation"),
    ("Part of #123", "continuation"),
    ("Continuation of #123", "continuation"),
    ("This still happens as in #123", "continuation"),
    ("Seeing #123 again on the new release", "continuation"),
    ("Also happens in #123's setup with a proxy", "continuation"),
    ("Please reopen #123", "continuation"),
    ("#123 remainder: the writer side", "continuation"),
    ("#123 leftovers", "continuation"),
    ("#123 follow-up", "continuation"),
    ("#123 still occurs on Windows", "continuation"),
    ("#123 happens again", "continuation"),
    ("#123 also happens with HTTP/2", "continuation"),
    ("#123 is back", "continuation"),
    # failure
    ("The change did not fix #123", "failure"),
    ("This was not fixed by #123", "failure"),
    ("It is not resolved by #123", "failure"),
    ("Despite #123 the socket leaks", "failure"),
    ("Even after #123 landed it hangs", "failure"),
    ("The tests from #123 fail on my machine", "failure"),
    ("#123 didn't fix it for me", "failure"),
    ("#123 does not help", "failure"),
    ("#123 was not enough", "failure"),
    ("#123 is incomplete", "failure"),
    ("#123 fails on Python 3.12", "failure"),
    ("#123's tests fail here", "failure"),
    ("#123 was reverted", "failure"),
    # causal
    ("Regression from #123", "causal"),
    ("This regressed in #123", "causal"),
    ("Broken since #123", "causal"),
    ("It broke after merging #123", "causal"),
    ("Introduced by #123", "causal"),
    ("Caused by #123", "causal"),
    ("It started with #123", "causal"),
    ("I bisected it to #123", "causal"),
    ("Bisected the problem down to PR 123", "causal"),
    ("#123 broke the proxy support", "causal"),
    ("#123 introduced this", "causal"),
    # mention
    ("See #123 for background.", "mention"),
    ("Related: #123", "mention"),
    ("Fix the timeout (#123)", "mention"),
    ("Similar to #123 but on Windows", "mention"),
    ("Not sure it is the same as #123", "mention"),
    ("Not sure if same as #123", "mention"),
    ("This might be a duplicate of #123", "mention"),
    ("The fix (#123) does not cover the worker case", "mention"),  # "fix" the noun
    ("I added a test in #123", "mention"),
    ("Like #123, the test fails on Windows", "mention"),
    ("This is the same class as #123.", "mention"),  # likeness, not identity
    ("The same kind of leak pattern as #123", "mention"),
]


@pytest.mark.parametrize(("text", "kind"), TABLE, ids=[t for t, _ in TABLE])
def test_each_cue_reads_its_citation(text: str, kind: str) -> None:
    [found] = citations(text)
    assert (found.number, found.kind) == (123, kind), found


def test_every_kind_has_examples_and_a_place() -> None:
    kinds = {kind for _, kind in TABLE}
    assert kinds == {"same", "contrast", "continuation", "failure", "causal", "mention"}
    assert {"same"} == FOR_MATCH
    assert {"contrast", "continuation", "failure"} == AGAINST_MATCH
    assert {"causal", "failure"} == REGRESSION


def test_a_cue_in_another_sentence_does_not_govern_the_reference() -> None:
    assert citations("It is not a duplicate. See #123.") == [Citation(123, "mention", "#123")]
    assert citations("This is distinct.\n\n#123 has the details")[0].kind == "mention"


def test_the_title_is_its_own_sentence() -> None:
    """The matcher reads the title and the body as one text, a line break between them."""
    text = "Duplicate of #123\nThe bot fails to answer after /new."
    assert [(c.number, c.kind) for c in citations(text)] == [(123, "same")]


def test_a_link_into_another_repository_is_not_ours() -> None:
    text = "See https://github.com/other/repo/pull/52 and https://github.com/o/r/issues/53"
    assert [c.number for c in citations(text, ["o/r"])] == [53]
    assert [c.number for c in citations(text)] == [52, 53]  # no repository given: any


def test_a_cue_governs_only_the_reference_it_touches() -> None:
    found = {c.number: c.kind for c in citations("Duplicate of #10, and see #11 too.")}
    assert found == {10: "same", 11: "mention"}


def test_the_strongest_reading_of_a_number_wins() -> None:
    text = "Same as #123. Update: #123 didn't fix it."
    assert [(c.number, c.kind) for c in citations(text)] == [(123, "failure")]
    # A later bare mention does not undo what an earlier sentence said of it.
    text = "Warns at startup (#123 remainder)\nThis covers what is left in #123."
    assert [(c.number, c.kind) for c in citations(text)] == [(123, "continuation")]


def test_urls_and_pr_forms_are_references() -> None:
    text = ("Distinct from https://github.com/o/r/issues/77 and follow-up to "
            "https://github.com/o/r/pull/78.")
    assert [(c.number, c.kind) for c in citations(text, ["O/R"])] == [(77, "contrast"),
                                                                      (78, "continuation")]


def test_a_reference_into_another_repository_is_not_ours() -> None:
    assert citations("Duplicate of other/project#123") == []


def test_a_long_list_of_references_is_read_only_so_far() -> None:
    text = " ".join(f"#{n}" for n in range(1, 200))
    assert len(citations(text)) == 50


def test_garbage_and_empty_text() -> None:
    assert citations("") == []
    assert citations("#" * 5000 + "(" * 5000) == []
