"""app.yml is what a maintainer pastes into GitHub; it must be a manifest GitHub accepts."""

from __future__ import annotations

import yaml

from tests.conftest import ROOT

# Events GitHub sends to every App and refuses in a manifest's default_events.
ALWAYS_DELIVERED = {"installation", "installation_repositories"}
# Which permission an event needs (GitHub rejects events their permissions do not cover).
EVENT_PERMISSION = {"issues": "issues", "issue_comment": "issues", "pull_request": "pull_requests",
                    "push": "contents"}


def test_manifest_permissions_and_events() -> None:
    manifest = yaml.safe_load((ROOT / "app.yml").read_text())
    perms = manifest["default_permissions"]
    assert perms == {"issues": "write", "metadata": "read", "contents": "read",
                     "pull_requests": "read", "checks": "write"}
    events = set(manifest["default_events"])
    assert {"issues", "issue_comment", "pull_request", "push"} <= events
    assert not events & ALWAYS_DELIVERED
    for event in events:
        assert EVENT_PERMISSION[event] in perms, event
    assert manifest["hook_attributes"]["url"].endswith("/webhook")


def test_procfile_runs_the_server_and_a_worker() -> None:
    from bot.__main__ import build_parser

    lines = dict(line.split(": ", 1) for line in (ROOT / "Procfile").read_text().splitlines())
    assert lines == {"web": "python -m bot serve --host 0.0.0.0", "worker": "python -m bot worker"}
    for command in lines.values():  # both parse as the CLI's commands
        build_parser().parse_args(command.split()[3:])


def test_every_event_the_manifest_subscribes_to_has_a_feature() -> None:
    """app.yml's notes promise what each event is for: some feature must take it."""
    from bot.features import ROUTERS

    manifest = yaml.safe_load((ROOT / "app.yml").read_text())
    for event in manifest["default_events"]:
        taken = any(router._shallow_routes.get(event) or router._deep_routes.get(event)
                    for router in ROUTERS)
        assert taken, event
    assert "ignores them" not in (ROOT / "app.yml").read_text()
