"""Commands in issue comments: maintainers and reporters correct Dejafix, confirm it, re-run it,
and lift its pause. Every command gets an answer (an edited comment or one short reply); nothing
a person writes can crash the handler or make the bot ping anyone."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import gidgethub
from gidgethub.routing import Router
from gidgethub.sansio import Event
from pydantic import ValidationError

from bot.clusters.learning import add_duplicate
from bot.clusters.models import Cluster
from bot.features import guardrails
from bot.features.comment_writer import OwnComment, write_comment
from bot.features.context import Context
from bot.features.known_fix import answer_issue
from bot.github.client import delivery_kind
from bot.github.payloads import Issue, User
from bot.metrics import current_metrics
from bot.render.comment import code, neutralise, render_confirmed, render_dismissed
from bot.repo_config import RepoConfig, RepoConfigError

log = logging.getLogger("dejafix.commands")
router = Router()

REPLY_MARKER = "<!-- dejafix:reply -->"
# Roles that may correct the bot for everyone (GitHub's role_name values).
TRIAGE_ROLES = frozenset({"triage", "write", "maintain", "admin"})
# A comment with more than this many commands gets answers for the first ones only.
MAX_COMMANDS = 3

_COMMAND = re.compile(r"^ {0,3}/dejafix(?![\w-])[ \t]*(?P<rest>[^\n]*)$",
                      re.IGNORECASE | re.MULTILINE)
# Possessive runs: giving back part of a fence or of its line never lets a fence match, and
# trying each shorter length made one unbroken line of backticks cost n² steps.
_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}+|~{3,}+)[^\n]*+\n.*?"
                    r"(?:^ {0,3}(?P=fence)[`~]*+[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
_QUOTE = re.compile(r"^ {0,3}>[^\n]*$", re.MULTILINE)
_BACKTICKS = re.compile(r"`+")
# GitHub refuses comments longer than this; parse_commands reads no more, so a comment from
# elsewhere (a replayed or forged delivery) costs no more than the longest real one.
MAX_BODY_CHARS = 65536
_HTML_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.DOTALL)
_TARGET = re.compile(r"^#?(?P<id>[A-Za-z0-9][\w.-]{0,99})$")

HELP = "\n".join([
    "**Dejafix commands** (write one at the start of a line in a comment on the issue):",
    "",
    "| command | who | what it does |",
    "|---|---|---|",
    "| `/dejafix not-this` | the issue's author, triage or write access | dismisses the "
    "suggestion: the comment says so, the label goes, and it is never suggested on this issue "
    "again |",
    "| `/dejafix same-as #N` | triage or write access | records this issue as another report "
    "of the bug of #N (an issue, PR or cluster id) |",
    "| `/dejafix recheck` | the issue's author, triage or write access | matches the issue "
    "again now |",
    "| `/dejafix resume` | triage or write access | lifts an automatic pause (in the issue that "
    "announced it) |",
    "| `/dejafix help` | anyone | this list |",
    "",
    "Commands inside quotes or code are ignored.",
])


@dataclass(frozen=True)
class Command:
    name: str
    args: list[str]
    raw: str


def strip_code_spans(text: str) -> str:
    """``text`` without its inline code spans: a whole run of backticks closed by the next whole
    run of the same length on the same line (spans never cross a line here).

    One pass over the runs: the regex it replaces tried every run against every later one and
    took seconds on one long run of backticks."""
    return "\n".join(_strip_line_spans(line) if "`" in line else line
                     for line in text.split("\n"))


def _strip_line_spans(line: str) -> str:
    runs = [m.span() for m in _BACKTICKS.finditer(line)]
    # For each run, the index of the next run of the same length, found right to left.
    closer: list[int | None] = [None] * len(runs)
    seen: dict[int, int] = {}
    for i in range(len(runs) - 1, -1, -1):
        length = runs[i][1] - runs[i][0]
        closer[i] = seen.get(length)
        seen[length] = i
    kept: list[str] = []
    last = 0
    i = 0
    while i < len(runs):
        j = closer[i]
        if j is None:
            i += 1  # an opener without a closer is plain text; the next run may open a span
            continue
        kept.append(line[last:runs[i][0]])
        last = runs[j][1]
        i = j + 1
    kept.append(line[last:])
    return "".join(kept)


def parse_commands(body: str | None) -> list[Command]:
    """The commands in a comment, in order: quoted lines, code blocks, code spans and HTML
    comments do not count."""
    text = (body or "")[:MAX_BODY_CHARS].replace("\r\n", "\n").replace("\r", "\n")
    text = _HTML_COMMENT.sub("", text)
    text = _FENCE.sub("", text)
    text = _QUOTE.sub("", text)
    text = strip_code_spans(text)
    found: list[Command] = []
    for m in _COMMAND.finditer(text):
        words = m.group("rest").split()
        name = words[0].lower() if words else "help"
        found.append(Command(name, words[1:], " ".join(["/dejafix", *words])))
    return found


class _Caller:
    """Who wrote the command, with their role looked up at most once."""

    def __init__(self, ctx: Context, login: str, issue_author: str) -> None:
        self.ctx = ctx
        self.login = login
        self.is_author = login.lower() == issue_author.lower()
        self._role: str | None = None
        self._looked = False

    async def role(self) -> str | None:
        if not self._looked:
            self._looked = True
            try:
                self._role = await self.ctx.repo.collaborator_permission(self.login)
            except gidgethub.BadRequest as exc:
                # No access to the permission API (a 403): nobody but the author may act.
                log.warning("delivery %s: %s: permission of %s unknown (%s)",
                            self.ctx.delivery_id, self.ctx.repo_name, self.login,
                            exc.status_code)
                self._role = None
        return self._role

    async def can_triage(self) -> bool:
        return await self.role() in TRIAGE_ROLES

    async def can_triage_or_is_author(self) -> bool:
        return self.is_author or await self.can_triage()


async def reply(ctx: Context, number: int, text: str) -> None:
    await ctx.repo.create_comment(number, f"{REPLY_MARKER}\n{text}\n")


def _denied(command: Command, who: str) -> str:
    return f"Sorry, {code(command.raw)} needs {who}. `/dejafix help` lists the commands."


async def _config(ctx: Context) -> RepoConfig | None:
    try:
        return await ctx.repo_config()
    except RepoConfigError:
        return None


async def _indexed(ctx: Context, public_id: str | None = None, kind: str | None = None,
                   number: int | None = None) -> Cluster | None:
    """A cluster of this repository in the live index, by id or by member."""
    # The index looks it up; scanning clusters() would rebuild every cluster of the repository.
    index = await ctx.services.index.view([ctx.repo_name])
    return index.find(ctx.repo_name, public_id=public_id, kind=kind, number=number)


async def find_cluster(ctx: Context, target: str) -> Cluster | None:
    """The cluster ``#N`` names: a cluster id first, else the cluster with issue or PR N."""
    store = ctx.services.store
    learned = await asyncio.to_thread(store.learned_clusters, ctx.repo_name)
    for cluster in learned:
        if cluster.public_id == target:
            return cluster
    found = await _indexed(ctx, public_id=target)
    if found is not None:
        return found
    if not target.isdigit():
        return None
    number = int(target)
    for kind in ("issue", "pr"):
        found = await asyncio.to_thread(store.find_learned, ctx.repo_name, kind, number)
        if found is None:
            found = await _indexed(ctx, kind=kind, number=number)
        if found is not None:
            return found
    return None


async def not_this(ctx: Context, issue: Issue, caller: _Caller, command: Command) -> None:
    number = issue.number
    if not await caller.can_triage_or_is_author():
        await reply(ctx, number, _denied(command, "the issue's author or triage or write access"))
        return
    store = ctx.services.store
    record = await asyncio.to_thread(store.get_comment, ctx.repo_name, number)
    if record is None or record.cluster is None:
        await reply(ctx, number, "There is no Dejafix suggestion on this issue to dismiss.")
        return
    feedback = await asyncio.to_thread(store.feedback_for, ctx.repo_name, number)
    if feedback.get(record.cluster) == "dismissed":
        await reply(ctx, number, f"The suggestion (cluster {code(record.cluster)}) was already "
                                 "dismissed; Dejafix will not suggest it here again.")
        return
    await asyncio.to_thread(store.record_feedback, ctx.repo_name, number, record.cluster,
                            "dismissed", caller.login)
    if (metrics := current_metrics()) is not None:
        metrics.dismissals.inc()
    cluster = await _indexed(ctx, public_id=record.cluster)
    body = render_dismissed(cluster, record.cluster, issue_repo=ctx.repo_name, by=caller.login)
    # A comment deleted since is not posted again: the dismissal stands without it.
    await write_comment(ctx, number, body, cluster=record.cluster, score=record.score,
                        found=OwnComment(record.comment_id, record), always_edit=True,
                        repost_when_gone=False, log=log)
    config = await _config(ctx)
    if config is None:
        return
    if config.label:
        # Not checked against the payload's labels, which may predate ours; removing an absent
        # label is a harmless 404.
        await ctx.repo.remove_label(number, config.label)
    await guardrails.after_dismissal(ctx, config)
    log.info("delivery %s: %s#%s cluster %s dismissed by %s", ctx.delivery_id, ctx.repo_name,
             number, record.cluster, caller.login)


async def same_as(ctx: Context, issue: Issue, caller: _Caller, command: Command,
                  raw_issue: dict[str, Any]) -> None:
    number = issue.number
    if not await caller.can_triage():
        await reply(ctx, number, _denied(command, "triage or write access"))
        return
    target = command.args[0] if command.args else ""
    m = _TARGET.match(target)
    if m is None:
        await reply(ctx, number, "Usage: `/dejafix same-as #N`, where N is an issue or pull "
                                 "request of the known bug (or its cluster id).")
        return
    cluster = await find_cluster(ctx, m.group("id"))
    if cluster is None:
        await reply(ctx, number, f"Dejafix knows no bug with {code(target)} among its reports "
                                 "in this repository, so nothing was recorded.")
        return
    store = ctx.services.store
    updated = add_duplicate(cluster, {**raw_issue, "number": number})
    if updated is not cluster:
        await asyncio.to_thread(store.put_learned, updated)
        await ctx.services.index.learned_changed(ctx.repo_name)
    await asyncio.to_thread(store.record_feedback, ctx.repo_name, number, cluster.public_id,
                            "confirmed", caller.login)
    record = await asyncio.to_thread(store.get_comment, ctx.repo_name, number)
    body = render_confirmed(updated, issue_repo=ctx.repo_name, by=caller.login)
    # Our comment (by the ledger, else looked for by its marker) says so, or a new one does,
    # outside the daily cap: a maintainer asked. A suggestion keeps its score (it stays in the
    # dismissal window); a comment that only carries a maintainer's word has none.
    await write_comment(ctx, number, body, cluster=cluster.public_id,
                        score=record.score if record is not None else None,
                        found=OwnComment.of(record), always_edit=True, log=log)
    log.info("delivery %s: %s#%s confirmed as cluster %s by %s", ctx.delivery_id,
             ctx.repo_name, number, cluster.public_id, caller.login)


async def recheck(ctx: Context, issue: Issue, caller: _Caller, command: Command) -> None:
    number = issue.number
    if not await caller.can_triage_or_is_author():
        await reply(ctx, number, _denied(command, "the issue's author or triage or write access"))
        return
    fresh = await ctx.repo.get_issue(number)
    current = issue
    if fresh is not None:
        try:
            current = Issue.model_validate(fresh)
        except ValidationError:
            current = issue
    outcome = await answer_issue(ctx, current, User(login=caller.login, type="User"))
    if outcome.action in ("commented", "edited"):
        return  # the comment is the answer
    if outcome.action == "unchanged":
        text = "Rechecked: the suggestion above still stands."
    elif outcome.action == "silent":
        text = "Rechecked: no known fixed bug matches this issue closely enough."
    else:
        text = f"Rechecked: nothing to do ({neutralise(outcome.reason)})."
    await reply(ctx, number, text)


async def resume(ctx: Context, issue: Issue, caller: _Caller, command: Command) -> None:
    number = issue.number
    if not await caller.can_triage():
        await reply(ctx, number, _denied(command, "triage or write access"))
        return
    store = ctx.services.store
    pause = await asyncio.to_thread(store.get_pause, ctx.repo_name)
    if pause is None or not pause.paused:
        await reply(ctx, number, "Dejafix is not paused in this repository.")
        return
    if pause.issue is not None and pause.issue != number:
        await reply(ctx, number, f"Please say `/dejafix resume` in #{pause.issue}, where the "
                                 "pause was announced.")
        return
    await asyncio.to_thread(store.resume, ctx.repo_name, caller.login)
    log.info("delivery %s: %s resumed by %s", ctx.delivery_id, ctx.repo_name, caller.login)
    await reply(ctx, number, f"Resumed by {code(caller.login)}: Dejafix comments on new issues "
                             "again, and measures the dismissal rate afresh from now.")


@router.register("issue_comment", action="created")
async def on_issue_comment(event: Event, ctx: Context) -> None:
    data = event.data
    comment = data.get("comment")
    raw_issue = data.get("issue")
    if not isinstance(comment, dict) or not isinstance(raw_issue, dict):
        return
    user = comment.get("user")
    if not isinstance(user, dict):
        return
    login = str(user.get("login") or "")
    slug = ctx.services.app_slug
    if not login or user.get("type") == "Bot" or login.lower().endswith("[bot]") or \
            (slug and login == f"{slug}[bot]"):
        return  # bots, our own replies included, do not command Dejafix
    body = comment.get("body")
    commands = parse_commands(body if isinstance(body, str) else None)
    if not commands:
        return
    delivery_kind("comment_command")
    try:
        issue = Issue.model_validate(raw_issue)
    except ValidationError:
        log.warning("delivery %s: issue_comment without a usable issue, skipped",
                    ctx.delivery_id)
        return
    caller = _Caller(ctx, login, issue.user.login)
    for command in commands[:MAX_COMMANDS]:
        log.info("delivery %s: %s#%s %s by %s", ctx.delivery_id, ctx.repo_name, issue.number,
                 command.raw[:100], login)
        if command.name == "help":
            await reply(ctx, issue.number, HELP)
        elif issue.is_pull_request:
            await reply(ctx, issue.number, "Dejafix answers issues, not pull requests; "
                                           f"{code(command.raw)} does nothing here.")
        elif command.name == "not-this":
            await not_this(ctx, issue, caller, command)
        elif command.name == "same-as":
            await same_as(ctx, issue, caller, command, raw_issue)
        elif command.name == "recheck":
            await recheck(ctx, issue, caller, command)
        elif command.name == "resume":
            await resume(ctx, issue, caller, command)
        else:
            await reply(ctx, issue.number, f"Dejafix does not know {code(command.raw)}. "
                                           "`/dejafix help` lists the commands.")
