"""The benchmark's cluster generator: deterministic for a seed, valid records, realistic fields,
and it scales (vocabulary grows with the corpus instead of repeating the real one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gen_clusters import DEFAULT_SOURCE, FIRST_NUMBER, generate, load_real, write_jsonl
from bot.clusters.load import load_clusters
from bot.clusters.models import Cluster
from bot.matching.evidence import extract_cluster_evidence

pytestmark = pytest.mark.skipif(not DEFAULT_SOURCE.exists(),
                                reason="needs ../shared/eval/clusters.jsonl")


def test_same_seed_same_clusters_other_seed_other_clusters() -> None:
    a = generate(300, seed=7)
    assert a == generate(300, seed=7)
    assert json.dumps(a) == json.dumps(generate(300, seed=7))  # key order too
    b = generate(300, seed=8)
    assert [c["display_label"] for c in a] != [c["display_label"] for c in b]


def test_prefix_stable_so_sizes_nest() -> None:
    assert generate(1200, seed=3)[:250] == generate(250, seed=3)


def test_records_are_valid_clusters_with_unique_ids_and_one_repo() -> None:
    real = load_real()
    records = generate(2000, seed=0, include_real=True)
    clusters = [Cluster.model_validate(r) for r in records]
    assert len(clusters) == 2000
    assert [c.public_id for c in clusters[: len(real)]] == [r["public_id"] for r in real]
    assert len({c.public_id for c in clusters}) == len(clusters)
    assert {c.repo for c in clusters} == {real[0]["repo"]}
    numbers = [m.number for c in clusters[len(real):] for m in c.members]
    assert len(numbers) == len(set(numbers))
    assert min(numbers) >= FIRST_NUMBER > max(m.number for c in clusters[: len(real)]
                                              for m in c.members)


def test_fields_look_like_the_real_feed() -> None:
    clusters = [Cluster.model_validate(r) for r in generate(3000, seed=1)]
    for c in clusters:
        assert c.display_label.strip()
        assert c.members, c.public_id
        assert c.public_id == str(c.members[0].number)
        assert c.counts.members == len(c.members)
        assert c.landed_fix.pr is not None
        assert c.fix_pr is not None and c.fix_pr.number == c.landed_fix.pr
        assert c.landed_fix.landed
        for m in c.members:
            kind = "pull" if m.is_pr else "issues"
            assert m.url == f"https://github.com/{c.repo}/{kind}/{m.number}"
    # As in the real feed: summaries, release-note one-liners without titles, issue threads
    # with titles, fixes with files, and (generated) fix hunks that carry symbols.
    assert sum(bool(c.summary) for c in clusters) > 0.9 * len(clusters)
    titled = sum(any(m.title for m in c.members) for c in clusters) / len(clusters)
    assert 0.2 < titled < 0.7
    with_files = [c for c in clusters if c.files_changed]
    assert 0.05 * len(clusters) < len(with_files) < 0.5 * len(clusters)
    hunks = [c for c in with_files if any(fh.hunks for m in c.fix_prs for fh in m.fix_hunks)]
    assert len(hunks) > 0.3 * len(with_files)
    assert any(extract_cluster_evidence(c).symbols for c in hunks)
    # Member titles share words with their label, as a real cluster's do.
    shared = [c for c in clusters
              if any(m.title and set(m.title.lower().split()) & set(c.display_label.lower().split())
                     for m in c.members)]
    assert len(shared) > 0.5 * titled * len(clusters)


def test_vocabulary_grows_with_the_corpus() -> None:
    def vocabulary(records: list[dict]) -> tuple[set[str], set[str]]:
        files = {f for r in records for m in r["members"] for f in m.get("files_changed", [])}
        words = {w.lower() for r in records for w in r["display_label"].split()}
        return files, words

    small_files, small_words = vocabulary(generate(500, seed=2))
    big_files, big_words = vocabulary(generate(5000, seed=2))
    assert len(big_files) > 2 * len(small_files)
    assert len(big_words) > 1.5 * len(small_words)
    # ... but not linearly: common files and words stay common.
    assert len(big_files) < 10 * len(small_files)
    assert len(big_words) < 10 * len(small_words)


def test_written_file_loads_with_the_bots_loader(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "clusters.jsonl", 400, seed=5, include_real=True)
    report = load_clusters([path])
    assert report.ok, report.errors[:3]
    assert len(report.clusters) == 400
