"""Learning clusters from merged fixes: closing references, reverts, hunks, the record."""

from __future__ import annotations

import pytest

from bot.clusters.learning import (
    add_duplicate,
    closing_refs,
    cluster_from_fix,
    duplicate_target,
    mark_reverted,
    reverted_number,
    trim_patch,
)

REPO = "octo/app"


@pytest.mark.parametrize("text, expected", [
    ("Fixes #12", [12]),
    ("closes #3, resolves #4 and fixed: #5", [3, 4, 5]),
    ("Resolves octo/app#7 and fixes other/repo#8", [7]),
    ("fix https://github.com/octo/app/issues/9", [9]),
    ("Related to #10; see #11", []),
    ("> fixes #12\nquoted from elsewhere", []),
    ("```\nfixes #13\n```", []),
    ("prefix-fixes #14", [14]),
    ("fixes #15 fixes #15", [15]),
    (None, []),
])
def test_closing_refs(text: str | None, expected: list[int]) -> None:
    assert closing_refs(text, REPO) == expected


@pytest.mark.parametrize("title, body, expected", [
    ('Revert "fix(gw): offload cleanup (#52)"', "Reverts octo/app#52", 52),
    ('Revert "fix(gw): offload cleanup (#52)"', "", 52),
    ("chore: tidy", "This reverts #40 because it broke CI", 40),
    ("chore: tidy", "Reverts other/repo#40", None),
    ("fix: thing", "no revert here", None),
])
def test_reverted_number(title: str, body: str, expected: int | None) -> None:
    assert reverted_number(title, body, REPO) == expected


def test_trim_patch_keeps_headers_and_changed_lines_only() -> None:
    patch = ("@@ -1,4 +1,5 @@ def run_tool(index):\n context\n-    old()\n+    new()\n context\n"
             "@@ -20,2 +21,3 @@ class Runner:\n+    added = 1\n unchanged\n")
    assert trim_patch(patch) == [
        "@@ -1,4 +1,5 @@ def run_tool(index):\n-    old()\n+    new()",
        "@@ -20,2 +21,3 @@ class Runner:\n+    added = 1",
    ]
    huge = "@@ -1 +1 @@\n" + "+x\n" * 500
    assert len(trim_patch(huge)[0].splitlines()) <= 41
    assert trim_patch(None) == []


def _pr(number: int = 50, **extra: object) -> dict[str, object]:
    pr: dict[str, object] = {"number": number, "title": "fix(tools): clean up in finally",
                             "body": "Fixes #10, fixes #11", "merged_at": "2026-05-30T10:00:00Z",
                             "html_url": f"https://github.com/octo/app/pull/{number}"}
    pr.update(extra)
    return pr


ISSUES = [{"number": 10, "title": "Interrupt state leaks after a tool raises", "state": "closed"},
          {"number": 11, "title": "Tools instantly interrupted", "state": "closed"}]
FILES = [{"filename": "agent/tool_executor.py",
          "patch": "@@ -1 +1 @@ def _run_tool(i):\n-a\n+b"},
         {"filename": "tests/test_interrupt.py", "patch": "@@ -0,0 +1 @@\n+def test(): pass"}]


def test_merged_pr_closing_two_issues_is_one_cluster() -> None:
    c = cluster_from_fix(REPO, _pr(), ISSUES, FILES)
    assert c.repo == REPO and c.public_id == "10"
    assert c.display_label == "Interrupt state leaks after a tool raises"
    assert [(m.kind, m.number) for m in c.members] == [("issue", 10), ("issue", 11), ("pr", 50)]
    assert c.landed_fix.landed and c.landed_fix.pr == 50
    assert c.landed_fix.merged_at == "2026-05-30T10:00:00Z"
    assert c.resolution.by == "pr-50" and c.resolution.deciding_pr == 50
    assert c.freshness.state == "verified" and not c.freshness.stale
    assert c.grouping.backbone == "CLOSING_REF"
    assert c.files_changed == ["agent/tool_executor.py", "tests/test_interrupt.py"]
    assert c.fix_pr is not None and c.fix_pr.fix_hunks[0].hunks == [
        "@@ -1 +1 @@ def _run_tool(i):\n-a\n+b"]
    assert [e.issue_number for e in c.fix_edges] == [10, 11]


def test_second_fix_for_the_same_bug_keeps_the_first_as_member() -> None:
    first = cluster_from_fix(REPO, _pr(50), ISSUES[:1], FILES)
    second = cluster_from_fix(REPO, _pr(60, title="fix: also cover the sync path"), ISSUES[:1],
                              FILES[:1], existing=first)
    assert second.public_id == "10" and second.landed_fix.pr == 60
    prs = {m.number: m for m in second.members if m.is_pr}
    assert set(prs) == {50, 60} and prs[60].is_fix_pr and not prs[50].is_fix_pr


def test_revert_marks_the_fix_and_it_is_no_longer_landed() -> None:
    c = mark_reverted(cluster_from_fix(REPO, _pr(), ISSUES, FILES), 70, "2026-06-01T00:00:00Z")
    assert not c.landed_fix.landed and c.landed_fix.reverted
    assert any(m.number == 70 for m in c.members)


def test_duplicates() -> None:
    c = cluster_from_fix(REPO, _pr(), ISSUES, FILES)
    d = add_duplicate(c, {"number": 99, "title": "same thing again", "state": "closed"})
    assert [m.number for m in d.members if m.kind == "issue"] == [10, 11, 99]
    assert add_duplicate(d, {"number": 99}) is d
    assert duplicate_target(["thanks", "Duplicate of #10", "> Duplicate of #5"]) == 10
    assert duplicate_target(["nothing"]) is None
