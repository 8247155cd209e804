"""The web page: server-rendered HTML (Jinja2 templates, no JavaScript needed)."""

from __future__ import annotations

import aiohttp_jinja2
import jinja2
from aiohttp import web

from bot.settings import Settings
from bot.web.auth import install_sessions


def install_templates(app: web.Application, settings: Settings) -> None:
    """Templates and the session cookie, before any page route is added."""
    aiohttp_jinja2.setup(app, loader=jinja2.PackageLoader("bot.web", "templates"),
                         autoescape=jinja2.select_autoescape(default=True),
                         undefined=jinja2.StrictUndefined)
    install_sessions(app, settings)
