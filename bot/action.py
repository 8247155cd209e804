"""``python -m bot action``: Dejafix as a step of a GitHub Actions workflow, no server.

The runner hands the step one event (``GITHUB_EVENT_NAME``, the payload at
``GITHUB_EVENT_PATH``); it goes through the same feature routers as a webhook delivery does in
the App (``bot.jobs.dispatch``), with a Context whose client authenticates with the workflow's
token instead of an installation token. ``schedule`` and ``workflow_dispatch`` run the
incremental backfill. State (learned clusters, the comment ledger, the daily cap, the pause)
lives in the SQLite store under ``DEJAFIX_DATA_DIR``, which the workflow restores and saves
with the runner's cache (docs/action.md). The repository's config and its ``clusters:`` are
read from the checkout (``GITHUB_WORKSPACE``).

Results go where a workflow reads them: ``GITHUB_OUTPUT`` (outcome, cluster, score,
comment-url), the step summary, and workflow-command annotations for config and cluster-file
errors (the job still succeeds: a broken config is the repository's to fix, not a failed
run)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

LOG = logging.getLogger("dejafix.action")

# Who the workflow token posts as: the Action's own comments are found by the marker and this
# author (``comment_writer.find_own_comment``).
ACTIONS_SLUG = "github-actions"
ISSUE_ACTIONS = ("opened", "edited", "reopened")
OUTCOMES = ("commented", "edited", "unchanged", "labelled", "shadow", "silent", "skipped")
DEFAULT_DATA_DIR = ".dejafix"
PR_EVENT = "pull_request"
# How far back a run looks for issues whose own run was cancelled, and how many it answers.
CATCH_UP_SECONDS = 24 * 3600.0
CATCH_UP_MAX = 10
CATCH_UP_PAGES = 3


class ActionError(Exception):
    """The step cannot run at all (a runner variable missing, an unreadable event file)."""


@dataclass(frozen=True)
class RunnerEnv:
    """What the runner gives every step, and the action's inputs."""

    event_name: str
    event_path: Path
    repository: str
    api_url: str
    server_url: str
    workspace: Path | None
    step_summary: Path | None
    output: Path | None
    token: str = field(repr=False)
    config_path: str
    mode: str | None
    data_dir: Path
    run_id: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunnerEnv:
        env = os.environ if environ is None else environ

        def get(name: str) -> str:
            return (env.get(name) or "").strip()

        missing = [n for n in ("GITHUB_EVENT_NAME", "GITHUB_EVENT_PATH", "GITHUB_REPOSITORY")
                   if not get(n)]
        if missing:
            raise ActionError(f"{', '.join(missing)} not set: `dejafix action` runs as a step of "
                              "a GitHub Actions workflow")
        token = get("INPUT_TOKEN") or get("GITHUB_TOKEN")
        if not token:
            raise ActionError("no token: give the action `token` (default: the workflow's "
                              "github.token) or set GITHUB_TOKEN")
        mode = get("INPUT_MODE") or None
        if mode is not None:
            from pydantic import ValidationError

            from bot.repo_config import RepoConfig

            # Whatever the file's `mode:` takes, the input takes.
            try:
                RepoConfig.model_validate({"mode": mode})
            except ValidationError:
                raise ActionError(f"input mode: {mode[:20]!r} is not a mode of "
                                  ".github/dejafix.yml (comment, shadow)") from None
        workspace = Path(get("GITHUB_WORKSPACE")) if get("GITHUB_WORKSPACE") else None
        data_dir = Path(get("DEJAFIX_DATA_DIR") or DEFAULT_DATA_DIR)
        if not data_dir.is_absolute() and workspace is not None:
            data_dir = workspace / data_dir
        return cls(
            event_name=get("GITHUB_EVENT_NAME"),
            event_path=Path(get("GITHUB_EVENT_PATH")),
            repository=get("GITHUB_REPOSITORY"),
            api_url=(get("GITHUB_API_URL") or "https://api.github.com").rstrip("/"),
            server_url=(get("GITHUB_SERVER_URL") or "https://github.com").rstrip("/"),
            workspace=workspace,
            step_summary=Path(get("GITHUB_STEP_SUMMARY")) if get("GITHUB_STEP_SUMMARY") else None,
            output=Path(get("GITHUB_OUTPUT")) if get("GITHUB_OUTPUT") else None,
            token=token,
            config_path=get("INPUT_CONFIG") or ".github/dejafix.yml",
            mode=mode,
            data_dir=data_dir,
            run_id=get("GITHUB_RUN_ID") or "local",
        )


# --- workflow commands ----------------------------------------------------------------------------

def escape_data(text: str) -> str:
    """A workflow command's message: a newline in it would start a line the runner reads as a
    command of its own (text from a config file or an issue must never do that)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotation(level: str, message: str, *, file: str | None = None,
               line: int | None = None, title: str | None = None) -> str:
    props = []
    if file:
        props.append(f"file={escape_property(file)}")
    if line:
        props.append(f"line={int(line)}")
    if title:
        props.append(f"title={escape_property(title)}")
    return f"::{level}{' ' + ','.join(props) if props else ''}::{escape_data(message)}"


class _OneLine(logging.Formatter):
    """Every log line starts with our own prefix: a newline inside a message (an exception's
    text, a name from a payload) is shown escaped, so it cannot open a workflow command."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return self.inner.format(record).replace("\r", "\\r").replace("\n", "\\n")


def _flatten_log_lines() -> None:
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _OneLine):
            handler.setFormatter(_OneLine(handler.formatter or logging.Formatter()))


@contextmanager
def group(out: TextIO, title: str) -> Iterator[None]:
    out.write(f"::group::{escape_data(title)}\n")
    out.flush()
    try:
        yield
    finally:
        sys.stderr.flush()
        out.write("::endgroup::\n")
        out.flush()


def write_outputs(path: Path | None, values: Mapping[str, str]) -> None:
    """``name<<DELIMITER`` blocks: a value can never close its block early or add an output
    (the delimiter is random and checked against the value)."""
    if path is None:
        return
    with path.open("a", encoding="utf-8") as out:
        for name, value in values.items():
            delimiter = f"dejafix_{secrets.token_hex(8)}"
            assert delimiter not in value
            out.write(f"{name}<<{delimiter}\n{value}\n{delimiter}\n")


# --- the run --------------------------------------------------------------------------------------

@dataclass
class Result:
    """What the step did, for its outputs and its summary."""

    outcome: str = ""
    reason: str = ""
    issue: int | None = None
    cluster: str | None = None
    score: float | None = None
    comment_url: str | None = None
    body: str | None = None
    evidence: str | None = None
    notes: list[str] = field(default_factory=list)

    def outputs(self) -> dict[str, str]:
        return {"outcome": self.outcome, "cluster": self.cluster or "",
                "score": f"{self.score:.3f}" if self.score is not None else "",
                "comment-url": self.comment_url or ""}


def _read_event(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ActionError(f"cannot read the event payload {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(data, dict):
        raise ActionError(f"the event payload {path} is not a JSON object")
    return data


def _inside(root: Path, relative: str) -> Path | None:
    """``relative`` under ``root``, or None when it resolves outside (a symlink out of the
    checkout included)."""
    base = root.resolve()
    target = (base / relative).resolve()
    return target if target == base or base in target.parents else None


class ActionRun:
    def __init__(self, env: RunnerEnv, out: TextIO) -> None:
        self.env = env
        self.out = out
        self.result = Result()

    def command(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    # -- config from the checkout ----------------------------------------------------------------
    def _config_text(self) -> str | None:
        """The config file from the checkout; None when there is no checkout or no file (the
        default branch's file is then read through the API, as the App does)."""
        if self.env.workspace is None:
            return None
        path = _inside(self.env.workspace, self.env.config_path)
        if path is None:
            self.command(annotation("error", f"input config: {self.env.config_path} is outside "
                                    "the checkout"))
            return None
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self.command(annotation("error", f"cannot read: {exc}", file=self.env.config_path))
            return None

    def annotate_config(self, exc: Exception) -> None:
        from bot.repo_config import RepoConfigError

        if not isinstance(exc, RepoConfigError):
            self.command(annotation("error", str(exc), file=self.env.config_path))
            return
        for problem in exc.problems:
            # Problems of an ``_extends`` base are shown on that line of this file.
            own = problem.source.endswith(self.env.config_path)
            key = f"{problem.key_path}: " if problem.key_path else ""
            where = "" if own else f"{problem.source}: "
            self.command(annotation("error", f"{where}{key}{problem.message}",
                                    file=self.env.config_path, line=problem.line,
                                    title="Dejafix config"))

    async def repo_clusters(self, store: Any, repo: str, entries: list[str], *,
                            sync: bool = True) -> Path:
        """The repository's ``clusters:`` read as the App reads them (the same checks, the
        same store rows), from the checkout; feeds fetched conditionally. Every problem is an
        annotation on its file and line. Returns the folder the index reads."""
        from bot.clusters.sources import is_feed
        from bot.features.repo_clusters import CheckoutReader, shown_entry, sync_repo
        from bot.features.repo_sources import FOLDER, materialise

        folder = self.env.data_dir / FOLDER
        if not sync:
            await asyncio.to_thread(materialise, store, folder)
            return folder
        reader = CheckoutReader(self.env.workspace) if self.env.workspace is not None else None
        if entries and reader is None and any(not is_feed(e) for e in entries):
            self.command(annotation("warning", "clusters: the repository is not checked out "
                                    "(add actions/checkout before Dejafix); its cluster files "
                                    "are not read", file=self.env.config_path))
        # A run sees its checkout as it is: every file entry is read again (no request), every
        # feed asked whether it changed (its ETag, from the store the last run saved).
        done = await sync_repo(store, repo, entries, reader, private_feeds=True,
                               force_files=True, force_feeds=True)
        base = self.env.workspace.resolve() if self.env.workspace is not None else None
        for synced in done:
            if synced.outcome == "failed":
                self.command(annotation("error", f"clusters: {shown_entry(synced.entry)}: "
                                        f"{synced.error}; its last good version stays",
                                        file=self.env.config_path))
            for problem in synced.problems:
                what = f"{problem.field + ': ' if problem.field else ''}{problem.message}"
                if is_feed(synced.entry):
                    # A feed's line is not a line of any file here: named in the message, on
                    # the config file that lists the feed.
                    where = f"{shown_entry(synced.entry)}" + (f":{problem.line}" if problem.line
                                                         else "")
                    self.command(annotation(problem.level, f"clusters: {where}: {what}",
                                            file=self.env.config_path,
                                            title="Dejafix cluster feed"))
                    continue
                file = problem.path
                if base is not None:
                    with suppress(ValueError, OSError):
                        file = str((base / problem.path).resolve().relative_to(base))
                self.command(annotation(problem.level, what, file=file,
                                        line=problem.line or None,
                                        title="Dejafix cluster file"))
        kept = sum(s.clusters for s in done if s.entry in entries)
        if entries:
            self.result.notes.append(f"{kept} cluster(s) from "
                                     f"{', '.join(shown_entry(e) for e in entries)}")
        await asyncio.to_thread(materialise, store, folder)
        return folder

    # -- running ---------------------------------------------------------------------------------
    async def run(self) -> int:
        import aiohttp
        import cachetools

        from bot.db import open_store
        from bot.features.context import Context, Services, resolve_config_text
        from bot.features.repo_sources import RepoSources
        from bot.github.app import GitHubApp
        from bot.github.client import USER_AGENT, RepoClient, RetryingGitHubAPI
        from bot.matching.builds import IndexDir
        from bot.matching.index import IndexHolder
        from bot.matching.repo_indexes import RepoIndexes
        from bot.metrics import Metrics
        from bot.repo_config import RepoConfigError, read_config_file
        from bot.settings import ServiceConfig

        env = self.env
        payload = _read_event(env.event_path)
        repository = payload.get("repository")
        repo_name = (repository.get("full_name") if isinstance(repository, dict) else None) \
            or env.repository
        _prepare_data_dir(env.data_dir)
        store = await asyncio.to_thread(open_store, env.data_dir, None)
        try:
            async with aiohttp.ClientSession() as session:
                gh = RetryingGitHubAPI(session, USER_AGENT, oauth_token=env.token,
                                       base_url=env.api_url,
                                       cache=cachetools.LRUCache(maxsize=256))
                client = RepoClient(gh, repo_name)
                if env.event_name in ("schedule", "workflow_dispatch"):
                    return await self._backfill(client, store, repo_name)
                # No App identity: the workflow token is the only credential, and the
                # "no installation in the delivery" guard is for Apps.
                github = GitHubApp(session, base_url=env.api_url, app_id=None,
                                   private_key=None)
                text = self._config_text()
                config = None
                resolved = None
                if text is not None:
                    resolved = await resolve_config_text(client, repo_name, text)
                    if isinstance(resolved.result, RepoConfigError):
                        self.annotate_config(resolved.result)
                    else:
                        config = resolved.result
                        if env.mode is not None:
                            config = config.model_copy(update={"mode": env.mode})
                            resolved = type(resolved)(config, resolved.sources,
                                                      resolved.extends_line)
                elif env.mode is not None:
                    config = read_config_file("").config.model_copy(update={"mode": env.mode})
                # A broken config lists nothing it can be trusted for: the last run's
                # clusters stay as stored (the issue is skipped anyway).
                broken = resolved is not None and isinstance(resolved.result, RepoConfigError)
                folder = await self.repo_clusters(
                    store, repo_name, config.clusters if config is not None else [],
                    sync=not broken)
                learned = RepoIndexes(store.learned_state, store.learned_records,
                                      budget_bytes=256 << 20, root=IndexDir(None))
                index = IndexHolder([folder], learned=learned)
                await index.refresh(force=True)
                # As the App's: an upstream's own clusters: are read through the API (this
                # repository's were just read from the checkout, and are found up to date).
                # Private addresses only for this repository's own feeds (read above): an
                # upstream's config is a third party's, and the runner may be self-hosted.
                sources = RepoSources(folder, store, index, private_feeds=False)
                services = Services(config=ServiceConfig(cluster_paths=[]), store=store,
                                    github=github, index=index, app_slug=ACTIONS_SLUG,
                                    repo_sources=sources)
                # A re-run of the job is a new process whose ledger may be older than the
                # comment (a cache saved before the post, or evicted): attempt 2 makes the
                # known-fix answer look for its comment by the marker before posting.
                ctx = Context(delivery_id=f"run-{env.run_id}", repo_name=repo_name,
                              repo=client, services=services, payload=payload, attempt=2)
                if resolved is not None:
                    services.repo_configs[(ctx.installation_id, repo_name.lower())] = resolved
                elif config is not None:
                    services.repo_configs[(ctx.installation_id, repo_name.lower())] = \
                        type_resolved(config, repo_name)
                metrics = Metrics()
                return await self._dispatch(ctx, payload, metrics)
        finally:
            await asyncio.to_thread(store.close)

    async def _dispatch(self, ctx: Any, payload: dict[str, Any], metrics: Any) -> int:
        from gidgethub.sansio import Event

        from bot.jobs.dispatch import HandlerFailures, describe_error, dispatch, wants
        from bot.metrics import metrics_scope

        env = self.env
        action = payload.get("action")
        # ``pull_request_target`` is the same payload run in the base branch's context, whose
        # cache the next runs restore (a ``pull_request`` run saves into the pull request's).
        name = PR_EVENT if env.event_name == "pull_request_target" else env.event_name
        if not wants(name, payload):
            self.result.outcome = "skipped"
            self.result.reason = f"Dejafix does nothing on {env.event_name} {action or ''}"
            return 0
        event = Event(payload, event=name, delivery_id=ctx.delivery_id)
        try:
            with metrics_scope(metrics):
                await dispatch(event, ctx)
        except HandlerFailures as exc:
            for error in exc.errors:
                self.command(annotation("error", f"Dejafix: {describe_error(error)}"))
            self.result.outcome = "failed"
            return 1
        if env.event_name == "issues" and action in ISSUE_ACTIONS:
            await self._issue_result(ctx, payload, metrics)
            issue = payload.get("issue")
            number = issue.get("number") if isinstance(issue, dict) else None
            if isinstance(number, int):
                await asyncio.to_thread(_mark_handled, ctx.services.store, ctx.repo_name,
                                        [number])
        # Every run that got this far looks for the issues whose run was cancelled: a comment's
        # or a merged fix's run can take a pending issue run's place as well.
        await self._catch_up(ctx, payload)
        return 0

    async def _catch_up(self, ctx: Any, payload: dict[str, Any]) -> None:
        """Answer the issues opened lately whose own run never ran: GitHub keeps one pending
        run per concurrency group and cancels the one it replaces, so in a burst of three
        issues the middle one's run is cancelled; this run answers it. Only issues opened
        before this run's event (a newer one has its own run coming) and after Dejafix first
        ran here. A failure here is a warning: the event itself was handled, and the next run
        tries again."""
        from gidgethub.sansio import Event

        from bot.features.context import Context
        from bot.jobs.dispatch import HandlerFailures, dispatch
        from bot.metrics import Metrics, metrics_scope

        store = ctx.services.store
        repo = ctx.repo_name
        first, handled = await asyncio.to_thread(_handled, store, repo)
        since = max(first, time.time() - CATCH_UP_SECONDS)
        before = _event_time(payload)
        try:
            items = await self._recent_issues(ctx, since)
        except Exception as exc:
            LOG.warning("catch-up: open issues not listed (%s)", type(exc).__name__)
            return
        missed = sorted((i for i in items if "pull_request" not in i
                         and isinstance(i.get("number"), int) and i["number"] not in handled
                         and since <= _created(i) < before), key=_created)[:CATCH_UP_MAX]
        for issue in missed:  # oldest first, as they were opened
            synthetic = {"action": "opened", "issue": issue,
                         "repository": payload.get("repository"),
                         "sender": issue.get("user")}
            one = Context(delivery_id=f"{ctx.delivery_id}-catch-up-{issue['number']}",
                          repo_name=repo, repo=ctx.repo, services=ctx.services,
                          payload=synthetic, attempt=2)
            metrics = Metrics()
            try:
                with metrics_scope(metrics):
                    await dispatch(Event(synthetic, event="issues",
                                         delivery_id=one.delivery_id), one)
            except HandlerFailures as exc:
                self.command(annotation("warning", f"Dejafix: #{issue['number']}, whose run "
                                        f"was cancelled, not answered now: {exc}"))
                continue
            outcome = next((o for o in OUTCOMES if metrics.matches.value(outcome=o)),
                           "skipped")
            await asyncio.to_thread(_mark_handled, store, repo, [issue["number"]])
            self.result.notes.append(f"caught up #{issue['number']}, whose own run was "
                                     f"cancelled: {outcome}")

    async def _recent_issues(self, ctx: Any, since: float) -> list[dict[str, Any]]:
        """Open issues (and pull requests: the listing mixes them) newest first, page by page
        until one reaches back past ``since``."""
        found: list[dict[str, Any]] = []
        for page in range(1, CATCH_UP_PAGES + 1):
            items = await ctx.repo.page(
                "/repos/{+repo}/issues?state=open&sort=created&direction=desc"
                "&per_page={per_page}&page={page}", {"per_page": 100, "page": page})
            found.extend(items)
            if len(items) < 100 or min((_created(i) for i in items), default=0.0) < since:
                break
        return found

    async def _issue_result(self, ctx: Any, payload: dict[str, Any], metrics: Any) -> None:
        result = self.result
        issue = payload.get("issue") if isinstance(payload.get("issue"), dict) else {}
        number = issue.get("number") if isinstance(issue, dict) else None
        result.issue = number if isinstance(number, int) else None
        # The known-fix handler counts each answer by outcome; one issue, one count.
        done = [o for o in OUTCOMES if metrics.matches.value(outcome=o)]
        result.outcome = done[0] if done else "skipped"
        if not done:
            result.reason = "title and body unchanged" if payload.get("action") == "edited" \
                else "not answered"
        if result.issue is None:
            return
        store = ctx.services.store
        record = await asyncio.to_thread(store.get_comment, ctx.repo_name, result.issue)
        if result.outcome in ("commented", "edited", "unchanged") and record is not None:
            result.cluster, result.score = record.cluster, record.score
            result.comment_url = (f"{self.env.server_url}/{ctx.repo_name}/issues/"
                                  f"{result.issue}#issuecomment-{record.comment_id}")
        if result.outcome in ("commented", "edited", "unchanged", "shadow", "labelled"):
            found = await asyncio.to_thread(store.suggestions, ctx.repo_name, 200)
            mine = next((s for s in found if s.issue == result.issue), None)
            if mine is not None:
                result.body, result.evidence = mine.body, mine.evidence
                result.cluster = result.cluster or mine.cluster
                result.score = result.score if result.score is not None else mine.score

    async def _backfill(self, client: Any, store: Any, repo_name: str) -> int:
        from bot.features.backfill import Backfill

        summary = await Backfill(client, store, repo_name).run()
        self.result.outcome = "backfilled"
        self.result.notes.extend(summary.lines())
        return 0

    def summary(self) -> str:
        r = self.result
        env = self.env
        what = f"#{r.issue}" if r.issue is not None else env.event_name
        lines = [f"### Dejafix on {what}: {r.outcome or 'nothing to do'}", ""]
        if r.reason:
            lines += [f"Reason: {r.reason}", ""]
        if r.cluster:
            score = f" (score {r.score:.2f})" if r.score is not None else ""
            lines += [f"Known bug: cluster `{r.cluster}`{score}", ""]
        if r.comment_url:
            lines += [f"Comment: {r.comment_url}", ""]
        if r.body:
            heading = ("Shadow mode: the comment it would post (nothing was posted)"
                       if r.outcome == "shadow" else "The comment")
            lines += [f"**{heading}:**", "", "<details open><summary>comment</summary>", "",
                      _fenced(r.body), "", "</details>", ""]
        if r.evidence:
            lines += ["<details><summary>evidence</summary>", "",
                      _fenced(_pretty_json(r.evidence), "json"), "", "</details>", ""]
        lines += [f"- {note}" for note in r.notes]
        return "\n".join(lines).rstrip() + "\n"


# --- issues handled here, for the catch-up ---------------------------------------------------

def _handled_key(repo: str) -> str:
    return f"action:handled:{repo.lower()}"


def _handled(store: Any, repo: str) -> tuple[float, set[int]]:
    """When Dejafix first ran here (issues opened before are not its to answer) and the issues
    it handled in the last week."""
    raw = store.get_cursor(_handled_key(repo))
    try:
        data = json.loads(raw) if raw else {}
        first = float(data.get("first", 0.0))
        numbers = {int(n) for n in data.get("issues", {})}
    except (ValueError, TypeError, AttributeError):
        first, numbers = 0.0, set()
    return first, numbers


def _mark_handled(store: Any, repo: str, numbers: list[int]) -> None:
    raw = store.get_cursor(_handled_key(repo))
    now = time.time()
    try:
        data = json.loads(raw) if raw else {}
        issues = {str(k): float(v) for k, v in dict(data.get("issues", {})).items()}
        first = float(data.get("first", now))
    except (ValueError, TypeError, AttributeError):
        issues, first = {}, now
    issues.update({str(n): now for n in numbers})
    # A week is past any catch-up window; the set stays small.
    issues = {k: v for k, v in issues.items() if v > now - 7 * 86400}
    store.set_cursor(_handled_key(repo), json.dumps({"first": first, "issues": issues}))


def _created(issue: dict[str, Any]) -> float:
    from bot.github.payloads import iso_seconds

    return iso_seconds(issue.get("created_at")) or 0.0


def _event_time(payload: dict[str, Any]) -> float:
    """When this run's event happened: issues opened before it had their own runs before this
    one (cancelled or not); a newer one has its own run coming."""
    from bot.github.payloads import iso_seconds

    def part(key: str) -> dict[str, Any]:
        value = payload.get(key)
        return value if isinstance(value, dict) else {}

    issue, comment, pr = part("issue"), part("comment"), part("pull_request")
    stamp = issue.get("created_at") if payload.get("action") == "opened" else \
        comment.get("created_at") or pr.get("closed_at") or issue.get("updated_at")
    return iso_seconds(stamp) or time.time()


def type_resolved(config: Any, repo_name: str) -> Any:
    from bot.features.context import ResolvedConfig

    return ResolvedConfig(config, frozenset({repo_name.lower()}))


def _pretty_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def _fenced(text: str, lang: str = "markdown") -> str:
    """In a fence longer than any backtick run inside, so the issue's text cannot end it."""
    longest = run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _prepare_data_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ActionError(f"data-dir {path}: {exc.strerror or exc}") from None


def run_action(out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The ``action`` command: 0 unless the event could not be handled (a GitHub error, a
    runner variable missing). Config and cluster-file errors are annotations, not failures."""
    out = out or sys.stdout
    _flatten_log_lines()
    try:
        env = RunnerEnv.from_env(environ)
    except ActionError as exc:
        out.write(annotation("error", f"Dejafix: {exc}") + "\n")
        return 2
    run = ActionRun(env, out)
    code = 0
    with group(out, f"Dejafix: {env.event_name} on {env.repository}"):
        try:
            code = asyncio.run(run.run())
        except ActionError as exc:
            run.command(annotation("error", f"Dejafix: {exc}"))
            code = 2
        except Exception as exc:
            from bot.jobs.dispatch import describe_error

            LOG.debug("action failed", exc_info=exc)
            run.command(annotation("error", f"Dejafix: {describe_error(exc)}"))
            run.result.outcome = run.result.outcome or "failed"
            code = 1
    write_outputs(env.output, run.result.outputs())
    if env.step_summary is not None:
        with env.step_summary.open("a", encoding="utf-8") as summary:
            summary.write(run.summary())
    out.write(f"dejafix: {run.result.outcome or 'nothing to do'}"
              f"{' (cluster ' + run.result.cluster + ')' if run.result.cluster else ''}\n")
    out.flush()
    return code
