"""bench/e2e.py's pieces that decide its figures, without processes: the delivery schedule (who
is cold, warm, overlapping), the attribution of the fake's calls to deliveries, and the
synthetic clusters (valid, and the matched text answered by the sample cluster alone)."""

from __future__ import annotations

import itertools
from pathlib import Path

from bench.e2e import (
    MATCHED_ID,
    SILENT,
    Delivery,
    _path_of,
    attribute,
    repo_names,
    schedule,
    seed_learned,
)
from bench.webhook import reset_hang
from bot.matching import IssueText
from bot.matching.builds import IndexDir
from bot.matching.index import IndexHolder
from bot.matching.repo_indexes import RepoIndexes
from bot.matching.scoring import decide
from bot.matching.types import MatchPolicy


def test_the_schedule_brings_repositories_in_evenly_and_classes_follow_the_definition() -> None:
    repos = repo_names(50, 1)
    plan = schedule(repos, 600, 20.0, 0.5, seed=3)
    assert plan == schedule(repos, 600, 20.0, 0.5, seed=3)  # seeded
    assert [d.at for d in plan[:3]] == [0.0, 0.05, 0.1]
    firsts: dict[str, float] = {}
    for d in plan:
        if d.repo not in firsts:
            firsts[d.repo] = d.at
            assert d.klass == "cold"
        elif d.at - firsts[d.repo] < 2.0:
            assert d.klass == "overlap"
        else:
            assert d.klass == "warm"
    assert len(firsts) == 50
    # One new repository every 12 deliveries, from the first to the last.
    colds = [d.serial for d in plan if d.klass == "cold"]
    assert max(b - a for a, b in itertools.pairwise(colds)) <= 12
    assert colds[-1] >= 600 - 12
    assert {d.installation for d in plan} == {inst for _, inst in repos}
    assert len({d.number for d in plan}) == 600
    shared = repo_names(6, 3)
    assert [inst for _, inst in shared] == [1000, 1000, 1000, 1001, 1001, 1001]


def _d(serial: int, repo: str, inst: int, sent: float, matched: bool = True) -> Delivery:
    return Delivery(serial, sent, repo, inst, 100 + serial, matched, sent=sent)


def test_calls_go_to_the_delivery_that_caused_them() -> None:
    a, b = "o/a", "o/b"
    cold = _d(0, a, 1, 0.0)
    second = _d(1, a, 1, 0.05)         # overlapping: waits for the cold one's config
    other = _d(2, b, 2, 0.1, matched=False)
    late = _d(3, a, 1, 400.0)          # past the config's cache time: reads it again
    calls = [
        (0.01, "POST", "/app/installations/1/access_tokens"),
        (0.11, "GET", f"/repos/{a}/contents/.github/dejafix.yml"),
        (0.12, "POST", "/app/installations/2/access_tokens"),
        (0.21, "GET", f"/repos/{a}/contents/.github/ISSUE_TEMPLATE"),
        (0.22, "GET", f"/repos/{b}/contents/.github/dejafix.yml"),
        (0.31, "POST", f"/repos/{a}/issues/100/comments"),
        (0.32, "POST", f"/repos/{a}/issues/101/comments"),
        (400.1, "GET", f"/repos/{a}/contents/.github/dejafix.yml"),
        (400.2, "POST", f"/repos/{a}/issues/103/comments"),
        (400.3, "GET", "/somewhere/else"),
        (400.4, "POST", f"/repos/{b}/issues/100/comments"),  # issue 100 is a's, not b's
    ]
    other_calls = attribute([cold, second, other, late], calls, ttl=300.0)
    assert (cold.calls, cold.tokens) == (4, 1)
    assert (second.calls, second.tokens) == (1, 0)
    assert (other.calls, other.tokens) == (2, 1)
    assert (late.calls, late.tokens) == (2, 0)
    assert other_calls == {"GET /somewhere/else": 1, f"POST /repos/{b}/issues/100/comments": 1}


def test_a_peer_that_reads_everything_per_delivery_gets_one_of_each_per_delivery() -> None:
    # Two deliveries of one repository in flight at once, their calls interleaved.
    first, second = _d(0, "o/a", 1, 0.0), _d(1, "o/a", 1, 0.02)
    calls = [
        (0.01, "POST", "/app/installations/1/access_tokens"),
        (0.03, "POST", "/app/installations/1/access_tokens"),
        (0.12, "GET", "/repos/o/a/contents/.github/dejafix.yml"),
        (0.13, "GET", "/repos/o/a/contents/.github/dejafix.yml"),
        (0.22, "GET", "/repos/o/a/issues/101/comments"),
        (0.23, "GET", "/repos/o/a/issues/100/comments"),
    ]
    assert attribute([first, second], calls) == {}
    assert (first.calls, first.tokens) == (3, 1)
    assert (second.calls, second.tokens) == (3, 1)


async def test_the_seeded_clusters_leave_the_matched_text_one_answer_and_the_silent_none(
        tmp_path: Path) -> None:
    """What the bench writes into the store is what the bot indexes per repository: 20 valid
    learned clusters each, the matched text answered by the sample cluster, the silent by none."""
    from bench.webhook import Store as BenchStore
    from bot.db.sqlite import SQLiteStore

    repos = [r for r, _ in repo_names(3, 1)]
    target = BenchStore("sqlite", tmp_path / "data", None, None)
    assert seed_learned(target, repos, 20, seed=0) == 60
    store = SQLiteStore(tmp_path / "data")
    try:
        holder = IndexHolder([], learned=RepoIndexes(store.learned_state, store.learned_records,
                                                     budget_bytes=1 << 30, root=IndexDir()))
        policy = MatchPolicy()
        matched = IssueText(number=1, **reset_hang())
        silent = IssueText(number=2, **SILENT)
        for repo in repos:
            index = await holder.view([repo])
            assert index.count(repo) == 20
            best = decide(index.rank(matched, [repo], policy=policy), policy)
            assert best is not None and best.public_id == MATCHED_ID
            assert best.cluster.repo == repo
            assert decide(index.rank(silent, [repo], policy=policy), policy) is None
    finally:
        store.close()


def test_a_graphql_query_counts_as_its_repository_s_call() -> None:
    from tests.fake_github import Recorded

    query = Recorded("POST", "/graphql", "", {}, {"query": "query{...}", "variables": {
        "owner": "o", "name": "a", "config": "HEAD:.github/dejafix.yml"}})
    assert _path_of(query) == "/repos/o/a/graphql"
    cold = _d(0, "o/a", 1, 0.0)
    assert attribute([cold], [(0.1, "POST", _path_of(query))]) == {}
    assert cold.calls == 1
