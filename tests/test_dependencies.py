"""Every third-party module the bot imports is a declared runtime dependency: a fresh
`pip install .` must be able to start it (the test extras would otherwise hide a gap)."""

from __future__ import annotations

import ast
import sys
import tomllib

from tests.conftest import ROOT

# Import name -> distribution name, where they differ.
DISTRIBUTION = {"yaml": "pyyaml", "jwt": "pyjwt", "cryptography": "pyjwt",
                "pydantic_core": "pydantic-core",
                # psycopg-pool comes with psycopg's "pool" extra, declared as psycopg[binary,pool].
                "psycopg_pool": "psycopg",
                "prometheus_client": "prometheus-client",
                "pythonjsonlogger": "python-json-logger",
                "aiohttp_jinja2": "aiohttp-jinja2", "aiohttp_session": "aiohttp-session",
                "markdown_it": "markdown-it-py"}
# Imported lazily by the eval command only, and declared as the "eval" extra.
OPTIONAL = {"matplotlib"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for spec in project["dependencies"]:
        name = spec.split(";")[0]
        for sep in "<>=![ ":
            name = name.split(sep)[0]
        names.add(name.lower())
    return names


def _imported() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "bot").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_every_third_party_import_is_a_declared_dependency() -> None:
    third_party = {m for m in _imported()
                   if m not in sys.stdlib_module_names and m not in {"bot", "bench"}}
    missing = {m for m in third_party - OPTIONAL
               if DISTRIBUTION.get(m, m).lower() not in _declared()}
    assert not missing, f"imported but not in [project].dependencies: {sorted(missing)}"
