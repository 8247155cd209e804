"""``python -m bot action`` (issue 27) as the runner starts it: a real subprocess, the runner's
environment variables and files, an event file made from GitHub's own payloads, the fake
GitHub on loopback answering the workflow token, and the SQLite store in ``data-dir`` carried
from one process to the next."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bot.action import annotation, write_outputs
from tests.conftest import PAYLOADS, REPO, ROOT, SAMPLE_CLUSTERS
from tests.fake_github import FakeGitHub
from tests.samples import (
    LEARN_REPO,
    NEW_REPORT,
    RESET_HANG,
    UNRELATED,
    merged_pr,
    seed_history,
)

TOKEN = "ghs_workflowTOKENforTHEtestRUN0123456789"
COMMENTS = f"/repos/{REPO}/issues/1/comments"


def real_payload(action: str, repo: str = REPO, **issue: Any) -> dict[str, Any]:
    """GitHub's own ``issues`` payload, moved to the fake's repository. A workflow's event has
    no ``installation``."""
    path = PAYLOADS / "issues" / f"{action}.payload.json"
    if not path.exists():
        pytest.skip("../shared/github-payloads is not here")
    payload: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    payload.pop("installation", None)
    owner, name = repo.split("/")
    payload["repository"].update(full_name=repo, name=name)
    payload["repository"]["owner"]["login"] = owner
    payload["issue"].update(issue)
    payload["issue"]["state"] = "open"
    return payload


@dataclass
class Step:
    code: int
    stdout: str
    stderr: str
    outputs: dict[str, str]
    summary: str


@dataclass
class Runner:
    """One job's runner: a checkout (``workspace``) and the files the runner gives a step."""

    fake: FakeGitHub
    api: str
    tmp: Path

    @property
    def workspace(self) -> Path:
        return self.tmp / "workspace"

    def checkout(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = self.workspace / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")

    async def step(self, event: str, payload: dict[str, Any], *, data_dir: Path,
                   extra: dict[str, str] | None = None, run: str = "1") -> Step:
        where = self.tmp / f"run-{run}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "event.json").write_text(json.dumps(payload), encoding="utf-8")
        (where / "output").write_text("")
        (where / "summary.md").write_text("")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GITHUB_", "DEJAFIX_", "INPUT_"))}
        env.update({
            "GITHUB_EVENT_NAME": event, "GITHUB_EVENT_PATH": str(where / "event.json"),
            "GITHUB_REPOSITORY": payload.get("repository", {}).get("full_name", REPO),
            "GITHUB_API_URL": self.api, "GITHUB_SERVER_URL": "https://github.example",
            "GITHUB_WORKSPACE": str(self.workspace), "GITHUB_RUN_ID": run,
            "GITHUB_STEP_SUMMARY": str(where / "summary.md"),
            "GITHUB_OUTPUT": str(where / "output"), "INPUT_TOKEN": TOKEN,
            "DEJAFIX_DATA_DIR": str(data_dir),
        })
        env.update(extra or {})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bot", "action", cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode is not None
        return Step(proc.returncode, out.decode(), err.decode(),
                    parse_outputs((where / "output").read_text()),
                    (where / "summary.md").read_text())


def parse_outputs(text: str) -> dict[str, str]:
    """GITHUB_OUTPUT as the runner reads it: ``name=value`` or ``name<<DELIM`` blocks."""
    found: dict[str, str] = {}
    lines = iter(text.splitlines())
    for line in lines:
        if "<<" in line:
            name, delimiter = line.split("<<", 1)
            value = []
            for inner in lines:
                if inner == delimiter:
                    break
                value.append(inner)
            found[name] = "\n".join(value)
        elif "=" in line:
            name, value_ = line.split("=", 1)
            found[name] = value_
    return found


@pytest.fixture
def runner(github: tuple[FakeGitHub, str], tmp_path: Path) -> Runner:
    fake, api = github
    # The workflow token, and what it posts as.
    fake.tokens[TOKEN] = 1
    fake.slug = "github-actions"
    return Runner(fake, api, tmp_path)


def known_bugs(runner: Runner, config: str = "") -> None:
    """The repository's own known bug, under ``bugs/``, listed by ``clusters:``."""
    runner.checkout({
        ".github/dejafix.yml": "threshold: 0.5\nclusters:\n  - bugs\n" + config,
        "bugs/cluster-35994.json": (SAMPLE_CLUSTERS / "cluster-35994.json").read_text(),
    })


def assert_secret_kept(step: Step) -> None:
    for text in (step.stdout, step.stderr, step.summary, json.dumps(step.outputs)):
        assert TOKEN not in text


async def test_opened_issue_gets_one_comment_from_the_repositorys_own_clusters(
        runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner)
    payload = real_payload("opened", number=1, **RESET_HANG)
    step = await runner.step("issues", payload, data_dir=tmp_path / "state")
    assert step.code == 0, step.stderr
    assert step.outputs["outcome"] == "commented"
    assert step.outputs["cluster"] == "35994"
    assert float(step.outputs["score"]) >= 0.5
    posts = runner.fake.calls("POST", COMMENTS)
    assert len(posts) == 1
    comment_id = runner.fake.comments[(REPO.lower(), 1)][0]["id"]
    assert step.outputs["comment-url"] == (
        f"https://github.example/{REPO}/issues/1#issuecomment-{comment_id}")
    # The summary shows the comment posted, with its evidence; the log is grouped.
    assert posts[0].body["body"].splitlines()[0] in step.summary
    assert "evidence" in step.summary and "35994" in step.summary
    assert step.stdout.startswith("::group::") and "::endgroup::" in step.stdout
    # Only the workflow token was used: no App JWT, no installation token.
    assert runner.fake.calls(contains="/access_tokens") == []
    assert all(r.headers.get("Authorization") == f"token {TOKEN}"
               for r in runner.fake.repo_requests())
    assert_secret_kept(step)


async def test_an_unrelated_issue_gets_no_comment(runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner)
    step = await runner.step("issues", real_payload("opened", number=1, **UNRELATED),
                             data_dir=tmp_path / "state")
    assert step.code == 0, step.stderr
    assert step.outputs["outcome"] == "silent"
    assert step.outputs["cluster"] == "" and step.outputs["comment-url"] == ""
    assert runner.fake.writes() == []


async def test_a_feed_listed_in_clusters_answers_and_is_asked_only_if_changed(
        runner: Runner, tmp_path: Path, aiohttp_server: Any) -> None:
    """A feed in ``clusters:``: fetched in the first run; the next run (a fresh process, the
    same data-dir) asks with the ETag the first stored and gets 304."""
    seen: list[str | None] = []
    line = json.dumps(json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text()))

    async def serve(request: web.Request) -> web.Response:
        seen.append(request.headers.get("If-None-Match"))
        if request.headers.get("If-None-Match") == '"feed-1"':
            return web.Response(status=304, headers={"ETag": '"feed-1"'})
        return web.Response(text=line + "\n", headers={"ETag": '"feed-1"'})

    app = web.Application()
    app.router.add_get("/known.jsonl", serve)
    server = await aiohttp_server(app)
    url = str(server.make_url("/known.jsonl"))
    runner.checkout({".github/dejafix.yml": f"threshold: 0.5\nclusters: ['{url}']\n"})
    state = tmp_path / "state"
    one = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                            data_dir=state, run="1")
    assert one.outputs["outcome"] == "commented", one.stderr
    two = await runner.step("issues", real_payload("opened", number=2, **RESET_HANG),
                            data_dir=state, run="2")
    assert two.outputs["outcome"] == "commented", two.stderr
    assert seen == [None, '"feed-1"']


async def test_an_upstreams_own_clusters_are_read_through_the_api(
        runner: Runner, tmp_path: Path) -> None:
    """A fork's workflow, ``upstreams:`` naming a public repository that lists its known bugs
    under ``clusters:``: read with the workflow token, as the App reads them."""
    fork = "octo/hermes-fork"
    fake = runner.fake
    fake.add_repo(REPO, private=False, installation=2)
    fake.add_repo(fork, private=False, installation=1)
    fake.add_file(REPO, ".github/dejafix.yml", "clusters: [bugs]\n")
    fake.add_file(REPO, "bugs/cluster-35994.json",
                  (SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    runner.checkout({".github/dejafix.yml": f"threshold: 0.5\nupstreams: [{REPO}]\n"})
    payload = real_payload("opened", repo=fork, number=1, **RESET_HANG)
    payload["repository"].update(private=False, visibility="public")
    step = await runner.step("issues", payload, data_dir=tmp_path / "state")
    assert step.code == 0, step.stderr
    assert step.outputs["outcome"] == "commented", step.stderr
    assert step.outputs["cluster"] == "35994"
    assert fake.calls("GET", f"/repos/{REPO}/contents/bugs")


async def test_a_cluster_of_another_repository_is_annotated_and_not_used(
        runner: Runner, tmp_path: Path) -> None:
    runner.checkout({
        ".github/dejafix.yml": "threshold: 0.5\nclusters: [bugs]\n",
        "bugs/cluster-35994.json": (SAMPLE_CLUSTERS / "cluster-35994.json").read_text(),
    })
    other = "octo/elsewhere"
    step = await runner.step("issues", real_payload("opened", repo=other, number=1,
                                                    **RESET_HANG),
                             data_dir=tmp_path / "state")
    assert step.code == 0, step.stderr
    assert "::error file=bugs/cluster-35994.json," in step.stdout
    assert f"is of {REPO}, not of {other}" in step.stdout
    assert step.outputs["outcome"] == "silent"
    assert runner.fake.writes() == []


async def test_an_issue_whose_run_was_cancelled_is_answered_by_the_next_run(
        runner: Runner, tmp_path: Path) -> None:
    """GitHub cancels the pending run a newer one replaces (``concurrency:``): in a burst the
    middle issue's run never runs, and the next run answers it. An issue opened before Dejafix
    first ran here is left alone, and nothing is answered twice."""
    known_bugs(runner)
    state = tmp_path / "state"
    fake = runner.fake

    def opened_at(number: int, when: float) -> dict[str, Any]:
        issue = real_payload("opened", number=number, **RESET_HANG)["issue"]
        issue["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
        fake.add_issue(REPO, issue)
        return issue

    def event(number: int, when: float, **text: str) -> dict[str, Any]:
        payload = real_payload("opened", number=number, **text)
        payload["issue"]["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                       time.gmtime(when))
        return payload

    now = time.time()
    opened_at(1, now - 3600)  # before Dejafix was set up
    first = await runner.step("issues", event(5, now, **RESET_HANG), data_dir=state, run="1")
    assert first.outputs["outcome"] == "commented", first.stderr
    opened_at(6, now + 2)  # its run is cancelled by #7's
    pr = opened_at(8, now + 3)
    pr["pull_request"] = {"url": "x"}
    opened_at(10, now + 9)  # newer than #7: its own run is still to come
    last = await runner.step("issues", event(7, now + 4, **RESET_HANG), data_dir=state,
                             run="2")
    assert last.code == 0, last.stderr
    assert last.outputs["outcome"] == "commented"
    assert "caught up #6" in last.summary
    commented = {n for n in (1, 5, 6, 7, 8, 10)
                 if fake.calls("POST", f"/repos/{REPO}/issues/{n}/comments")}
    assert commented == {5, 6, 7}

    # #10's own run, then a run that must answer nothing twice.
    tenth = await runner.step("issues", event(10, now + 9, **RESET_HANG), data_dir=state,
                              run="3")
    assert tenth.outputs["outcome"] == "commented" and "caught up" not in tenth.summary
    again = await runner.step("issues", event(9, now + 12, **UNRELATED), data_dir=state,
                              run="4")
    assert "caught up" not in again.summary
    assert all(len(fake.calls("POST", f"/repos/{REPO}/issues/{n}/comments")) == 1
               for n in (5, 6, 7, 10))


async def test_a_rerun_or_an_edit_never_posts_a_second_comment(
        runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner)
    state = tmp_path / "state"
    opened = real_payload("opened", number=1, **RESET_HANG)
    first = await runner.step("issues", opened, data_dir=state, run="1")
    assert first.outputs["outcome"] == "commented"

    # The same job again with the same state: the ledger says it reads so already.
    again = await runner.step("issues", opened, data_dir=state, run="2")
    assert again.outputs["outcome"] == "unchanged", again.stderr
    # A re-run whose state was lost (cache evicted, or saved before the post): the comment is
    # found by the marker and the author github-actions[bot], and edited.
    lost = await runner.step("issues", opened, data_dir=tmp_path / "fresh", run="3")
    assert lost.outputs["outcome"] == "edited", lost.stderr

    edited = real_payload("edited", number=1, title=RESET_HANG["title"],
                          body=RESET_HANG["body"] + "\nStill happens on 1.4.\n")
    edited["changes"] = {"body": {"from": RESET_HANG["body"]}}
    step = await runner.step("issues", edited, data_dir=state, run="4")
    assert step.outputs["outcome"] in ("edited", "unchanged"), step.stderr
    assert len(runner.fake.calls("POST", COMMENTS)) == 1
    assert len(runner.fake.comments[(REPO.lower(), 1)]) == 1


async def test_a_cluster_learned_in_one_run_is_used_by_the_next(
        runner: Runner, tmp_path: Path) -> None:
    seed_history(runner.fake)
    state = tmp_path / "state"
    merged = merged_pr()
    merged.pop("installation")
    merged["repository"] = {"full_name": LEARN_REPO, "name": "widgets",
                            "owner": {"login": "octo"}}
    # As the documented workflow runs it: in the base branch's context, whose cache the
    # next runs restore.
    learned = await runner.step("pull_request_target", merged, data_dir=state, run="1")
    assert learned.code == 0, learned.stderr

    report = real_payload("opened", repo=LEARN_REPO, number=12, **NEW_REPORT)
    step = await runner.step("issues", report, data_dir=state, run="2")
    assert step.outputs["outcome"] == "commented", step.stderr
    assert step.outputs["cluster"] == "10"
    assert len(runner.fake.calls("POST", f"/repos/{LEARN_REPO}/issues/12/comments")) == 1

    # Another data-dir (no state carried over) knows nothing.
    other = real_payload("opened", repo=LEARN_REPO, number=13, **NEW_REPORT)
    cold = await runner.step("issues", other, data_dir=tmp_path / "elsewhere", run="3")
    assert cold.outputs["outcome"] == "silent"


async def test_the_daily_cap_holds_across_runs(runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner, "max_comments_per_day: 1\n")
    state = tmp_path / "state"
    one = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                            data_dir=state, run="1")
    assert one.outputs["outcome"] == "commented"
    two = await runner.step("issues", real_payload("opened", number=2, **RESET_HANG),
                            data_dir=state, run="2")
    assert two.outputs["outcome"] == "skipped", two.stderr
    assert runner.fake.calls("POST", f"/repos/{REPO}/issues/2/comments") == []


async def test_shadow_mode_posts_nothing_and_shows_the_comment(
        runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner)
    step = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                             data_dir=tmp_path / "state", extra={"INPUT_MODE": "shadow"})
    assert step.code == 0, step.stderr
    assert step.outputs["outcome"] == "shadow"
    assert step.outputs["cluster"] == "35994" and step.outputs["comment-url"] == ""
    assert runner.fake.writes() == []
    assert "would post" in step.summary and "35994" in step.summary
    assert "evidence" in step.summary


async def test_a_config_error_is_an_annotation_on_its_line_and_the_job_succeeds(
        runner: Runner, tmp_path: Path) -> None:
    runner.checkout({".github/dejafix.yml": "enabled: true\nthreshold: 2\n"})
    step = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                             data_dir=tmp_path / "state")
    assert step.code == 0, step.stderr
    errors = [line for line in step.stdout.splitlines() if line.startswith("::error ")]
    assert len(errors) == 1
    assert errors[0].startswith("::error file=.github/dejafix.yml,line=2,")
    assert "threshold" in errors[0]
    assert step.outputs["outcome"] == "skipped"
    assert runner.fake.writes() == []


async def test_a_bad_cluster_file_is_annotated_and_the_others_still_answer(
        runner: Runner, tmp_path: Path) -> None:
    known_bugs(runner)
    runner.checkout({"bugs/broken.jsonl": '{"repo": "x/y"}\n'})
    step = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                             data_dir=tmp_path / "state")
    assert "::error file=bugs/broken.jsonl,line=1," in step.stdout
    assert step.outputs["outcome"] == "commented"


async def test_clusters_outside_the_checkout_are_refused(
        runner: Runner, tmp_path: Path) -> None:
    outside = tmp_path / "secret-bugs"
    outside.mkdir()
    shutil.copy(SAMPLE_CLUSTERS / "cluster-35994.json", outside)
    runner.checkout({".github/dejafix.yml": "threshold: 0.5\nclusters: [bugs]\n"})
    (runner.workspace / "bugs").symlink_to(outside)
    step = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                             data_dir=tmp_path / "state")
    assert "leaves the repository" in step.stdout
    assert step.outputs["outcome"] == "silent"
    assert runner.fake.writes() == []


def test_clusters_key_takes_paths_inside_the_repository_only() -> None:
    from bot.repo_config import RepoConfigError, read_config_file

    assert read_config_file("clusters: [bugs, docs/known.md]\n").config.clusters == [
        "bugs", "docs/known.md"]
    for bad in ("/etc", "../other", "bugs/../../x", "~/x", "C:/x"):
        with pytest.raises(RepoConfigError, match="clusters"):
            read_config_file(f"clusters: ['{bad}']\n")


def test_untrusted_text_cannot_open_a_workflow_command(tmp_path: Path) -> None:
    line = annotation("error", "bad\n::add-mask::x%", file="a,b:c.yml", line=3)
    assert "\n" not in line
    assert line == "::error file=a%2Cb%3Ac.yml,line=3::bad%0A::add-mask::x%25"
    out = tmp_path / "out"
    write_outputs(out, {"cluster": "x\nscore=1"})
    assert parse_outputs(out.read_text()) == {"cluster": "x\nscore=1"}


async def test_missing_runner_variables_are_a_clear_error(
        runner: Runner, tmp_path: Path) -> None:
    payload = copy.deepcopy(real_payload("opened", number=1, **RESET_HANG))
    step = await runner.step("issues", payload, data_dir=tmp_path / "state",
                             extra={"INPUT_TOKEN": "", "GITHUB_TOKEN": ""})
    assert step.code == 2
    assert "::error::Dejafix: no token" in step.stdout


def test_action_yml_passes_inputs_through_the_environment_only() -> None:
    import yaml

    action = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
    assert action["runs"]["using"] == "composite"
    assert set(action["inputs"]) == {"token", "config", "mode", "data-dir"}
    assert action["inputs"]["token"]["default"] == "${{ github.token }}"
    assert all(spec.get("description") for spec in action["inputs"].values())
    assert set(action["outputs"]) == {"outcome", "cluster", "score", "comment-url"}
    for name, spec in action["outputs"].items():
        assert spec["value"] == f"${{{{ steps.dejafix.outputs.{name} }}}}"
    steps = {s.get("id"): s for s in action["runs"]["steps"]}
    run = steps["dejafix"]
    assert run["env"]["INPUT_TOKEN"] == "${{ inputs.token }}"
    assert run["env"]["DEJAFIX_DATA_DIR"] == "${{ inputs.data-dir }}"
    # An expression inside a script is pasted into it before the shell reads it: inputs and
    # paths reach the scripts as environment variables, never as ${{ }} in `run:`.
    for step in action["runs"]["steps"]:
        assert "${{" not in step.get("run", "")
    assert "dejafix\" action" in run["run"]


async def test_a_scheduled_run_backfills_and_the_next_issue_uses_it(
        runner: Runner, tmp_path: Path) -> None:
    seed_history(runner.fake)
    runner.fake.pulls[LEARN_REPO] = [
        {"number": 50, "title": "fix(exporter): bound flush_queue with a timeout",
         "body": "Fixes #10", "merged_at": "2026-01-09T12:00:00Z"}]
    state = tmp_path / "state"
    # A schedule's payload names no repository: the runner's GITHUB_REPOSITORY does.
    schedule = {"schedule": "17 3 * * *", "workflow": ".github/workflows/dejafix.yml"}
    step = await runner.step("schedule", schedule, data_dir=state, run="1",
                             extra={"GITHUB_REPOSITORY": LEARN_REPO})
    assert step.code == 0, step.stderr
    assert step.outputs["outcome"] == "backfilled"
    report = real_payload("opened", repo=LEARN_REPO, number=12, **NEW_REPORT)
    answered = await runner.step("issues", report, data_dir=state, run="2")
    assert answered.outputs["outcome"] == "commented", answered.stderr
    assert answered.outputs["cluster"] == "10"


async def test_commands_keep_their_permission_checks(runner: Runner, tmp_path: Path) -> None:
    from tests.samples import comment_payload

    known_bugs(runner)
    state = tmp_path / "state"
    opened = real_payload("opened", number=1, **RESET_HANG)
    author = opened["issue"]["user"]["login"]
    assert (await runner.step("issues", opened, data_dir=state, run="1")
            ).outputs["outcome"] == "commented"
    original = runner.fake.comments[(REPO.lower(), 1)][0]["body"]

    def said(login: str) -> dict[str, Any]:
        payload = comment_payload("/dejafix not-this", login=login, number=1, author=author,
                                  issue=dict(RESET_HANG))
        payload.pop("installation")
        return payload

    stranger = await runner.step("issue_comment", said("passer-by"), data_dir=state, run="2")
    assert stranger.code == 0, stranger.stderr
    said_to_stranger = runner.fake.comments[(REPO.lower(), 1)]
    assert said_to_stranger[0]["body"] == original
    assert "needs" in said_to_stranger[1]["body"]  # the refusal, as the App says it
    reporter = await runner.step("issue_comment", said(author), data_dir=state, run="3")
    assert reporter.code == 0, reporter.stderr
    assert runner.fake.comments[(REPO.lower(), 1)][0]["body"] != original
    # Dismissed, in the store of the next run: never suggested on this issue again.
    again = await runner.step("issues", opened, data_dir=state, run="4")
    assert again.outputs["outcome"] == "silent"
    assert "dismissed" in runner.fake.comments[(REPO.lower(), 1)][0]["body"]
    assert len(runner.fake.calls("POST", COMMENTS)) == 2  # the answer and the refusal


def test_the_documented_workflow_carries_the_state_and_runs_one_at_a_time() -> None:
    import re

    import yaml

    text = (ROOT / "docs" / "action.md").read_text(encoding="utf-8")
    workflow = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", text, re.S)[0])
    events = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert set(events) == {"issues", "issue_comment", "pull_request_target", "schedule",
                           "workflow_dispatch"}
    assert workflow["permissions"] == {"contents": "read", "issues": "write",
                                       "pull-requests": "read"}
    # On the job: a run whose job is skipped never takes the one pending slot.
    assert "concurrency" not in workflow
    assert workflow["jobs"]["dejafix"]["concurrency"] == {
        "group": "dejafix-${{ github.repository }}", "cancel-in-progress": False}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'concurrency: {group: "dejafix-${{ github.repository }}"' in readme
    steps = workflow["jobs"]["dejafix"]["steps"]
    uses = [s.get("uses", "").split("@")[0] for s in steps]
    assert uses.index("actions/checkout") < uses.index("actions/cache/restore") \
        < uses.index("OWNER/dejafix") < uses.index("actions/cache/save")
    restore = steps[uses.index("actions/cache/restore")]["with"]
    save = steps[uses.index("actions/cache/save")]
    assert save["if"] == "always()" and save["with"]["key"] == restore["key"]
    assert "github.run_id" in restore["key"] and restore["key"].startswith(
        restore["restore-keys"])
    run = steps[uses.index("OWNER/dejafix")]["with"]
    assert run["data-dir"] == restore["path"] == save["with"]["path"]
    assert run["mode"] == "shadow"


async def test_a_bad_mode_input_is_refused_before_anything_is_read(
        runner: Runner, tmp_path: Path) -> None:
    step = await runner.step("issues", real_payload("opened", number=1, **RESET_HANG),
                             data_dir=tmp_path / "state", extra={"INPUT_MODE": "loud\n::x"})
    assert step.code == 2
    assert step.stdout.splitlines()[0].startswith(
        "::error::Dejafix: input mode: 'loud\\n::x' is not a mode")
    assert not any(line.startswith("::x") for line in step.stdout.splitlines())
    assert runner.fake.requests == []
