"""`python -m bot match` and `python -m bot eval` as subprocesses, on synthetic files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.samples import OFFLINE_CLUSTERS as CLUSTERS
from tests.samples import RENDER_CRASH

ROOT = Path(__file__).resolve().parents[1]

QUERIES = [
    {"number": 1, **RENDER_CRASH, "expected": "101"},
    {
        "number": 2,
        "title": "Dark mode colours wrong in print preview",
        "body": "Too bright.",
        "expected": None,
    },
    {"number": 3, "title": "PDF export loses embedded fonts", "body": "", "expected": "102"},
    {"number": 4, "title": "Something vague", "body": None, "expected": None, "uncertain": True},
]


def _write(tmp_path: Path) -> tuple[Path, Path]:
    clusters = tmp_path / "clusters.jsonl"
    clusters.write_text("".join(json.dumps(c) + "\n" for c in CLUSTERS))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    return clusters, queries


def _bot(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bot", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _check_contract(lines: list[str]) -> list[dict[str, object]]:
    out = [json.loads(line) for line in lines]
    assert [o["number"] for o in out] == [1, 2, 3, 4]
    for o in out:
        assert set(o) >= {"number", "comment", "best", "score", "matches"}
        assert isinstance(o["comment"], bool)
        assert isinstance(o["score"], float)
        assert (o["best"] is None) == (not o["comment"])
        for m in o["matches"]:
            assert set(m) >= {"cluster", "score", "why"}
            assert {
                "parts",
                "shared_files",
                "shared_symbols",
                "shared_errors",
                "matched_terms",
                "title_similarity",
            } <= set(m["why"])
    return out


def test_match_from_file(tmp_path: Path) -> None:
    clusters, queries = _write(tmp_path)
    proc = _bot("match", "--clusters", str(clusters), "--queries", str(queries))
    assert proc.returncode == 0, proc.stderr
    out = _check_contract(proc.stdout.splitlines())
    assert out[0]["comment"] is True and out[0]["best"] == "101"
    assert out[0]["matches"][0]["cluster"] == "101"
    assert "widget/render/frame.py" in out[0]["matches"][0]["why"]["shared_files"]
    assert out[1]["comment"] is False and out[1]["best"] is None


def test_match_from_stdin_with_repeated_clusters(tmp_path: Path) -> None:
    clusters, queries = _write(tmp_path)
    extra = tmp_path / "more.json"
    extra.write_text(json.dumps({**CLUSTERS[1], "public_id": "104"}))
    proc = _bot(
        "match", "--clusters", str(clusters), "--clusters", str(extra), stdin=queries.read_text()
    )
    assert proc.returncode == 0, proc.stderr
    out = _check_contract(proc.stdout.splitlines())
    ids = {m["cluster"] for m in out[2]["matches"]}
    assert {"102", "104"} <= ids


def test_eval_prints_figures_and_plot(tmp_path: Path) -> None:
    clusters, queries = _write(tmp_path)
    plot = tmp_path / "pr.png"
    proc = _bot(
        "eval",
        "--clusters",
        str(clusters),
        "--queries",
        str(queries),
        "--plot",
        str(plot),
        "--cv",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # Uncertain labels are left out, as score.py leaves them out.
    assert "3 issues (2 with a cluster, 1 without)" in text
    assert "precision" in text and "recall" in text and "R@1" in text and "R@5" in text
    assert "threshold  comments  precision  recall" in text
    assert "cross-validated" in text
    assert "baseline title edit distance" in text
    assert "baseline BM25 title+body" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the plot is not checked")
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the cross-validated figures' interval, by-kind table and wrong comments -------------------

from bot.clusters.models import Cluster  # noqa: E402
from bot.eval.fit import Outcome  # noqa: E402
from bot.eval.report import (  # noqa: E402
    KINDS,
    bootstrap_pr,
    by_kind,
    evidence_lines,
    format_bootstrap,
    is_release_note_cluster,
    kinds_of,
    other_language,
    wrong_comments,
)

# A release-note cluster (the fix PR and its release, no reporter's title) beside the above.
RELEASE_NOTE = {
    "repo": "acme/widget",
    "public_id": "105",
    "display_label": "Clipboard paste of images truncated above 4 MB",
    "landed_fix": {"status": "merged_to_main", "pr": 1105, "released_in": "v2.1.0"},
    "members": [{"kind": "pr", "number": 1105, "title": None, "is_fix_pr": True}],
}
MORE_QUERIES = [
    {"number": 11, "title": "Renderer divides by zero when paused", "body": None,
     "expected": "101"},
    {"number": 12, "title": "Fonts missing after export to PDF", "body": "All of them.",
     "expected": "102", "kind": "pr"},
    {"number": 13, "title": "Tooltip flickers on toolbar hover", "body": "Every time.",
     "expected": "103"},
    {"number": 14, "title": "Pasting a large image from the clipboard cuts it off",
     "body": "Above a few MB.", "expected": "105"},
    {"number": 15, "title": "Tooltip flickers on menu bar hover", "body": "Other widget.",
     "expected": None, "hard_negative": True},
    {"number": 16, "title": "工具栏 提示 闪烁", "body": "鼠标悬停时", "expected": None},
    {"number": 17, "title": "Installer asks for admin rights", "body": "", "expected": None},
]


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert found, f"no line starting {start!r} in:\n{text}"
    return found[0]


def test_eval_prints_interval_kinds_and_writes_json(tmp_path: Path) -> None:
    import re

    clusters = tmp_path / "clusters.jsonl"
    clusters.write_text("".join(json.dumps(c) + "\n" for c in [*CLUSTERS, RELEASE_NOTE]))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps(q) + "\n" for q in QUERIES + MORE_QUERIES))
    report = tmp_path / "report.json"
    proc = _bot("eval", "--clusters", str(clusters), "--queries", str(queries), "--cv", "3",
                "--no-baselines", "--json-report", str(report))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # The lines that were there before are still there.
    assert "10 issues (6 with a cluster, 4 without)" in text
    assert "cross-validated: threshold  comments  precision  recall" in text

    ci = _line(text, "cross-validated @ threshold")
    m = re.fullmatch(
        r"cross-validated @ threshold (\d\.\d\d) margin (\d\.\d\d): precision (\d\.\d{3})"
        r" \[90% CI (\d\.\d\d)-(\d\.\d\d)\] recall (\d\.\d{3}) \[(\d\.\d\d)-(\d\.\d\d)\]"
        r" \(bootstrap over 10 issues, 2000 resamples"
        r"(?:; \d+ without a comment skipped for precision)?"
        r"(?:; \d+ without a positive skipped for recall)?\)",
        ci,
    )
    assert m, ci
    p, p_lo, p_hi, r, r_lo, r_hi = (float(m.group(i)) for i in range(3, 9))
    # Two decimals for the bounds: allow their rounding.
    assert p_lo - 0.005 <= p <= p_hi + 0.005
    assert r_lo - 0.005 <= r <= r_hi + 0.005

    assert _line(text, "cross-validated by kind @ threshold")
    header = _line(text, "  kind ")
    assert header.split()[:7] == ["kind", "issues", "pos", "neg", "comments", "right", "wrong"]
    rows = {k: _line(text, f"  {k} ") for k in ("all", "positives", "negatives",
                                                 "hard negatives", "PR-shaped", "other language",
                                                 "empty body", "release-note clusters")}
    assert rows["all"].split()[1:4] == ["10", "6", "4"]
    assert rows["hard negatives"].split()[2:5] == ["1", "0", "1"]
    assert rows["other language"].split()[2:5] == ["1", "0", "1"]
    assert rows["release-note clusters"].split()[2:5] == ["1", "1", "0"]
    # Issues 3 (body ""), 11 (body null) and 17 (body ""): two with a cluster, one without.
    assert rows["empty body"].split()[2:5] == ["3", "2", "1"]
    assert rows["PR-shaped"].split()[1:4] == ["1", "1", "0"]
    assert "cross-validated wrong comments:" in text

    data = json.loads(report.read_text())
    cv = data["cross_validated"]
    assert cv["folds"] == 3
    boot = cv["bootstrap"]
    assert boot["issues"] == 10 and boot["resamples"] == 2000
    assert f"{boot['precision']:.3f}" == m.group(3) and f"{boot['recall']:.3f}" == m.group(6)
    assert boot["precision_ci"][0] <= boot["precision"] <= boot["precision_ci"][1]
    assert boot["recall_ci"][0] <= boot["recall"] <= boot["recall_ci"][1]
    assert [row["kind"] for row in cv["by_kind"]] == list(KINDS)
    total = cv["by_kind"][0]
    assert (total["comments"], total["right"]) == (cv["comments"], cv["right"])
    assert len(cv["wrong_comments"]) == total["wrong"]
    for w in cv["wrong_comments"]:
        assert {"number", "title", "named", "expected", "cv_score", "evidence"} <= set(w)
    assert data["in_sample"]["pr_table"] and data["policy"]["threshold"] > 0


def _o(expected: str | None, top: str | None, score: float, second: float = 0.0) -> Outcome:
    return Outcome(expected=expected, top=top, score=score, second=second, in_top5=True)


def test_bootstrap_all_right_is_one() -> None:
    outs = [_o("a", "a", 0.9), _o("b", "b", 0.95), _o(None, None, 0.0), _o(None, "c", 0.2)]
    b = bootstrap_pr(outs, 0.5, 0.05)
    assert (b.comments, b.right, b.positives) == (2, 2, 2)
    assert b.precision == 1.0 and b.recall == 1.0
    assert b.precision_ci == (1.0, 1.0) and b.recall_ci == (1.0, 1.0)
    assert b.resamples == 2000 and b.issues == 4
    line = format_bootstrap(b, 0.5, 0.05)
    assert "precision 1.000 [90% CI 1.00-1.00] recall 1.000 [1.00-1.00]" in line
    assert "(bootstrap over 4 issues, 2000 resamples" in line


def test_bootstrap_mixed_brackets_the_point_and_is_seeded() -> None:
    # 10 positives: 5 answered right, 5 silent; 10 negatives: 2 false alarms, 8 silent.
    outs = [_o(f"c{i}", f"c{i}", 0.9) for i in range(5)]
    outs += [_o(f"c{i}", f"c{i}", 0.1) for i in range(5, 10)]
    outs += [_o(None, "x", 0.9) for _ in range(2)] + [_o(None, "x", 0.1) for _ in range(8)]
    b = bootstrap_pr(outs, 0.5, 0.0)
    assert b.precision == 5 / 7 and b.recall == 0.5
    assert b.precision_ci and b.recall_ci
    assert b.precision_ci[0] < b.precision < b.precision_ci[1]
    assert b.recall_ci[0] < b.recall < b.recall_ci[1]
    # Recall's spread: the share of right answers among ~10 positives, about +-0.26 at 90%.
    assert 0.15 < b.recall_ci[0] < 0.4 and 0.6 < b.recall_ci[1] < 0.85
    assert b.precision_ci[1] == 1.0  # a resample can miss both false alarms
    assert bootstrap_pr(outs, 0.5, 0.0) == b
    assert bootstrap_pr(outs, 0.5, 0.0, seed=1) != b
    # The margin counts: with a runner-up close behind, nothing is said.
    close = [_o(o.expected, o.top, o.score, o.score - 0.01) for o in outs]
    assert bootstrap_pr(close, 0.5, 0.05).comments == 0


def test_bootstrap_skips_resamples_without_a_comment() -> None:
    # One comment among 20 issues: a resample misses it with chance (19/20)^20 ~ 0.36.
    outs = [_o("a", "a", 0.9)] + [_o(None, None, 0.0) for _ in range(19)]
    b = bootstrap_pr(outs, 0.5, 0.0)
    assert 600 < b.skipped_precision < 840
    assert b.precision_ci == (1.0, 1.0)
    assert "without a comment skipped for precision" in format_bootstrap(b, 0.5, 0.0)
    silent = bootstrap_pr([_o(None, None, 0.0)] * 3, 0.5, 0.0)
    assert silent.precision is None and silent.precision_ci is None
    assert silent.recall is None and silent.skipped_precision == 2000
    assert "precision n/a recall n/a" in format_bootstrap(silent, 0.5, 0.0)


def test_language_detection() -> None:
    assert other_language("导出时字体丢失", "")
    assert other_language("Crash on start", "エラーが出ます")
    assert other_language("", "설정이 저장되지 않습니다")
    assert other_language("Не работает экспорт", "")
    assert other_language("Export broken", "log:\n导出")  # mixed in
    assert not other_language("Café naïve façade — 10 μs → crash ✅", "Ünïcödé Latin only")
    assert not other_language("Export brоken", "")  # one Cyrillic look-alike "о"
    assert not other_language("", "")


def test_kinds_and_release_note_clusters() -> None:
    note = Cluster.model_validate(RELEASE_NOTE)
    assert is_release_note_cluster(note)
    # Released, but a report's title is known: not a release-note cluster.
    titled = note.model_copy(update={"members": [
        *note.members,
        Cluster.model_validate(CLUSTERS[0]).members[0],
    ]})
    assert not is_release_note_cluster(titled)
    # A fix with no named release is not one either.
    assert not is_release_note_cluster(Cluster.model_validate(CLUSTERS[1]))
    notes = {"105"}
    assert kinds_of({"title": "x", "body": "y", "expected": "101"}, notes) == ["all", "positives"]
    assert kinds_of({"title": "x", "body": " \n", "expected": "105", "kind": "pr"}, notes) == [
        "all", "positives", "PR-shaped", "empty body", "release-note clusters"]
    assert kinds_of({"title": "悬停闪烁", "body": None, "expected": None,
                     "hard_negative": True}, notes) == [
        "all", "negatives", "hard negatives", "other language", "empty body"]
    assert kinds_of({"title": "x", "body": "y", "expected": None, "hard_negative": False},
                    notes) == ["all", "negatives"]


def test_by_kind_rows_and_wrong_comments() -> None:
    clusters = [Cluster.model_validate(c) for c in [*CLUSTERS, RELEASE_NOTE]]
    queries = [
        {"title": "a", "body": "b", "expected": "101"},
        {"title": "a", "body": "b", "expected": "105"},
        {"title": "a", "body": "b", "expected": None, "hard_negative": True},
        {"title": "a", "body": "b", "expected": None},
    ]
    outs = [_o("101", "101", 0.9), _o("105", "102", 0.9), _o(None, "103", 0.9),
            _o(None, "103", 0.2)]
    rows = {r.kind: r for r in by_kind(outs, queries, clusters, 0.5, 0.0)}
    assert set(rows) == {"all", "positives", "negatives", "hard negatives",
                         "release-note clusters"}
    a = rows["all"]
    assert (a.issues, a.comments, a.right, a.wrong, a.false_alarms) == (4, 3, 1, 2, 1)
    assert a.precision == 1 / 3 and a.recall == 0.5 and a.false_alarm_rate == 0.5
    n = rows["negatives"]
    assert n.recall is None and (n.wrong, n.false_alarms, n.false_alarm_rate) == (1, 1, 0.5)
    h = rows["hard negatives"]
    assert (h.issues, h.false_alarms, h.false_alarm_rate) == (1, 1, 1.0)
    rn = rows["release-note clusters"]
    assert (rn.issues, rn.right, rn.wrong, rn.recall) == (1, 0, 1, 0.0)
    assert wrong_comments(outs, 0.5, 0.0) == [1, 2]
    with pytest.raises(ValueError):
        by_kind(outs[:3], queries, clusters, 0.5, 0.0)


def test_evidence_lines_show_for_against_and_any_new_field() -> None:
    lines = evidence_lines({
        "parts": {"title": 1.5, "files": 0.25, "facet_conflict": -0.75, "zero": 0.0},
        "title_similarity": 0.5,
        "shared_files": ["a/b.py"],
        "shared_symbols": [],
        "matched_terms": ["crash", "render"],
        "against_terms": ["pdf"],  # a field this code has never heard of
        "facet_mismatch": {"os": "windows"},
        "unused": None,
    })
    assert lines[0] == "for: title +1.50, files +0.25"
    assert lines[1] == "against: facet_conflict -0.75"
    assert "shared_files: a/b.py" in lines
    assert "matched_terms: crash, render" in lines
    assert "against_terms: pdf" in lines
    assert "facet_mismatch: os windows" in lines
    assert "title_similarity: 0.500" in lines
    assert not any(line.startswith(("shared_symbols", "unused")) for line in lines)
