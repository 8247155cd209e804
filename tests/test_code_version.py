"""The code version a saved index is keyed by (``builds.code_version``): any change to a module
that shapes an index's arrays or reads them back must change it, or an upgrade maps an index
written by the old code. Its globs once pointed at folders a package move had emptied, and the
version then hashed one module only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bot.matching.builds import CODE_PACKAGES, code_sources

BOT = Path(__file__).resolve().parents[1] / "bot"

# Modules a saved index depends on, from the tokeniser to the cluster model; and one the version
# leaves out on purpose (ranking weights: no array is computed from them).
SHAPING = ["matching/text.py", "matching/build.py", "matching/arrays.py", "matching/evidence.py",
           "clusters/models.py", "clusters/load.py"]
NOT_SHAPING = ["matching/model.json"]

_PRINT = ("import bot.matching.builds as b; print(b.__file__); print(b.code_version())")


def _version_of(package_root: Path) -> str:
    """``code_version()`` of the ``bot`` package under ``package_root``, in a fresh process
    (it is cached per process, and reads the files of the package it was imported from)."""
    env = dict(os.environ, PYTHONPATH=str(package_root), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-c", _PRINT], cwd=package_root, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    module, version = done.stdout.split()
    assert Path(module).is_relative_to(package_root), "the copy was not the one imported"
    return version


def _flip_one_byte(file: Path) -> None:
    """The case of the first letter after the first quote: inside a docstring or a JSON string,
    so the module still imports and the file is the same size."""
    data = bytearray(file.read_bytes())
    start = data.index(b'"')
    i = next(i for i in range(start, len(data)) if chr(data[i]).isalpha())
    data[i] = ord(chr(data[i]).swapcase())
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("unchanged")
    shutil.copytree(BOT, root / "bot", ignore=shutil.ignore_patterns("__pycache__"))
    return _version_of(root)


@pytest.mark.parametrize("module", SHAPING)
def test_one_byte_changed_in_a_module_that_shapes_the_index_changes_the_version(
        module: str, baseline: str, tmp_path: Path) -> None:
    shutil.copytree(BOT, tmp_path / "bot", ignore=shutil.ignore_patterns("__pycache__"))
    _flip_one_byte(tmp_path / "bot" / module)
    assert _version_of(tmp_path) != baseline


@pytest.mark.parametrize("file", NOT_SHAPING)
def test_the_ranking_weights_do_not_invalidate_a_saved_index(
        file: str, baseline: str, tmp_path: Path) -> None:
    shutil.copytree(BOT, tmp_path / "bot", ignore=shutil.ignore_patterns("__pycache__"))
    _flip_one_byte(tmp_path / "bot" / file)
    assert _version_of(tmp_path) == baseline


def test_every_module_of_the_matcher_and_cluster_packages_is_hashed() -> None:
    hashed = {p.relative_to(BOT).as_posix() for p in code_sources()}
    for package in CODE_PACKAGES:
        modules = {p.relative_to(BOT).as_posix() for p in (BOT / package).glob("*.py")}
        assert modules and modules <= hashed, package
    assert set(SHAPING) <= hashed
    assert "matching/builds.py" in hashed and "matching/index.py" in hashed


def test_a_package_folder_without_modules_fails_loudly(tmp_path: Path) -> None:
    """Were the packages to move again, the version would hash nothing and never change."""
    with pytest.raises(RuntimeError, match="no modules"):
        code_sources(tmp_path)
    (tmp_path / "matching").mkdir()
    (tmp_path / "matching" / "text.py").write_text("")
    with pytest.raises(RuntimeError, match="clusters"):
        code_sources(tmp_path)
