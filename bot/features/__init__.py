"""Features: the only place where GitHub calls, the store and the matcher meet. Each module has
its own ``gidgethub.routing.Router``; ``bot.jobs.dispatch`` runs them."""

from __future__ import annotations

from gidgethub.routing import Router

from bot.features import (
    commands,
    config_check,
    installs,
    known_fix,
    learning,
    repo_clusters,
)

ROUTERS: tuple[Router, ...] = (
    known_fix.router, learning.router, commands.router, config_check.router,
    installs.router, repo_clusters.router,
)
