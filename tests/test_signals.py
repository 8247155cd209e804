"""The registry of signals is the one list: the matcher's columns, the model's weights, the
fit's constraints, the comment's rows and the page's names all follow it, and a model that
would silently switch a signal off is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bot.clusters.models import Cluster
from bot.eval import fit as F
from bot.matching import IssueText, Matcher, MatchPolicy
from bot.matching.model import DEFAULT_MODEL, FEATURES, MODEL_FILE, ScoreModel
from bot.matching.signals import AGAINST, FIXED_WEIGHTS, LABELS, ROW_OF, ROWS, SIGNALS, WORDS
from bot.matching.types import Match, MatchEvidence
from bot.render.comment import evidence_rows
from bot.web.dashboard import evidence_view
from tests.conftest import ROOT
from tests.samples import FILLER, ISSUE, LOOKALIKE, TARGET

CLUSTERS = [TARGET, LOOKALIKE, *FILLER]


def test_the_matcher_computes_the_registry_in_its_order() -> None:
    matcher = Matcher(CLUSTERS)
    assert matcher.feature_names == FEATURES == tuple(s.name for s in SIGNALS)
    ranked = matcher._rank(ISSUE, None, MatchPolicy(), None)
    assert ranked.values.shape[1] == len(FEATURES)
    # The relevance is the model's own sum over exactly those columns.
    row = dict(zip(FEATURES, ranked.values[0].tolist(), strict=True))
    assert ranked.relevance[0] == pytest.approx(DEFAULT_MODEL.relevance(row))


def test_the_shipped_model_weighs_every_signal() -> None:
    model = ScoreModel.load(MODEL_FILE)
    assert set(model.weights) == set(FEATURES)
    for name, weight in model.weights.items():
        if name in FIXED_WEIGHTS:
            assert weight == FIXED_WEIGHTS[name]
        elif name in AGAINST:
            assert weight <= 0, name
        else:
            assert weight >= 0, name


def test_a_model_without_a_weight_the_matcher_needs_is_refused() -> None:
    weights = dict(DEFAULT_MODEL.weights)
    del weights["title_miss"]
    with pytest.raises(ValueError, match="no weight for title_miss"):
        Matcher(CLUSTERS, model=ScoreModel(weights=weights, bias=DEFAULT_MODEL.bias))


def test_a_model_with_a_weight_no_signal_has_is_refused() -> None:
    text = json.dumps({"weights": {**DEFAULT_MODEL.weights, "no_such_signal": 1.0}})
    with pytest.raises(ValueError, match="no_such_signal"):
        ScoreModel.from_json(text)


def test_the_command_line_names_the_model_file_it_refuses(tmp_path: Path) -> None:
    data = json.loads(MODEL_FILE.read_text())
    del data["model"]["weights"]["facet_conflict"]
    model = tmp_path / "model.json"
    model.write_text(json.dumps(data))
    clusters = tmp_path / "c.jsonl"
    clusters.write_text(TARGET.model_dump_json() + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAFIX_")}
    proc = subprocess.run([sys.executable, "-m", "bot", "match", "--clusters", str(clusters),
                           "--model", str(model)], cwd=ROOT, input='{"title": "x"}\n',
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"--model {model}" in proc.stderr and "facet_conflict" in proc.stderr


def test_the_fit_constrains_and_fixes_what_the_registry_declares() -> None:
    assert {s.name for s in SIGNALS if s.against} == AGAINST
    assert {"facet_conflict", "title_miss", "ref_against"} <= AGAINST
    assert F.AGAINST is AGAINST and F.FIXED_WEIGHTS is FIXED_WEIGHTS
    # The shipped model was fitted under the same constraints.
    constants = json.loads(MODEL_FILE.read_text())["constants"]
    assert constants["against"] == sorted(AGAINST)
    assert constants["fixed_weights"] == FIXED_WEIGHTS


def test_every_row_with_pieces_names_an_evidence_field() -> None:
    fields = set(MatchEvidence.model_fields)
    for row in ROWS.values():
        assert row.pieces is None or row.pieces in fields, row.name
        assert row.signals <= {s.name for s in SIGNALS}
    # Evidence against a match is never a row of the table of evidence for it.
    assert not (AGAINST & set(ROW_OF))
    assert {"text", "title_cov", "label_cov"} <= ROWS[WORDS].signals


def test_comment_rows_add_up_the_signals_of_one_row() -> None:
    evidence = MatchEvidence(parts={"text": 0.5, "title_cov": 0.25, "label_cov": 0.25,
                                    "files": 1.0, "facet_conflict": -0.5},
                             shared_files=["widget/render/frame.py"],
                             matched_terms=["spline"])
    rows = evidence_rows(Match(TARGET, 0.9, evidence))
    weights = {name: weight for name, _, weight in rows}
    # The three word signals are one row, as heavy as the file row; nothing against is a row.
    assert weights == {WORDS: pytest.approx(0.5), ROW_OF["files"]: pytest.approx(0.5)}


def test_the_page_names_each_part_as_the_registry_labels_it() -> None:
    evidence = MatchEvidence(parts={"files": 1.0, "title_miss": -0.3, "facet_conflict": -0.2},
                             shared_files=[f"a/f{i}.py" for i in range(9)])
    view = evidence_view(evidence, None, "octo/widget")
    assert view.against[:2] == [f"{LABELS['title_miss']} (-0.30)",
                                f"{LABELS['facet_conflict']} (-0.20)"]
    # Without the record, as many pieces as the comment would show.
    files_row = next(what for name, what, _ in view.for_ if name == ROW_OF["files"])
    assert files_row.count("a/f") == ROWS[ROW_OF["files"]].shown


def test_a_row_that_would_read_zero_is_not_evidence() -> None:
    evidence = MatchEvidence(parts={"text": 2.0, "title_cov": 1.0, "files": 0.01},
                             shared_files=["widget/render/frame.py"],
                             matched_terms=["renderer", "crash"])
    rows = evidence_rows(Match(TARGET, 0.9, evidence))
    assert [name for name, _, _ in rows] == [WORDS]
    assert rows[0][2] == pytest.approx(1.0)
    assert all(f"{weight:.2f}" != "0.00" for _, _, weight in rows)


def test_a_file_many_fixes_changed_counts_less() -> None:
    """A file the issue names counts as specific as the repository's other fixes leave it:
    1/sqrt(how many of its bugs' fixes changed it); another repository's fixes do not count."""
    from tests.samples import cluster

    issue = IssueText(title="Connection drops", body="It fails in widget/net/conn.py when idle.")
    mine = cluster("301", "Idle connections are dropped", files=("widget/net/conn.py",))
    other = cluster("302", "Reconnect loops forever", files=("widget/net/conn.py",))
    elsewhere = cluster("303", "Reconnect loops forever", files=("widget/net/conn.py",),
                        repo="other/project")

    def files_of(clusters: list[Cluster]) -> float:
        matcher = Matcher(clusters)
        ranked = matcher._rank(issue, None, MatchPolicy(), None)
        row = [matcher.public_id(int(i)) for i in ranked.docs].index("301")
        return float(ranked.values[row, matcher.feature_names.index("files")])

    alone = files_of([mine, *FILLER])
    shared = files_of([mine, other, *FILLER])
    assert alone == pytest.approx(1.0)
    assert shared == pytest.approx(alone / 2 ** 0.5)
    assert files_of([mine, elsewhere, *FILLER]) == pytest.approx(alone)
