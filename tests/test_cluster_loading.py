"""Loading cluster files and directories: mixed formats, per-line errors, duplicates."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from bot.clusters.load import LoadError, load_clusters

ROOT = Path(__file__).resolve().parents[1]


def _record(public_id: str, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "repo": "acme/widgets",
        "public_id": public_id,
        "display_label": f"Cluster {public_id}",
        "landed_fix": {"status": "merged_to_main", "pr": 100},
        "members": [
            {"kind": "issue", "number": int(public_id), "title": "t", "state": "closed"},
            {"kind": "pr", "number": 100, "state": "merged", "merged": True},
        ],
    }
    record.update(extra)
    return record


REPORT = """\
# acme/widgets · Report cluster

A summary.

## Closed / duplicate issues

- #{id}: A closed issue

## Prior & competing PRs

- **#200: fix it**. merged to main
  - files: `widgets/a.py`

## Fix status

- Merged to main in PR #200 (cited above).
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(*records: dict[str, Any] | str) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"


def _ids(report_clusters: list[Any]) -> list[str]:
    return [c.public_id for c in report_clusters]


def test_directory_of_mixed_files(tmp_path: Path) -> None:
    _write(tmp_path / "a.json", json.dumps(_record("1")))
    _write(tmp_path / "b.jsonl", _jsonl(_record("2"), "", _record("3")))
    _write(tmp_path / "cluster-4.md", REPORT.format(id=4))
    _write(tmp_path / "c.json", json.dumps([_record("5"), _record("6")]))
    _write(tmp_path / "notes.txt", "not a cluster")
    _write(tmp_path / ".a.json.swp.json", "{ half written")
    (tmp_path / "nested").mkdir()
    _write(tmp_path / "nested" / "x.json", json.dumps(_record("7")))

    report = load_clusters([tmp_path])

    assert report.errors == []
    assert report.ok is True
    # Name order: a.json, b.jsonl, c.json, cluster-4.md.
    assert _ids(report.clusters) == ["1", "2", "3", "5", "6", "4"]
    md = report.clusters[-1]
    assert md.display_label == "Report cluster"
    assert md.landed_fix.pr == 200 and md.fix_pr is not None and md.fix_pr.number == 200


def test_a_single_path_string_is_not_split_into_characters(tmp_path: Path) -> None:
    _write(tmp_path / "a.json", json.dumps(_record("1")))
    report = load_clusters(str(tmp_path))
    assert _ids(report.clusters) == ["1"] and report.errors == []


def test_bad_jsonl_line_is_reported_and_the_rest_loads(tmp_path: Path) -> None:
    bad = _record("2")
    bad["members"][0]["number"] = "two"
    path = _write(
        tmp_path / "x.jsonl",
        _jsonl(_record("1"), "", bad, '{"repo": "acme/widgets", broken', _record("5")),
    )

    report = load_clusters([path])

    assert _ids(report.clusters) == ["1", "5"]
    assert [(e.path, e.line, e.field, e.level) for e in report.errors] == [
        (str(path), 3, "members.0.number", "error"),
        (str(path), 4, None, "error"),
    ]
    first = report.errors[0]
    assert first.message.startswith("Input should be a valid integer")
    assert str(first) == f"{path}:3: members.0.number: {first.message}"
    assert report.errors[1].message.startswith("invalid JSON at column 26: Expecting property name")
    assert report.ok is False


def test_json_list_reports_the_line_of_the_bad_record(tmp_path: Path) -> None:
    missing_label = _record("2")
    del missing_label["display_label"]
    text = "[\n" + json.dumps(_record("1"), indent=2) + ",\n\n" + json.dumps(missing_label) + "\n]"
    path = _write(tmp_path / "list.json", text)
    bad_line = text.split("\n").index(json.dumps(missing_label)) + 1

    report = load_clusters([path])

    assert _ids(report.clusters) == ["1"]
    assert [(e.line, e.field, e.message) for e in report.errors] == [
        (bad_line, "display_label", "Field required")
    ]
    assert bad_line > 3


def test_bad_json_and_broken_markdown_do_not_stop_the_others(tmp_path: Path) -> None:
    _write(tmp_path / "a.json", '{\n  "repo": "acme/widgets",\n  "public_id": 1,\n}\n')
    _write(tmp_path / "b.json", json.dumps(_record("2")))
    _write(tmp_path / "c.json", "42")
    _write(tmp_path / "cluster-3.md", "Just some notes, no heading.\n\n- #3: an issue\n")
    _write(tmp_path / "cluster-4.md", REPORT.format(id=4))
    (tmp_path / "d.jsonl").write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')

    report = load_clusters([tmp_path])

    assert _ids(report.clusters) == ["2", "4"]
    found = [(Path(e.path).name, e.line, e.field) for e in report.errors]
    # In the .jsonl file each line stands alone: the first is validated (and lacks every
    # required field), the second is not UTF-8; neither takes the other down.
    assert found == [
        ("a.json", 4, None),
        ("c.json", 1, None),
        ("cluster-3.md", 1, None),
        ("cluster-3.md", 1, "members"),
        ("d.jsonl", 1, "repo"),
        ("d.jsonl", 1, "public_id"),
        ("d.jsonl", 1, "display_label"),
        ("d.jsonl", 2, None),
    ]
    messages = [e.message for e in report.errors]
    assert messages[0].startswith("invalid JSON")
    assert messages[1] == "expected a cluster object or a list of them, got int"
    assert "heading" in messages[2]
    assert messages[7].startswith("not valid UTF-8")


def test_markdown_validation_error_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "cluster-9.md", "\n" + REPORT.replace("acme/widgets", "widgets"))
    report = load_clusters([path])
    assert report.clusters == []
    assert [(e.line, e.field) for e in report.errors] == [(2, "repo")]
    assert str(report.errors[0]).startswith(f"{path}:2: repo: Value error, repo must be")


def test_duplicates_later_wins_with_a_warning(tmp_path: Path) -> None:
    first = _write(tmp_path / "a.json", json.dumps(_record("1", summary="from a")))
    second = _write(tmp_path / "b.jsonl", _jsonl(_record("2"), _record("1", summary="from b")))
    other_repo = _write(
        tmp_path / "c.json", json.dumps(_record("1", repo="acme/gadgets", summary="other"))
    )
    # The same id spelled with another case of the repository is the same cluster.
    upper = _write(
        tmp_path / "d.json", json.dumps(_record("2", repo="ACME/Widgets", summary="from d"))
    )

    report = load_clusters([first, second, other_repo, upper])

    by_key = {c.key: c.summary for c in report.clusters}
    assert by_key == {
        ("acme/widgets", "1"): "from b",
        ("acme/widgets", "2"): "from d",
        ("acme/gadgets", "1"): "other",
    }
    assert len(report.clusters) == 3
    assert [(e.path, e.line, e.level) for e in report.errors] == [
        (str(second), 2, "warning"),
        (str(upper), 1, "warning"),
    ]
    assert f"also defined at {first}:1" in report.errors[0].message
    assert str(report.errors[0]).startswith(f"{second}:2: warning: cluster acme/widgets#1")
    assert report.ok is True


def test_explicit_files_unknown_suffix_and_missing(tmp_path: Path) -> None:
    text_file = _write(tmp_path / "clusters.txt", json.dumps(_record("1")))
    missing = tmp_path / "nope.json"
    good = _write(tmp_path / "good.json", json.dumps(_record("3")))

    report = load_clusters([text_file, missing, good])

    assert _ids(report.clusters) == ["3"]
    assert [(e.path, e.line) for e in report.errors] == [(str(text_file), 1), (str(missing), 1)]
    assert "unknown cluster file type '.txt'" in report.errors[0].message
    assert report.errors[1].message == "no such file or directory"


def test_log_errors_one_warning_each(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write(tmp_path / "x.jsonl", _jsonl("{", "[1]", _record("1")))
    report = load_clusters([path])
    assert len(report.errors) == 2

    with caplog.at_level(logging.WARNING, logger="dejafix.clusters"):
        assert report.log_errors() == 2

    records = [r for r in caplog.records if r.name == "dejafix.clusters"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    assert records[0].getMessage() == f"cluster load: {report.errors[0]}"
    assert f"{path}:2: " in records[1].getMessage()


def test_load_error_str_without_field() -> None:
    error = LoadError("config/clusters/x.json", 1, None, "invalid JSON: Expecting value")
    assert str(error) == "config/clusters/x.json:1: invalid JSON: Expecting value"


def test_shipped_config_loads_cleanly() -> None:
    report = load_clusters([ROOT / "config" / "clusters"])
    assert report.errors == []
    assert sorted(c.public_id for c in report.clusters) == ["35309", "35994", "53175"]
    for cluster in report.clusters:
        assert cluster.repo == "NousResearch/hermes-agent"
        assert cluster.display_label and cluster.summary and cluster.subsystem
        assert cluster.landed_fix.landed
        assert cluster.resolution.deciding_pr is not None
        assert cluster.freshness.state == "verified"
        fix = cluster.fix_pr
        assert fix is not None and fix.title and fix.files_changed and fix.fix_hunks
        assert all(m.title for m in cluster.members)
    fixes = {c.public_id: (c.landed_fix.pr, c.resolution.deciding_pr) for c in report.clusters}
    assert fixes == {"35309": (35382, 35381), "35994": (52090, 52090), "53175": (54130, 54130)}
