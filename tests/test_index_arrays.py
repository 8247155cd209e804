"""The index as arrays: written by one process, mapped by another, and ranking the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bot.clusters.models import Cluster
from bot.matching import IssueText, Matcher
from bot.matching.arrays import FORMAT, IndexArrays, StringTable
from tests.conftest import SAMPLE_CLUSTERS

SAMPLES = [Cluster.model_validate(json.loads(p.read_text()))
           for p in sorted(SAMPLE_CLUSTERS.glob("*.json"))]
ISSUE = IssueText(
    title="Telegram bot stops answering after I tap the confirm button for /new",
    body="It hangs in `_handle_reset_command` in gateway/slash_commands.py (see #35994).",
)


def _bare(cluster: Cluster, public_id: str) -> Cluster:
    """A cluster with a label and nothing else: no files, symbols, errors or member titles."""
    return Cluster.model_validate({
        "repo": cluster.repo, "public_id": public_id, "display_label": "Tray icon vanishes",
        "landed_fix": {"status": "merged", "pr": 1}, "members": [{"kind": "pr", "number": 1}],
    })


def _ranked(matcher: Matcher, issue: IssueText = ISSUE) -> list[tuple[str, float, dict]]:
    return [(m.public_id, m.score, m.evidence.model_dump()) for m in matcher.rank(issue)]


def test_saved_and_mapped_arrays_rank_exactly_as_built(tmp_path: Path) -> None:
    built = Matcher(SAMPLES)
    built.arrays.save(tmp_path / "index")
    mapped = Matcher(arrays=IndexArrays.load(tmp_path / "index"))
    assert _ranked(mapped) == _ranked(built)
    assert _ranked(built) and _ranked(built)[0][2]["shared_files"]  # evidence survived


def test_empty_columns_survive_a_round_trip(tmp_path: Path) -> None:
    """No cluster has a file, symbol or error: every such column is empty on disk."""
    only_labels = [_bare(SAMPLES[0], "1"), _bare(SAMPLES[0], "2")]
    built = Matcher(only_labels)
    assert len(built.arrays.file_ids) == len(built.arrays.sym_low) == 0
    built.arrays.save(tmp_path / "index")
    mapped = Matcher(arrays=IndexArrays.load(tmp_path / "index"))
    issue = IssueText(title="The tray icon vanishes after sleep", body="see gateway/run.py")
    assert _ranked(mapped, issue) == _ranked(built, issue) != []
    assert len(Matcher([]).rank(issue)) == 0


def test_an_index_of_another_format_is_refused(tmp_path: Path) -> None:
    Matcher(SAMPLES).arrays.save(tmp_path / "index")
    meta = json.loads((tmp_path / "index" / "meta.json").read_text())
    meta["format"] = FORMAT + 1
    (tmp_path / "index" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="format"):
        IndexArrays.load(tmp_path / "index")


def _first_naming(kind: str, number: int) -> int:
    """What the scans the index replaced returned: the first cluster with that member (a PR
    also as its landed fix)."""
    return min(i for i, c in enumerate(SAMPLES)
               if any(m.kind == kind and m.number == number for m in c.members)
               or (kind == "pr" and c.landed_fix.pr == number))


def test_clusters_are_found_by_id_member_and_fix() -> None:
    matcher = Matcher(SAMPLES)
    for i, cluster in enumerate(SAMPLES):
        assert matcher.find(public_id=cluster.public_id) == i
        assert matcher.cluster(i) == cluster  # the record comes back whole
        for member in cluster.members:
            assert matcher.find(kind=member.kind, number=member.number) == \
                _first_naming(member.kind, member.number)
        if cluster.landed_fix.pr is not None:
            assert matcher.find(kind="pr", number=cluster.landed_fix.pr) == \
                _first_naming("pr", cluster.landed_fix.pr)
    assert matcher.find(public_id="no-such-id") is None
    assert matcher.find(kind="issue", number=987654321) is None


def test_a_redefined_cluster_replaces_the_earlier_one() -> None:
    first = SAMPLES[0]
    second = first.model_copy(update={"display_label": "Redefined label"})
    matcher = Matcher([first, *SAMPLES[1:], second])
    assert len(matcher) == len(SAMPLES)
    i = matcher.find(public_id=first.public_id)
    assert i is not None and matcher.cluster(i).display_label == "Redefined label"


def test_string_tables_look_strings_up_by_value() -> None:
    words = ["alpha", "beta", "", "gamma", "naïve", "\ud800lone"]  # a lone surrogate from JSON
    table = StringTable.build(words, keyed=True)
    assert [table[i] for i in range(len(words))] == words
    assert table.lookup(words).tolist() == list(range(len(words)))
    assert table.lookup(["delta", "Alpha"]).tolist() == [-1, -1]
    assert table.get("gamma") == 3
    with pytest.raises(TypeError):
        StringTable.build(words).lookup(["alpha"])  # built without keys


def test_match_reads_its_cluster_and_evidence_only_when_asked() -> None:
    matcher = Matcher(SAMPLES)
    calls: list[int] = []
    original = matcher.cluster

    def counting(i: int) -> Cluster:
        calls.append(i)
        return original(i)

    matcher.cluster = counting  # type: ignore[method-assign]
    matches = matcher.rank(ISSUE)
    assert len(matches) > 1 and calls == []
    assert matches[0].cluster.public_id == matches[0].public_id
    assert len(calls) == 1
    assert matches[0].cluster is matches[0].cluster and len(calls) == 1
    assert matches[0].evidence.parts and matches[0].evidence.matched_terms


def test_a_file_only_a_replaced_cluster_named_does_not_break_ranking() -> None:
    """The replaced definition's paths stay in the path table with no live cluster behind
    them; an issue naming one must still rank (it divided by zero)."""
    first = SAMPLES[0].model_copy(update={"display_label": "Tray icon vanishes after sleep"})
    fix = first.fix_pr
    assert fix is not None
    old_files = fix.model_copy(update={"files_changed": ["gui/tray_icon_legacy.py"],
                                       "fix_hunks": []})
    new_files = fix.model_copy(update={"files_changed": ["gui/tray/icon_impl.py"],
                                       "fix_hunks": []})
    before = first.model_copy(update={"members": [old_files]})
    after = first.model_copy(update={"members": [new_files]})
    matcher = Matcher([before, *SAMPLES[1:], after])
    issue = IssueText(title="Tray icon vanishes after sleep",
                      body="Traceback: File tray_icon_legacy.py, and icon_impl.py")
    ranked = matcher.rank(issue)
    assert ranked and ranked[0].public_id == first.public_id
    assert ranked[0].evidence.shared_files == ["gui/tray/icon_impl.py"]


def _word(i: int) -> str:
    """A word of its own for cluster ``i`` (digits would not be tokens)."""
    return "zq" + "".join(chr(ord("a") + int(d)) for d in str(i))


def _variants(n: int, *, shared: int) -> list[Cluster]:
    """``n`` clusters that all say "widget"; the first ``shared`` also say "renderer"."""
    out = []
    for i in range(n):
        words = "renderer glitch" if i < shared else "toolbar"
        out.append(Cluster.model_validate({
            "repo": "acme/widgets", "public_id": str(1000 + i),
            "display_label": f"Widget {words} {_word(i)}",
            "landed_fix": {"status": "merged", "pr": 5000 + i},
            "members": [{"kind": "pr", "number": 5000 + i}],
        }))
    return out


def _evidence_of(matcher: Matcher, issue: IssueText) -> list[tuple[str, float, dict]]:
    return [(m.public_id, m.score, m.evidence.model_dump()) for m in matcher.rank(issue)]


def test_the_pruned_first_stage_ranks_the_shortlist_as_the_full_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bot.matching import build

    clusters = _variants(60, shared=50)
    full = Matcher(clusters)
    # "widget" (60 clusters) becomes common, "renderer" (50) stays rare.
    monkeypatch.setattr(build, "_COMMON_MIN", 55)
    monkeypatch.setattr(build, "_COMMON_SHARE", 0.0)
    pruned = Matcher(clusters)
    issue = IssueText(title=f"Widget renderer glitch {_word(7)}", body="widget widget")
    q = pruned._query(issue, None)
    _, was_pruned = pruned._first_stage(q)
    assert was_pruned  # the path under test
    assert _evidence_of(pruned, issue) == _evidence_of(full, issue)
    assert pruned.rank(issue)[0].public_id == "1007"

    # Too few clusters share a rarer word: every word counts again, as in the full index (the
    # runners-up are alike but for their own word, so only their order may differ).
    for few in (IssueText(title=f"Widget toolbar {_word(55)}", body="the widget"),
                IssueText(title="Widget", body="renderer")):
        got, want = _evidence_of(pruned, few), _evidence_of(full, few)
        assert got[0] == want[0]
        assert sorted(str(m[1:]) for m in got) == sorted(str(m[1:]) for m in want)
