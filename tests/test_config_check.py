"""Config errors people see, and config read the way people expect (issue 7, parts 3 and 4):
the "dejafix config" check run on pull requests and pushes, the cache dropped by a push that
changes the file, the organisation's .github fallback, ``_extends``, and ``config check``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import bot.features as handlers
import bot.jobs.dispatch as dispatch
from bot.__main__ import main
from bot.features import config_check
from bot.repo_config import CONFIG_PATH, RepoConfigError, parse_repo_config
from bot.web.app import SERVICES
from tests.conftest import REPO, BotFactory, BotUnderTest, issue_payload
from tests.samples import RESET_HANG

OWNER = REPO.split("/")[0]
SHA = "a" * 40
OTHER_SHA = "b" * 40
HTML = f"https://github.com/{REPO}"
INVALID = "enabled: true\nthreshold: 1.5\nlabel: known-fix\nlables: [dup]\n"


def test_the_config_check_router_is_registered() -> None:
    assert config_check.router in handlers.ROUTERS
    assert dispatch.wants("push", {"ref": "refs/heads/main"})
    assert dispatch.wants("pull_request", {"action": "synchronize"})


def _repository(repo: str = REPO) -> dict[str, Any]:
    owner, name = repo.split("/")
    return {"full_name": repo, "name": name, "owner": {"login": owner},
            "default_branch": "main", "html_url": f"https://github.com/{repo}"}


def pr_payload(action: str = "opened", sha: str = SHA, repo: str = REPO) -> dict[str, Any]:
    # Trimmed to what GitHub sends and the handler reads (the project's own fixture, so the
    # suite runs without the shared payload folder).
    return {
        "action": action, "number": 7,
        "pull_request": {"number": 7, "state": "open", "title": "Tune dejafix",
                         "head": {"sha": sha, "ref": "tune", "repo": _repository(repo)},
                         "base": {"ref": "main", "repo": _repository(repo)},
                         "user": {"login": "contributor", "type": "User"}},
        "repository": _repository(repo),
        "sender": {"login": "contributor", "type": "User"},
        "installation": {"id": 77},
    }


def push_payload(sha: str = SHA, *, branch: str = "main", changed: list[str] | None = None,
                 repo: str = REPO) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "ref": f"refs/heads/{branch}", "before": "0" * 40, "after": sha, "created": False,
        "deleted": False, "forced": False, "repository": _repository(repo),
        "sender": {"login": "maintainer", "type": "User"}, "installation": {"id": 77},
    }
    payload["commits"] = [{"id": sha, "added": [], "removed": [],
                           "modified": changed if changed is not None else [CONFIG_PATH]}]
    return payload


def runs(bot: BotUnderTest, repo: str = REPO) -> list[dict[str, Any]]:
    return bot.github.check_runs.get(repo.lower(), [])


def link(line: int, sha: str = SHA) -> str:
    return f"{HTML}/blob/{sha}/{CONFIG_PATH}#L{line}"


# -- the check run --------------------------------------------------------------------------

async def test_invalid_config_in_a_pr_fails_the_check_with_lines_and_links(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, CONFIG_PATH, "label: known-fix\n")  # the default branch: valid
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, INVALID)
    resp = await bot.deliver("pull_request", pr_payload("opened"))
    assert resp.status == 202 and (await resp.json())["status"] == "queued"
    await bot.settle()

    # Read at the PR's head commit, not from the default branch.
    reads = bot.github.calls("GET", f"/repos/{REPO}/contents/{CONFIG_PATH}")
    assert [r.query for r in reads] == [f"ref={SHA}"]
    [run] = runs(bot)
    assert run["name"] == "dejafix config" and run["head_sha"] == SHA
    assert run["conclusion"] == "failure" and run["status"] == "completed"
    annotations = run["output"]["annotations"]
    assert [(a["path"], a["start_line"], a["end_line"], a["annotation_level"])
            for a in annotations] == [(CONFIG_PATH, 2, 2, "failure"),
                                      (CONFIG_PATH, 4, 4, "failure")]
    assert annotations[0]["message"] == "threshold: Input should be less than or equal to 1"
    assert annotations[1]["message"] == "lables: Extra inputs are not permitted"
    summary = run["output"]["summary"]
    assert f"[line 2]({link(2)}): `threshold`: Input should be less than or equal to 1" \
        in summary
    assert f"[line 4]({link(4)}): `lables`: Extra inputs are not permitted" in summary
    assert run["output"]["title"] == f"2 errors in {CONFIG_PATH}"
    assert [w.path for w in bot.github.writes()] == [f"/repos/{REPO}/check-runs"]


@pytest.mark.parametrize("action", ["synchronize", "reopened"])
async def test_valid_config_passes_the_check(make_bot: BotFactory, action: str) -> None:
    bot = await make_bot()
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, "threshold: 0.8\nlabel: known-fix\n")
    await bot.deliver("pull_request", pr_payload(action))
    await bot.settle()
    [run] = runs(bot)
    assert run["conclusion"] == "success" and run["head_sha"] == SHA
    assert run["output"]["annotations"] == []
    assert f"{HTML}/blob/{SHA}/{CONFIG_PATH}" in run["output"]["summary"]


async def test_no_check_when_the_commit_has_no_config_or_the_pr_is_closed(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, CONFIG_PATH, INVALID)  # default branch only, not the commit
    await bot.deliver("pull_request", pr_payload("opened"))
    bot.github.add_file_at(REPO, OTHER_SHA, CONFIG_PATH, INVALID)
    await bot.deliver("pull_request", pr_payload("labeled", sha=OTHER_SHA))
    await bot.settle()
    assert runs(bot) == []
    # Control: the same commit in an opened PR is checked.
    await bot.deliver("pull_request", pr_payload("opened", sha=OTHER_SHA))
    await bot.settle()
    assert [r["conclusion"] for r in runs(bot)] == ["failure"]


async def test_yaml_syntax_error_is_annotated_at_its_line(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, "enabled: true\nlabel: [unclosed\n")
    await bot.deliver("pull_request", pr_payload())
    await bot.settle()
    [run] = runs(bot)
    [annotation] = run["output"]["annotations"]
    assert annotation["start_line"] == 3  # PyYAML notices at the end of the flow sequence
    assert annotation["message"].startswith("not valid YAML")
    assert link(annotation["start_line"]) in run["output"]["summary"]


async def test_dry_run_logs_the_check_instead_of_creating_it(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot(dry_run=True)
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, INVALID)
    with caplog.at_level(logging.INFO, logger="dejafix.github"):
        await bot.deliver("pull_request", pr_payload())
        await bot.settle()
    assert runs(bot) == [] and bot.github.writes() == []
    assert bot.github.calls("GET", f"/repos/{REPO}/contents/{CONFIG_PATH}")
    assert any("would create check run" in r.getMessage() and "threshold" in r.getMessage()
               for r in caplog.records)


async def test_missing_checks_permission_is_logged_not_retried(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot()
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, INVALID)
    bot.github.failures[f"POST /repos/{REPO}/check-runs"] = [403]
    with caplog.at_level(logging.WARNING, logger="dejafix.config_check"):
        await bot.deliver("pull_request", pr_payload(), delivery="d-perm")
        await bot.settle()
    assert len(bot.github.calls("POST", "/check-runs")) == 1
    # Done once, not failed and retried: retrying cannot grant a permission.
    assert bot.app[SERVICES].store.failed_count() == 0
    assert bot.app[SERVICES].store.pending_count() == 0
    assert any("d-perm" in r.getMessage() and "checks permission" in r.getMessage()
               for r in caplog.records)


# -- pushes: the check, and the cache ----------------------------------------------------------

async def test_push_to_the_default_branch_checks_and_drops_the_cached_config(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(REPO, CONFIG_PATH, "enabled: false\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=1))
    await bot.settle()
    assert bot.github.writes() == []  # disabled, and that is now cached

    bot.github.add_file(REPO, CONFIG_PATH, "enabled: true\n")
    # A push that does not touch the file keeps the cache: still disabled.
    await bot.deliver("push", push_payload(OTHER_SHA, changed=["README.md"]))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=2))
    await bot.settle()
    assert bot.github.calls("POST", "/comments") == []
    # A push to another branch neither checks nor drops anything.
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, "enabled: true\n")
    await bot.deliver("push", push_payload(SHA, branch="feature"))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=3))
    await bot.settle()
    assert bot.github.calls("POST", "/comments") == []
    assert runs(bot) == []

    # The push that changes it: checked at its commit, and the next issue uses the new file.
    await bot.deliver("push", push_payload(SHA))
    await bot.settle()
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=4))
    await bot.settle()
    assert [r["conclusion"] for r in runs(bot)] == ["success"]
    assert runs(bot)[0]["head_sha"] == SHA
    assert [p.path for p in bot.github.calls("POST", "/comments")] == \
        [f"/repos/{REPO}/issues/4/comments"]


async def test_invalid_config_pushed_to_the_default_branch_fails_the_check(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, INVALID)
    await bot.deliver("push", push_payload(SHA))
    deleted = push_payload("0" * 40)
    deleted["deleted"] = True
    await bot.deliver("push", deleted)
    await bot.settle()
    [run] = runs(bot)
    assert run["conclusion"] == "failure" and run["head_sha"] == SHA
    assert [a["start_line"] for a in run["output"]["annotations"]] == [2, 4]


def test_which_pushes_may_change_the_config() -> None:
    touch = {"added": [], "removed": [], "modified": [CONFIG_PATH]}
    other = {"added": ["a.py"], "removed": [], "modified": []}
    assert config_check.push_changes_config({"commits": [other, touch]})
    assert config_check.push_changes_config({"commits": [{**other, "removed": [CONFIG_PATH]}]})
    assert not config_check.push_changes_config({"commits": [other]})
    # Unknown is treated as changed: forced pushes, truncated or missing commit lists.
    assert config_check.push_changes_config({"commits": [other], "forced": True})
    assert config_check.push_changes_config({"commits": [other] * 20})
    assert config_check.push_changes_config({"commits": []})


# -- reading config: the organisation's .github, _extends --------------------------------------

async def test_org_dotgithub_config_applies_when_the_repo_has_none(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_org_file(OWNER, CONFIG_PATH, "label: from-org\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=1))
    await bot.settle()
    [labels] = bot.github.calls("POST", "/issues/1/labels")
    assert labels.body == {"labels": ["from-org"]}
    assert bot.github.calls("GET", f"/repos/{OWNER}/.github/contents/{CONFIG_PATH}")

    # The repository's own file wins outright; the org's is not read for it.
    bot.github.add_file(REPO, CONFIG_PATH, "label: own\n")
    await bot.deliver("push", push_payload(SHA))  # drops the cache
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=2))
    await bot.settle()
    assert bot.github.calls("POST", "/issues/2/labels")[0].body == {"labels": ["own"]}


async def test_push_to_the_org_dotgithub_repo_drops_the_configs_read_from_it(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_org_file(OWNER, CONFIG_PATH, "enabled: false\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=1))
    await bot.settle()
    bot.github.add_org_file(OWNER, CONFIG_PATH, "enabled: true\n")
    await bot.deliver("push", push_payload(SHA, repo=f"{OWNER}/.github"))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=2))
    await bot.settle()
    assert [p.path for p in bot.github.calls("POST", "/comments")] == \
        [f"/repos/{REPO}/issues/2/comments"]


async def test_org_config_errors_skip_the_repo(make_bot: BotFactory,
                                               caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot()
    bot.github.add_org_file(OWNER, CONFIG_PATH, "enabled: true\nlables: [x]\n")
    with caplog.at_level(logging.ERROR, logger="dejafix.known_fix"):
        await bot.deliver("issues", issue_payload(**RESET_HANG))
        await bot.settle()
    assert bot.github.writes() == []
    assert any(f"{OWNER}/.github:{CONFIG_PATH}:2: lables: Extra inputs" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("extends", ["shared-config", f"{OWNER}/shared-config"])
async def test_extends_merges_the_named_repo_underneath(make_bot: BotFactory,
                                                        extends: str) -> None:
    bot = await make_bot()
    bot.github.add_file(f"{OWNER}/shared-config", CONFIG_PATH,
                        "label: shared-label\nskip_labels: [question]\n")
    bot.github.add_file(REPO, CONFIG_PATH, f"_extends: {extends}\nskip_labels: [wontfix]\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=1, labels=["question"]))
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=2, labels=["wontfix"]))
    await bot.settle()
    # The base's label applies; its skip_labels is replaced by the file's own.
    assert [p.path for p in bot.github.calls("POST", "/comments")] == \
        [f"/repos/{REPO}/issues/1/comments"]
    assert bot.github.calls("POST", "/issues/1/labels")[0].body == {"labels": ["shared-label"]}


async def test_extends_cycle_and_missing_base_are_errors_in_the_check(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    name = REPO.split("/")[1]
    bot.github.add_file(f"{OWNER}/a", CONFIG_PATH, f"_extends: {name}\n")
    bot.github.add_file(f"{OWNER}/bad-base", CONFIG_PATH, "label: x\nthreshold: 2\n")
    bot.github.add_file_at(REPO, SHA, CONFIG_PATH, "enabled: true\n_extends: a\n")
    bot.github.add_file_at(REPO, OTHER_SHA, CONFIG_PATH, "# shared\n\n_extends: bad-base\n")
    missing = "c" * 40
    bot.github.add_file_at(REPO, missing, CONFIG_PATH, "_extends: nowhere\n")
    for sha in (SHA, OTHER_SHA, missing):
        await bot.deliver("pull_request", pr_payload(sha=sha))
    await bot.settle()
    by_sha = {r["head_sha"]: r for r in runs(bot)}
    assert {r["conclusion"] for r in by_sha.values()} == {"failure"}

    [cycle] = by_sha[SHA]["output"]["annotations"]
    assert cycle["start_line"] == 2 and "cycle" in cycle["message"]
    # An error inside the extended file: shown at the _extends line, naming the other file's
    # line, and linked to it.
    [base] = by_sha[OTHER_SHA]["output"]["annotations"]
    assert base["start_line"] == 3
    assert base["message"] == (f"{OWNER}/bad-base:{CONFIG_PATH}:2: threshold: "
                               "Input should be less than or equal to 1")
    assert f"https://github.com/{OWNER}/bad-base/blob/HEAD/{CONFIG_PATH}#L2" in \
        by_sha[OTHER_SHA]["output"]["summary"]
    [gone] = by_sha[missing]["output"]["annotations"]
    assert gone["start_line"] == 1 and f"{OWNER}/nowhere has no" in gone["message"]


async def test_extends_cycle_skips_the_repo(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.add_file(f"{OWNER}/a", CONFIG_PATH, f"_extends: {REPO}\n")
    bot.github.add_file(REPO, CONFIG_PATH, "_extends: a\n")
    await bot.deliver("issues", issue_payload(**RESET_HANG))
    await bot.settle()
    assert bot.github.writes() == []
    # Control: the same base without the way back is followed.
    bot.github.add_file(f"{OWNER}/a", CONFIG_PATH, "label: from-a\n")
    bot.app[SERVICES].repo_configs.clear()
    await bot.deliver("issues", issue_payload(**RESET_HANG, number=2))
    await bot.settle()
    assert bot.github.calls("POST", "/issues/2/labels")[0].body == {"labels": ["from-a"]}


# -- the parser's locations and the command line ------------------------------------------------

def test_errors_carry_line_and_key_path() -> None:
    # An unknown key is placed at the key, a wrong value at the value (here a line below).
    text = ("enabled: true\nskip_labels:\n  - ok\n  - [nested]\nthreshold: 1.5\n"
            "lables:\n  - dup\n")
    with pytest.raises(RepoConfigError) as info:
        parse_repo_config(text)
    assert info.value.errors == [
        (4, "skip_labels.1", "Input should be a valid string"),
        (5, "threshold", "Input should be less than or equal to 1"),
        (6, "lables", "Extra inputs are not permitted"),
    ]
    assert str(info.value).startswith(
        f"{CONFIG_PATH}:4: skip_labels.1: Input should be a valid string; ")


def test_config_check_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "dejafix.yml"
    bad.write_text(INVALID)
    assert main(["config", "check", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{bad}:2: threshold: Input should be less than or equal to 1",
                   f"{bad}:4: lables: Extra inputs are not permitted"]

    broken = tmp_path / "broken.yml"
    broken.write_text("label: [unclosed\n")
    assert main(["config", "check", str(broken)]) == 1
    assert capsys.readouterr().out.startswith(f"{broken}:")

    good = tmp_path / "good.yml"
    good.write_text("threshold: 0.8\n_extends: shared-config\n")
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: valid"
    assert main(["config", "check", str(tmp_path / "absent.yml")]) == 2

