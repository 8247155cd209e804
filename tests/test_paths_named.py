"""Every file of the project that its documentation, build files or source text names by path
exists: a module moved without its references leaves readers (and ``code_version``-like globs)
pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

# A path into one of the project's own folders, ending in a suffix the project keeps files in.
_PATH = re.compile(r"(?<![\w/.-])((?:bot|bench|tests|config|deploy|docs)/[\w./-]*?"
                   r"\.(?:py|json|jsonl|md|yml|yaml|toml|html|txt))(?![\w/-])")


def _named(text: str) -> set[str]:
    return set(_PATH.findall(text))


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "Makefile",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "bench").glob("*.md"))]
    for folder in ("bot", "bench"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f.exists()]


def test_the_pattern_finds_a_path_in_prose() -> None:
    assert _named("the fit (`bot/eval/fit.py`) and bench/fit.py, not bot/x") == {
        "bot/eval/fit.py", "bench/fit.py"}


def test_every_path_the_project_names_exists() -> None:
    missing = [f"{source.relative_to(ROOT)}: {path}" for source in _sources()
               for path in sorted(_named(source.read_text(encoding="utf-8")))
               if not (ROOT / path).exists()]
    assert not missing, "named but not there:\n" + "\n".join(missing)
