"""One fake GitHub for every test: a real aiohttp server on loopback that issues installation
tokens (checking the App JWT), serves repository contents and issue comments, and records every
request it receives, so tests assert the exact calls the bot made."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
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
    tokens: dict[str, int] = field(default_factory=dict)
    # Status codes to answer, in order, before behaving normally (per "METHOD path-prefix").
    failures: dict[str, list[int]] = field(default_factory=dict)
    # Seconds to wait before answering (per "METHOD path-prefix"), to widen race windows.
    delays: dict[str, float] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(5001))

    # -- helpers for tests -------------------------------------------------------------------
    def calls(self, method: str | None = None, contains: str = "") -> list[Recorded]:
        return [r for r in self.requests
                if (method is None or r.method == method) and contains in r.path]

    def writes(self) -> list[Recorded]:
        return [r for r in self.requests if r.method in {"POST", "PATCH", "PUT", "DELETE"}
                and "/access_tokens" not in r.path]

    def repo_requests(self) -> list[Recorded]:
        """Requests made for some delivery (the startup GET /app excluded)."""
        return [r for r in self.requests if r.path != "/app"]

    def add_file(self, repo: str, path: str, text: str) -> None:
        self.files[(repo.lower(), path)] = text

    # -- the server --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/app/installations/{iid}/access_tokens", self._token)
        app.router.add_get("/app", self._app)
        app.router.add_get("/repos/{owner}/{repo}/contents/{path:.*}", self._contents)
        app.router.add_get("/repos/{owner}/{repo}/issues/{number}/comments", self._list_comments)
        app.router.add_post("/repos/{owner}/{repo}/issues/{number}/comments", self._create)
        app.router.add_patch("/repos/{owner}/{repo}/issues/comments/{cid}", self._edit)
        app.router.add_post("/repos/{owner}/{repo}/issues/{number}/labels", self._labels)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.requests.append(Recorded(request.method, request.path, request.query_string,
                                      dict(request.headers), body))
        for key, seconds in self.delays.items():
            method, _, prefix = key.partition(" ")
            if request.method == method and request.path.startswith(prefix):
                await asyncio.sleep(seconds)
        for key, codes in self.failures.items():
            method, _, prefix = key.partition(" ")
            if codes and request.method == method and request.path.startswith(prefix):
                status = codes.pop(0)
                return web.json_response({"message": "injected failure"}, status=status)
        return await handler(request)

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
        text = self.files.get((repo, path))
        if text is not None:
            return web.json_response({
                "type": "file", "path": path, "encoding": "base64",
                "content": base64.b64encode(text.encode()).decode(),
            })
        listing = [{"type": "file", "path": p, "name": p.rsplit("/", 1)[-1]}
                   for (r, p) in self.files if r == repo and p.startswith(path + "/")
                   and "/" not in p[len(path) + 1:]]
        if listing:
            return web.json_response(listing)
        return web.json_response({"message": "Not Found"}, status=404)

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
