"""End to end over real HTTP: signed deliveries into the running bot, GitHub faked on loopback,
assertions on the exact requests the bot made. Every test runs on both stores: SQLite, and
PostgreSQL on a fresh schema."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from bot.render.comment import MARKER
from bot.settings import ServiceConfig, Settings, SettingsError
from bot.web.app import METRICS, SERVICES, WORKER
from tests.conftest import PAYLOADS, REPO, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload
from tests.samples import INTERRUPT_LEAK, RESET_HANG, UNRELATED


@pytest.fixture
def make_bot(make_bot: BotFactory, backend: str | None) -> BotFactory:
    """conftest's bot, on each backend in turn."""

    async def factory(**kwargs: object) -> BotUnderTest:
        kwargs.setdefault("database_url", backend)
        return await make_bot(**kwargs)

    return factory


COMMENTS = f"/repos/{REPO}/issues/90001/comments"


async def test_matching_issue_gets_exactly_one_comment_with_fix_and_verdict(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    resp = await bot.deliver("issues", issue_payload(**RESET_HANG))
    assert resp.status == 202
    await bot.settle()

    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 1
    body = posts[0].body["body"]
    assert body.startswith(MARKER)
    assert "#52090" in body and "merged 2026-06-24" in body
    assert "`resolved`" in body
    assert "gateway/slash_commands.py" in body
    assert bot.github.writes() == posts  # nothing else was written
    # The installation token was minted once, with a JWT the fake verified.
    assert len(bot.github.calls("POST", "/app/installations/77/access_tokens")) == 1
    assert posts[0].headers["Authorization"].startswith("token ghs_")


async def test_unrelated_issue_gets_no_comment(make_bot: BotFactory) -> None:
    bot = await make_bot()
    assert (await bot.deliver("issues", issue_payload(**UNRELATED))).status == 202
    await bot.settle()
    assert bot.github.writes() == []


async def test_pull_requests_and_bot_authors_get_no_comment(make_bot: BotFactory) -> None:
    bot = await make_bot()
    as_pr = issue_payload(**RESET_HANG)
    as_pr["issue"]["pull_request"] = {"url": "https://api.github.com/repos/x/y/pulls/1"}
    await bot.deliver("issues", as_pr)
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=90002,
                                              login="renovate[bot]", user_type="Bot"))
    pr_event = {"action": "labeled", "number": 3, "pull_request": {"title": RESET_HANG["title"]},
                "repository": {"full_name": REPO}, "installation": {"id": 77}}
    resp = await bot.deliver("pull_request", pr_event)
    assert resp.status == 202 and (await resp.json())["status"] == "ignored"
    # Control: the same text from a person on an issue is answered.
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=90003))
    await bot.settle()
    assert [r.path for r in bot.github.writes()] == [f"/repos/{REPO}/issues/90003/comments"]


async def test_redelivery_is_acknowledged_and_not_redone(make_bot: BotFactory) -> None:
    bot = await make_bot()
    payload = issue_payload(**RESET_HANG)
    first = await bot.deliver("issues", payload, delivery="d-1")
    await bot.settle()
    second = await bot.deliver("issues", payload, delivery="d-1")
    await bot.settle()
    assert first.status == 202 and (await first.json())["status"] == "queued"
    assert second.status == 202 and (await second.json())["status"] == "duplicate"
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_edit_updates_the_comment_instead_of_posting_again(make_bot: BotFactory) -> None:
    bot = await make_bot()
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    edited = issue_payload("edited", **INTERRUPT_LEAK,
                           changes={"title": {"from": RESET_HANG["title"]}})
    await bot.deliver("issues", edited)
    await bot.settle()

    assert len(bot.github.calls("POST", COMMENTS)) == 1
    patches = bot.github.calls("PATCH", "/issues/comments/")
    assert len(patches) == 1
    assert "#35382" in patches[0].body["body"]
    # An edit that does not touch title or body (e.g. a label change) is not re-matched.
    await bot.deliver("issues", issue_payload("edited", **INTERRUPT_LEAK, changes={}))
    await bot.settle()
    assert len(bot.github.calls("PATCH")) == 1


async def test_reopened_issue_with_existing_comment_is_not_commented_twice(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    await bot.deliver("issues", issue_payload("reopened", **RESET_HANG))
    await bot.settle()
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert bot.github.calls("PATCH") == []  # same body: nothing to change


async def test_bad_or_missing_signature_is_401_and_nothing_happens(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bad = await bot.deliver("issues", issue_payload(**RESET_HANG), secret="wrong")
    missing = await bot.deliver("issues", issue_payload(**RESET_HANG), secret=None)
    assert bad.status == 401 and missing.status == 401
    await bot.settle()
    assert bot.github.repo_requests() == []


async def test_ping_non_json_and_oversized_bodies(make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              max_body_bytes=4096))
    ping = await bot.deliver("ping", {"zen": "Keep it logically awesome.", "hook_id": 1})
    assert ping.status == 200
    assert (await bot.deliver("issues", b"{not json")).status == 400
    big = issue_payload(title="x", body="y" * 8192)
    assert (await bot.deliver("issues", big)).status == 413
    await bot.settle()
    assert bot.github.repo_requests() == []


async def test_healthz_reports_clusters(make_bot: BotFactory) -> None:
    bot = await make_bot()
    resp = await bot.client.get("/healthz")
    data = await resp.json()
    assert resp.status == 200 and data["ok"] is True and data["clusters"] == 3
    assert data["clusters_repos"] >= 1


async def test_the_index_builds_under_the_data_dir_from_the_store(make_bot: BotFactory) -> None:
    # A large build runs in a process that writes its arrays under the data directory; the
    # per-repository indexes read the learned clusters from the store.
    bot = await make_bot()
    services = bot.app[SERVICES]
    holder = services.index
    assert holder.index_dir == bot.data_dir / "index"
    assert holder.learned is not None
    assert holder.learned.learned_state(REPO) == (0, "0@None@0")
    assert list(holder.learned.learned_records(REPO)) == []


def test_server_refuses_to_start_without_a_secret(tmp_path: object) -> None:
    settings = Settings(webhook_secret=None)
    with pytest.raises(SettingsError, match="DEJAFIX_WEBHOOK_SECRET"):
        from bot.web.app import create_app

        create_app(settings, ServiceConfig())


async def test_dry_run_posts_nothing_and_logs_the_comment(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot(dry_run=True)
    with caplog.at_level(logging.INFO, logger="dejafix.github"):
        await bot.deliver("issues", issue_payload(**RESET_HANG))
        await bot.settle()
    assert bot.github.writes() == []
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "dry-run: would comment on NousResearch/hermes-agent#90001" in logged
    assert "#52090" in logged
    # Counted as what it would have done, never as a comment made.
    comments = bot.app[METRICS].comments
    assert (comments.value(action="would_comment"), comments.value(action="created")) == (1, 0)


async def test_dry_run_without_credentials_touches_no_github(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    """What the Quickstart starts: no App, no secret; unsigned deliveries, comment in the log."""
    bot = await make_bot(dry_run=True, with_credentials=False)
    with caplog.at_level(logging.INFO, logger="dejafix.github"):
        resp = await bot.deliver("issues", issue_payload(**RESET_HANG), secret=None)
        await bot.settle()
    merged = {"action": "closed", "number": 5, "repository": {"full_name": REPO},
              "pull_request": {"number": 5, "merged": True, "title": "fix: x",
                               "body": "Fixes #1", "merged_at": "2026-01-01T00:00:00Z"}}
    assert (await bot.deliver("pull_request", merged, secret=None)).status == 202
    await bot.settle()
    assert resp.status == 202
    assert bot.github.requests == []  # neither the issue nor the merged PR read anything
    assert any("#52090" in r.getMessage() for r in caplog.records)


async def test_repo_config_label_and_disable(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, ".github/dejafix.yml", "label: known-fix\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    labels = bot.github.calls("POST", "/issues/90001/labels")
    assert [r.body for r in labels] == [{"labels": ["known-fix"]}]


async def test_disabled_repo_gets_nothing(make_bot: BotFactory,
                                          caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, ".github/dejafix.yml", "enabled: false\n")
    with caplog.at_level(logging.INFO, logger="dejafix.known_fix"):
        await bot.deliver("issues", issue_payload(**RESET_HANG))
        await bot.settle()
    assert bot.github.writes() == []
    assert any("skipped: disabled" in r.getMessage() for r in caplog.records)


async def test_invalid_repo_config_skips_the_repo_and_logs_the_key(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, ".github/dejafix.yml", "threshold: 0.7\nlables: [dup]\n")
    with caplog.at_level(logging.ERROR, logger="dejafix.known_fix"):
        await bot.deliver("issues", issue_payload(**RESET_HANG), delivery="d-cfg")
        await bot.settle()
    assert bot.github.writes() == []
    # It did read the file (with the templates, in one GraphQL call).
    assert [r.body["variables"]["config"] for r in bot.github.calls("POST", "/graphql")] == \
        ["HEAD:.github/dejafix.yml"]
    errors = [r.getMessage() for r in caplog.records]
    assert any("d-cfg" in m and "lables" in m and "invalid config" in m for m in errors)


async def test_skip_labels_and_authors(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, ".github/dejafix.yml",
                        "skip_labels: [Question]\nskip_authors: [Maintainer1]\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG, labels=["question"]))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=90002, login="maintainer1"))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=90003, labels=["bug"]))
    await bot.settle()
    # Only the control issue (other label, other author) is answered.
    assert [r.path for r in bot.github.writes()] == [f"/repos/{REPO}/issues/90003/comments"]


async def test_fork_matches_upstream_clusters_only_when_configured(make_bot: BotFactory) -> None:
    bot = await make_bot()
    fork = "someone/hermes-fork"
    await bot.deliver("issues", issue_payload(**RESET_HANG, repo=fork))
    await bot.settle()
    assert bot.github.writes() == []  # clusters belong to another repository

    bot.github.add_file(fork, ".github/dejafix.yml", f"upstreams: [{REPO}]\n")
    # The first delivery cached "no config" for the fork; a real owner waits out the TTL.
    bot.app[SERVICES].repo_configs.clear()
    bot.app[SERVICES].repo_files.clear()  # (shorter-lived than the config cache)
    await bot.deliver("issues", issue_payload(**RESET_HANG, repo=fork, number=7))
    await bot.settle()
    posts = bot.github.calls("POST", f"/repos/{fork}/issues/7/comments")
    assert len(posts) == 1
    # Upstream items must be linked with owner/name, or GitHub would link the fork's own #52090.
    assert f"{REPO}#52090" in posts[0].body["body"]


async def test_existing_marker_comment_is_edited_after_a_lost_ledger(
        make_bot: BotFactory) -> None:
    """A crash between POST and the ledger write: the marker on the issue prevents a second.
    (Here a reopened issue: a newly opened one looks only on a retry, which the crash tests in
    test_faults.py run with real processes.)"""
    bot = await make_bot()
    bot.github.comments[(REPO.lower(), 90001)] = [
        {"id": 4444, "body": MARKER + "\nold text",
         "user": {"login": "dejafix-test[bot]", "type": "Bot"}},
        {"id": 4445, "body": MARKER + "\nquoted by a human",
         "user": {"login": "someone", "type": "User"}},
    ]
    await bot.deliver("issues", issue_payload("reopened", **RESET_HANG))
    await bot.settle()
    assert bot.github.calls("POST", COMMENTS) == []
    patches = bot.github.calls("PATCH")
    assert [p.path for p in patches] == [f"/repos/{REPO}/issues/comments/4444"]


async def test_mentions_in_cluster_text_cannot_ping(make_bot: BotFactory, tmp_path: object) -> None:
    from pathlib import Path

    src = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    src["display_label"] += " (cc @everyone-team <img src=x>)"
    src["members"][0]["title"] += " @release-managers"
    folder = Path(str(tmp_path)) / "clusters"
    folder.mkdir()
    for sample in SAMPLE_CLUSTERS.iterdir():
        (folder / sample.name).write_bytes(sample.read_bytes())
    (folder / "cluster-35994.json").write_text(json.dumps(src))
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(folder)]))
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    body = bot.github.calls("POST", COMMENTS)[0].body["body"]
    assert "@everyone-team" not in body and "@&#8203;everyone-team" in body
    assert "<img" not in body
    assert "@release-managers" not in body and "@&#8203;release-managers" in body


async def test_real_octokit_payload_is_processed(make_bot: BotFactory) -> None:
    path = PAYLOADS / "issues" / "opened.payload.json"
    if not path.exists():
        pytest.skip("shared github-payloads not present")
    payload = json.loads(path.read_text())
    payload["installation"] = {"id": 77}
    payload["repository"]["full_name"] = REPO
    payload["issue"].update(RESET_HANG)
    assert (await bot_deliver(make_bot, payload)) == 1


async def bot_deliver(make_bot: BotFactory, payload: dict[str, object]) -> int:
    bot = await make_bot()
    await bot.deliver("issues", payload)
    await bot.settle()
    number = payload["issue"]["number"]  # type: ignore[index]
    return len(bot.github.calls("POST", f"/repos/{REPO}/issues/{number}/comments"))


async def test_concurrent_open_and_edit_of_one_issue_post_one_comment(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    # Slow comment listing: both deliveries are in flight while the first looks for a comment.
    bot.github.delays[f"GET {COMMENTS}"] = 0.3
    edited = issue_payload("edited", **RESET_HANG, changes={"body": {"from": ""}})
    await asyncio.gather(bot.deliver("issues", issue_payload(**RESET_HANG)),
                         bot.deliver("issues", edited))
    await bot.settle()
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_dry_run_leaves_no_ledger_row(make_bot: BotFactory) -> None:
    bot = await make_bot(dry_run=True)
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    store = bot.app[SERVICES].store
    assert store.get_comment(REPO, 90001) is None
    # As a live run: a newly opened issue (first attempt) holds no comment of ours to look for.
    assert not bot.github.calls("GET", COMMENTS)


async def test_deleted_comment_is_posted_again(make_bot: BotFactory) -> None:
    bot = await make_bot()
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    bot.github.comments.clear()  # a maintainer deleted it
    await bot.deliver("issues", issue_payload("edited", **INTERRUPT_LEAK,
                                              changes={"title": {"from": "x"}}))
    await bot.settle()
    assert len(bot.github.calls("PATCH")) == 1  # tried to edit, got 404
    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 2 and "#35382" in posts[1].body["body"]


async def test_failed_label_is_added_on_retry(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.app[WORKER].retry_base = 0.0
    bot.github.add_file(REPO, ".github/dejafix.yml", "label: known-fix\n")
    bot.github.failures[f"POST /repos/{REPO}/issues/90001/labels"] = [502]
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert len(bot.github.calls("POST", "/issues/90001/labels")) == 2


@pytest.mark.parametrize("refused", ["POST /graphql", f"GET /repos/{REPO}/contents"])
async def test_refused_token_is_replaced_before_the_retry(make_bot: BotFactory,
                                                          refused: str) -> None:
    bot = await make_bot()
    bot.app[WORKER].retry_base = 0.0
    # The cold read is one GraphQL call; without GraphQL, REST reads.
    bot.github.graphql_files_off = refused.startswith("GET")
    bot.github.failures[refused] = [401]
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert len(bot.github.calls("POST", "/access_tokens")) == 2
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_marker_in_another_bots_comment_is_not_ours(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.comments[(REPO.lower(), 90001)] = [
        {"id": 9, "body": "> " + MARKER, "user": {"login": "github-actions[bot]", "type": "Bot"}},
    ]
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert bot.github.calls("PATCH") == []
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_sha1_signature_is_refused(make_bot: BotFactory) -> None:
    import hashlib
    import hmac

    from tests.conftest import SECRET

    bot = await make_bot()
    body = json.dumps(issue_payload(**RESET_HANG)).encode()
    sha1 = "sha1=" + hmac.new(SECRET.encode(), body, hashlib.sha1).hexdigest()
    resp = await bot.deliver("issues", body, secret=None,
                             headers={"X-Hub-Signature-256": sha1})
    assert resp.status == 401


async def test_actions_without_a_handler_are_not_queued(make_bot: BotFactory) -> None:
    bot = await make_bot()
    resp = await bot.deliver("issues", issue_payload("labeled", **RESET_HANG))
    assert (await resp.json())["status"] == "ignored"
    await bot.settle()
    assert bot.github.repo_requests() == []
    assert bot.app[SERVICES].store.pending_count() == 0


async def test_issue_templates_are_fetched_once_and_learned(make_bot: BotFactory) -> None:
    bot = await make_bot()
    template = (
        "name: Bug report\nbody:\n  - type: textarea\n    attributes:\n"
        "      label: What happened on the reset flow?\n"
        "      description: Describe what you saw after the confirm button.\n"
    )
    bot.github.add_file(REPO, ".github/ISSUE_TEMPLATE/bug.yml", template)
    form_body = ("### What happened on the reset flow?\n\n" + RESET_HANG["body"])
    await bot.deliver("issues", issue_payload(title=RESET_HANG["title"], body=form_body))
    await bot.deliver("issues", issue_payload(title=RESET_HANG["title"], body=form_body,
                                              number=90002))
    await bot.settle()
    # One read of the templates and the config (a GraphQL call), then the cache: not once per
    # issue; and the owner's .github fallback, once.
    assert len(bot.github.calls("POST", "/graphql")) == 1
    assert bot.github.calls("GET", "/contents/.github/ISSUE_TEMPLATE") == []
    assert len(bot.github.calls("GET", "/contents/.github/dejafix.yml")) == 1
    assert len(bot.github.calls("POST", "/comments")) == 2
    # The form's own question is template text, not the reporter's.
    boilerplate = bot.app[SERVICES].boilerplates[REPO.lower()]
    assert "What happened on the reset flow?" not in boilerplate.strip(form_body)


async def test_without_graphql_issue_templates_are_listed_and_read_once(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.graphql_files_off = True
    bot.github.add_file(REPO, ".github/ISSUE_TEMPLATE/bug.md", "### What happened?\n")
    for number in (90001, 90002):
        await bot.deliver("issues", issue_payload(number=number, **RESET_HANG))
    await bot.settle()
    listing = bot.github.calls("GET", "/contents/.github/ISSUE_TEMPLATE")
    # One listing and one file read, then the cache: not once per issue.
    assert len([r for r in listing if r.path.endswith("ISSUE_TEMPLATE")]) == 1
    assert len([r for r in listing if r.path.endswith("bug.md")]) == 1
    # The repository's file and its owner's .github fallback, once each.
    assert len(bot.github.calls("GET", f"/repos/{REPO}/contents/.github/dejafix.yml")) == 1
    assert len(bot.github.calls("GET", "/contents/.github/dejafix.yml")) == 2


async def test_a_delivery_that_keeps_failing_is_kept_as_failed_and_counted(
        make_bot: BotFactory) -> None:
    cfg = ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)], max_attempts=2, retry_base=0.0)
    bot = await make_bot(config=cfg)
    bot.github.failures[f"POST {COMMENTS}"] = [500, 500, 500]
    await bot.deliver("issues", issue_payload(**RESET_HANG), delivery="d-doomed")
    await bot.settle()
    health = await (await bot.client.get("/healthz")).json()
    assert health["failed"] == 1 and health["queued"] == 0
    # The retry looked for a comment the first attempt may have posted before posting again;
    # the first attempt, at a newly opened issue, had nothing to look for.
    assert len(bot.github.calls("POST", COMMENTS)) == 2
    assert len(bot.github.calls("GET", COMMENTS)) == 1
    row = bot.app[SERVICES].store.job_state("d-doomed")
    assert row is not None and row[:2] == ("failed", 2) and "GitHubBroken 500" in (row[2] or "")


async def test_a_delivery_without_an_installation_is_skipped_not_retried(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    """An App's deliveries always name their installation; a hand-made one that does not
    cannot be answered (every call would be refused), so it is skipped once, not retried."""
    bot = await make_bot()
    payload = issue_payload(**RESET_HANG)
    del payload["installation"]
    with caplog.at_level(logging.INFO):
        assert (await bot.deliver("issues", payload)).status == 202
        await bot.settle()
    assert bot.github.writes() == []
    assert "no installation in the delivery" in caplog.text
    assert "attempt 1 failed" not in caplog.text


async def test_shadow_mode_records_what_it_would_post_and_posts_nothing(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, ".github/dejafix.yml", "mode: shadow\nlabel: known-fix\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert bot.github.writes() == []  # no comment, no label
    store = bot.app[SERVICES].store
    [shadow] = store.suggestions(REPO)
    assert (shadow.issue, shadow.cluster, shadow.mode) == (90001, "35994", "shadow")
    assert "#52090" in shadow.body and shadow.body.startswith(MARKER)
    assert shadow.score >= 0.7 and json.loads(shadow.evidence)["shared_files"]
    assert store.get_comment(REPO, 90001) is None
    comments = bot.app[METRICS].comments
    assert (comments.value(action="would_comment"), comments.value(action="created")) == (1, 0)

    # Switched to comment: the same issue, edited, gets the comment, recorded as posted.
    bot.github.add_file(REPO, ".github/dejafix.yml", "mode: comment\n")
    bot.app[SERVICES].repo_configs.clear()
    await bot.deliver("issues", issue_payload("edited", **RESET_HANG,
                                              changes={"body": {"from": "x"}}))
    await bot.settle()
    [post] = bot.github.calls("POST", COMMENTS)
    [posted] = store.suggestions(REPO)
    assert posted.mode == "comment" and posted.body == post.body["body"]


async def test_a_deployment_may_start_every_repository_in_shadow_mode(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              default_mode="shadow"))
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert bot.github.writes() == []
    assert [s.mode for s in bot.app[SERVICES].store.suggestions(REPO)] == ["shadow"]


async def test_a_delivery_gets_no_session_cookie(make_bot: BotFactory) -> None:
    # The page's sessions must not reach the webhook: no cookie, no session made per delivery.
    bot = await make_bot()
    resp = await bot.deliver("issues", issue_payload(**UNRELATED))
    assert resp.status == 202
    assert "Set-Cookie" not in resp.headers
    await bot.settle()
    # The page (opened with the operator token from the data directory) makes one.
    token = (bot.data_dir / "operator-token").read_text().strip()
    page = await bot.client.get(f"/?token={token}", allow_redirects=False)
    assert page.status == 302 and "Set-Cookie" in page.headers
