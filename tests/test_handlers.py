"""Handlers called directly (tests/handler_support.py): one call of known-fix's or the commands'
entry point on a real SQLite store and the fake GitHub, and exactly what it wrote to each."""

from __future__ import annotations

from typing import Any

from bot.features import commands, known_fix
from bot.render.comment import MARKER
from bot.settings import ServiceConfig
from tests.conftest import REPO, SAMPLE_CLUSTERS, issue_payload
from tests.handler_support import Handlers, HandlersFactory
from tests.samples import RESET_HANG, UNRELATED, comment_payload

ISSUE = 90001
COMMENTS = f"/repos/{REPO}/issues/{ISSUE}/comments"
CLUSTER = "35994"  # the sample cluster RESET_HANG is a report of; its fix is PR #52090


def looked_at_the_repository(h: Handlers) -> bool:
    """Whether the handler read anything of the repository (its config, at least): a silent
    outcome is only worth asserting when the handler got that far."""
    return any("/access_tokens" not in r.path for r in h.fake.repo_requests())


async def open_issue(h: Handlers, text: dict[str, str], **kwargs: Any) -> None:
    await h.call(known_fix.on_issue_opened, "issues", issue_payload(**text, **kwargs))


# -- known fix --------------------------------------------------------------------------------


async def test_known_fix_answers_a_duplicate_with_one_comment_it_records(
        handlers: Handlers) -> None:
    await open_issue(handlers, RESET_HANG)
    [post] = handlers.fake.calls("POST", COMMENTS)
    assert post.body["body"].startswith(MARKER) and "#52090" in post.body["body"]
    assert handlers.fake.writes() == [post]  # no label (none configured), nothing else
    [created] = handlers.fake.comments[(REPO.lower(), ISSUE)]
    record = handlers.store.get_comment(REPO, ISSUE)
    assert record is not None
    assert (record.comment_id, record.cluster) == (created["id"], CLUSTER)
    [suggestion] = handlers.store.suggestions(REPO)
    assert (suggestion.issue, suggestion.cluster, suggestion.mode) == (ISSUE, CLUSTER, "comment")
    assert suggestion.body == post.body["body"]


async def test_known_fix_run_again_on_the_same_issue_does_not_post_twice(
        handlers: Handlers) -> None:
    """A retry (attempt 2) of the delivery after the comment was posted: found in the ledger,
    the same text, so nothing is written."""
    payload = issue_payload(**RESET_HANG)
    await handlers.call(known_fix.on_issue_opened, "issues", payload, delivery_id="d-1")
    writes = len(handlers.fake.writes())
    await handlers.call(known_fix.on_issue_opened, "issues", payload, delivery_id="d-1",
                        attempt=2)
    assert len(handlers.fake.calls("POST", COMMENTS)) == 1
    assert len(handlers.fake.writes()) == writes


async def test_known_fix_stays_silent_on_an_unrelated_issue(handlers: Handlers) -> None:
    await open_issue(handlers, UNRELATED)
    assert looked_at_the_repository(handlers)
    assert handlers.fake.writes() == []
    assert handlers.store.get_comment(REPO, ISSUE) is None
    assert handlers.store.suggestions(REPO) == []


async def test_a_repository_in_shadow_mode_records_the_answer_and_posts_nothing(
        handlers: Handlers) -> None:
    handlers.fake.add_file(REPO, ".github/dejafix.yml", "mode: shadow\nlabel: known-fix\n")
    await open_issue(handlers, RESET_HANG)
    assert handlers.fake.writes() == []  # no comment, no label
    assert handlers.store.get_comment(REPO, ISSUE) is None
    [shadow] = handlers.store.suggestions(REPO)
    assert (shadow.issue, shadow.cluster, shadow.mode) == (ISSUE, CLUSTER, "shadow")
    assert shadow.body.startswith(MARKER) and "#52090" in shadow.body


async def test_a_deployment_in_shadow_mode_posts_nothing(
        make_handlers: HandlersFactory) -> None:
    h = await make_handlers(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                                 default_mode="shadow"))
    await open_issue(h, RESET_HANG)
    assert h.fake.writes() == []
    assert [s.mode for s in h.store.suggestions(REPO)] == ["shadow"]


# -- commands ---------------------------------------------------------------------------------


async def test_not_this_by_the_author_edits_the_comment_and_records_the_dismissal(
        handlers: Handlers) -> None:
    await open_issue(handlers, RESET_HANG)
    record = handlers.store.get_comment(REPO, ISSUE)
    assert record is not None
    await handlers.call(commands.on_issue_comment, "issue_comment",
                        comment_payload("Not my bug.\n/dejafix not-this", login="reporter"))
    [patch] = handlers.fake.calls("PATCH", "/issues/comments/")
    assert patch.path == f"/repos/{REPO}/issues/comments/{record.comment_id}"
    assert patch.body["body"].startswith(MARKER) and "dismissed" in patch.body["body"].lower()
    assert len(handlers.fake.calls("POST", COMMENTS)) == 1  # answered by the edit, no reply
    assert handlers.store.feedback_for(REPO, ISSUE) == {CLUSTER: "dismissed"}


async def test_not_this_by_a_stranger_is_refused_and_changes_nothing(
        handlers: Handlers) -> None:
    await open_issue(handlers, RESET_HANG)
    await handlers.call(commands.on_issue_comment, "issue_comment",
                        comment_payload("/dejafix not-this", login="passer-by"))
    posts = handlers.fake.calls("POST", COMMENTS)
    assert len(posts) == 2 and posts[1].body["body"].startswith(commands.REPLY_MARKER)
    assert handlers.fake.calls("PATCH") == []
    assert handlers.store.feedback_for(REPO, ISSUE) == {}
