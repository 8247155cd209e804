from __future__ import annotations

import json

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
    assert "| files | `gateway/slash_commands.py` | 0.50 |" in body
    assert ("| title | the issue title's rarer words, found in this bug's titles and summary "
            "| 0.30 |") in body
    assert "| text | `confirm` | 0.20 |" in body
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
    assert "gateway/slash_commands.py" in line and "_handle_reset_command" in line


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
