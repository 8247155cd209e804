"""The README's configuration reference is generated from the model; keep them in step."""

from __future__ import annotations

import re

from bot.repo_config import reference_markdown
from bot.settings import ServiceConfig
from tests.conftest import ROOT


def test_readme_config_reference_matches_the_model() -> None:
    readme = (ROOT / "README.md").read_text()
    assert reference_markdown() in readme


def test_readme_names_every_environment_setting_and_service_key() -> None:
    readme = (ROOT / "README.md").read_text()
    env = (ROOT / ".env.example").read_text()
    # Every variable Settings.from_env reads, found in its source so that none can be added
    # without the README and .env.example; the token is read by the backfill command.
    read = set(re.findall(r'get\("([A-Z_]+)"\)', (ROOT / "bot" / "settings.py").read_text()))
    assert {"DEJAFIX_APP_ID", "DEJAFIX_OAUTH_CLIENT_SECRET", "PORT"} <= read
    for name in sorted(read | {"DEJAFIX_GITHUB_TOKEN"}):
        assert f"`{name}`" in readme and f"{name}=" in env
    assert "make run" in readme and "make test" in readme
    for key in ServiceConfig.model_fields:
        assert key in (ROOT / "config" / "bot.yml").read_text() or key in readme, key


def test_readme_commands_run_as_written_in_a_fresh_clone() -> None:
    """A bare ``python -m bot`` fails outside the virtualenv (no aiohttp): the README names the
    virtualenv's entry point, which ``make run``/``make test`` install."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"(?<![\w/.])python -m bot\b", readme)
    assert ".venv/bin/dejafix serve" in readme
    project = (ROOT / "pyproject.toml").read_text()
    assert 'dejafix = "bot.__main__:main"' in project
