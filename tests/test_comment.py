from __future__ import annotations

import json
import re

from bot.clusters.models import Cluster
from bot.matching.types import Match, MatchEvidence
from bot.render.comment import MARKER, has_marker, neutralise, render, why_line
from tests.conftest import SAMPLE_CLUSTERS


def _cluster(name: str = "cluster-35994.json", **changes: object) -> Cluster:
    data = json.loads((SAMPLE_CLUSTERS / name).read_text())
    data.update(changes)
    return Cluster.model_validate(data)


def _match(cluster: Cluster) -> Match:
    ev = MatchEvidence(parts={"files": 1.0, "title_cov": 0.6, "text": 0.4, "errors": 0.0},
                       title_similarity=0.62,
                       shared_files=["gateway/slash_commands.py"],
                       shared_symbols=["_handle_reset_command"], matched_terms=["confirm"])
    return Match(cluster=cluster, score=0.91, evidence=ev)


def test_comment_names_fix_verdict_freshness_related_and_evidence() -> None:
    body = render(_match(_cluster()), issue_repo="NousResearch/hermes-agent")
    assert body.startswith(MARKER) and has_marker(body)
    assert "Gateway reset/new command hang and cleanup fixes" in body
    assert "| **Fix** | #52090 · fix(gateway): offload agent cleanup" in body
    assert "merged 2026-06-24" in body
    assert "| **Maintainers' verdict** | `resolved`, decided by #52090 |" in body
    assert "verified, last checked 2026-06-24" in body
    assert "#35994 (issue, closed)" in body and "#36006 (PR, closed)" in body
    assert "| files | changed by #52090: `gateway/slash_commands.py` | 0.50 |" in body
    # The title and text signals rest on the same shared words: one row, their weights added.
    assert "| words | the title of #35994: `confirm` | 0.50 |" in body
    assert "error text" not in body  # a signal that contributed nothing is not shown
    assert "match score 0.91" in body


def test_verdict_deciding_pr_shown_separately_when_it_differs() -> None:
    cluster = _cluster(resolution={"state": "resolved", "by": "pr-35381"})
    body = render(_match(cluster), issue_repo="NousResearch/hermes-agent")
    assert "decided by #35381 (not the fix PR above" in body
    assert "#52090" in body


def test_upstream_references_are_qualified() -> None:
    body = render(_match(_cluster()), issue_repo="me/fork")
    assert "NousResearch/hermes-agent#52090" in body
    assert "| #52090" not in body


def test_neutralise_breaks_mentions_html_and_table_cells() -> None:
    assert neutralise("ping @octocat and @org/team") == "ping @&#8203;octocat and @&#8203;org/team"
    assert neutralise("<script>x</script>") == "&lt;script&gt;x&lt;/script&gt;"
    assert neutralise("a | b\nc", table=True) == "a \\| b c"
    assert neutralise("mail me at a@b.c") == "mail me at a@&#8203;b.c"
    assert neutralise(None) == ""


def test_why_line_lists_files_and_symbols() -> None:
    line = why_line(_match(_cluster()))
    assert "changed by #52090: gateway/slash_commands.py" in line
    assert "_handle_reset_command" in line


def test_neutralise_closing_keywords_images_and_code_spans() -> None:
    assert neutralise("fixes #12, Closes owner/repo#3") == (
        "fixes&#8203; #12, Closes&#8203; owner/repo#3")
    assert neutralise("resolved: https://github.com/o/r/issues/1").startswith("resolved&#8203;:")
    assert neutralise("![px](https://e.example/p.png)") == "!\\[px\\](https://e.example/p.png)"
    assert neutralise("[click](javascript:alert(1))").startswith("\\[click\\]")
    # Nothing renders inside a code span, so it is left as written (no visible backslashes).
    assert neutralise("crash in `items[0]` for @bob") == "crash in `items[0]` for @&#8203;bob"
    assert neutralise("Tom & Jerry <b>") == "Tom &amp; Jerry &lt;b&gt;"


def test_comment_stays_under_githubs_limit_whatever_the_record_holds() -> None:
    cluster = _cluster()
    huge_title = "@everyone fixes #1 " + "word " * 5000
    members = [m.model_copy(update={"title": huge_title}) for m in cluster.members] * 200
    big = cluster.model_copy(update={"display_label": huge_title, "members": members})
    match = _match(big)
    match.evidence.shared_files[:] = ["x/" * 2000 + "y.py"] * 50
    body = render(match, issue_repo="NousResearch/hermes-agent")
    assert len(body) < 65536
    assert "@everyone" not in body and "fixes #1" not in body
    assert body.startswith(MARKER)


# -- the evidence table: each piece once, with where it came from --------------------------------
# A made-up bug of a made-up repository: two reports, an attempt and the fix that landed.
WIDGETS = "acme/widgets"
_DIFF = ("@@ -10,6 +10,9 @@ def evict_stale_entries(self, now):\n"
         "-    for key in self._slots:\n+    for key in list(self._slots):\n")


def _widgets(**changes: object) -> Cluster:
    data: dict[str, object] = {
        "repo": WIDGETS,
        "public_id": "w-7",
        "display_label": "Cache eviction crash during warmup",
        "summary": "Reports of the cache crashing while stale entries are evicted at startup.",
        "subsystem": "cache",
        "landed_fix": {"status": "landed", "pr": 203, "merged_at": "2030-01-02T03:04:05Z"},
        "members": [
            {"kind": "issue", "number": 201, "state": "closed",
             "title": "Crash with KeyError: 'slot gone' in `LruSlotTable` after upgrade"},
            {"kind": "issue", "number": 202, "state": "closed",
             "title": "Widgets freeze on warmup when the cache flushes"},
            {"kind": "pr", "number": 203, "state": "closed", "merged": True, "is_fix_pr": True,
             "title": "cache: iterate over a copy of the slots when evicting",
             "files_changed": ["src/cache/store.py", "src/cache/sweeper.py"],
             "fix_hunks": [{"file": "src/cache/store.py", "hunks": [_DIFF]}]},
        ],
    }
    data.update(changes)
    return Cluster.model_validate(data)


def _widgets_match(cluster: Cluster | None = None, **evidence: object) -> Match:
    fields: dict[str, object] = {
        "parts": {"label_cov": 2.0, "text": 1.5, "title_cov": 0.5, "files": 0.5,
                  "symbols": 0.4, "errors": 0.1, "title_miss": -0.7},
        "title_similarity": 0.3,
        "shared_files": ["src/cache/store.py"],
        "shared_symbols": ["evict_stale_entries", "LruSlotTable"],
        "shared_errors": ["slot gone"],
        # As the matcher orders them: the rarer first. Some are a piece above or a part of one.
        "matched_terms": ["evict_stale_entries", "src/cache/store.py", "lruslottable", "warmup",
                          "freeze", "evict", "stale", "keyerror", "slot", "widget", "flush",
                          "crash", "upgrade"],
    }
    fields.update(evidence)
    return Match(cluster=cluster or _widgets(), score=0.9,
                 evidence=MatchEvidence.model_validate(fields))


def _table(body: str) -> dict[str, tuple[str, str]]:
    """signal -> (what matched, weight) of the evidence table."""
    rows = body.split("| signal | what matched | weight |\n|---|---|---|\n", 1)[1]
    found: dict[str, tuple[str, str]] = {}
    for line in rows.split("\n\n", 1)[0].splitlines():
        signal, what, weight = (cell.strip() for cell in line.strip("|").split(" | "))
        assert signal not in found, f"two rows for {signal}"
        found[signal] = (what, weight)
    return found


def _spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_each_piece_of_evidence_appears_once_in_the_whole_table() -> None:
    table = _table(render(_widgets_match(), issue_repo=WIDGETS))
    spans = [s for what, _ in table.values() for s in _spans(what)]
    assert len(spans) == len({s.lower() for s in spans}), spans
    # Among them every shared file, function and error text, each in its own row.
    assert _spans(table["files"][0]) == ["src/cache/store.py"]
    assert sorted(_spans(table["functions / classes"][0])) == ["LruSlotTable",
                                                               "evict_stale_entries"]
    assert _spans(table["error text"][0]) == ["slot gone"]


def test_no_row_repeats_another_rows_terms_or_their_parts() -> None:
    table = _table(render(_widgets_match(), issue_repo=WIDGETS))
    words = [w.lower() for w in _spans(table["words"][0])]
    # Neither the pieces themselves nor the words the index split them into ("evict", "stale",
    # "slot") come back as shared words.
    for taken in ("evict_stale_entries", "src/cache/store.py", "lruslottable", "evict", "stale",
                  "slot", "gone"):
        assert taken not in words, taken
    # The other shared words, six at most (so "upgrade", the weakest, is left out).
    assert sorted(words) == ["crash", "flushes", "freeze", "keyerror", "warmup", "widgets"]
    # The three word signals are one row, not three rows with the same words.
    assert {"title", "text", "bug label"}.isdisjoint(table)


def test_each_row_says_where_its_evidence_came_from() -> None:
    table = _table(render(_widgets_match(), issue_repo=WIDGETS))
    assert table["files"][0] == "changed by #203: `src/cache/store.py`"
    assert table["functions / classes"][0] == (
        "in the diff of #203: `evict_stale_entries`; "
        "named in the title of #201: `LruSlotTable`")
    assert table["error text"][0] == "quoted in the title of #201: `slot gone`"
    # Each word as the title writes it ("Widgets" for the term "widget").
    assert table["words"][0] == ("the title of #202: `warmup`, `freeze`, `Widgets`, `flushes`; "
                                 "the title of #201: `keyerror`, `Crash`")


def test_shared_words_name_the_member_title_they_were_found_in() -> None:
    match = _widgets_match(parts={"text": 1.0},
                           matched_terms=["warmup", "freeze", "copy", "startup", "zzyzx"])
    what = _table(render(match, issue_repo=WIDGETS))["words"][0]
    # The title holding most of the words first (a member's before the label, which says
    # "warmup" too), then the one with most of the rest, and so on: each word once.
    assert what == ("the title of #202: `warmup`, `freeze`; the title of #203: `copy`; "
                    "the bug's summary: `startup`; elsewhere in this bug's record: `zzyzx`")
    # Another repository's issue: the titles are named as that repository's items.
    what = _table(render(match, issue_repo="someone/fork"))["words"][0]
    assert what.startswith("the title of acme/widgets#202: `warmup`")


def test_shared_words_found_only_in_a_changed_files_path_name_that_file() -> None:
    match = _widgets_match(parts={"text": 1.0, "files": 0.0}, shared_files=[],
                           matched_terms=["sweeper"])
    what = _table(render(match, issue_repo=WIDGETS))["words"][0]
    assert what == "the path of `src/cache/sweeper.py`, which the fix changed: `sweeper`"


def test_a_words_row_with_no_words_of_its_own_lists_none() -> None:
    match = _widgets_match(parts={"text": 3.0, "files": 1.0},
                           matched_terms=["src/cache/store.py", "cache", "store"])
    table = _table(render(match, issue_repo=WIDGETS))
    assert table["words"] == ("only the words of the rows above", "0.75")
    assert table["files"] == ("changed by #203: `src/cache/store.py`", "0.25")


def test_weight_is_the_share_of_the_positive_score() -> None:
    table = _table(render(_widgets_match(), issue_repo=WIDGETS))
    # Positive parts add up to 5.0; the three word signals give 4.0 of it, title_miss (against)
    # is not in the table.
    assert [(name, weight) for name, (_, weight) in table.items()] == [
        ("words", "0.80"), ("files", "0.10"), ("functions / classes", "0.08"),
        ("error text", "0.02")]


def test_a_file_whose_signal_added_nothing_leaves_its_words_to_the_words_row() -> None:
    match = _widgets_match(parts={"text": 1.0}, matched_terms=["src/cache/store.py", "warmup"])
    table = _table(render(match, issue_repo=WIDGETS))
    assert list(table) == ["words"]
    assert table["words"][0] == ("the title of #202: `warmup`; "
                                 "a file the fix changed: `src/cache/store.py`")


def test_the_regression_comment_shows_the_same_evidence_table() -> None:
    from bot.matching.regression import Regression
    from bot.render.comment import render_regression

    match = _widgets_match()
    regression = Regression(kind="caused_by_fix", cited=203, phrase="regression from #203")
    assert _table(render_regression(match, regression, issue_repo=WIDGETS)) == \
        _table(render(match, issue_repo=WIDGETS))


def test_why_line_names_each_piece_once_with_its_source() -> None:
    match = _widgets_match(shared_symbols=["evict_stale_entries", "SRC/cache/store.py"])
    assert why_line(match) == (
        "changed by #203: src/cache/store.py; in the diff of #203: evict_stale_entries; "
        "quoted in the title of #201: slot gone; title similarity 0.30")


def test_untrusted_titles_and_terms_stay_inert_in_the_evidence_table() -> None:
    members = [
        {"kind": "issue", "number": 301, "state": "open",
         "title": "@everyone Crash <img src=x> on Save, fixes #1"},
        {"kind": "pr", "number": 302, "state": "closed", "merged": True, "is_fix_pr": True,
         "title": "fix", "files_changed": ["a|b/<b>x</b>.py"]},
    ]
    cluster = _widgets(members=members, landed_fix={"status": "landed", "pr": 302},
                       repo="evil@org/widgets")
    match = _widgets_match(cluster, parts={"text": 1.0, "files": 1.0},
                           shared_files=["a|b/<b>x</b>.py"], shared_symbols=[],
                           shared_errors=[], matched_terms=["@everyone", "crash", "save"])
    body = render(match, issue_repo="someone/fork")
    table = _table(body)
    # A term is shown as a title writes it only when the title writes it as a plain word.
    assert table["words"][0] == ("the title of evil@&#8203;org/widgets#301: `Crash`, `Save`; "
                                 "elsewhere in this bug's record: `@everyone`")
    assert table["files"][0] == "changed by evil@&#8203;org/widgets#302: `a\\|b/<b>x</b>.py`"
    # Outside code spans (which GitHub renders as plain text) nothing pings, tags or closes.
    prose = re.sub(r"`[^`]*`", "", body)
    assert re.search(r"@(?!&#8203;)", prose) is None
    assert "<b>" not in prose and "<img" not in prose and "fixes #1" not in body
