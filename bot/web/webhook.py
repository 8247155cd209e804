"""The receiver: verify, parse, record the delivery and its job in one transaction, answer 202.
It never matches and never calls GitHub, because GitHub waits 10 seconds for the answer and does
not redeliver on its own."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web
from gidgethub import ValidationFailure
from gidgethub.sansio import validate_event

from bot.db.store import Store, issue_key
from bot.github.payloads import parse_json
from bot.logs import bind, issue_number, log_context
from bot.metrics import Metrics, event_label

log = logging.getLogger("dejafix.webhook")

_REPO_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}")


def _answer(status: int, text: str) -> web.Response:
    # The common answers are constant: no JSON encoding per request.
    return web.Response(body=text.encode(), status=status, content_type="application/json",
                        charset="utf-8")


_QUEUED = '{"status": "queued"}'
_DUPLICATE = '{"status": "duplicate"}'
_IGNORED = '{"status": "ignored"}'


class Receiver:
    def __init__(
        self,
        *,
        secret: str | None,
        wants: Callable[[str, dict[str, Any]], bool],
        store: Callable[[], Store],
        metrics: Metrics | None = None,
    ) -> None:
        self.secret = secret
        # Whether some handler takes this event and action; the rest is acknowledged and
        # dropped here, so the queue (and the token mint) only sees work.
        self.wants = wants
        self.store = store
        self.metrics = metrics

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        delivery = _header(request, "X-GitHub-Delivery")
        event = _header(request, "X-GitHub-Event")
        outcome = "error"
        with log_context(delivery=delivery):
            try:
                outcome, response = await self._handle(request, delivery, event)
            except web.HTTPRequestEntityTooLarge:
                outcome = "too_large"  # raised by aiohttp while reading the body
                raise
            finally:
                if self.metrics is not None:
                    self.metrics.deliveries.inc(event=event_label(event), outcome=outcome)
                    self.metrics.receiver_seconds.observe(time.perf_counter() - started)
        return response

    async def _handle(self, request: web.Request, delivery: str, event: str
                      ) -> tuple[str, web.Response]:
        signature = request.headers.get("X-Hub-Signature-256")
        # aiohttp raises 413 itself when the body exceeds the app's client_max_size.
        body = await request.read()
        if self.secret is not None:
            if not signature or not signature.startswith("sha256="):
                # validate_event would also accept "sha1=..."; this header promises SHA-256.
                log.warning("delivery %s: rejected, no sha256 X-Hub-Signature-256",
                            delivery or "-")
                return "unauthorized", web.json_response({"error": "signature required"},
                                                         status=401)
            try:
                validate_event(body, signature=signature, secret=self.secret)
            except ValidationFailure:
                log.warning("delivery %s: rejected, signature does not match", delivery or "-")
                return "unauthorized", web.json_response({"error": "bad signature"}, status=401)
        if not delivery or not event:
            return "bad_request", web.json_response(
                {"error": "X-GitHub-Delivery and X-GitHub-Event are required"}, status=400
            )
        ctype = request.content_type
        if ctype == "application/x-www-form-urlencoded":
            # The App's other delivery format: the same JSON in a form field named payload.
            try:
                fields = parse_qs(body.decode("latin-1"), max_num_fields=10)
            except ValueError:
                # parse_qs refuses a form past max_num_fields; GitHub sends one field, so a
                # longer form is the sender's mistake, not our failure.
                log.warning("delivery %s: form body with more than 10 fields", delivery)
                return "bad_request", web.json_response(
                    {"error": "form body has more than 10 fields; expected one, payload"},
                    status=400)
            raw = fields.get("payload", [""])[0].encode("latin-1")
        elif ctype == "application/json":
            raw = body
        else:
            log.warning("delivery %s: content type %r is not JSON", delivery, ctype[:100])
            return "unsupported_media_type", web.json_response(
                {"error": "expected application/json"}, status=415)
        try:
            payload = parse_json(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            log.warning("delivery %s: body is not JSON (%s)", delivery, str(exc)[:200])
            return "bad_request", web.json_response({"error": "body is not JSON"}, status=400)
        if not isinstance(payload, dict):
            log.warning("delivery %s: body is JSON but not an object", delivery)
            return "bad_request", web.json_response({"error": "body must be a JSON object"},
                                                        status=400)
        if event == "ping":
            return "ping", web.json_response({"ok": True, "zen": payload.get("zen")}, status=200)
        action = payload.get("action")
        if action is not None and not isinstance(action, str):
            # gidgethub's router looks the action up in a dict: a list or object would raise.
            log.warning("delivery %s: %s with a non-string action, skipped", delivery, event)
            return "bad_request", web.json_response({"error": "action must be a string"},
                                                        status=400)
        if not self.wants(event, payload):
            log.debug("delivery %s: %s is not handled, acknowledged", delivery, event)
            return "ignored", _answer(202, _IGNORED)
        repo_data = payload.get("repository")
        repo = repo_data.get("full_name") if isinstance(repo_data, dict) else None
        number = issue_number(payload)
        bind(repo=repo if isinstance(repo, str) and _REPO_NAME.fullmatch(repo) else None,
             issue=number)
        if event in ("installation", "installation_repositories") and repo_data is None:
            # About an installation, not one repository: GitHub names none (its repositories
            # are listed in the payload); the worker runs it without one.
            repo = None
        elif not isinstance(repo, str) or not _REPO_NAME.fullmatch(repo):
            log.warning("delivery %s: %s without a valid repository.full_name, skipped",
                        delivery, event)
            return "bad_request", web.json_response(
                {"error": "repository.full_name missing"}, status=400)
        inst = payload.get("installation")
        installation_id = inst.get("id") if isinstance(inst, dict) else None
        if not isinstance(installation_id, int) or isinstance(installation_id, bool):
            installation_id = None
        elif not 0 < installation_id < 2**63:
            log.warning("delivery %s: %s with installation.id out of range, skipped",
                        delivery, event)
            return "bad_request", web.json_response(
                {"error": "installation.id out of range"}, status=400)
        # The JSON itself, also for form deliveries, whose body is "payload=<urlencoded JSON>".
        # One transaction: the delivery's row (its id unique) and its job; the commit wakes the
        # workers (a NOTIFY with PostgreSQL).
        store = self.store()
        try:
            fresh = await asyncio.to_thread(store.accept_delivery, delivery, event, action, repo,
                                            installation_id, raw, issue_key(repo, number))
        except store.unstorable as exc:
            # A field the store cannot hold (a lone surrogate escape, a NUL in PostgreSQL's
            # text): redelivering it would not help.
            log.warning("delivery %s: %s not recorded (%s)", delivery, event, str(exc)[:200])
            return "bad_request", web.json_response(
                {"error": "a field of the delivery cannot be recorded"}, status=400)
        except store.unavailable as exc:
            # Not recorded (a full disk, a lost database, a lock held past its timeout): a 5xx,
            # so GitHub lists the delivery as failed and it can be redelivered once mended.
            log.error("delivery %s: could not be recorded (%s); answered 503", delivery, exc)
            return "error", web.json_response({"error": "the delivery could not be recorded"},
                                              status=503)
        if not fresh:
            log.info("delivery %s: redelivery of a delivery already accepted, not redone",
                     delivery)
            return "duplicate", _answer(202, _DUPLICATE)
        log.info("delivery %s: %s.%s for %s queued", delivery, event, action, repo)
        return "queued", _answer(202, _QUEUED)


def _header(request: web.Request, name: str) -> str:
    """A header that goes into log lines and the ledger: short and printable, or empty."""
    value = request.headers.get(name, "")
    return value if len(value) <= 100 and value.isprintable() else ""
