"""`python -m bot eval` over several repositories (each on its own, then pooled) and its
false-alarm rate, as subprocesses on synthetic files; the pooling helpers of bot/eval/report.py
directly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bot.eval.fit import Outcome
from bot.eval.report import (
    KindRow,
    bootstrap_pooled,
    bootstrap_pr,
    format_false_alarms,
    pool_kind_rows,
    upper_bound_none_seen,
)
from tests.samples import OFFLINE_CLUSTERS as CLUSTERS_A
from tests.samples import RENDER_CRASH

ROOT = Path(__file__).resolve().parents[1]

# Repository A: a renderer (tests/samples.py). Its issue #1's traceback names the fix's file and
# function, so the matcher comments on 101.
QUERIES_A = [
    {"number": 1, **RENDER_CRASH, "expected": "101"},
    {"number": 2, "title": "Dark mode colours wrong in print preview", "body": "Too bright.",
     "expected": None},
    {"number": 3, "title": "PDF export loses embedded fonts", "body": "", "expected": "102"},
    # Labelled as having no cluster although it is #1 again: a sure false alarm.
    {"number": 4, **RENDER_CRASH, "expected": None, "hard_negative": True},
    {"number": 5, "title": "Something vague", "body": None, "expected": None, "uncertain": True},
]

# Repository B: an HTTP client, no renderer. Its issue #21 is repository A's renderer crash: an
# issue of B must never be answered with a cluster of A.
CLUSTERS_B = [
    {
        "repo": "other/gadget",
        "public_id": "201",
        "display_label": "Connection pool leaks sockets when a request times out",
        "summary": "release_conn was skipped on timeout.",
        "landed_fix": {"status": "merged", "pr": 1201},
        "members": [
            {"kind": "issue", "number": 201, "title": "Socket leak after timeouts"},
            {"kind": "pr", "number": 1201, "title": "fix(pool): release on timeout",
             "merged": True, "is_fix_pr": True, "files_changed": ["gadget/pool.py"]},
        ],
    },
    {
        "repo": "other/gadget",
        "public_id": "202",
        "display_label": "Cookie parser drops cookies after a quoted value",
        "landed_fix": {"status": "merged", "pr": 1202},
        "members": [{"kind": "pr", "number": 1202, "merged": True, "is_fix_pr": True}],
    },
]
QUERIES_B = [
    {"number": 21, **RENDER_CRASH, "expected": None},
    {"number": 22, "title": "Sockets leak from the connection pool when requests time out",
     "body": 'File "/x/site-packages/gadget/pool.py", line 9, in release_conn', "expected": "201"},
    {"number": 23, "title": "Cookies after a quoted cookie value are dropped",
     "body": "The parser stops.", "expected": "202"},
    {"number": 24, "title": "Docs typo in the README", "body": "teh", "expected": None},
]


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _files(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    return (_jsonl(tmp_path / "a-clusters.jsonl", CLUSTERS_A),
            _jsonl(tmp_path / "a-queries.jsonl", QUERIES_A),
            _jsonl(tmp_path / "b-clusters.jsonl", CLUSTERS_B),
            _jsonl(tmp_path / "b-queries.jsonl", QUERIES_B))


def _bot(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bot", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def _eval(tmp_path: Path, name: str, *args: str | Path) -> tuple[str, dict[str, Any]]:
    """Run ``eval`` (3 folds, no baselines); its printed output and its --json-report."""
    report = tmp_path / f"{name}.json"
    proc = _bot("eval", *args, "--cv", "3", "--no-baselines", "--json-report", report)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(report.read_text())


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert len(found) == 1, f"{len(found)} lines starting {start!r} in:\n{text}"
    return found[0]


def _masked(text: str) -> list[str]:
    # The index and per-issue timings are the only figures that change between runs.
    return [re.sub(r"index \d+ ms, [\d.]+ ms/issue", "index _", line)
            for line in text.splitlines() if not line.startswith("report written to")]


def _without_sources(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("cluster_files", "queries_file")}


def test_issues_of_one_repository_never_match_clusters_of_another(tmp_path: Path) -> None:
    ca, qa, cb, qb = _files(tmp_path)
    text, data = _eval(tmp_path, "both", "--clusters", ca, "--queries", qa,
                       "--clusters", cb, "--queries", qb)
    a, b = data["repositories"]
    assert (a["repository"], b["repository"]) == ("acme/widget", "other/gadget")
    assert (a["clusters"], b["clusters"]) == (3, 2)
    # B's renderer crash finds nothing to answer among B's clusters: no comment at all on B's
    # issues without a cluster, in-sample or cross-validated.
    assert b["in_sample"]["false_alarms"]["false_alarms"] == 0
    assert b["cross_validated"]["false_alarms"]["false_alarms"] == 0
    assert b["cross_validated"]["wrong_comments"] == []
    # Each repository's figures are what it gets evaluated alone.
    for clusters, queries, got in ((ca, qa, a), (cb, qb, b)):
        _, alone = _eval(tmp_path, "alone", "--clusters", clusters, "--queries", queries)
        assert _without_sources(got) == _without_sources(alone)
    assert _line(text, "== repository 1 of 2: acme/widget (")
    assert _line(text, "== repository 2 of 2: other/gadget (")

    # The control: the same issues against both repositories' clusters as ONE repository
    # answer B's renderer crash with A's cluster. Were the repositories mixed, the checks above
    # would fail.
    _, mixed = _eval(tmp_path, "mixed", "--clusters", ca, "--clusters", cb, "--queries", qb)
    assert mixed["in_sample"]["false_alarms"]["false_alarms"] == 1
    assert [w["named"] for w in mixed["cross_validated"]["wrong_comments"]] == ["101"]


def test_pooled_counts_are_the_sums(tmp_path: Path) -> None:
    ca, qa, cb, qb = _files(tmp_path)
    text, data = _eval(tmp_path, "both", "--clusters", ca, "--queries", qa,
                       "--clusters", cb, "--queries", qb)
    repos, pooled = data["repositories"], data["pooled"]

    def total(*path: str) -> int:
        out = 0
        for r in repos:
            value: Any = r
            for key in path:
                value = value[key]
            out += value
        return int(out)

    assert pooled["repositories"] == 2 and pooled["names"] == ["acme/widget", "other/gadget"]
    for key in ("issues", "positives", "negatives", "clusters"):
        assert pooled[key] == total(key), key
    assert (pooled["issues"], pooled["positives"], pooled["negatives"]) == (8, 4, 4)
    for part in ("in_sample", "cross_validated"):
        for key in ("comments", "right"):
            assert pooled[part][key] == total(part, key), (part, key)
        fa = pooled[part]["false_alarms"]
        assert fa["false_alarms"] == total(part, "false_alarms", "false_alarms"), part
        assert fa["negatives"] == 4
    # Both repositories have a say: otherwise the sums prove nothing.
    assert all(r["in_sample"]["comments"] > 0 for r in repos)
    s = pooled["in_sample"]
    assert s["precision"] == s["right"] / s["comments"] and s["recall"] == s["right"] / 4
    # R@1 over the pooled positives: 2 of A's and 2 of B's.
    assert s["r1"] == sum(r["in_sample"]["r1"] * r["positives"] for r in repos) / 4
    # The pooled by-kind rows add up as well.
    rows = [{row["kind"]: row for row in r["cross_validated"]["by_kind"]} for r in repos]
    for row in pooled["cross_validated"]["by_kind"]:
        for key in ("issues", "comments", "right", "wrong", "false_alarms"):
            assert row[key] == sum(r[row["kind"]][key] for r in rows if row["kind"] in r)
    boot = pooled["cross_validated"]["bootstrap"]
    assert (boot["issues"], boot["groups"]) == (8, 2)

    # The printed pooled lines say the same.
    m = re.fullmatch(r"pooled dejafix @ threshold \d\.\d\d margin \d\.\d\d: comments (\d+),"
                     r" right (\d+): precision [\d.]+ recall [\d.]+ R@1 [\d.]+ R@5 [\d.]+",
                     _line(text, "pooled dejafix @ threshold"))
    assert m and (int(m[1]), int(m[2])) == (s["comments"], s["right"])
    cv = pooled["cross_validated"]
    assert f"comments {cv['comments']}, right {cv['right']}:" in _line(
        text, "pooled dejafix 3-fold cross-validated, each repository on its own")
    assert "resampled within each of 2 repositories" in _line(
        text, "pooled cross-validated @ threshold")
    assert _line(text, "== pooled over 2 repositories: 8 issues (4 with a cluster, 4 without),"
                       " 5 clusters;")


def test_false_alarm_count(tmp_path: Path) -> None:
    ca, qa, cb, qb = _files(tmp_path)
    text, data = _eval(tmp_path, "both", "--clusters", ca, "--queries", qa,
                       "--clusters", cb, "--queries", qb)
    a = data["repositories"][0]
    # Counted independently: the comments `match` would post on A's issues without a cluster.
    negatives = [q for q in QUERIES_A if not q.get("expected") and not q.get("uncertain")]
    proc = _bot("match", "--clusters", ca,
                "--queries", _jsonl(tmp_path / "a-negatives.jsonl", negatives))
    assert proc.returncode == 0, proc.stderr
    said = sum(json.loads(line)["comment"] for line in proc.stdout.splitlines())
    assert said == 1  # issue #4, the renderer crash labelled as having no cluster
    fa = a["in_sample"]["false_alarms"]
    assert (fa["false_alarms"], fa["negatives"], fa["rate"]) == (1, 2, 0.5)
    assert fa["ci"][0] <= 0.5 <= fa["ci"][1] and fa["exact_upper"] is None
    # Cross-validated: the by-kind table's "negatives" row, counted the same way.
    cv_fa = a["cross_validated"]["false_alarms"]
    negatives_row = next(r for r in a["cross_validated"]["by_kind"] if r["kind"] == "negatives")
    assert (cv_fa["false_alarms"], cv_fa["negatives"]) == (
        negatives_row["false_alarms"], negatives_row["negatives"])

    def shown(line: str) -> list[str]:
        return re.findall(r"(\d+ of \d+ \([\d.]+%\) \[90% CI [\d.]+-[\d.]+%)", line)

    lines = [line for line in text.splitlines() if line.startswith(
        "false alarms (comments on issues with no cluster) @ threshold")]
    assert len(lines) == 2  # one per repository
    assert shown(lines[0])[0].startswith("1 of 2 (50.0%) [90% CI ")
    assert shown(lines[0])[1].startswith(f"{cv_fa['false_alarms']} of 2 (")
    assert "in-sample 0 of 2 (0.0%)" in lines[1] and "exact upper bound 77.6%" in lines[1]
    pooled = _line(text, "pooled false alarms (comments on issues with no cluster) @ threshold")
    assert shown(pooled)[0].startswith("1 of 4 (25.0%) [90% CI ")


# The lines one repository's eval has always printed, in order (what follows "cross-validated
# wrong comments" is their evidence, not checked here).
SINGLE_SHAPE = [
    r"\d+ issues \(\d+ with a cluster, \d+ without\), \d+ clusters; index _",
    r"dejafix @ threshold .*R@5 \d\.\d{3}",
    "threshold  comments  precision  recall",
    *[r"   \d\.\d\d +\d+ +\d\.\d{3} +\d\.\d{3}"] * 12,
    r"dejafix best single threshold .*",
    r"dejafix 3-fold cross-validated, folds grouped by cluster \(model refitted without each"
    r" fold\): comments .*",
    r"cross-validated: threshold  comments  precision  recall",
    *[r" {20}\d\.\d\d +\d+ +\d\.\d{3} +\d\.\d{3}"] * 12,
    r"cross-validated @ threshold .* \(bootstrap over \d+ issues, 2000 resamples.*\)",
    r"cross-validated by kind @ threshold .*",
    r"  kind  .*false alarms",
]


def test_single_pair_output_is_one_repository_section(tmp_path: Path) -> None:
    ca, qa, cb, qb = _files(tmp_path)
    text, data = _eval(tmp_path, "single", "--clusters", ca, "--clusters", cb, "--queries", qa)
    lines = _masked(text)
    for pattern, line in zip(SINGLE_SHAPE, lines, strict=False):
        assert re.fullmatch(pattern, line), (pattern, line)
    assert sum(line.startswith("  ") for line in lines[len(SINGLE_SHAPE):]) >= 1
    assert any(line.startswith("cross-validated wrong comments: ") for line in lines)
    # Nothing of the several-repository layout but the false alarms, which every run says.
    assert not any(line.startswith(("==", "pooled")) for line in lines)
    assert sum(line.startswith("false alarms (comments on issues") for line in lines) == 1
    assert text.endswith(f"report written to {tmp_path / 'single.json'}\n")
    # The report keeps its keys in their order; the new ones come after them.
    assert list(data)[:8] == ["issues", "positives", "negatives", "clusters", "policy",
                              "in_sample", "cross_validated", "baselines"]
    assert list(data)[8:] == ["repository", "cluster_files", "queries_file"]
    assert list(data["in_sample"]) == ["comments", "right", "precision", "recall", "r1", "r5",
                                       "pr_table", "best_threshold", "false_alarms"]
    assert list(data["cross_validated"])[:10] == [
        "folds", "comments", "right", "precision", "recall", "r1", "r5", "pr_table", "bootstrap",
        "by_kind"]
    assert data["issues"] == 4 and data["clusters"] == 5

    # --queries before --clusters, the clusters split around it: still one repository, the
    # same figures. (Grouping by position would take it for a --queries with no --clusters.)
    text2, data2 = _eval(tmp_path, "single", "--clusters", ca, "--queries", qa, "--clusters", cb)
    text3, _ = _eval(tmp_path, "single", "--queries", qa, "--clusters", ca, "--clusters", cb)
    assert _masked(text2) == _masked(text3) == lines and data2 == data

    # And each repository's section of a several-repository run is that output, line for line.
    both, _ = _eval(tmp_path, "both", "--clusters", ca, "--clusters", cb, "--queries", qa,
                    "--clusters", cb, "--queries", qb)
    section = _masked(both)
    start = next(i for i, line in enumerate(section) if line.startswith("== repository 1 of 2"))
    assert section[start + 1:start + 1 + len(lines)] == lines


def test_repository_grouping_errors(tmp_path: Path) -> None:
    ca, qa, cb, qb = _files(tmp_path)
    proc = _bot("eval", "--queries", qa, "--clusters", ca, "--queries", qb, "--clusters", cb)
    assert proc.returncode == 2 and f"--queries {qa}: no --clusters before it" in proc.stderr
    proc = _bot("eval", "--clusters", ca, "--queries", qa, "--queries", qb)
    assert proc.returncode == 2 and f"--queries {qb}: no --clusters before it" in proc.stderr
    proc = _bot("eval", "--clusters", ca, "--queries", qa, "--clusters", cb, "--queries", qb,
                "--clusters", ca)
    assert proc.returncode == 2 and "after the last --queries" in proc.stderr
    # A missing file in the last repository stops the run before the first is evaluated.
    proc = _bot("eval", "--clusters", ca, "--queries", qa, "--clusters", cb,
                "--queries", tmp_path / "nope.jsonl")
    assert proc.returncode == 2 and "nope.jsonl: no such file" in proc.stderr
    assert proc.stdout == ""
    assert "--clusters A.jsonl --queries qa.jsonl --clusters B.jsonl" in _bot(
        "eval", "--help").stdout


# --- the pooled bootstrap, the pooled by-kind rows, the false-alarm figures -------------------


def _o(expected: str | None, top: str | None, score: float) -> Outcome:
    return Outcome(expected=expected, top=top, score=score, second=0.0, in_top5=True)


def test_one_group_bootstraps_as_before() -> None:
    outs = [_o(f"c{i}", f"c{i}", 0.9) for i in range(5)]
    outs += [_o(f"c{i}", f"c{i}", 0.1) for i in range(5, 10)]
    outs += [_o(None, "x", 0.9) for _ in range(2)] + [_o(None, "x", 0.1) for _ in range(8)]
    b = bootstrap_pr(outs, 0.5, 0.0)
    assert bootstrap_pooled([outs], 0.5, 0.0) == b
    assert (b.groups, b.negatives, b.false_alarms, b.false_alarm_rate) == (1, 10, 2, 0.2)
    assert b.false_alarm_ci and b.false_alarm_ci[0] < 0.2 < b.false_alarm_ci[1]
    # What bootstrap_pr gave for these outcomes and the default seed before pooling and false
    # alarms existed (the same draws: the intervals of one repository did not move).
    assert b.precision_ci == (0.4, 1.0)
    assert b.recall_ci == pytest.approx((0.2222222222222222, 0.7692307692307693), abs=1e-12)
    assert format_false_alarms(b).startswith("2 of 10 (20.0%) [90% CI ")


def test_pooled_bootstrap_resamples_within_each_repository() -> None:
    # One repository with its only issue answered rightly, one of 50 silent negatives. Drawn as
    # one pool, about a third of the resamples would hold no positive (recall skipped); drawn
    # within each repository, every resample holds it.
    one = [_o("a", "a", 0.9)]
    silent = [_o(None, None, 0.0) for _ in range(50)]
    b = bootstrap_pooled([one, silent], 0.5, 0.0)
    assert (b.issues, b.groups, b.positives, b.negatives) == (51, 2, 1, 50)
    assert b.skipped_recall == 0 and b.skipped_precision == 0
    assert b.recall_ci == (1.0, 1.0) and b.precision_ci == (1.0, 1.0)
    assert b.false_alarms == 0 and b.false_alarm_ci == (0.0, 0.0)
    assert 500 < bootstrap_pr(one + silent, 0.5, 0.0).skipped_recall < 950
    text = format_false_alarms(b)
    assert text.startswith("0 of 50 (0.0%) [90% CI 0.0-0.0%; none to resample, exact upper")
    assert upper_bound_none_seen(50) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert upper_bound_none_seen(58) == pytest.approx(0.0503, abs=1e-4)
    assert upper_bound_none_seen(0) is None


def test_pool_kind_rows_adds_counts_and_recomputes_rates() -> None:
    def row(kind: str, issues: int, pos: int, comments: int, right: int, alarms: int) -> KindRow:
        neg = issues - pos
        return KindRow(kind, issues, pos, neg, comments, right, comments - right, alarms,
                       right / comments if comments else None, right / pos if pos else None,
                       alarms / neg if neg else None)

    a = [row("all", 10, 4, 4, 3, 1), row("negatives", 6, 0, 1, 0, 1)]
    b = [row("all", 30, 2, 1, 1, 0), row("negatives", 28, 0, 0, 0, 0),
         row("hard negatives", 5, 0, 0, 0, 0)]
    pooled = {r.kind: r for r in pool_kind_rows([a, b])}
    assert list(pooled) == ["all", "negatives", "hard negatives"]
    al = pooled["all"]
    assert (al.issues, al.positives, al.negatives, al.comments, al.right, al.wrong) == (
        40, 6, 34, 5, 4, 1)
    assert al.precision == 4 / 5 and al.recall == 4 / 6 and al.false_alarm_rate == 1 / 34
    assert pooled["negatives"].false_alarm_rate == 1 / 34
    assert pooled["hard negatives"].precision is None


def test_possible_regression_labels_are_counted_apart_and_wrong_ones_named() -> None:
    """A label is not a comment, but everyone on the issue sees it: eval counts them, and
    those on the wrong bug."""
    from bot.eval import report
    from bot.eval.fit import Outcome

    outcomes = [
        Outcome("1", "1", 0.9, 0.1, True, regression=True),  # right bug, labelled
        Outcome(None, "2", 0.9, 0.1, True, regression=True),  # unrelated issue, labelled
        Outcome("3", "4", 0.9, 0.1, True, regression=True),  # another bug, labelled
        Outcome(None, "5", 0.5, 0.1, True, regression=True),  # under the threshold
        Outcome(None, "6", 0.9, 0.1, True),  # a comment, not a label
    ]
    assert report.wrong_labels(outcomes, 0.7, 0.05) == (2, 3)
    assert not any(report.speaks(o, 0.7, 0.05) for o in outcomes[:4])
