"""One fake GitHub for every test: a real aiohttp server on loopback that issues installation
tokens (checking the App JWT), serves repository contents and issue comments, and records every
request it receives, so tests assert the exact calls the bot made.

Faults for the process-level tests: ``failures`` answer a status (an int, or a ``Fault`` with
headers such as Retry-After, or one that first sleeps past the client's timeout); ``holds`` keep a
request waiting until the test releases it, before or after the fake has done it. A request whose
client went away before its answer (the aiohttp test server cancels the handler) is recorded in
``disconnects``.

For the chaos tests, ``chaos`` fails a share of all calls at random (502, a timeout, a secondary
rate limit, or a comment created and then answered 502); ``hang_repos`` keeps every call for
those repositories waiting until the fake closes; ``latency`` delays every answer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import json
import random
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from aiohttp import web


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any


@dataclass
class Fault:
    """One injected answer: ``status`` with ``headers``, after ``sleep`` seconds. A sleep longer
    than the client's timeout is a timeout: the client gives up, and nothing was done."""

    status: int = 502
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "injected failure"
    sleep: float = 0.0


def timeout_fault(seconds: float) -> Fault:
    """An answer that comes too late: the request is never performed."""
    return Fault(status=504, message="injected timeout", sleep=seconds)


def rate_limit_fault(status: int = 403, retry_after: str = "1") -> Fault:
    """GitHub's secondary rate limit: refused before it ran, with a Retry-After."""
    return Fault(status=status, headers={"Retry-After": retry_after},
                 message="You have exceeded a secondary rate limit. Please wait a few minutes "
                         "before you try again.")


@dataclass
class Chaos:
    """Fail ``rate`` of the calls, chosen by a seeded random draw: a 502, a timeout (an answer
    after ``timeout`` seconds, past the client's own), a secondary rate limit (403 with
    Retry-After: 1), or, for a comment POST, the comment created and then a 502."""

    rate: float = 0.2
    timeout: float = 3.0
    seed: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def draw(self, request: web.Request) -> str | None:
        if self.rng.random() >= self.rate:
            return None
        kinds = ["502", "timeout", "rate_limit"]
        if request.method == "POST" and request.path.endswith("/comments"):
            kinds.append("created_then_502")
        kind = self.rng.choice(kinds)
        self.injected[kind] = self.injected.get(kind, 0) + 1
        return kind


@dataclass
class Hold:
    """Holds the next ``count`` requests matching "METHOD path-prefix" until ``release()``.

    ``perform_first=False``: the request waits before it is done; released with
    ``perform=False`` (or abandoned by its client) it is never done. ``perform_first=True``: the
    fake does it (the comment exists), then holds the answer."""

    perform_first: bool = False
    count: int = 1
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the client went away while its request was held.
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    perform: bool = True
    held: int = 0
    performed: int = 0

    def release(self, *, perform: bool = True) -> None:
        self.perform = perform
        self.released.set()


def _graphql_query(r: Recorded) -> bool:
    """A GraphQL read (its POST writes nothing); a mutation is a write."""
    query = r.body.get("query", "") if r.path == "/graphql" and isinstance(r.body, dict) else None
    return query is not None and not str(query).lstrip().startswith("mutation")


@dataclass
class FakeGitHub:
    app_id: str
    public_key_pem: str
    slug: str = "dejafix-test"
    token_lifetime: float = 3600.0
    requests: list[Recorded] = field(default_factory=list)
    # (repo lower, path) -> file text
    files: dict[tuple[str, str], str] = field(default_factory=dict)
    # (repo lower, issue number) -> comments
    comments: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    # (repo lower, number) -> issue JSON; also listed by GET /repos/o/r/issues.
    issues: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    # repo lower -> pull request JSONs, listed by GET /repos/o/r/pulls (oldest first).
    pulls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # (repo lower, PR number) -> the PR's files, paginated like GitHub's.
    pr_files: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    # (repo lower, PR number) -> issue numbers GraphQL reports as closingIssuesReferences
    # (``"owner/repo#N"`` for another repository's issue); a PR not listed gets a GraphQL error
    # on the one-PR query, as on a GitHub without the field (the backfill's query: none linked).
    closing_refs: dict[tuple[str, int], list[int | str]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    # Status codes (or Faults) to answer, in order, before behaving normally
    # (per "METHOD path-prefix").
    failures: dict[str, list[int | Fault]] = field(default_factory=dict)
    # Seconds to wait before answering (per "METHOD path-prefix"), to widen race windows.
    delays: dict[str, float] = field(default_factory=dict)
    # Requests to hold until the test releases them (per "METHOD path-prefix").
    holds: dict[str, Hold] = field(default_factory=dict)
    # Requests whose client disconnected before the answer was sent.
    disconnects: list[Recorded] = field(default_factory=list)
    chaos: Chaos | None = None
    # Repositories (lower) whose every call hangs until close().
    hang_repos: set[str] = field(default_factory=set)
    # Seconds every answer waits (the bench's GitHub at 100 ms).
    latency: float = 0.0
    # repo lower -> installation id (GET /repos/o/r/installation); a repository not listed is
    # installation 1 unless it is in ``not_installed``.
    installations: dict[str, int] = field(default_factory=dict)
    not_installed: set[str] = field(default_factory=set)
    # Private repositories (lower): GET /repos/o/r answers a user token 404 unless the user
    # has a role there (``set_role``), as GitHub hides them. An installation token is answered
    # 404 too when the repository is listed in ``installations`` under another installation
    # (or in ``not_installed``): a token sees its installation's repositories and public ones.
    private_repos: set[str] = field(default_factory=set)
    # Repositories (lower) the fake knows of beyond those above (``add_repo``), for
    # GET /installation/repositories.
    known_repos: set[str] = field(default_factory=set)
    # OAuth: the App's client, the user the authorize page signs in, and the tokens given out
    # (token -> login).
    oauth_client_id: str = "Iv1.testclient"
    oauth_client_secret: str = "test-client-secret"
    oauth_login: str = "maintainer"
    user_tokens: dict[str, str] = field(default_factory=dict)
    _oauth_codes: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The manifest flow: manifests posted to the new-App form, codes it handed out, and what a
    # conversion answers (the App GitHub made).
    manifests: list[dict[str, Any]] = field(default_factory=list)
    _manifest_codes: set[str] = field(default_factory=set)
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(5001))

    # -- helpers for tests -------------------------------------------------------------------
    def calls(self, method: str | None = None, contains: str = "") -> list[Recorded]:
        return [r for r in self.requests
                if (method is None or r.method == method) and contains in r.path]

    def writes(self) -> list[Recorded]:
        return [r for r in self.requests if r.method in {"POST", "PATCH", "PUT", "DELETE"}
                and "/access_tokens" not in r.path and not _graphql_query(r)]

    def repo_requests(self) -> list[Recorded]:
        """Requests made for some delivery (the startup GET /app excluded)."""
        return [r for r in self.requests if r.path != "/app"]

    def add_file(self, repo: str, path: str, text: str) -> None:
        self.files[(repo.lower(), path)] = text

    def add_repo(self, repo: str, *, private: bool = False,
                 installation: int | None = None) -> None:
        """A repository with its visibility and, when given, the installation it belongs to
        (otherwise installation 1, as any unlisted repository)."""
        key = repo.lower()
        self.known_repos.add(key)
        if private:
            self.private_repos.add(key)
        else:
            self.private_repos.discard(key)
        if installation is not None:
            self.installations[key] = installation
            self.not_installed.discard(key)

    def installation_of(self, repo: str) -> int | None:
        """The installation a repository belongs to (None: the App is not installed there)."""
        key = repo.lower()
        return None if key in self.not_installed else self.installations.get(key, 1)

    def hold(self, key: str, *, perform_first: bool = False, count: int = 1) -> Hold:
        hold = Hold(perform_first=perform_first, count=count)
        self.holds[key] = hold
        return hold

    def close(self) -> None:
        """Wake every held or sleeping request (without doing it), so the server stops fast."""
        self._closing.set()
        for hold in self.holds.values():
            if not hold.released.is_set():
                hold.release(perform=False)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), timeout=seconds)

    @staticmethod
    def _matches(key: str, request: web.Request) -> bool:
        method, _, prefix = key.partition(" ")
        return request.method == method and request.path.startswith(prefix)

    # -- the server --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/app/installations/{iid}/access_tokens", self._token)
        app.router.add_get("/app", self._app)
        app.router.add_get("/repos/{owner}/{repo}/contents/{path:.*}", self._contents)
        app.router.add_get("/repos/{owner}/{repo}/git/blobs/{sha}", self._blob)
        app.router.add_get("/repos/{owner}/{repo}/issues/{number}/comments", self._list_comments)
        app.router.add_post("/repos/{owner}/{repo}/issues/{number}/comments", self._create)
        app.router.add_patch("/repos/{owner}/{repo}/issues/comments/{cid}", self._edit)
        app.router.add_post("/repos/{owner}/{repo}/issues/{number}/labels", self._labels)
        # commands (issue 7): collaborator permission, label removal, opening an issue
        app.router.add_get("/repos/{owner}/{repo}/collaborators/{login}/permission",
                           self._collaborator_permission)
        app.router.add_delete("/repos/{owner}/{repo}/issues/{number}/labels/{name}",
                              self._remove_label)
        app.router.add_post("/repos/{owner}/{repo}/issues", self._create_issue)
        app.router.add_get("/repos/{owner}/{repo}/issues/{number:\\d+}", self._get_issue)
        app.router.add_get("/repos/{owner}/{repo}/issues", self._list_issues)
        app.router.add_get("/repos/{owner}/{repo}/pulls", self._list_pulls)
        app.router.add_get("/repos/{owner}/{repo}/pulls/{number}/files", self._list_pr_files)
        app.router.add_post("/graphql", self._graphql)
        # config checks (issue 7): check runs the bot creates
        app.router.add_post("/repos/{owner}/{repo}/check-runs", self._create_check_run)
        # regressions: the releases a fix's first release is read from
        app.router.add_get("/repos/{owner}/{repo}/releases", self._list_releases)
        # the web page (issue 16): the App's installation on a repository, OAuth sign-in (the
        # authorize page approves at once, as the user ``oauth_login``), the signed-in user,
        # and the manifest flow's new-App form and code conversion
        app.router.add_get("/repos/{owner}/{repo}/installation", self._repo_installation)
        app.router.add_get("/repos/{owner}/{repo}", self._get_repo)
        app.router.add_get("/installation/repositories", self._installation_repositories)
        app.router.add_get("/login/oauth/authorize", self._oauth_authorize)
        app.router.add_post("/login/oauth/access_token", self._oauth_token)
        app.router.add_get("/user", self._user)
        app.router.add_delete("/applications/{client_id}/token", self._revoke_token)
        app.router.add_post("/settings/apps/new", self._new_app)
        app.router.add_post("/organizations/{org}/settings/apps/new", self._new_app)
        app.router.add_post("/app-manifests/{code}/conversions", self._conversion)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        recorded = Recorded(request.method, request.path, request.query_string,
                            dict(request.headers), body)
        self.requests.append(recorded)
        try:
            return await self._answer(request, handler)
        except asyncio.CancelledError:
            # The test server cancels a handler whose client went away (killed, timed out).
            self.disconnects.append(recorded)
            raise

    async def _answer(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.hang_repos:
            parts = request.path.split("/")
            if len(parts) > 3 and parts[1] == "repos" and \
                    f"{parts[2]}/{parts[3]}".lower() in self.hang_repos:
                await self._closing.wait()
                return web.json_response({"message": "closing"}, status=503)
        if self.chaos is not None:
            kind = self.chaos.draw(request)
            if kind == "created_then_502":
                await handler(request)
                return web.json_response({"message": "injected failure"}, status=502)
            if kind == "timeout":
                await self._pause(self.chaos.timeout)
                return web.json_response({"message": "injected timeout"}, status=504)
            if kind == "rate_limit":
                fault = rate_limit_fault(403, retry_after="1")
                return web.json_response({"message": fault.message}, status=403,
                                         headers=fault.headers)
            if kind == "502":
                return web.json_response({"message": "injected failure"}, status=502)
        for key, seconds in self.delays.items():
            if self._matches(key, request):
                await asyncio.sleep(seconds)
        for key, codes in self.failures.items():
            if codes and self._matches(key, request):
                fault = codes.pop(0)
                if not isinstance(fault, Fault):
                    fault = Fault(status=fault)
                if fault.sleep:
                    await self._pause(fault.sleep)
                return web.json_response({"message": fault.message}, status=fault.status,
                                         headers=fault.headers)
        for key, hold in self.holds.items():
            if hold.count > hold.held and self._matches(key, request):
                return await self._held(hold, request, handler)
        return await handler(request)

    async def _held(self, hold: Hold, request: web.Request, handler: Any) -> web.StreamResponse:
        hold.held += 1
        try:
            if hold.perform_first:
                response = await handler(request)
                hold.performed += 1
                hold.arrived.set()
                await hold.released.wait()
                return response
            hold.arrived.set()
            await hold.released.wait()
            if not hold.perform:
                return web.json_response({"message": "abandoned by the test"}, status=502)
            hold.performed += 1
            return await handler(request)
        except asyncio.CancelledError:
            hold.disconnected.set()
            raise

    def _check_jwt(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        # GitHub accepts the scheme in any case; gidgethub sends "bearer".
        if auth[:7].lower() != "bearer ":
            raise web.HTTPUnauthorized(text='{"message": "JWT required"}',
                                       content_type="application/json")
        try:
            claims = jwt.decode(auth[7:], self.public_key_pem, algorithms=["RS256"])
        except jwt.PyJWTError as exc:
            raise web.HTTPUnauthorized(text=json.dumps({"message": f"bad JWT: {exc}"}),
                                       content_type="application/json") from exc
        if str(claims.get("iss")) != self.app_id:
            raise web.HTTPUnauthorized(text='{"message": "wrong issuer"}',
                                       content_type="application/json")

    def _check_token(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("token ") or auth[6:] not in self.tokens:
            raise web.HTTPUnauthorized(text='{"message": "Bad credentials"}',
                                       content_type="application/json")

    async def _token(self, request: web.Request) -> web.Response:
        self._check_jwt(request)
        token = "ghs_" + secrets.token_hex(16)
        self.tokens[token] = int(request.match_info["iid"])
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                time.gmtime(time.time() + self.token_lifetime))
        return web.json_response({"token": token, "expires_at": expires}, status=201)

    async def _app(self, request: web.Request) -> web.Response:
        self._check_jwt(request)
        return web.json_response({"id": int(self.app_id), "slug": self.slug})

    async def _contents(self, request: web.Request) -> web.Response:
        self._check_token(request)
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}".lower()
        path = request.match_info["path"].strip("/")
        if "ref" in request.query:  # config checks (issue 7): a file at a commit
            return self._contents_at(repo, path, request.query["ref"])
        text = self.files.get((repo, path))
        if text is not None:
            return self._conditional(request, {
                "type": "file", "path": path, "encoding": "base64", "sha": _blob_sha(text),
                "size": len(text.encode()),
                "content": base64.b64encode(text.encode()).decode(),
            })
        listing = [{"type": "file", "path": p, "name": p.rsplit("/", 1)[-1],
                    "sha": _blob_sha(t), "size": len(t.encode())}
                   for (r, p), t in self.files.items() if r == repo
                   and p.startswith(path + "/") and "/" not in p[len(path) + 1:]]
        if listing:
            return self._conditional(request, listing)
        return web.json_response({"message": "Not Found"}, status=404)

    async def _blob(self, request: web.Request) -> web.Response:
        self._check_token(request)
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}".lower()
        texts = [(r, t) for (r, _), t in self.files.items()] + \
            [(r, t) for (r, _, _), t in self.files_at.items()]
        for r, text in texts:
            if r == repo and _blob_sha(text) == request.match_info["sha"]:
                if "raw" in request.headers.get("Accept", ""):
                    return web.Response(body=text.encode(),
                                        content_type="application/vnd.github.raw")
                return web.json_response({
                    "sha": request.match_info["sha"], "encoding": "base64",
                    "size": len(text.encode()),
                    "content": base64.b64encode(text.encode()).decode()})
        return web.json_response({"message": "Not Found"}, status=404)

    @staticmethod
    def _conditional(request: web.Request, data: Any) -> web.Response:
        """GitHub's ETag: a request whose If-None-Match still matches gets 304 and no body
        (and does not count against the rate limit)."""
        body = json.dumps(data)
        etag = '"' + hashlib.sha256(body.encode()).hexdigest()[:20] + '"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=body, content_type="application/json", headers={"ETag": etag})

    def _issue_key(self, request: web.Request) -> tuple[str, int]:
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}".lower()
        return repo, int(request.match_info["number"])

    async def _list_comments(self, request: web.Request) -> web.Response:
        self._check_token(request)
        return web.json_response(self.comments.get(self._issue_key(request), []))

    async def _create(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        comment = {"id": next(self._ids), "body": data["body"],
                   "user": {"login": f"{self.slug}[bot]", "type": "Bot"}}
        self.comments.setdefault(self._issue_key(request), []).append(comment)
        return web.json_response(comment, status=201)

    async def _edit(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        cid = int(request.match_info["cid"])
        for comments in self.comments.values():
            for comment in comments:
                if comment["id"] == cid:
                    comment["body"] = data["body"]
                    return web.json_response(comment)
        return web.json_response({"message": "Not Found"}, status=404)

    async def _labels(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        return web.json_response([{"name": n} for n in data.get("labels", [])])

    # -- history: issues, pull requests, their files, GraphQL ---------------------------------
    def add_issue(self, repo: str, issue: dict[str, Any]) -> None:
        self.issues[(repo.lower(), int(issue["number"]))] = issue

    def _page(self, request: web.Request, items: list[dict[str, Any]]) -> web.Response:
        per_page = int(request.query.get("per_page", "30"))
        page = int(request.query.get("page", "1"))
        chunk = items[(page - 1) * per_page: page * per_page]
        headers = {}
        if page * per_page < len(items):
            nxt = request.url.update_query({"page": str(page + 1)})
            headers["Link"] = f'<{nxt}>; rel="next"'
        return web.json_response(chunk, headers=headers)

    def _repo(self, request: web.Request) -> str:
        return f"{request.match_info['owner']}/{request.match_info['repo']}".lower()

    async def _get_issue(self, request: web.Request) -> web.Response:
        self._check_token(request)
        issue = self.issues.get(self._issue_key(request))
        if issue is None:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response(issue)

    async def _list_issues(self, request: web.Request) -> web.Response:
        self._check_token(request)
        repo = self._repo(request)
        state = request.query.get("state", "open")
        items = [i for (r, _), i in sorted(self.issues.items()) if r == repo
                 and (state == "all" or i.get("state") == state)]
        return self._page(request, items)

    async def _list_pulls(self, request: web.Request) -> web.Response:
        self._check_token(request)
        return self._page(request, list(self.pulls.get(self._repo(request), [])))

    async def _list_pr_files(self, request: web.Request) -> web.Response:
        self._check_token(request)
        return self._page(request, list(self.pr_files.get(self._issue_key(request), [])))

    async def _graphql(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        variables = data.get("variables") or {}
        query = str(data.get("query", ""))
        missing = sorted(f for f in self.graphql_missing if f in query)
        if missing:
            # What a GitHub Enterprise without the field answers (HTTP 200, errors only).
            return web.json_response({"errors": [{
                "message": f"Field '{f}' doesn't exist on type 'PullRequest'",
                "extensions": {"code": "undefinedField", "typeName": "PullRequest",
                               "fieldName": f}} for f in missing]})
        operation = re.match(r"\s*query\s+(\w+)", query)
        if operation and operation.group(1).startswith("DejafixBackfill"):
            return self._graphql_backfill(operation.group(1), query, variables)
        if "object(expression:" in query:
            return self._graphql_files(variables)
        key = (f"{variables.get('owner')}/{variables.get('name')}".lower(),
               int(variables.get("number", 0)))
        if key not in self.closing_refs:
            return web.json_response({"errors": [{"message": "Field not available"}]})
        nodes = [self._ref_node(key[0], ref) for ref in self.closing_refs[key]]
        return web.json_response({"data": {"repository": {"pullRequest": {
            "closingIssuesReferences": {"nodes": [n for n in nodes if n]}}}}})

    # -- the backfill's GraphQL queries (bot/github/graphql.py), recognised by operation name
    # and answered from ``pulls``, ``issues``, ``pr_files``, ``closing_refs`` and ``comments``:
    # the same history the REST listings serve. Cursors are offsets.
    # Points left in the GraphQL budget (each query costs 1) and when it resets.
    graphql_remaining: int = 5000
    graphql_reset_at: str = "2099-01-01T00:00:00Z"
    # Field names this GitHub "does not have": a query naming one is answered with GitHub's
    # undefinedField error, as an older GitHub Enterprise does.
    graphql_missing: set[str] = field(default_factory=set)

    def _issue_node(self, repo: str, issue: dict[str, Any]) -> dict[str, Any]:
        reason = issue.get("state_reason")
        return {"number": issue["number"], "title": issue.get("title"),
                "body": issue.get("body"), "url": issue.get("html_url"),
                "state": str(issue.get("state") or "open").upper(),
                "stateReason": str(reason).upper() if reason else None,
                "createdAt": issue.get("created_at"), "repository": {"nameWithOwner": repo}}

    def _ref_node(self, repo: str, ref: int | str) -> dict[str, Any] | None:
        """A closing reference: ``N`` (this repository's issue) or ``"owner/repo#N"``."""
        home = repo
        if isinstance(ref, str):
            repo, _, number = ref.lower().partition("#")
            ref = int(number)
        issue = self.issues.get((repo, ref))
        if issue is None:
            # GitHub links only issues that exist; another repository's need not be here.
            return None if repo == home else {"number": ref,
                                              "repository": {"nameWithOwner": repo}}
        return self._issue_node(repo, issue)

    @staticmethod
    def _connection(items: list[Any], first: int, after: Any, last: int | None = None
                    ) -> tuple[list[Any], dict[str, Any]]:
        start = int(after) if after else 0
        if last is not None:
            chunk = items[-last:] if last else []
            return chunk, {"hasNextPage": False, "endCursor": None}
        chunk = items[start:start + first]
        return chunk, {"hasNextPage": start + first < len(items),
                       "endCursor": str(start + len(chunk))}

    def _graphql_backfill(self, operation: str, query: str,
                          variables: dict[str, Any]) -> web.Response:
        repo = f"{variables.get('owner')}/{variables.get('name')}".lower()
        self.graphql_remaining = max(0, self.graphql_remaining - 1)
        repository: dict[str, Any] = {}

        def closing(number: int, first: int) -> dict[str, Any]:
            refs = [self._ref_node(repo, r) for r in self.closing_refs.get((repo, number), [])]
            nodes = [n for n in refs if n is not None]
            return {"totalCount": len(nodes), "nodes": nodes[:first]}

        def files(number: int, after: Any) -> dict[str, Any]:
            paths = [{"path": f["filename"]} for f in self.pr_files.get((repo, number), [])]
            chunk, info = self._connection(paths, 100, after)
            return {"totalCount": len(paths), "pageInfo": info, "nodes": chunk}

        if operation == "DejafixBackfillPulls":
            merged = [p for p in self.pulls.get(repo, []) if p.get("merged_at")]
            chunk, info = self._connection(merged, int(variables["first"]),
                                           variables.get("after"))
            nodes = []
            for pr in chunk:
                node = {"number": pr["number"], "title": pr.get("title"), "body": pr.get("body"),
                        "url": pr.get("html_url"), "mergedAt": pr.get("merged_at"),
                        "closingIssuesReferences": closing(int(pr["number"]), 10)}
                if " files(" in query:
                    node["files"] = files(int(pr["number"]), None)
                nodes.append(node)
            repository["pullRequests"] = {"pageInfo": info, "nodes": nodes}
            # Only when the query names it, as GitHub answers only what is asked.
            if "totalCount pageInfo" in query.split("nodes{", 1)[0]:
                repository["pullRequests"]["totalCount"] = len(merged)
        elif operation == "DejafixBackfillPullFiles":
            number = int(variables["number"])
            repository["pullRequest"] = {"files": files(number, variables.get("after"))}
        elif operation == "DejafixBackfillPullRefs":
            number = int(variables["number"])
            repository["pullRequest"] = {"closingIssuesReferences": closing(number, 50)}
        elif operation == "DejafixBackfillLookup":
            for name, number in variables.items():
                if not re.fullmatch(r"n\d+", name):
                    continue
                issue = self.issues.get((repo, int(number)))
                repository[f"i{name[1:]}"] = None if issue is None else (
                    {"__typename": "PullRequest"} if "pull_request" in issue
                    else {"__typename": "Issue", **self._issue_node(repo, issue)})
        elif operation == "DejafixBackfillIssues":
            closed = [i for (r, _), i in sorted(self.issues.items()) if r == repo
                      and i.get("state") == "closed" and "pull_request" not in i]
            chunk, info = self._connection(closed, int(variables["first"]),
                                           variables.get("after"))
            nodes = []
            for issue in chunk:
                said = self.comments.get((repo, int(issue["number"])), [])
                nodes.append({**self._issue_node(repo, issue), "comments": {
                    "totalCount": len(said),
                    "nodes": [{"body": c.get("body")} for c in said[-10:]]}})
            repository["issues"] = {"pageInfo": info, "nodes": nodes}
            if "totalCount pageInfo" in query.split("nodes{", 1)[0]:
                repository["issues"]["totalCount"] = len(closed)
        else:
            return web.json_response({"errors": [{"message": f"unknown operation {operation}"}]})
        return web.json_response({"data": {
            "rateLimit": {"cost": 1, "remaining": self.graphql_remaining,
                          "resetAt": self.graphql_reset_at},
            "repository": repository}})

    # Repositories whose files GraphQL does not answer (as a GitHub Enterprise without it):
    # the bot reads them over REST instead.
    graphql_files_off: bool = False

    def _graphql_files(self, variables: dict[str, Any]) -> web.Response:
        """A repository's config file and issue templates (``object(expression: "HEAD:...")``)
        from ``files``, as GitHub's GraphQL API answers: null for a path that is not there."""
        if self.graphql_files_off:
            return web.json_response({"errors": [{"message": "Field 'object' doesn't exist"}]})
        repo = f"{variables.get('owner')}/{variables.get('name')}".lower()

        def blob(text: str) -> dict[str, Any]:
            return {"text": text, "isTruncated": False, "isBinary": False}

        config_path = str(variables.get("config", "")).removeprefix("HEAD:")
        folder = str(variables.get("templates", "")).removeprefix("HEAD:")
        text = self.files.get((repo, config_path))
        entries = [{"path": p, "type": "blob", "object": blob(t)}
                   for (r, p), t in self.files.items()
                   if r == repo and p.startswith(folder + "/") and "/" not in p[len(folder) + 1:]]
        return web.json_response({"data": {"repository": {
            "config": blob(text) if text is not None else None,
            "templates": {"entries": entries} if entries else None}}})

    # -- commands (issue 7): collaborator roles, label removal, issues the bot opens ----------
    # (repo lower, login lower) -> role_name (admin | maintain | write | triage | read); a login
    # not listed is "read", as anyone is on a public repository.
    roles: dict[tuple[str, str], str] = field(default_factory=dict)
    # (repo lower, issue number) -> label names currently on the issue, for DELETE to answer
    # 404 on a label that is not there. Issues not listed answer 200 to any removal.
    issue_labels: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    def set_role(self, repo: str, login: str, role: str) -> None:
        self.roles[(repo.lower(), login.lower())] = role

    async def _collaborator_permission(self, request: web.Request) -> web.Response:
        self._check_token(request)
        role = self.roles.get((self._repo(request), request.match_info["login"].lower()), "read")
        # GitHub's older field folds triage into read and maintain into write.
        legacy = {"maintain": "write", "triage": "read"}.get(role, role)
        return web.json_response({"permission": legacy, "role_name": role,
                                  "user": {"login": request.match_info["login"]}})

    async def _remove_label(self, request: web.Request) -> web.Response:
        self._check_token(request)
        key = self._issue_key(request)
        name = request.match_info["name"]
        if key in self.issue_labels:
            if name not in self.issue_labels[key]:
                return web.json_response({"message": "Label does not exist"}, status=404)
            self.issue_labels[key].remove(name)
            return web.json_response([{"name": n} for n in self.issue_labels[key]])
        return web.json_response([])

    async def _create_issue(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        repo = self._repo(request)
        number = max([n for (r, n) in self.issues if r == repo] + [0, 100000 - 1]) + 1
        issue = {"number": number, "title": data.get("title", ""), "body": data.get("body"),
                 "state": "open", "user": {"login": f"{self.slug}[bot]", "type": "Bot"},
                 "labels": [{"name": n} for n in data.get("labels", [])]}
        self.add_issue(repo, issue)
        return web.json_response(issue, status=201)

    # -- config checks (issue 7): files at a commit, org .github files, check runs ----------
    # (repo lower, ref, path) -> file text at that commit (or branch). A read with ?ref= sees
    # only these: a commit's tree is what the test put there, never the default branch's.
    files_at: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # repo lower -> the check runs created there (the request bodies, with their ids).
    check_runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add_file_at(self, repo: str, ref: str, path: str, text: str) -> None:
        self.files_at[(repo.lower(), ref, path)] = text

    def add_org_file(self, owner: str, path: str, text: str) -> None:
        """A file of the owner's ``.github`` repository (its default branch)."""
        self.add_file(f"{owner}/.github", path, text)

    def _contents_at(self, repo: str, path: str, ref: str) -> web.Response:
        text = self.files_at.get((repo, ref, path))
        if text is None:
            listing = [{"type": "file", "path": p, "name": p.rsplit("/", 1)[-1],
                        "sha": _blob_sha(t), "size": len(t.encode())}
                       for (r, f, p), t in self.files_at.items() if r == repo and f == ref
                       and p.startswith(path + "/") and "/" not in p[len(path) + 1:]]
            if listing:
                return web.json_response(listing)
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response({
            "type": "file", "path": path, "encoding": "base64", "sha": _blob_sha(text),
            "size": len(text.encode()), "content": base64.b64encode(text.encode()).decode(),
        })

    async def _create_check_run(self, request: web.Request) -> web.Response:
        self._check_token(request)
        data = await request.json()
        missing = [k for k in ("name", "head_sha") if not data.get(k)]
        annotations = (data.get("output") or {}).get("annotations") or []
        required = ("path", "start_line", "end_line", "annotation_level", "message")
        bad = [a for a in annotations if any(k not in a for k in required)
               or a["annotation_level"] not in ("notice", "warning", "failure")]
        if missing or bad or len(annotations) > 50:
            return web.json_response({"message": "Validation Failed", "missing": missing},
                                     status=422)
        run = {"id": next(self._ids), **data}
        self.check_runs.setdefault(self._repo(request), []).append(run)
        return web.json_response(run, status=201)

    # -- regressions: releases, newest first as GitHub lists them -----------------------------
    # repo lower -> release JSONs; a repository not listed has none (an empty list, not a 404).
    releases: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add_release(self, repo: str, tag: str, published_at: str | None, *,
                    draft: bool = False) -> None:
        items = self.releases.setdefault(repo.lower(), [])
        items.append({"id": next(self._ids), "tag_name": tag, "name": tag, "draft": draft,
                      "prerelease": False, "published_at": published_at})
        items.sort(key=lambda r: r["published_at"] or "9999", reverse=True)

    async def _list_releases(self, request: web.Request) -> web.Response:
        self._check_token(request)
        return self._page(request, list(self.releases.get(self._repo(request), [])))

    # -- the web page and the manifest flow -------------------------------------------------

    async def _repo_installation(self, request: web.Request) -> web.Response:
        self._check_jwt(request)
        repo = self._repo(request)
        if repo in self.not_installed:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response({"id": self.installations.get(repo, 1)})

    async def _get_repo(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        auth = request.headers.get("Authorization", "")
        token = auth.partition(" ")[2]
        login = self.user_tokens.get(token)
        private = repo in self.private_repos
        if login is None:
            self._check_token(request)  # an installation token sees its repositories
            # ...and public ones; another installation's private repository is not there.
            if private and (repo in self.not_installed or (
                    repo in self.installations and self.installations[repo] != self.tokens[token])):
                return web.json_response({"message": "Not Found"}, status=404)
        role = self.roles.get((repo, login.lower())) if login else None
        if private and login is not None and role is None:
            return web.json_response({"message": "Not Found"}, status=404)
        rank = ["read", "triage", "write", "maintain", "admin"]
        have = rank.index(role) if role in rank else (0 if not private else -1)
        permissions = {"pull": have >= 0, "triage": have >= 1, "push": have >= 2,
                       "maintain": have >= 3, "admin": have >= 4}
        return web.json_response({"full_name": f"{request.match_info['owner']}/"
                                  f"{request.match_info['repo']}", "private": private,
                                  "visibility": "private" if private else "public",
                                  "permissions": permissions})

    async def _installation_repositories(self, request: web.Request) -> web.Response:
        """The repositories of the token's installation, as GitHub lists them (an object with
        ``total_count`` and a page of ``repositories``)."""
        self._check_token(request)
        installation = self.tokens[request.headers["Authorization"][6:]]
        names = sorted(self.known_repos | self.private_repos | set(self.installations))
        items = [{"full_name": name, "private": name in self.private_repos,
                  "visibility": "private" if name in self.private_repos else "public"}
                 for name in names if self.installation_of(name) == installation]
        page = self._page(request, items)
        return web.json_response({"total_count": len(items),
                                  "repositories": json.loads(page.text or "[]")},
                                 headers={k: v for k, v in page.headers.items() if k == "Link"})

    async def _oauth_authorize(self, request: web.Request) -> web.Response:
        # GitHub's page asks the user to approve; this one approves at once as oauth_login.
        if request.query.get("client_id") != self.oauth_client_id:
            return web.Response(status=404, text="unknown client_id")
        redirect = request.query.get("redirect_uri", "")
        # GitHub sends the user back only to the App's callback URL (app.yml's callback_urls).
        if not redirect.split("?", 1)[0].endswith("/oauth/callback"):
            return web.Response(status=400, text="redirect_uri is not the App's callback URL")
        code = secrets.token_hex(10)
        self._oauth_codes[code] = (self.oauth_login, redirect)
        sep = "&" if "?" in redirect else "?"
        state = request.query.get("state", "")
        raise web.HTTPFound(f"{redirect}{sep}code={code}&state={state}")

    async def _oauth_token(self, request: web.Request) -> web.Response:
        form = await request.post()
        if form.get("client_id") != self.oauth_client_id or \
                form.get("client_secret") != self.oauth_client_secret:
            return web.json_response({"error": "incorrect_client_credentials"})
        grant = self._oauth_codes.pop(str(form.get("code", "")), None)
        if grant is None:
            return web.json_response({"error": "bad_verification_code"})
        token = "ghu_" + secrets.token_hex(16)
        self.user_tokens[token] = grant[0]
        return web.json_response({"access_token": token, "token_type": "bearer",
                                  "scope": ""})

    def _user_login(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        login = self.user_tokens.get(token) if scheme.lower() in ("token", "bearer") else None
        if login is None:
            raise web.HTTPUnauthorized(text='{"message": "Bad credentials"}',
                                       content_type="application/json")
        return login

    async def _revoke_token(self, request: web.Request) -> web.Response:
        # Basic auth with the App's OAuth client, as GitHub asks for it.
        expected = "Basic " + base64.b64encode(
            f"{self.oauth_client_id}:{self.oauth_client_secret}".encode()).decode()
        if request.match_info["client_id"] != self.oauth_client_id or \
                request.headers.get("Authorization") != expected:
            return web.json_response({"message": "Not Found"}, status=404)
        token = str((await request.json()).get("access_token", ""))
        if self.user_tokens.pop(token, None) is None:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.Response(status=204)

    async def _user(self, request: web.Request) -> web.Response:
        login = self._user_login(request)
        return web.json_response({"login": login, "id": abs(hash(login)) % 10**8,
                                  "type": "User"})

    async def _new_app(self, request: web.Request) -> web.Response:
        # The browser posts the manifest form here; GitHub creates the App when the user
        # confirms and sends them to the manifest's redirect_url with a one-time code.
        form = await request.post()
        manifest = json.loads(str(form.get("manifest", "{}")))
        self.manifests.append(manifest)
        code = secrets.token_hex(10)
        self._manifest_codes.add(code)
        state = request.query.get("state", "")
        raise web.HTTPFound(f"{manifest['redirect_url']}?code={code}&state={state}")

    async def _conversion(self, request: web.Request) -> web.Response:
        code = request.match_info["code"]
        if code not in self._manifest_codes:
            return web.json_response({"message": "Not Found"}, status=404)
        self._manifest_codes.discard(code)
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption()).decode()
        manifest = self.manifests[-1] if self.manifests else {}
        slug = str(manifest.get("name", "dejafix")).lower().replace(" ", "-")
        return web.json_response({
            "id": int(self.app_id), "slug": slug, "name": manifest.get("name", "Dejafix"),
            "client_id": self.oauth_client_id, "client_secret": self.oauth_client_secret,
            "webhook_secret": "whsec-" + secrets.token_hex(8), "pem": pem,
            "html_url": f"https://github.com/apps/{slug}",
            "owner": {"login": "octo-org", "type": "Organization"},
        }, status=201)


def _blob_sha(text: str) -> str:
    """Git's blob id of a file's text, as the contents API gives it."""
    data = text.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
