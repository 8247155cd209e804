"""Evidence against a match: learned facets, causal citations and versions, and the fit's
constraints and model file. Synthetic clusters only (an invented repository and vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bot.clusters.models import Cluster
from bot.eval import fit as F
from bot.matching import IssueText, Matcher
from bot.matching.citations import citations
from bot.matching.facets import facet_candidates, is_facet
from bot.matching.model import DEFAULT_MODEL, FEATURES, MODEL_FILE, ScoreModel
from bot.matching.regression import (
    first_release_after,
    parse_version,
    regression_of,
    reporter_version,
    version_contains,
)
from tests.samples import cluster

# Three "channels" of an invented chat gateway, each tagged by its subsystem and file name, and
# filler clusters so that the channel names are rare.
CHANNELS = ("pigeon", "semaphore", "heliograph")


def _channel_clusters() -> list[Cluster]:
    out = []
    for n, ch in enumerate(CHANNELS):
        for k in range(2):
            cid = str(100 + n * 10 + k)
            out.append(cluster(cid, f"{ch.title()}: replies dropped after reconnect {k}",
                               titles=(f"fix({ch}): reconnect drops queued replies {k}",),
                               files=(f"relay/channels/{ch}.py",), subsystem=ch))
    for j in range(30):
        out.append(cluster(str(500 + j), f"Unrelated widget problem number {j} in module{j}",
                           subsystem=f"module{j}"))
    return out


def test_facet_candidates_come_from_tags_not_from_prose() -> None:
    c = cluster("7", "Pigeon: replies dropped", titles=("fix(semaphore/relay): drop",),
                files=("relay/channels/heliograph.py", "tests/test_pigeon.py"),
                summary="the lamp and the telegraph", subsystem="relay")
    found = facet_candidates(c)
    assert {"pigeon", "semaphore", "relay", "heliograph"} <= set(found)
    # Summary words and test files are not tags.
    assert "lamp" not in found and "telegraph" not in found
    assert not any("test" in w for w in found)


def test_is_facet_needs_a_tag_used_as_one() -> None:
    assert is_facet(tagged=5, said=8, clusters=100)
    assert not is_facet(tagged=1, said=1, clusters=100)  # one cluster is not a vocabulary
    assert not is_facet(tagged=3, said=40, clusters=100)  # "run" in run.py: a word, mostly
    assert not is_facet(tagged=30, said=30, clusters=100)  # in almost every cluster


def test_another_channel_is_evidence_against() -> None:
    matcher = Matcher(_channel_clusters())
    assert len(matcher.arrays.facet_terms) >= len(CHANNELS)
    same = matcher.rank(IssueText(title="Pigeon replies dropped after reconnect"))[0]
    assert same.public_id in ("100", "101")
    assert same.evidence.parts.get("facet_conflict", 0.0) == 0.0
    # The issue names one channel; the clusters of the others are tagged with theirs:
    wrong = matcher._rank(IssueText(title="Heliograph replies dropped after reconnect"), None,
                          F.MatchPolicy(), None)
    col = FEATURES.index("facet_conflict")
    ids = [matcher.public_id(int(i)) for i in wrong.docs.tolist()]
    values = dict(zip(ids, wrong.values[:, col].tolist(), strict=True))
    assert values["120"] == 0.0 and values["121"] == 0.0  # heliograph's own clusters
    assert values["100"] == 1.0 and values["110"] == 1.0  # pigeon's, semaphore's
    # An issue naming both its channel and another is explained by its channel's cluster.
    both = matcher._rank(IssueText(title="Pigeon and heliograph replies dropped"), None,
                         F.MatchPolicy(), None)
    ids = [matcher.public_id(int(i)) for i in both.docs.tolist()]
    assert both.values[ids.index("100"), col] == 0.0


def test_conflict_is_shown_in_the_evidence() -> None:
    matcher = Matcher(_channel_clusters(), model=ScoreModel(
        weights={**DEFAULT_MODEL.weights, "facet_conflict": -2.0}, bias=DEFAULT_MODEL.bias))
    ranked = matcher.rank(IssueText(title="Heliograph replies dropped after reconnect"), limit=6)
    conflicted = [m for m in ranked if m.evidence.parts.get("facet_conflict")]
    assert conflicted, [m.evidence for m in ranked]
    ev = conflicted[0].evidence
    assert ev.parts["facet_conflict"] < 0
    assert ev.issue_facets == ["heliograph"]
    assert ev.cluster_facets and "heliograph" not in ev.cluster_facets
    # The clusters of the named channel rank above the conflicted ones.
    assert ranked[0].public_id in ("120", "121")


@pytest.mark.parametrize("text,number", [
    ("Crash on start, a regression from #412", 412),
    ("This broke since #77 was merged", 77),
    ("introduced by #9001 (the reconnect change)", 9001),
    ("Looks like #55 broke the reply queue", 55),
    ("It started with PR 31 and has not stopped", 31),
    ("Replies vanish again after #88 landed", 88),
])
def test_causal_citations(text: str, number: int) -> None:
    assert [c.number for c in citations(text) if c.kind == "causal"] == [number]


@pytest.mark.parametrize("text", [
    "Same as #412, which fixed it for me",
    "see #77 for context",
    "the migration checks of #74 are green",
    "Fixes #12",
    "thereafter #12 was reopened",  # a cue word inside another word
    "see other/lib#123 which broke this",  # another repository's item
])
def test_plain_citations_are_not_causal(text: str) -> None:
    assert [c for c in citations(text) if c.kind == "causal"] == []


def test_a_cue_belongs_to_its_own_reference() -> None:
    # The window around #5 ends inside #12345: that must not read as a citation of #123.
    text = "See #5 x x x x x x x and it was caused by #12345"
    assert [c.number for c in citations(text) if c.kind == "causal"] == [12345]


def test_a_hostile_version_body_is_read_line_by_line() -> None:
    # The multi-line pattern this replaced backtracked quadratically: on this body it ran for
    # minutes (a hang the suite would not survive); read line by line it is one pass.
    body = "### version\n" + "\n" * 20000 + "x" + "# version " * 4000
    assert reporter_version("t", body) is None
    assert reporter_version("t", "### Python version\n\n3.11.2\n\n### Version\n\n1.4.0") \
        == "1.4.0"  # the bare Version heading wins over a runtime's


def test_reporter_version_from_form_and_text() -> None:
    form = "### What happened\n\nit broke\n\n### Version\n\n1.4.0\n\n### OS\n\nLinux"
    assert reporter_version("t", form) == "1.4.0"
    assert reporter_version("Crash in v2.3.1 on start", "") == "2.3.1"
    # A runtime's version far past every release this repository has is not ours.
    assert reporter_version("t", "Node v20.11.1 and app v1.2.0", [(1, 4, 0)]) == "1.2.0"
    assert reporter_version("t", "no version here, Python 3.11") is None


def test_version_contains_and_first_release() -> None:
    assert version_contains("1.4.0", "v1.2.0")
    assert version_contains("1.2", "v1.2.0")
    assert not version_contains("1.1.9", "v1.2.0")
    assert parse_version("release-0.13.2") == (0, 13, 2)
    releases = [("v1.0.0", "2026-01-01T00:00:00Z"), ("v1.1.0", "2026-03-01T00:00:00Z"),
                ("v1.2.0", "2026-05-01T00:00:00Z")]
    assert first_release_after("2026-02-10T00:00:00Z", releases) == "v1.1.0"
    assert first_release_after("2026-06-01T00:00:00Z", releases) is None


def test_regression_of_a_cluster() -> None:
    c = cluster("101", "Pigeon replies dropped", pr=4242)
    assert regression_of(IssueText(title="Pigeon replies dropped again",
                                   body="regression from #4242"), c) is not None
    # Citing some other PR causally says nothing of this cluster's fix, nor does telling how
    # the bug's first report (an issue, not a change) came about.
    assert regression_of(IssueText(title="x", body="regression from #17"), c) is None
    assert regression_of(IssueText(title="x", body="it happens again since #101"), c) is None
    released = c.model_copy(update={"landed_fix": c.landed_fix.model_copy(
        update={"released_in": "v1.2.0"})})
    newer = regression_of(IssueText(title="x", body="### Version\n\n1.4.0"), released)
    assert newer is not None and newer.kind == "version_contains_fix"
    assert regression_of(IssueText(title="x", body="### Version\n\n1.1.0"), released) is None


def test_a_causal_citation_of_the_fix_is_not_a_reference_for_the_match() -> None:
    clusters = _channel_clusters()
    matcher = Matcher(clusters)
    pr = next(c for c in clusters if c.public_id == "100").landed_fix.pr
    col = FEATURES.index("ref")

    def ref(body: str) -> float:
        ranked = matcher._rank(IssueText(title="Pigeon replies dropped", body=body), None,
                               F.MatchPolicy(), None)
        row = [matcher.public_id(int(i)) for i in ranked.docs.tolist()].index("100")
        return float(ranked.values[row, col])

    assert ref(f"same as #{pr}") == 1.0
    assert ref(f"a regression from #{pr}") == 0.0


def test_fit_keeps_signs_and_bounds() -> None:
    names = FEATURES
    rng = np.random.default_rng(0)
    data = []
    for n in range(60):
        right = n % 2 == 0
        # facet_conflict is noise that leans *positive* here: the fit must not make it count
        # for a match; title_cov separates perfectly and must stay within the bound.
        vec_right = dict.fromkeys(names, 0.0) | {"text": 0.5, "title_cov": 1.0,
                                                  "facet_conflict": float(rng.random() < 0.6)}
        vec_wrong = dict.fromkeys(names, 0.0) | {"text": 0.5, "title_cov": 0.0,
                                                  "facet_conflict": float(rng.random() < 0.4)}
        vec_right_l = [vec_right[k] for k in names]
        vec_wrong_l = [vec_wrong[k] for k in names]
        cands = [("a", vec_right_l if right else vec_wrong_l), ("b", vec_wrong_l)]
        data.append(F.QueryFeatures("a" if right else None, cands, names, group=str(n)))
    model = F.fit(data, l2_rel=1e-3, l2_cal=1e-3)
    assert model.weights["facet_conflict"] <= 0.0
    assert 0.0 <= model.weights["title_cov"] <= F.MAX_WEIGHT
    assert all(model.weights[k] >= 0 for k in names if k not in F.AGAINST)


def test_synthetic_pairs_hold_out_their_own_member() -> None:
    clusters = _channel_clusters()
    pairs = F.synthetic(clusters, parts=2, per_cluster=1)
    positives = [p for p in pairs if p.expected]
    negatives = [p for p in pairs if p.expected is None]
    assert len(positives) == len(negatives) == len(CHANNELS) * 2
    for p in negatives:
        # The pair's own cluster is not in the index it was ranked against.
        assert p.group not in {cid for cid, _ in p.candidates}
    for p in positives:
        assert p.group in {cid for cid, _ in p.candidates}


def test_the_model_file_is_what_the_matcher_loads() -> None:
    record = json.loads(MODEL_FILE.read_text(encoding="utf-8"))
    assert ScoreModel.from_json(MODEL_FILE.read_text(encoding="utf-8")) == DEFAULT_MODEL
    for key in ("refit", "constants", "training", "cross_validated", "model"):
        assert key in record
    assert len(record["training"]["data_sha256"]) == 64
    # No weight beyond the bound the fit promises, the hand-set ones included.
    assert all(abs(w) <= F.MAX_WEIGHT for w in DEFAULT_MODEL.weights.values())


def test_a_model_naming_an_unknown_feature_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"model": {"weights": {"colour": 1.0}}}), encoding="utf-8")
    with pytest.raises(ValueError, match="colour"):
        ScoreModel.load(bad)


def test_match_explains_and_withholds_the_comment_from_a_regression(tmp_path: Path) -> None:
    import subprocess
    import sys

    clusters = _channel_clusters()
    path = tmp_path / "clusters.jsonl"
    path.write_text("".join(c.model_dump_json() + "\n" for c in clusters), encoding="utf-8")
    pr = next(c for c in clusters if c.public_id == "120").landed_fix.pr
    issues = [
        {"number": 1, "title": "Heliograph: reconnect drops queued replies",
         "body": "fix(heliograph): reconnect drops queued replies after the relay restarts"},
        {"number": 2, "title": "Heliograph: reconnect drops queued replies",
         "body": f"fix(heliograph): reconnect drops queued replies. A regression from #{pr}."},
    ]
    stdin = "".join(json.dumps(i) + "\n" for i in issues)
    root = Path(__file__).resolve().parents[1]

    def run(*extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "bot", "match", "--clusters", str(path),
                               "--threshold", "0.0", "--margin", "0.0", *extra],
                              input=stdin, capture_output=True, text=True, cwd=root,
                              check=True)
        return done.stdout

    lines = [json.loads(line) for line in run().splitlines()]
    assert lines[0]["regression"] is None
    assert lines[1]["comment"] is False and lines[1]["regression"]["cited"] == pr
    text = run("--explain")
    assert "possible regression of cluster" in text and "for: " in text


def test_versions_can_be_left_out() -> None:
    c = cluster("101", "Pigeon replies dropped", pr=4242)
    released = c.model_copy(update={"landed_fix": c.landed_fix.model_copy(
        update={"released_in": "v1.2.0"})})
    newer = IssueText(title="x", body="### Version\n\n1.4.0")
    assert regression_of(newer, released, versions=False) is None
    caused = IssueText(title="x", body="broke since #4242")
    assert regression_of(caused, released, versions=False) is not None
