"""GitHub calls: the retry policy (``RetryingGitHubAPI``) and ``RepoClient``, the handful of
calls the features make on a repository (and its dry-run and offline variants). The App's
identity and tokens are in ``bot.github.app``."""

from __future__ import annotations

import base64
import contextvars
import http
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import aiohttp
import gidgethub
from gidgethub import sansio
from gidgethub.aiohttp import GitHubAPI

from bot.github.graphql import in_repo
from bot.metrics import Metrics, status_class

log = logging.getLogger("dejafix.github")

USER_AGENT = "dejafix"
# Calls that can be sent again without checking whether the first one happened: PATCH sets a
# comment's body to the same text twice. POST (a new comment) is not among them.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class RetryPolicy:
    """Retries inside one call. A job that still fails is retried later by the worker, which
    first looks for the comment a lost POST may have made."""

    attempts: int = 4
    base: float = 0.5
    cap: float = 20.0
    # A Retry-After longer than this is not slept through here: the job fails and the queue
    # retries it later, so a worker slot is not held for minutes.
    max_wait: float = 60.0

    def backoff(self, attempt: int) -> float:
        # Full jitter: many installations retrying together must not hit GitHub in step.
        return random.uniform(0.0, min(self.cap, self.base * 2 ** (attempt - 1)))


def rate_limit_wait(exc: gidgethub.HTTPException, now: float | None = None) -> float | None:
    """Seconds GitHub asks us to wait, when the error is a (primary or secondary) rate limit;
    None when it is not one (a 403 for missing permission, say)."""
    status = int(exc.status_code)
    if status not in (403, 429):
        return None
    headers = {k.lower(): v for k, v in (getattr(exc, "headers", None) or {}).items()}
    retry_after = headers.get("retry-after")
    if retry_after is not None:
        try:
            return max(0.0, float(retry_after))
        except ValueError:
            return 60.0
    if headers.get("x-ratelimit-remaining") == "0" and "x-ratelimit-reset" in headers:
        try:
            reset = float(headers["x-ratelimit-reset"])
        except ValueError:
            return 60.0
        return max(0.0, reset - (time.time() if now is None else now))
    return 1.0 if status == 429 else None


@dataclass
class CallTally:
    """The GitHub API calls one delivery made (``calls``; ``conditional`` of them answered 304,
    which GitHub does not count against the rate limit), and what kind of delivery it was, as
    the handler that ran it says (``opened_matched``, ``opened_silent``, ``edited``,
    ``comment_command``; else the event)."""

    kind: str
    calls: int = 0
    conditional: int = 0


# Set by the worker around each delivery; every request through RetryingGitHubAPI counts.
CALLS: contextvars.ContextVar[CallTally | None] = contextvars.ContextVar("dejafix_calls",
                                                                         default=None)


def delivery_kind(kind: str) -> None:
    """What the running delivery turned out to be, for the calls-per-delivery metric."""
    tally = CALLS.get()
    if tally is not None:
        tally.kind = kind


class RetryingGitHubAPI(GitHubAPI):
    """The retry policy, in one place (gidgethub's rate-limit hook plus transport errors)."""

    def __init__(self, *args: Any, retry: RetryPolicy | None = None,
                 metrics: Metrics | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry = retry or RetryPolicy()
        self.metrics = metrics

    async def _request(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes = b""
    ) -> tuple[int, Mapping[str, str], bytes]:
        attempt = 0
        while True:
            attempt += 1
            try:
                answer = await super()._request(method, url, headers, body)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._count("transport")
                # A timed-out POST may have been performed; only the job-level retry, which
                # looks first, may send it again.
                if method not in IDEMPOTENT or attempt >= self.retry.attempts:
                    raise
                delay = self.retry.backoff(attempt)
                log.warning("GitHub %s %s: %s; retry %d in %.1fs", method, _path(url),
                            type(exc).__name__ or "error", attempt, delay)
                self._count(None, "transport")
                await self.sleep(delay)
            else:
                tally = CALLS.get()
                if tally is not None:
                    tally.calls += 1
                    tally.conditional += int(answer[0] == 304)
                return answer

    async def get_raw(self, url: str, url_vars: Mapping[str, Any]) -> bytes:
        """GET ``url`` as raw bytes (``application/vnd.github.raw+json``), past the ETag cache;
        an error status raises as gidgethub's calls do."""
        filled = sansio.format_url(url, url_vars, base_url=self.base_url)
        headers = sansio.create_headers(self.requester, accept="application/vnd.github.raw+json",
                                        oauth_token=self.oauth_token)
        status, answer_headers, body = await self._request("GET", filled, headers)
        if status >= 300:
            sansio.decipher_response(status, answer_headers, body)  # raises for the status
            raise gidgethub.HTTPException(http.HTTPStatus(status))
        return body

    def _count(self, error: str | None, retry: str | None = None) -> None:
        if self.metrics is not None:
            if error is not None:
                self.metrics.github_errors.inc(status=error)
            if retry is not None:
                self.metrics.github_retries.inc(reason=retry)

    async def handle_rate_limit_error(
        self, *, method: str, url: str, exception: gidgethub.HTTPException, attempt: int
    ) -> bool:
        self._count(status_class(int(exception.status_code)))
        if attempt >= self.retry.attempts:
            return False
        wait = rate_limit_wait(exception)
        if wait is not None:
            # A rate-limited request was refused before it ran, so even a POST may be resent.
            if wait > self.retry.max_wait:
                return False
            delay = wait + self.retry.backoff(1)
            log.warning("GitHub %s %s: rate limited (%s); retry %d in %.1fs", method,
                        _path(url), exception.status_code, attempt, delay)
            self._count(None, "rate_limited")
            await self.sleep(delay)
            return True
        if isinstance(exception, gidgethub.GitHubBroken) and method in IDEMPOTENT:
            delay = self.retry.backoff(attempt)
            log.warning("GitHub %s %s: %s; retry %d in %.1fs", method, _path(url),
                        exception.status_code, attempt, delay)
            self._count(None, "server_error")
            await self.sleep(delay)
            return True
        return False


def graphql_url(base_url: str) -> str:
    """GraphQL lives beside the REST API: api.github.com/graphql, or HOST/api/graphql on GitHub
    Enterprise (whose REST base is HOST/api/v3)."""
    base = base_url.rstrip("/")
    if base.endswith("/api/v3"):
        return base[: -len("/v3")] + "/graphql"
    return base + "/graphql"


def _path(url: str) -> str:
    # Log the path only: a query string could carry something a log should not keep.
    return url.split("?", 1)[0]


# How a repository is shown: ``unknown`` is an answer that does not say it plainly (its
# reader decides which way to err).
Visibility = Literal["public", "internal", "private", "unknown"]


def repo_visibility(data: Any) -> Visibility:
    """A repository's visibility from its JSON (REST, or a webhook payload's ``repository``):
    ``private`` is GitHub's long-standing field, ``visibility`` tells internal from private.
    Fields that disagree, or are missing, are ``unknown``."""
    if not isinstance(data, dict) or not isinstance(data.get("private"), bool):
        return "unknown"
    shown = data.get("visibility")
    if data["private"] is False:
        return "public" if shown in (None, "public") else "unknown"
    if shown in (None, "private"):
        return "private"
    return "internal" if shown == "internal" else "unknown"


@dataclass(frozen=True)
class RepoFiles:
    """A repository's config file and issue templates, as one GraphQL query read them."""

    config: str | None  # None: no such file
    templates: list[tuple[str, str]]  # (path, text) of each file in the template folder


# One query for what a repository's first issue needs of its files: the config and every issue
# template (the REST API takes a call for each, and one for the folder).
_FILES_QUERY = (
    "query($owner:String!,$name:String!,$config:String!,$templates:String!){"
    "repository(owner:$owner,name:$name){"
    "config:object(expression:$config){...on Blob{text isTruncated isBinary}}"
    "templates:object(expression:$templates){...on Tree{entries{path type "
    "object{...on Blob{text isTruncated isBinary}}}}}}}")


def _blob_text(blob: Any) -> str | None:
    if not isinstance(blob, dict) or blob.get("isBinary") or blob.get("isTruncated"):
        raise ValueError("not a whole text file")
    text = blob.get("text")
    if not isinstance(text, str):
        raise ValueError("no text")
    return text


class RepoClient:
    """The calls the handlers make on one repository."""

    def __init__(self, gh: GitHubAPI, repo: str) -> None:
        self.gh = gh
        self.repo = repo

    async def read_file(self, path: str) -> str | None:
        """A text file from the default branch, or None when it does not exist."""
        return await self.read_file_from(self.repo, path)

    async def read_files(self, config_path: str, template_dir: str) -> RepoFiles | None:
        """The config file and the templates of the default branch in one GraphQL call; None
        where that is not possible (GraphQL unavailable, a file too large or binary for it):
        the caller reads them over REST."""
        owner, name = self.repo.split("/", 1)
        try:
            data = await self.gh.graphql(_FILES_QUERY, endpoint=graphql_url(self.gh.base_url),
                                         owner=owner, name=name, config=f"HEAD:{config_path}",
                                         templates=f"HEAD:{template_dir}")
            repository = data["repository"]
            config = repository.get("config")
            tree = repository.get("templates")
            templates = []
            for entry in (tree or {}).get("entries") or []:
                path = str(entry.get("path", ""))
                if entry.get("type") != "blob" or \
                        not path.lower().endswith((".md", ".yml", ".yaml")):
                    continue  # an image or other file beside the templates: not read
                try:
                    templates.append((path, _blob_text(entry.get("object")) or ""))
                except ValueError:
                    continue  # a binary or oversized "template": left out
            return RepoFiles(_blob_text(config) if config is not None else None, templates)
        except gidgethub.BadGraphQLRequest as exc:
            if exc.status_code in (401, 403):
                raise  # a refused token: the worker gets a new one and tries again
            reason = type(exc).__name__
        except (gidgethub.GitHubException, ValueError, KeyError, TypeError,
                AttributeError) as exc:
            # An outage shows again, and is reported, on the REST reads.
            reason = type(exc).__name__
        log.debug("%s: files not read over GraphQL (%s); reading them over REST", self.repo,
                  reason)
        return None

    async def list_dir(self, path: str) -> list[str]:
        """Paths of the files in a folder of the default branch (empty when it does not exist)."""
        try:
            data = await self.gh.getitem(
                "/repos/{+repo}/contents/{+path}", {"repo": self.repo, "path": path}
            )
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return []
            raise
        if not isinstance(data, list):
            return []
        return [str(e["path"]) for e in data if isinstance(e, dict) and e.get("type") == "file"]

    async def contents(self, path: str, ref: str | None = None
                       ) -> dict[str, Any] | list[Any] | None:
        """The contents API's answer for ``path`` on the default branch (or at ``ref``): a
        file (with its text when under 1 MB), a folder's listing, or None when it does not
        exist. Conditional (the ETag cache): asking again for an unchanged path costs no rate
        limit."""
        params: dict[str, Any] = {"repo": self.repo, "path": path}
        if ref:
            params["ref"] = ref
        try:
            data = await self.gh.getitem("/repos/{+repo}/contents/{+path}"
                                         + ("{?ref}" if ref else ""), params)
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return None
            raise
        return data if isinstance(data, dict | list) else None

    async def blob(self, sha: str) -> bytes:
        """A file's bytes by its blob sha, raw: never parsed as JSON on the loop nor kept in
        the ETag cache (a blob never changes; the caller bounds its size from the listing)."""
        if not isinstance(self.gh, RetryingGitHubAPI):
            raise TypeError("raw reads need the retrying client")
        return await self.gh.get_raw("/repos/{+repo}/git/blobs/{sha}",
                                     {"repo": self.repo, "sha": sha})

    async def get_issue(self, number: int) -> dict[str, Any] | None:
        try:
            data = await self.gh.getitem("/repos/{+repo}/issues/{number}",
                                         {"repo": self.repo, "number": number})
        except gidgethub.BadRequest as exc:
            if exc.status_code in (404, 410):
                return None
            raise
        return data if isinstance(data, dict) else None

    async def pr_files(self, number: int, limit: int = 3000) -> list[dict[str, Any]]:
        """The files a PR changed, with patches, across pages (GitHub lists at most 3000)."""
        url = "/repos/{+repo}/pulls/{number}/files?per_page=100"
        files: list[dict[str, Any]] = []
        async for item in self.gh.getiter(url, {"repo": self.repo, "number": number}):
            files.append(item)
            if len(files) >= limit:
                break
        return files

    async def closing_issue_numbers(self, number: int) -> list[int]:
        """Issues GitHub itself links as closed by the PR (closingIssuesReferences); empty where
        GraphQL is not available (some GitHub Enterprise versions, tests)."""
        owner, name = self.repo.split("/", 1)
        query = ("query($owner:String!,$name:String!,$number:Int!){repository(owner:$owner,"
                 "name:$name){pullRequest(number:$number){closingIssuesReferences(first:50)"
                 "{nodes{number repository{nameWithOwner}}}}}}")
        try:
            data = await self.gh.graphql(query, endpoint=graphql_url(self.gh.base_url),
                                         owner=owner, name=name, number=number)
        except (gidgethub.GitHubException, ValueError, KeyError) as exc:
            log.debug("%s#%s: closingIssuesReferences unavailable (%s)", self.repo, number,
                     type(exc).__name__)
            return []
        try:
            nodes = data["repository"]["pullRequest"]["closingIssuesReferences"]["nodes"]
            # GitHub links other repositories' issues too: their numbers name nothing here.
            return [int(n["number"]) for n in nodes if isinstance(n, dict)
                    and in_repo(n, self.repo)]
        except (KeyError, TypeError, ValueError):
            return []

    async def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        """One GraphQL query about this repository (``$owner`` and ``$name`` are filled in):
        its ``data``. Errors are gidgethub's (``QueryError`` holds GitHub's ``errors``)."""
        owner, name = self.repo.split("/", 1)
        data = await self.gh.graphql(query, endpoint=graphql_url(self.gh.base_url),
                                     owner=owner, name=name, **variables)
        if not isinstance(data, dict):
            raise gidgethub.GraphQLException("GraphQL answered no data object", data)
        return data

    async def page(self, url: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        """One page of a listing (the caller keeps the cursor, so a walk can resume)."""
        data = await self.gh.getitem(url, {"repo": self.repo, **params})
        return [item for item in data if isinstance(item, dict)] if isinstance(data, list) else []

    async def releases(self, repo: str | None = None) -> list[tuple[str, str]]:
        """``(tag, published_at)`` of the latest releases of ``repo`` (this repository when
        None): the first page of 100, newest first, drafts (never published) left out."""
        data = await self.gh.getitem("/repos/{+repo}/releases?per_page=100",
                                     {"repo": repo or self.repo})
        if not isinstance(data, list):
            return []
        return [(str(r["tag_name"]), str(r["published_at"])) for r in data
                if isinstance(r, dict) and r.get("tag_name") and r.get("published_at")
                and not r.get("draft")]

    async def visibility(self, repo: str) -> Visibility | None:
        """How ``repo`` is shown to this token (``GET /repos/{repo}``): ``public``,
        ``internal``, ``private``, or ``unknown`` when the answer does not say it plainly; None
        when GitHub hides it from this token (404, or 403 for a reason other than a rate
        limit): an installation token sees only its installation's repositories and public
        ones."""
        try:
            data = await self.gh.getitem("/repos/{+repo}", {"repo": repo})
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404 or \
                    (exc.status_code in (403, 451) and rate_limit_wait(exc) is None):
                return None
            raise
        return repo_visibility(data)

    def rate_remaining(self) -> tuple[int, float] | None:
        """Requests left in this token's budget and when it resets, from the last answer."""
        limit = self.gh.rate_limit
        if limit is None:
            return None
        return int(limit.remaining), float(limit.reset_datetime.timestamp())

    async def issue_comments(self, number: int) -> list[dict[str, Any]]:
        url = "/repos/{+repo}/issues/{number}/comments?per_page=100"
        return [c async for c in self.gh.getiter(url, {"repo": self.repo, "number": number})]

    async def create_comment(self, number: int, body: str) -> int:
        data = await self.gh.post(
            "/repos/{+repo}/issues/{number}/comments",
            {"repo": self.repo, "number": number},
            data={"body": body},
        )
        return int(data["id"])

    async def edit_comment(self, comment_id: int, body: str) -> None:
        await self.gh.patch(
            "/repos/{+repo}/issues/comments/{comment_id}",
            {"repo": self.repo, "comment_id": comment_id},
            data={"body": body},
        )

    async def add_labels(self, number: int, labels: list[str]) -> None:
        await self.gh.post(
            "/repos/{+repo}/issues/{number}/labels",
            {"repo": self.repo, "number": number},
            data={"labels": labels},
        )

    async def collaborator_permission(self, login: str) -> str | None:
        """The person's role on the repository: admin, maintain, write, triage, read or none.
        ``role_name`` first: the older ``permission`` field reports triage as read and maintain
        as write. A login GitHub does not know is "none"."""
        try:
            data = await self.gh.getitem(
                "/repos/{+repo}/collaborators/{login}/permission",
                {"repo": self.repo, "login": login},
            )
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return "none"
            raise
        if not isinstance(data, dict):
            return None
        role = data.get("role_name") or data.get("permission")
        return str(role).lower() if role else None

    async def remove_label(self, number: int, name: str) -> None:
        """Take a label off an issue; one that is not there (404) is fine."""
        try:
            await self.gh.delete(
                "/repos/{+repo}/issues/{number}/labels/{name}",
                {"repo": self.repo, "number": number, "name": name},
            )
        except gidgethub.BadRequest as exc:
            if exc.status_code != 404:
                raise

    async def create_issue(self, title: str, body: str) -> int:
        data = await self.gh.post(
            "/repos/{+repo}/issues", {"repo": self.repo}, data={"title": title, "body": body},
        )
        return int(data["number"])

    # -- config checks (issue 7): files of other repositories or at a commit; check runs --------
    async def read_file_from(self, repo: str, path: str, ref: str | None = None) -> str | None:
        """A text file of ``repo`` (any repository this token can read) at ``ref`` (a sha or
        branch; the default branch when None), or None when it does not exist."""
        url = "/repos/{+repo}/contents/{+path}" + ("{?ref}" if ref else "")
        params: dict[str, Any] = {"repo": repo, "path": path}
        if ref:
            params["ref"] = ref
        try:
            data = await self.gh.getitem(url, params)
        except gidgethub.BadRequest as exc:
            if exc.status_code == 404:
                return None
            raise
        if not isinstance(data, dict) or data.get("type") != "file":
            return None
        if data.get("encoding") == "base64":
            return base64.b64decode(data.get("content", "")).decode("utf-8", errors="replace")
        return str(data.get("content", ""))

    async def create_check_run(self, head_sha: str, name: str, conclusion: str, title: str,
                               summary: str, annotations: list[dict[str, Any]]) -> int:
        """A completed check run on ``head_sha`` (GitHub takes at most 50 annotations a call)."""
        data = await self.gh.post(
            "/repos/{+repo}/check-runs",
            {"repo": self.repo},
            data={
                "name": name,
                "head_sha": head_sha,
                "status": "completed",
                "conclusion": conclusion,
                "completed_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "output": {"title": title, "summary": summary[:65535],
                           "annotations": annotations[:50]},
            },
        )
        return int(data["id"])


class DryRunRepoClient(RepoClient):
    """Reads like ``RepoClient``; every write is logged instead of sent."""

    async def create_comment(self, number: int, body: str) -> int:
        log.info("dry-run: would comment on %s#%s:\n%s", self.repo, number, body)
        return 0

    async def edit_comment(self, comment_id: int, body: str) -> None:
        log.info("dry-run: would edit comment %s on %s:\n%s", comment_id, self.repo, body)

    async def add_labels(self, number: int, labels: list[str]) -> None:
        log.info("dry-run: would label %s#%s with %s", self.repo, number, labels)

    async def remove_label(self, number: int, name: str) -> None:
        log.info("dry-run: would remove label %r from %s#%s", name, self.repo, number)

    async def create_issue(self, title: str, body: str) -> int:
        log.info("dry-run: would open an issue on %s: %s\n%s", self.repo, title, body)
        return 0

    async def create_check_run(self, head_sha: str, name: str, conclusion: str, title: str,
                               summary: str, annotations: list[dict[str, Any]]) -> int:
        log.info("dry-run: would create check run %r (%s) on %s@%s:\n%s", name, conclusion,
                 self.repo, head_sha, summary)
        return 0


class OfflineRepoClient(DryRunRepoClient):
    """Dry-run without App credentials: nothing is read from GitHub either (private repositories
    would refuse, and a laptop may have no route to it), so every repository runs on defaults."""

    async def read_file(self, path: str) -> str | None:
        return None

    async def read_files(self, config_path: str, template_dir: str) -> RepoFiles | None:
        return RepoFiles(None, [])

    async def list_dir(self, path: str) -> list[str]:
        return []

    async def get_issue(self, number: int) -> dict[str, Any] | None:
        return None

    async def contents(self, path: str, ref: str | None = None
                       ) -> dict[str, Any] | list[Any] | None:
        return None

    async def blob(self, sha: str) -> bytes:
        return b""

    async def pr_files(self, number: int, limit: int = 3000) -> list[dict[str, Any]]:
        return []

    async def closing_issue_numbers(self, number: int) -> list[int]:
        return []

    async def page(self, url: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    async def issue_comments(self, number: int) -> list[dict[str, Any]]:
        return []

    async def releases(self, repo: str | None = None) -> list[tuple[str, str]]:
        return []

    async def visibility(self, repo: str) -> Visibility | None:
        # Nothing is read: no repository is known to be visible.
        return None

    async def collaborator_permission(self, login: str) -> str | None:
        return None

    async def read_file_from(self, repo: str, path: str, ref: str | None = None) -> str | None:
        return None
