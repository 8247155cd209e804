"""The cluster model against the JSON seeds, and the shipped JSON samples made from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from bot.clusters.models import Cluster

ROOT = Path(__file__).resolve().parents[1]
SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
SAMPLES = ROOT / "config" / "clusters"


def _seed_record(name: str) -> dict[str, Any]:
    path = SEEDS / name
    if not path.exists():
        pytest.skip(f"seed not available at {path}")
    record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return record


def _sample(name: str) -> Cluster:
    return Cluster.model_validate_json((SAMPLES / name).read_text(encoding="utf-8"))


def _check_35994(cluster: Cluster) -> None:
    assert cluster.repo == "NousResearch/hermes-agent"
    assert cluster.public_id == "35994"
    assert cluster.display_label == "Gateway reset/new command hang and cleanup fixes"
    assert cluster.summary.startswith("These items relate to hangs, deadlocks")
    assert cluster.subsystem == "gateway"
    assert cluster.landed_fix.status == "merged_to_main"
    assert cluster.landed_fix.pr == 52090
    assert cluster.landed_fix.merged_at == "2026-06-24T19:04:21+00:00"
    assert cluster.landed_fix.landed is True
    assert cluster.resolution.state == "resolved"
    assert cluster.resolution.deciding_pr == 52090
    assert cluster.freshness.state == "verified" and cluster.freshness.stale is False
    assert cluster.freshness.last_verified_at == "2026-06-24T19:04:21+00:00"
    assert cluster.grouping.backbone == "STRUCTURAL_SPANNING"
    assert [(m.kind, m.number, m.state, m.merged) for m in cluster.members] == [
        ("issue", 35994, "closed", None),
        ("pr", 36006, "closed", False),
        ("pr", 52090, "merged", True),
    ]
    assert cluster.members[0].title == (
        "Telegram /new confirm button hangs in `_handle_reset_command()` state machine deadlock"
    )
    fix = cluster.fix_pr
    assert fix is not None and fix.number == 52090
    assert (
        fix.title == "fix(gateway): offload agent cleanup off the event loop in /new reset (#35994)"
    )
    assert cluster.files_changed == [
        "gateway/slash_commands.py",
        "tests/gateway/test_35994_reset_button_deadlock.py",
    ]
    assert [m.number for m in cluster.fix_prs] == [52090]
    superseded = cluster.members[1].close_reason
    assert superseded is not None and superseded.implication == "superseded"
    assert [r.number for r in superseded.refs] == [0, 35994]
    headers = [h.split("\n")[0] for fh in fix.fix_hunks for h in fh.hunks]
    assert headers[1].startswith("@@ -111,13 +117,44 @@ async def _handle_reset_command(self")
    assert [(e.issue_number, e.pr_number, e.tier) for e in cluster.fix_edges] == [
        (35994, 52090, "verified")
    ]


def _check_53175(cluster: Cluster) -> None:
    assert cluster.public_id == "53175"
    assert cluster.display_label == "Event loop blocking and zombie state from agent cleanup"
    assert cluster.subsystem == "gateway"
    assert cluster.landed_fix.pr == 54130 and cluster.landed_fix.landed is True
    assert cluster.landed_fix.merged_at == "2026-06-28T09:41:37+00:00"
    assert cluster.resolution.by == "pr-54130" and cluster.resolution.deciding_pr == 54130
    assert cluster.freshness.stale is False
    assert [(m.kind, m.number, m.state) for m in cluster.members] == [
        ("issue", 53175, "closed"),
        ("pr", 53183, "closed"),
        ("pr", 54130, "merged"),
    ]
    assert cluster.members[0].title == (
        "Gateway event loop dies silently after long responses + /new "
        "(zombie state, 16 crashes in 30h)"
    )
    fix = cluster.fix_pr
    assert fix is not None and fix.number == 54130 and fix.fix_tier == "verified"
    assert fix.files_changed[0] == "gateway/run.py"
    assert len(fix.files_changed) == 5
    assert [fh.file for fh in fix.fix_hunks] == [
        "gateway/run.py",
        "tests/gateway/test_13121_shutdown_inflight_transcript_flush.py",
        "tests/gateway/test_53175_cleanup_off_loop.py",
        "tests/gateway/test_shutdown_cache_cleanup.py",
    ]
    assert len(fix.fix_hunks[0].hunks) == 7
    refs = cluster.members[1].close_reason
    assert refs is not None and [r.number for r in refs.refs][-2:] == [53175, 54130]


def test_seed_35994() -> None:
    _check_35994(Cluster.model_validate(_seed_record("cluster-35994.json")))


def test_seed_53175() -> None:
    _check_53175(Cluster.model_validate(_seed_record("cluster-53175.json")))


def test_shipped_samples_keep_the_bot_fields() -> None:
    _check_35994(_sample("cluster-35994.json"))
    _check_53175(_sample("cluster-53175.json"))


@pytest.mark.parametrize("name", ["cluster-35994.json", "cluster-53175.json"])
def test_shipped_samples_match_the_seeds_except_hunk_bodies(name: str) -> None:
    seed = Cluster.model_validate(_seed_record(name))
    sample = _sample(name)
    assert sample.model_dump(exclude={"members"}) == seed.model_dump(exclude={"members"})
    for ours, theirs in zip(sample.members, seed.members, strict=True):
        assert ours.model_dump(exclude={"fix_hunks"}) == theirs.model_dump(exclude={"fix_hunks"})
        assert [fh.file for fh in ours.fix_hunks] == [fh.file for fh in theirs.fix_hunks]
        for mine, full in zip(ours.fix_hunks, theirs.fix_hunks, strict=True):
            assert [h.split("\n")[0] for h in mine.hunks] == [h.split("\n")[0] for h in full.hunks]
            for short, long in zip(mine.hunks, full.hunks, strict=True):
                # Trimmed means a subset of the real lines, never invented ones.
                assert set(short.split("\n")) <= set(long.split("\n"))
                assert len(short) < len(long) or len(long) < 200


def test_unknown_fields_are_tolerated() -> None:
    record: dict[str, Any] = {
        "repo": "acme/widgets",
        "public_id": "1",
        "display_label": "Label",
        "future_field": {"x": 1},
        "landed_fix": {"status": "merged", "pr": 3, "new_flag": True},
        "members": [{"kind": "pr", "number": 3, "reviewers": ["a"], "merged": True}],
    }
    cluster = Cluster.model_validate(record)
    assert cluster.model_extra == {"future_field": {"x": 1}}
    assert cluster.landed_fix.model_extra == {"new_flag": True}
    assert cluster.members[0].model_extra == {"reviewers": ["a"]}
    assert cluster.landed_fix.landed is True
    assert cluster.fix_pr is cluster.members[0]


def test_public_id_as_int_becomes_text() -> None:
    cluster = Cluster.model_validate({"repo": "a/b", "public_id": 35994, "display_label": "x"})
    assert cluster.public_id == "35994"
    assert cluster.key == ("a/b", "35994")


@pytest.mark.parametrize("repo", ["hermes-agent", "a/b/c", "/b", "a/", ""])
def test_bad_repo_is_rejected(repo: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Cluster.model_validate({"repo": repo, "public_id": "1", "display_label": "x"})
    assert [e["loc"] for e in caught.value.errors()] == [("repo",)]
