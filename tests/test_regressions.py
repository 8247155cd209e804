"""Regressions are not duplicates: an issue matched to a known bug whose fix it says caused it, or
whose reporter already runs a version with the fix, never gets "already fixed". Over real HTTP,
through the fake GitHub, with the sample clusters (or copies of them changed in the test)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from bot.clusters.models import Cluster
from bot.github.client import RetryPolicy
from bot.matching.regression import Regression
from bot.matching.types import Match, MatchEvidence
from bot.render.comment import MARKER, render_regression
from bot.settings import ServiceConfig
from bot.web.app import METRICS, SERVICES
from tests.conftest import REPO, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload
from tests.samples import CAUSED, REGRESSION_POLICY, RESET_HANG, SAMPLES

COMMENTS = f"/repos/{REPO}/issues/90001/comments"
LABELS = f"/repos/{REPO}/issues/90001/labels"
RELEASES = f"/repos/{REPO}/releases"
ALREADY_FIXED = "This looks like a known bug that already has a fix"
CAUSED_HEADLINE = ("This looks like the bug fixed in #52090, which this issue says caused it: "
                   "possibly a regression of #52090")
VERSION_HEADLINE = ("This looks like the bug fixed in #52090, which your version already "
                    "contains: possibly a regression")
CONFIG = ".github/dejafix.yml"

def with_version(version: str) -> dict[str, str]:
    """The sample bug through an issue form that asks for the version."""
    return {"title": RESET_HANG["title"],
            "body": RESET_HANG["body"] + f"\n### Version\n\n{version}\n"}


def clusters_with(tmp_path: Path, **landed_fix: Any) -> ServiceConfig:
    """The sample clusters, with cluster 35994's ``landed_fix`` changed."""
    folder = tmp_path / "clusters"
    folder.mkdir(exist_ok=True)
    for sample in SAMPLE_CLUSTERS.iterdir():
        (folder / sample.name).write_bytes(sample.read_bytes())
    data = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    data["landed_fix"].update(landed_fix)
    (folder / "cluster-35994.json").write_text(json.dumps(data))
    return ServiceConfig(cluster_paths=[str(folder)], matching=REGRESSION_POLICY)


def label_calls(bot: BotUnderTest, number: int = 90001) -> list[Any]:
    return [r.body for r in bot.github.calls("POST", f"/repos/{REPO}/issues/{number}/labels")]


async def deliver(bot: BotUnderTest, fields: dict[str, str], *, number: int = 90001,
                  action: str = "opened", **extra: Any) -> None:
    await bot.deliver("issues", issue_payload(action, number=number, **fields, **extra))
    await bot.settle()


# -- (a) (b) (c): the issue says the fix caused it --------------------------------------------

async def test_caused_by_the_fix_gets_the_label_and_no_comment_by_default(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    await deliver(bot, CAUSED)
    assert bot.github.calls("POST", COMMENTS) == []
    assert bot.github.calls("PATCH") == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    assert [r.path for r in bot.github.writes()] == [LABELS]
    metrics = bot.app[METRICS]
    assert metrics.matches.value(outcome="labelled") == 1
    assert metrics.matches.value(outcome="commented") == 0
    assert metrics.regressions.value(kind="caused_by_fix", action="labelled") == 1
    # Kept for the web page's "fixes that look incomplete", with why and what it would say.
    [kept] = bot.app[SERVICES].store.suggestions(REPO)
    assert (kept.issue, kept.mode) == (90001, "label")
    assert kept.regression and kept.body.startswith(MARKER)


async def test_a_label_already_on_the_issue_is_not_added_again(make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    await deliver(bot, CAUSED, labels=["Possible-Regression"])
    assert bot.github.writes() == []


# A reporter who cites the fix has seen it: whatever the sentence says of it, never "already
# fixed". Each reads the sample bug's fix PR differently (bot/matching/citations.py): as the
# same bug or a mere mention (a possible regression), or as a fix that failed or left something
# (evidence against the match as well: a regression comment, or silence).
CITES_FIX = [
    ("Same as #52090?", "regression"),
    ("Upgrading to the release with #52090 changed nothing.", "regression"),
    ("#52090 didn't fix it for me.", "regression or silent"),
    ("I saw #52090, but I still see this on my machine.", "regression or silent"),
    ("This is distinct from #52090.", "regression or silent"),
]


def with_sentence(sentence: str) -> dict[str, str]:
    return {"title": RESET_HANG["title"], "body": RESET_HANG["body"] + "\n" + sentence + "\n"}


@pytest.mark.parametrize(("sentence", "expected"), CITES_FIX, ids=[s for s, _ in CITES_FIX])
async def test_a_report_that_cites_the_fix_is_never_told_it_is_already_fixed(
        make_bot: BotFactory, sentence: str, expected: str) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regressions: comment\n")
    await deliver(bot, with_sentence(sentence))
    posts = bot.github.calls("POST", COMMENTS)
    assert all(ALREADY_FIXED not in p.body["body"] for p in posts)
    assert all("possibly a regression" in p.body["body"] for p in posts)
    if expected == "regression":
        assert len(posts) == 1


async def test_by_default_a_report_that_cites_the_fix_is_labelled_not_answered(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    await deliver(bot, with_sentence("Same as #52090?"))
    assert bot.github.calls("POST", COMMENTS) == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    assert bot.app[METRICS].regressions.value(kind="cites_fix", action="labelled") == 1


async def test_comment_mode_posts_one_regression_comment(make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regressions: comment\nlabel: known-fix\n")
    await deliver(bot, CAUSED)
    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 1
    body = posts[0].body["body"]
    assert body.startswith(MARKER)
    assert CAUSED_HEADLINE in body
    assert "#52090" in body and "regression from #52090" in body
    assert ALREADY_FIXED not in body
    assert "| signal | what matched | weight |" in body  # the evidence, as the normal comment
    assert "cc: whoever looks after gateway" in body
    # The regression label, not the known-fix one: this bug is not known to be fixed for them.
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    # Redelivered (an edit that changes nothing): the same comment, not a second one.
    await deliver(bot, CAUSED, action="edited", changes={"body": {"from": ""}})
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert bot.github.calls("PATCH") == []
    assert bot.app[METRICS].regressions.value(kind="caused_by_fix", action="unchanged") == 1


async def test_off_mode_does_nothing(make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regressions: off\nlabel: known-fix\n")
    await deliver(bot, CAUSED)
    assert bot.github.writes() == []
    assert bot.app[METRICS].matches.value(outcome="silent") == 1


async def test_a_custom_regression_label(make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regression_label: 'needs: triage'\n")
    await deliver(bot, CAUSED)
    assert label_calls(bot) == [{"labels": ["needs: triage"]}]


async def test_an_invalid_regressions_value_skips_the_repository(make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regressions: shout\n")
    await deliver(bot, CAUSED)
    assert bot.github.writes() == []


# -- the issue becomes a regression after it was answered "already fixed" ---------------------

async def test_an_edit_turns_the_earlier_comment_into_the_regression_variant(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.add_file(REPO, CONFIG, "regressions: comment\n")
    await deliver(bot, RESET_HANG)
    first = bot.github.calls("POST", COMMENTS)
    assert len(first) == 1 and ALREADY_FIXED in first[0].body["body"]
    await deliver(bot, CAUSED, action="edited", changes={"body": {"from": RESET_HANG["body"]}})
    assert len(bot.github.calls("POST", COMMENTS)) == 1  # never a second comment
    patches = bot.github.calls("PATCH")
    ours = bot.github.comments[(REPO.lower(), 90001)]
    assert len(ours) == 1
    assert [p.path for p in patches] == [f"/repos/{REPO}/issues/comments/{ours[0]['id']}"]
    body = patches[0].body["body"]
    assert body.startswith(MARKER) and CAUSED_HEADLINE in body and ALREADY_FIXED not in body
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    assert bot.app[METRICS].regressions.value(kind="caused_by_fix", action="edited") == 1


async def test_label_mode_leaves_the_earlier_comment_and_adds_the_label(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)
    await deliver(bot, RESET_HANG)
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    await deliver(bot, CAUSED, action="edited", changes={"body": {"from": RESET_HANG["body"]}})
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert bot.github.calls("PATCH") == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    # The suggestion stays the posted one, its comment still on the issue.
    [kept] = bot.app[SERVICES].store.suggestions(REPO)
    assert (kept.mode, kept.regression) == ("comment", None)


# -- (d) the reporter's version already contains the fix (the record's release) ---------------

async def test_a_version_with_the_fix_gets_the_label_and_an_older_one_the_comment(
        make_bot: BotFactory, tmp_path: Path) -> None:
    bot = await make_bot(config=clusters_with(tmp_path, released_in="v1.2.0"))
    await deliver(bot, with_version("1.4.0"))
    assert bot.github.calls("POST", COMMENTS) == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    assert bot.app[METRICS].regressions.value(kind="version_contains_fix",
                                               action="labelled") == 1

    await deliver(bot, with_version("1.1.0"), number=90002)
    posts = bot.github.calls("POST", f"/repos/{REPO}/issues/90002/comments")
    assert len(posts) == 1 and ALREADY_FIXED in posts[0].body["body"]
    assert "released in v1.2.0" in posts[0].body["body"]
    assert label_calls(bot, 90002) == []


async def test_comment_mode_says_the_version_already_contains_the_fix(
        make_bot: BotFactory, tmp_path: Path) -> None:
    bot = await make_bot(config=clusters_with(tmp_path, released_in="v1.2.0"))
    bot.github.add_file(REPO, CONFIG, "regressions: comment\n")
    await deliver(bot, with_version("1.4.0"))
    body = bot.github.calls("POST", COMMENTS)[0].body["body"]
    assert VERSION_HEADLINE in body and ALREADY_FIXED not in body
    assert "1.4.0 already contains the fix (released in v1.2.0)" in body


# -- (e) the fix's first release from the Releases API ----------------------------------------

def publish_releases(bot: BotUnderTest) -> None:
    # The fix (cluster 35994) was merged on 2026-06-24: v1.3.0 is the first release with it.
    bot.github.add_release(REPO, "v1.2.0", "2026-06-01T10:00:00Z")
    bot.github.add_release(REPO, "v1.3.0", "2026-07-01T10:00:00Z")
    bot.github.add_release(REPO, "v1.4.0", "2026-08-01T10:00:00Z")
    bot.github.add_release(REPO, "v9.0.0", None, draft=True)  # never published


async def test_first_release_after_the_merge_comes_from_the_releases_api(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)  # the sample record has merged_at and no released_in
    publish_releases(bot)
    await deliver(bot, with_version("1.4.0"))
    assert bot.github.calls("POST", COMMENTS) == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
    assert [r.query for r in bot.github.calls("GET", RELEASES)] == ["per_page=100"]

    # Released before the merge: that version cannot have the fix, so "already fixed" stands.
    await deliver(bot, with_version("1.2.0"), number=90002)
    posts = bot.github.calls("POST", f"/repos/{REPO}/issues/90002/comments")
    assert len(posts) == 1 and ALREADY_FIXED in posts[0].body["body"]
    # The releases were read once for both issues (cached per repository for an hour).
    assert len(bot.github.calls("GET", RELEASES)) == 1


async def test_without_releases_a_version_alone_is_not_a_regression(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=SAMPLES)  # the fake lists no releases
    await deliver(bot, with_version("1.4.0"))
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert label_calls(bot) == []


async def test_a_failing_releases_call_does_not_stop_the_answer(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.app[SERVICES].github.retry = RetryPolicy(base=0.0)
    publish_releases(bot)
    bot.github.failures[f"GET {RELEASES}"] = [500] * 4  # every retry of the one call
    with caplog.at_level(logging.INFO, logger="dejafix.known_fix"):
        await bot.deliver("issues", issue_payload(**with_version("1.4.0")), delivery="d-rel")
        await bot.settle()
    assert len(bot.github.calls("GET", RELEASES)) == 4
    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 1 and ALREADY_FIXED in posts[0].body["body"]
    assert label_calls(bot) == []
    logged = [r for r in caplog.records if "releases unavailable" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    assert "d-rel" in logged[0].getMessage()
    # A failure is not cached: the next issue asks again, and now gets the release.
    await deliver(bot, with_version("1.4.0"), number=90002)
    assert len(bot.github.calls("GET", RELEASES)) == 5
    assert label_calls(bot, 90002) == [{"labels": ["possible-regression"]}]


# -- the regression comment on its own ---------------------------------------------------------

def _sample_match(**changes: Any) -> Match:
    data = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    data.update(changes)
    ev = MatchEvidence(parts={"files": 1.0, "ref": 0.5}, title_similarity=0.5,
                       shared_files=["gateway/slash_commands.py"], matched_terms=["confirm"])
    return Match(cluster=Cluster.model_validate(data), score=0.88, evidence=ev)


def test_render_regression_has_the_marker_and_lets_no_mention_through() -> None:
    match = _sample_match(subsystem="@core-team gateway", display_label="Hang @everyone")
    regression = Regression(kind="caused_by_fix", cited=52090,
                            phrase="regression from #52090 cc @octocat fixes #1")
    body = render_regression(match, regression, issue_repo=REPO)
    assert body.startswith(MARKER)
    # Every "@" is followed by the zero-width space that breaks GitHub's mention parser.
    assert re.search(r"@(?!&#8203;)", body) is None
    assert "@&#8203;core-team" in body and "@&#8203;octocat" in body
    assert "fixes #1" not in body  # no closing keyword either
    assert CAUSED_HEADLINE in body and ALREADY_FIXED not in body
    assert "| files | changed by #52090: `gateway/slash_commands.py` |" in body
    assert "cluster `35994` · possible regression" in body


def test_render_regression_for_a_version_and_an_upstream_fix() -> None:
    regression = Regression(kind="version_contains_fix", reporter_version="1.4.0",
                            fix_version="v1.3.0")
    body = render_regression(_sample_match(), regression, issue_repo="me/fork",
                             docs_url="https://example.org/docs")
    assert ("This looks like the bug fixed in NousResearch/hermes-agent#52090, which your "
            "version already contains: possibly a regression") in body
    assert "the reporter's version 1.4.0 already contains the fix (released in v1.3.0)" in body
    assert "[how to read this comment](https://example.org/docs)" in body


def test_the_regressions_key_reads_a_bare_off_and_refuses_other_words() -> None:
    from bot.repo_config import RepoConfigError, parse_repo_config

    assert parse_repo_config(None).regressions == "label"
    assert parse_repo_config(None).regression_label == "possible-regression"
    assert parse_repo_config("regressions: off\n").regressions == "off"  # YAML 1.1: false
    assert parse_repo_config("regressions: comment\n").regressions == "comment"
    for bad in ("regressions: on\n", "regressions: loud\n", "regression_label: ''\n"):
        with pytest.raises(RepoConfigError):
            parse_repo_config(bad)


async def test_an_upstream_fix_is_not_compared_with_the_downstream_version(
        make_bot: BotFactory, tmp_path: Path) -> None:
    """A fork matches its upstream's bug: the upstream's release numbers are not the fork's,
    so a fork version past them is no regression; the issue's own causal words still are."""
    fork = "someone/hermes-fork"
    bot = await make_bot(config=clusters_with(tmp_path, released_in="v1.2.0"))
    bot.github.add_file(fork, CONFIG, f"upstreams: [{REPO}]\n")
    await bot.deliver("issues", issue_payload(**with_version("1.4.0"), repo=fork, number=7))
    await bot.settle()
    posts = bot.github.calls("POST", f"/repos/{fork}/issues/7/comments")
    assert len(posts) == 1 and ALREADY_FIXED in posts[0].body["body"]

    await bot.deliver("issues", issue_payload(**CAUSED, repo=fork, number=8))
    await bot.settle()
    assert bot.github.calls("POST", f"/repos/{fork}/issues/8/comments") == []
    assert [r.body for r in bot.github.calls("POST", f"/repos/{fork}/issues/8/labels")] == \
        [{"labels": ["possible-regression"]}]


async def test_the_default_policy_labels_the_regression_and_comments_on_the_duplicate(
        make_bot: BotFactory) -> None:
    """With the shipped threshold and model, not the lowered one above: the same bug is
    answered "already fixed", and its report that says the fix caused it gets the label only."""
    bot = await make_bot()
    await deliver(bot, {"title": RESET_HANG["title"], "body": RESET_HANG["body"]}, number=90002)
    posts = bot.github.calls("POST", f"/repos/{REPO}/issues/90002/comments")
    assert len(posts) == 1 and ALREADY_FIXED in posts[0].body["body"]
    await deliver(bot, CAUSED)
    assert bot.github.calls("POST", COMMENTS) == []
    assert label_calls(bot) == [{"labels": ["possible-regression"]}]
