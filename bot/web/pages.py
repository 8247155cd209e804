"""The web page: server-rendered HTML (Jinja2 templates, no JavaScript needed)."""

from __future__ import annotations

from typing import Any

import aiohttp_jinja2
import jinja2
from aiohttp import web

from bot.settings import Settings
from bot.web.auth import csrf_token, install_sessions

# Set on the request by the page's access check: who is looking (auth.Viewer), or absent.
VIEWER = "dejafix.viewer"


async def _common(request: web.Request) -> dict[str, Any]:
    """What base.html reads on every page: who is looking, the CSRF token for its forms, and
    whether to say that the page is the operator's alone."""
    viewer = request.get(VIEWER)
    return {"viewer": viewer, "csrf": await csrf_token(request),
            "operator_notice": viewer is not None and viewer.operator}


def install_templates(app: web.Application, settings: Settings) -> None:
    """Templates and the session cookie, before any page route is added."""
    aiohttp_jinja2.setup(app, loader=jinja2.PackageLoader("bot.web", "templates"),
                         autoescape=jinja2.select_autoescape(default=True),
                         undefined=jinja2.StrictUndefined, context_processors=[_common])
    install_sessions(app, settings)
