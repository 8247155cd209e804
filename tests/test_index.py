"""The live index: per repository, rebuilt off the loop when files change, swapped whole."""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bot.matching import IssueText, Matcher
from bot.matching.builds import IndexDir, build_arrays, build_workers
from bot.matching.index import ClusterIndex, IndexHolder, build_index
from bot.matching.repo_indexes import RepoIndexes
from tests.conftest import SAMPLE_CLUSTERS

ISSUE = IssueText(
    title="Telegram bot stops answering after I tap the confirm button for /new",
    body="It hangs in `_handle_reset_command` in gateway/slash_commands.py.",
)


def _copy_samples(folder: Path) -> None:
    folder.mkdir()
    for sample in SAMPLE_CLUSTERS.iterdir():
        (folder / sample.name).write_bytes(sample.read_bytes())


def _as_other_repo(folder: Path, repo: str) -> None:
    data = json.loads((folder / "cluster-35994.json").read_text())
    data["repo"] = repo
    (folder / "other.json").write_text(json.dumps(data))


def test_issues_only_see_the_repositories_asked_for(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)
    _as_other_repo(folder, "someone/fork")
    index = build_index([folder])
    assert index.repos == ["nousresearch/hermes-agent", "someone/fork"]
    mine = index.rank(ISSUE, ["NousResearch/hermes-agent"])
    assert mine and all(m.cluster.repo == "NousResearch/hermes-agent" for m in mine)
    both = index.rank(ISSUE, ["someone/fork", "NousResearch/hermes-agent"], limit=10)
    assert {m.cluster.repo for m in both} == {"NousResearch/hermes-agent", "someone/fork"}
    assert index.rank(ISSUE, ["nobody/else"]) == []


async def test_changed_files_are_reindexed_and_swapped_unchanged_repos_reused(
        tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)
    holder = IndexHolder([folder])
    assert await holder.refresh(force=True)
    first = holder.current
    assert first.size == 3
    assert not await holder.refresh()  # nothing changed: no rebuild

    _as_other_repo(folder, "someone/fork")
    os.utime(folder / "other.json", ns=(1, 1))  # a distinct version even on coarse clocks
    assert await holder.refresh()
    second = holder.current
    assert second is not first and second.size == 4 and second.version != first.version
    # The repository whose clusters did not change kept its built index.
    assert second._matchers["nousresearch/hermes-agent"] is first._matchers[
        "nousresearch/hermes-agent"]
    # A delivery that took the old version still ranks on it, unchanged.
    assert [m.public_id for m in first.rank(ISSUE, ["someone/fork"])] == []


async def test_a_failed_build_keeps_the_previous_index(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)

    def broken(paths: list[Path], reuse: ClusterIndex | None) -> ClusterIndex:
        raise RuntimeError("disk on fire")

    holder = IndexHolder([folder])
    await holder.refresh(force=True)
    before = holder.current
    holder.builder = broken
    with pytest.raises(RuntimeError):
        await holder.refresh(force=True)
    assert holder.current is before


def test_curated_clusters_win_and_learned_ones_fill_the_gaps() -> None:
    """The merge a repository's own index is built with (``RepoIndexes``): its curated records,
    read back from the curated index, and its learned records from the store."""
    from bot.clusters.learning import cluster_from_fix, mark_reverted
    from bot.clusters.models import Cluster

    record = (SAMPLE_CLUSTERS / "cluster-35994.json").read_bytes()
    given = Cluster.model_validate_json(record)
    repo = given.repo
    same_issue = cluster_from_fix(repo, {"number": 1, "merged_at": "2026-01-01"},
                                  [{"number": 35994, "title": "dup"}], [])
    new_bug = cluster_from_fix(repo, {"number": 2, "merged_at": "2026-01-01"},
                               [{"number": 7, "title": "other bug"}], [])
    reverted = mark_reverted(given, 99, None)

    def merged(*learned: Cluster) -> list[Cluster]:
        stored = [c.model_dump_json(exclude_none=True) for c in learned]  # as the store keeps them
        arrays, report = build_arrays([], stored, given=[record])
        assert report.errors == []
        return Matcher(arrays=arrays[repo.lower()]).clusters

    first = merged(same_issue, new_bug)
    assert [c.public_id for c in first] == ["35994", "7"]
    assert first[0] == given  # the curated record, not the learned one for its issue
    overridden = merged(reverted)
    assert overridden[0].landed_fix.reverted  # a revert is the one learned fact that overrides


def _mapped(array: object) -> bool:
    """Whether an array's memory is a file mapping (through any chain of views)."""
    while array is not None and not isinstance(array, mmap.mmap):
        array = getattr(array, "base", None)
    return array is not None


def _ranked(index: ClusterIndex) -> list[tuple[str, float]]:
    return [(m.public_id, m.score) for m in index.rank(ISSUE, ["NousResearch/hermes-agent"])]


async def test_a_large_input_is_built_in_another_process_and_mapped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)
    in_thread = build_index([folder])
    caplog.set_level(logging.INFO, logger="dejafix.index")
    holder = IndexHolder([folder], index_dir=tmp_path / "index", process_above=0,
                         parallel_above=0)
    assert await holder.refresh(force=True)
    assert "built in a separate process" in caplog.text
    assert holder.saved is not None and holder.saved.workers == (
        build_workers() if build_workers() > 1 else 0)
    assert holder.saved is not None and holder.saved.directory.parent == tmp_path / "index"
    # The arrays are memory-mapped from the files the build process wrote, not built here.
    matcher = holder.current._matchers["nousresearch/hermes-agent"]
    assert _mapped(matcher.arrays.post_ids)
    assert holder.current.size == 3
    assert _ranked(holder.current) == _ranked(in_thread) != []
    found = holder.current.find("NousResearch/hermes-agent", kind="issue", number=35994)
    assert found is not None and found.public_id == "35994"

    # A restart with the same inputs maps the saved index instead of building it again.
    caplog.clear()
    again = IndexHolder([folder], index_dir=tmp_path / "index", process_above=0)
    assert await again.refresh(force=True)
    assert "mapped, not rebuilt" in caplog.text and "separate process" not in caplog.text
    assert _ranked(again.current) == _ranked(in_thread)

    # A new version replaces the saved one; the old directory goes.
    _as_other_repo(folder, "someone/fork")
    assert await again.refresh()
    assert again.current.size == 4
    assert again.saved is not None
    assert [p.name for p in (tmp_path / "index").iterdir()] == [again.saved.directory.name]


async def test_a_large_repository_s_learned_clusters_are_built_in_a_process_and_mapped(
        tmp_path: Path) -> None:
    from bot.clusters.learning import cluster_from_fix
    from bot.db.sqlite import SQLiteStore as Store

    folder = tmp_path / "c"
    _copy_samples(folder)
    store = Store(tmp_path / "data")
    try:
        learned = cluster_from_fix("NousResearch/hermes-agent",
                                   {"number": 9001, "merged_at": "2026-01-01",
                                    "title": "fix(cron): scheduler drops jobs after DST change"},
                                   [{"number": 9000, "title": "Cron jobs vanish after DST"}],
                                   [{"filename": "cron/scheduler.py", "patch": "@@ def tick"}])
        store.put_learned(learned)
        index_dir = IndexDir(tmp_path / "index")
        holder = IndexHolder([folder], index_dir=index_dir, process_above=0,
                             learned=RepoIndexes(store.learned_state, store.learned_records,
                                                 budget_bytes=1 << 30, root=index_dir,
                                                 process_above=0))
        assert await holder.refresh(force=True)
        curated = holder.current.count("NousResearch/hermes-agent")
        assert curated >= 1
        view = await holder.view(["NousResearch/hermes-agent"])
        assert view.count("NousResearch/hermes-agent") == curated + 1
        saved = list((tmp_path / "index" / "repos").glob("*/v-*/manifest.json"))
        assert len(saved) == 1  # built in the other process, written under the index dir
        found = view.find("NousResearch/hermes-agent", kind="pr", number=9001)
        assert found is not None and found.public_id == learned.public_id
        issue = IssueText(title="Cron jobs vanish after the DST change",
                          body="The scheduler in cron/scheduler.py drops them.")
        assert view.rank(issue, ["NousResearch/hermes-agent"])[0].public_id == \
            learned.public_id
        # A restart with the same inputs maps what was written instead of building again.
        index_dir = IndexDir(tmp_path / "index")
        again = IndexHolder([folder], index_dir=index_dir, process_above=0,
                            learned=RepoIndexes(store.learned_state, store.learned_records,
                                                budget_bytes=1 << 30, root=index_dir,
                                                process_above=0))
        await again.refresh(force=True)
        before = saved[0].stat().st_mtime_ns
        assert (await again.view(["NousResearch/hermes-agent"])).count(
            "NousResearch/hermes-agent") == curated + 1
        assert saved[0].stat().st_mtime_ns == before
    finally:
        store.close()


async def test_an_unreadable_saved_repository_index_fails_one_issue_then_is_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Unlike the curated index (rebuilt at once), a repository's unreadable saved index is
    removed and the issue answered from its curated clusters; its next issue builds it."""
    from bot.clusters.learning import cluster_from_fix
    from bot.db.sqlite import SQLiteStore as Store

    folder = tmp_path / "c"
    _copy_samples(folder)
    store = Store(tmp_path / "data")
    repo = "NousResearch/hermes-agent"

    def holder() -> IndexHolder:
        index_dir = IndexDir(tmp_path / "index")
        return IndexHolder([folder], index_dir=index_dir, process_above=0,
                           learned=RepoIndexes(store.learned_state, store.learned_records,
                                               budget_bytes=1 << 30, root=index_dir,
                                               process_above=0))

    try:
        store.put_learned(cluster_from_fix(repo, {"number": 9001, "merged_at": "2026-01-01"},
                                           [{"number": 9000, "title": "Cron jobs vanish"}], []))
        first = holder()
        await first.refresh(force=True)
        curated = first.current.count(repo)
        assert (await first.view([repo])).count(repo) == curated + 1
        [manifest] = (tmp_path / "index" / "repos").glob("*/v-*/manifest.json")
        next(manifest.parent.glob("*/post_ids.npy")).unlink()

        caplog.set_level(logging.INFO, logger="dejafix.index")
        restarted = holder()
        await restarted.refresh(force=True)
        assert (await restarted.view([repo])).count(repo) == curated
        assert "could not be built" in caplog.text and "its curated clusters" in caplog.text
        assert not manifest.parent.exists()
        caplog.clear()
        assert (await restarted.view([repo])).count(repo) == curated + 1
        assert "index built in a separate process" in caplog.text
    finally:
        store.close()


def test_worker_processes_build_the_same_index_and_report_the_same_problems(
        tmp_path: Path) -> None:
    """Records validated and extracted in worker processes reach the index in file order: the
    arrays, the problems and the later-definition-wins rule are those of a build in one
    process."""
    from bot.matching.arrays import HashKeys, StringTable

    records = [json.loads(p.read_text()) for p in sorted(SAMPLE_CLUSTERS.glob("*.json"))]
    lines = []
    for i in range(1500):  # several chunks per worker
        record = dict(records[i % len(records)], public_id=str(100_000 + i))
        record["display_label"] = f"{record['display_label']} variant {i}"
        lines.append(json.dumps(record))
    lines[700] = "{not json"
    lines[701] = json.dumps({"repo": "acme/widgets"})
    lines.append(json.dumps(dict(records[0], public_id="100003", display_label="later")))
    feed = tmp_path / "feed.jsonl"
    feed.write_text("\n".join(lines) + "\n", encoding="utf-8")
    learned = [json.dumps(dict(records[1], public_id="200000"))]

    serial, serial_report = build_arrays([feed], learned, workers=0)
    parallel, parallel_report = build_arrays([feed], learned, workers=2)

    assert [str(e) for e in parallel_report.errors] == [str(e) for e in serial_report.errors]
    assert [e.line for e in serial_report.errors if e.level == "error"][:1] == [701]
    assert serial.keys() == parallel.keys()
    for repo, one in serial.items():
        other = parallel[repo]
        assert one.n == other.n and one.fingerprint == other.fingerprint
        for name, value in vars(one).items():
            if isinstance(value, HashKeys):
                assert (value.hashes == getattr(other, name).hashes).all(), name
            elif isinstance(value, StringTable):
                assert [value[i] for i in range(len(value))] == \
                    [getattr(other, name)[i] for i in range(len(value))], name
            elif hasattr(value, "shape"):
                assert (value == getattr(other, name)).all(), name
    later = Matcher(arrays=serial["nousresearch/hermes-agent"])
    i = later.find("100003")
    assert i is not None and later.cluster(i).display_label == "later"


async def test_a_build_whose_learned_clusters_cannot_be_read_keeps_the_index(
        tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)
    holder = IndexHolder([folder], index_dir=tmp_path / "index", process_above=0)
    assert await holder.refresh(force=True)
    before = holder.current

    def lost(repo: str) -> Iterator[str]:  # the database went away half-way through
        yield json.loads(json.dumps("{}"))
        raise ConnectionError("the store is gone")

    holder.learned = RepoIndexes(lambda repo: (1, "changed"), lost, budget_bytes=1 << 30,
                                 root=lambda: tmp_path / "index", process_above=0)
    repo = before.repos[0]
    # The issue is answered from the curated clusters; the next one tries the build again.
    view = await holder.view([repo])
    assert view.matcher(repo) is before.matcher(repo)
    assert holder.current is before and _ranked(before)
    assert not holder.learned.resident(repo)
    assert not list((tmp_path / "index").rglob(".learned-*")), "the handed-over file stays"


async def test_a_cancelled_refresh_terminates_its_build_process(tmp_path: Path) -> None:
    import asyncio
    import multiprocessing

    folder = tmp_path / "c"
    _copy_samples(folder)
    holder = IndexHolder([folder], index_dir=tmp_path / "index", process_above=0)
    task = asyncio.create_task(holder.refresh(force=True))
    for _ in range(200):  # until the build process is running
        await asyncio.sleep(0.01)
        if any(p.name == "dejafix-index-build" for p in multiprocessing.active_children()):
            break
    else:
        pytest.fail("no build process started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [p for p in multiprocessing.active_children() if p.name == "dejafix-index-build"]
    assert holder.current.version == "empty"


async def test_leftovers_of_a_killed_build_and_an_unreadable_saved_index_are_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "c"
    _copy_samples(folder)
    root = tmp_path / "index"
    holder = IndexHolder([folder], index_dir=root, process_above=0)
    assert await holder.refresh(force=True)
    assert holder.saved is not None
    saved = holder.saved.directory
    # A build killed half-way left its directory; the saved one lost a file.
    (root / ".build-killed" / "0000-x.tmp").mkdir(parents=True)
    (root / ".build-killed" / "0000-x.tmp" / "post_ids.npy").write_bytes(b"half")
    next(saved.glob("*/post_ids.npy")).unlink()

    caplog.set_level(logging.INFO, logger="dejafix.index")
    restarted = IndexHolder([folder], index_dir=root, process_above=0)
    assert await restarted.refresh(force=True)
    assert "unreadable" in caplog.text and "built in a separate process" in caplog.text
    assert _ranked(restarted.current) == _ranked(holder.current) != []
    assert sorted(p.name for p in root.iterdir()) == [saved.name]


def _group(pgid: int) -> list[int]:
    """The processes of a process group (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
async def test_a_cancelled_build_leaves_no_worker_behind(tmp_path: Path) -> None:
    import asyncio
    import multiprocessing

    records = [json.loads(p.read_text()) for p in sorted(SAMPLE_CLUSTERS.glob("*.json"))]
    feed = tmp_path / "feed.jsonl"
    with open(feed, "w", encoding="utf-8") as fh:
        for i in range(20_000):
            fh.write(json.dumps(dict(records[i % len(records)], public_id=str(10**6 + i))))
            fh.write("\n")
    holder = IndexHolder([feed], index_dir=tmp_path / "index", process_above=0,
                         parallel_above=0)
    task = asyncio.create_task(holder.refresh(force=True))
    pgid = 0
    for _ in range(600):  # until the build process runs with its workers
        await asyncio.sleep(0.05)
        builds = [p for p in multiprocessing.active_children()
                  if p.name == "dejafix-index-build" and p.pid]
        if builds and len(_group(builds[0].pid or 0)) >= 3:
            pgid = builds[0].pid or 0
            break
    if not pgid:
        task.cancel()
        pytest.skip("the build finished before its workers were seen (fast machine)")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not _group(pgid):
            break
        await asyncio.sleep(0.05)
    assert _group(pgid) == []
    assert holder.current.version == "empty"
