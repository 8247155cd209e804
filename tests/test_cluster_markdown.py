"""The markdown report parser, against the real seed report and the shipped trimmed copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from bot.clusters.markdown import (
    MarkdownReportError,
    load_cluster_markdown,
    parse_cluster_markdown,
    unescape_markdown,
)
from bot.clusters.models import Cluster

ROOT = Path(__file__).resolve().parents[1]
SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
SHIPPED = ROOT / "config" / "clusters" / "cluster-35309.md"

ISSUE_TITLE = (
    "[Bug]: ThreadPoolExecutor leaks _interrupted_threads state when _run_tool raises an "
    "unhandled exception"
)
FIX_TITLE = "fix(tools): wrap _run_tool cleanup in finally to prevent interrupt state leak (#35309)"
VERDICT_TITLE = "fix(gateway): recover model on post-interrupt recovery turn; gate fallback status"
FIRST_HUNK_HEADER = (
    "@@ -306,33 +306,38 @@ def _run_tool(index, tool_call, function_name, function_args):"
)


@pytest.fixture(scope="module")
def seed() -> Cluster:
    path = SEEDS / "cluster-35309.md"
    if not path.exists():
        pytest.skip(f"seed report not available at {path}")
    return load_cluster_markdown(path)


def _members(cluster: Cluster) -> list[tuple[str, int, str | None, str, bool | None]]:
    return [(m.kind, m.number, m.title, m.state, m.merged) for m in cluster.members]


def test_heading_summary_and_id(seed: Cluster) -> None:
    assert seed.repo == "NousResearch/hermes-agent"
    assert seed.public_id == "35309"
    assert seed.key == ("nousresearch/hermes-agent", "35309")
    assert seed.display_label == "Interrupt state leak fixes and recovery handling"
    assert seed.summary.startswith(
        "These members address a bug where interrupted thread state leaks when tool execution"
    )
    assert seed.summary.endswith("gating fallback status.")
    assert seed.subsystem == "agent"


def test_fix_status_and_verdict_stay_distinct(seed: Cluster) -> None:
    assert seed.landed_fix.status == "merged_to_main"
    assert seed.landed_fix.pr == 35382
    assert seed.landed_fix.merged_at == "2026-05-30"
    assert seed.landed_fix.landed is True
    assert seed.resolution.state == "resolved"
    assert seed.resolution.by == "pr-35381"
    assert seed.resolution.deciding_pr == 35381
    assert seed.freshness.state == "verified"
    assert seed.freshness.last_verified_at == "2026-05-30"
    assert seed.freshness.stale is False


def test_grouping_and_counts(seed: Cluster) -> None:
    assert seed.grouping.backbone == "STRUCTURAL_SPANNING"
    assert seed.grouping.link_density == 0.5
    counts = seed.counts
    assert (counts.members, counts.open_issues, counts.closed_issues) == (4, 0, 1)
    assert (counts.open_prs, counts.merged_prs, counts.attempt_prs) == (0, 2, 1)


def test_members(seed: Cluster) -> None:
    assert _members(seed) == [
        ("issue", 35309, ISSUE_TITLE, "closed", None),
        ("pr", 35382, FIX_TITLE, "merged", True),
        ("pr", 35320, FIX_TITLE, "closed", False),
        ("pr", 35381, VERDICT_TITLE, "merged", True),
    ]
    by_number = {m.number: m for m in seed.members}
    assert by_number[35382].is_fix_pr is True
    assert by_number[35382].fix_tier == "verified"
    assert by_number[35381].is_fix_pr is None
    assert by_number[35381].fix_tier is None
    assert seed.fix_pr is by_number[35382]


def test_superseded_pr_and_close_reasons(seed: Cluster) -> None:
    by_number = {m.number: m for m in seed.members}
    superseded = by_number[35320]
    assert superseded.state == "closed" and superseded.merged is False
    assert superseded.close_reason is not None
    assert superseded.close_reason.category == "merged_via"
    assert superseded.close_reason.implication == "superseded"
    assert [(r.kind, r.value, r.number) for r in superseded.close_reason.refs] == [
        ("pr", "#35382", 35382)
    ]
    assert superseded.files_changed == [] and superseded.fix_hunks == []
    fixed = by_number[35382].close_reason
    assert fixed is not None and fixed.category == "merged" and fixed.refs == []


def test_files_and_hunks(seed: Cluster) -> None:
    by_number = {m.number: m for m in seed.members}
    assert by_number[35382].files_changed == [
        "agent/tool_executor.py",
        "tests/tools/test_interrupt.py",
    ]
    assert by_number[35381].files_changed == [
        "agent/conversation_loop.py",
        "gateway/run.py",
        "run_agent.py",
        "tests/gateway/test_empty_model_recovery.py",
    ]
    hunks = by_number[35382].fix_hunks
    assert [fh.file for fh in hunks] == ["agent/tool_executor.py", "tests/tools/test_interrupt.py"]
    assert [len(fh.hunks) for fh in hunks] == [1, 1]
    first = hunks[0].hunks[0].split("\n")
    assert first[0] == FIRST_HUNK_HEADER
    # The list indentation is gone but the diff's own first column stays.
    assert first[1] == "         # submit site below (GHSA-qg5c-hvr5-hjgr, #13617)."
    assert "-            result = agent._invoke_tool(" in first
    assert "+        finally:" in first
    assert first[-1] == "     spinner = None"
    assert len(first) == 66
    second = hunks[1].hunks[0].split("\n")
    assert second[0] == "@@ -203,6 +203,83 @@ def _run():"
    assert "+class TestRunToolCleanupOnBaseException:" in second
    # Lines inside the diff that look like list items must not become members.
    assert len(seed.members) == 4


def test_shipped_copy_has_the_same_facts(seed: Cluster) -> None:
    shipped = load_cluster_markdown(SHIPPED)
    same = ("repo", "public_id", "display_label", "summary", "subsystem", "counts")
    for name in same:
        assert getattr(shipped, name) == getattr(seed, name), name
    for name in ("landed_fix", "resolution", "freshness", "grouping"):
        assert getattr(shipped, name) == getattr(seed, name), name
    assert _members(shipped) == _members(seed)
    for ours, theirs in zip(shipped.members, seed.members, strict=True):
        assert ours.files_changed == theirs.files_changed
        assert ours.close_reason == theirs.close_reason
        assert [fh.file for fh in ours.fix_hunks] == [fh.file for fh in theirs.fix_hunks]
        assert [h.split("\n")[0] for fh in ours.fix_hunks for h in fh.hunks] == [
            h.split("\n")[0] for fh in theirs.fix_hunks for h in fh.hunks
        ]
    # Trimmed, yet the identifiers the matcher needs are still in the changed lines.
    fix = shipped.fix_pr
    assert fix is not None and fix.number == 35382
    body = fix.fix_hunks[0].hunks[0]
    assert "+        finally:" in body and "_set_interrupt" in body
    assert len(body.split("\n")) < 20


def test_shipped_copy_without_seeds() -> None:
    cluster = load_cluster_markdown(SHIPPED)
    assert cluster.public_id == "35309"
    assert cluster.landed_fix.pr == 35382 and cluster.resolution.deciding_pr == 35381
    assert cluster.members[0].title == ISSUE_TITLE
    assert cluster.fix_pr is not None and cluster.fix_pr.title == FIX_TITLE


MINIMAL = """\
# acme/widgets · Crash on \\*empty\\* config

Widgets crashes when the config file is empty.

## Open now

- #12: Crash on empty `config\\_file` \\(again\\)
- Also see the docs.

## Closed / duplicate issues

- #7: \\[Bug\\] crash on empty config

## Prior & competing PRs

- **#9: fix: handle **empty** config**. merged to main
  - files: `widgets/config.py`
  - fix hunks:
  - `widgets/config.py`

    ```diff
    diff --git a/widgets/config.py b/widgets/config.py
    @@ -1,2 +1,3 @@ def load(path):
    -    return parse(text)
    +    if not text:
    +        return {}

    @@ -20,1 +21,1 @@ class Config:
    -    x = 1
    +    x = 2
    ```

## Fix status

- Merged to main in PR #9 on `2026-01-02T03:04:05+00:00`.
- Fix last verified (merged) `2026-01-05`.
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_minimal_report(tmp_path: Path) -> None:
    cluster = load_cluster_markdown(_write(tmp_path, "report.md", MINIMAL))
    assert cluster.repo == "acme/widgets"
    assert cluster.display_label == "Crash on *empty* config"
    assert cluster.summary == "Widgets crashes when the config file is empty."
    # No cluster-<id>.md name: the first closed issue gives the id.
    assert cluster.public_id == "7"
    assert _members(cluster) == [
        ("issue", 12, "Crash on empty `config\\_file` (again)", "open", None),
        ("issue", 7, "[Bug] crash on empty config", "closed", None),
        ("pr", 9, "fix: handle **empty** config", "merged", True),
    ]
    fix = cluster.fix_pr
    assert fix is not None and fix.number == 9 and fix.is_fix_pr is True
    assert [fh.hunks for fh in fix.fix_hunks] == [
        [
            "@@ -1,2 +1,3 @@ def load(path):\n-    return parse(text)\n+    if not text:\n"
            "+        return {}",
            "@@ -20,1 +21,1 @@ class Config:\n-    x = 1\n+    x = 2",
        ]
    ]
    # An explicit merge date beats the verification date.
    assert cluster.landed_fix.merged_at == "2026-01-02T03:04:05+00:00"
    # Sections the report left out keep the model defaults.
    assert cluster.resolution.state is None and cluster.resolution.by is None
    assert cluster.grouping.backbone is None and cluster.subsystem is None
    assert cluster.counts.members == 0


def test_id_from_file_name(tmp_path: Path) -> None:
    cluster = load_cluster_markdown(_write(tmp_path, "cluster-abc-1.md", MINIMAL))
    assert cluster.public_id == "abc-1"
    assert parse_cluster_markdown(MINIMAL).public_id == "7"


def test_no_heading_is_an_error(tmp_path: Path) -> None:
    text = MINIMAL.split("\n", 1)[1]
    path = _write(tmp_path, "cluster-1.md", text)
    with pytest.raises(MarkdownReportError) as caught:
        load_cluster_markdown(path)
    assert caught.value.line == 1
    assert "heading" in caught.value.message
    assert str(caught.value).startswith(f"{path}:1: ")


def test_no_members_is_an_error_at_the_heading(tmp_path: Path) -> None:
    text = "\n\n# acme/widgets · Label\n\nSummary.\n\n## Fix status\n\n- Subsystem: `x`\n"
    path = _write(tmp_path, "cluster-2.md", text)
    with pytest.raises(MarkdownReportError) as caught:
        load_cluster_markdown(path)
    assert (caught.value.line, caught.value.field) == (3, "members")
    assert str(caught.value).startswith(f"{path}:3: members: no members found")


def test_heading_without_label_is_an_error() -> None:
    with pytest.raises(MarkdownReportError) as caught:
        parse_cluster_markdown("# acme/widgets\n\n## Open\n\n- #1: t\n", "x.md")
    assert caught.value.line == 1
    assert str(caught.value) == "x.md:1: heading must read '# owner/name · Label'"


def test_bad_repo_is_reported_with_field_and_line() -> None:
    text = "\n# widgets · Label\n\n## Closed issues\n\n- #1: t\n"
    with pytest.raises(MarkdownReportError) as caught:
        parse_cluster_markdown(text, "y.md")
    assert (caught.value.line, caught.value.field) == (2, "repo")
    assert "owner/name" in caught.value.message


def test_unescape_markdown() -> None:
    assert unescape_markdown(r"\[Bug\]: a\_b \#1 \\ x") == "[Bug]: a_b #1 \\ x"
    assert unescape_markdown(r"keep `C:\path\[x\]` as is") == r"keep `C:\path\[x\]` as is"
    assert unescape_markdown(r"no \escape of letters") == r"no \escape of letters"
