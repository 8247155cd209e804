"""Mistakes a maintainer makes on the command line end in one line naming what is wrong and a
non-zero exit, never a traceback or a bot that starts with nothing (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def run(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> tuple[int, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DEJAFIX_")}
    proc = subprocess.run([sys.executable, "-m", "bot", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=60, env={**base, **(env or {})})
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def test_match_on_a_cluster_path_that_does_not_exist_is_an_error() -> None:
    code, err = run("match", "--clusters", "/no/such/clusters", stdin='{"title": "x"}\n')
    assert code == 2 and "--clusters /no/such/clusters: no such file" in err


def test_serve_with_a_config_file_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    code, err = run("serve", "--dry-run", "--config", str(tmp_path / "bot.yml"),
                    env={"DEJAFIX_DATA_DIR": str(tmp_path / "data")})
    assert code == 2 and f"--config {tmp_path / 'bot.yml'}: no such file" in err


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_data_dir_names_the_variable(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    data_dir = blocker if kind == "a file" else blocker / "data"
    code, err = run("serve", "--dry-run", env={"DEJAFIX_DATA_DIR": str(data_dir)})
    assert code == 2 and f"DEJAFIX_DATA_DIR ({data_dir})" in err, err


@pytest.mark.parametrize("args, says", [
    (["--log-level", "loud", "serve"], "--log-level: invalid choice"),
    (["backfill", "not-a-repo"], "'not-a-repo' is not OWNER/REPO"),
    (["backfill", "octo/widgets", "--since", "last week"], "'last week' is not a date"),
])
def test_bad_arguments_are_refused_by_name(args: list[str], says: str) -> None:
    code, err = run(*args)
    assert code == 2 and says in err, err


def test_backfill_without_github_ends_in_one_line(tmp_path: Path) -> None:
    code, err = run("backfill", "octo/widgets", env={
        "DEJAFIX_GITHUB_URL": "http://127.0.0.1:9", "DEJAFIX_GITHUB_TOKEN": "not-a-token",
        "DEJAFIX_DATA_DIR": str(tmp_path / "data")})
    last = [line for line in err.splitlines() if line.split(" ", 3)[2:3] != ["WARNING"]]
    assert code == 1 and len(last) == 1, err
    assert last[0].startswith("backfill octo/widgets: cannot reach GitHub")


def test_backtest_on_cluster_files_with_dates_runs_offline(tmp_path: Path) -> None:
    """``backtest --clusters`` needs no store and no network: clusters whose issues carry their
    opening dates are replayed as they are."""
    from bot.clusters.learning import cluster_from_fix

    lines = []
    for issue, pr, title in [(1, 101, "Exporter flush_queue hangs forever on shutdown"),
                             (2, 102, "Tooltip renders behind the modal dialog overlay")]:
        c = cluster_from_fix("acme/widgets", {"number": pr, "title": title,
                                              "merged_at": "2026-01-05"},
                             [{"number": issue, "title": title, "created_at": "2026-01-01"}],
                             [{"filename": f"widgets/{pr}.py"}])
        later = c.members[0].model_copy(update={"number": issue + 10, "title": title.lower(),
                                                "created_at": "2026-01-09"})
        lines.append(c.model_copy(update={"members": [*c.members, later]}).model_dump_json())
    path = tmp_path / "clusters.jsonl"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "bot", "backtest", "acme/widgets", "--clusters",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DEJAFIX_GITHUB_URL": "http://127.0.0.1:9",
                               "DEJAFIX_DATA_DIR": str(tmp_path / "data")})
    assert proc.returncode == 0, proc.stderr
    assert "2 clusters, 4 issues replayed (2 opened after their bug's fix" in proc.stdout
    assert "precision 1.000 recall 1.000" in proc.stdout, proc.stdout


def test_backtest_without_dated_issues_says_what_it_needs(tmp_path: Path) -> None:
    code, err = run("backtest", "NousResearch/hermes-agent", "--clusters",
                    str(ROOT / "config" / "clusters"), env={"DEJAFIX_DATA_DIR": str(tmp_path)})
    assert code == 1 and "created_at" in err and ".venv/bin/dejafix backfill" in err, err


def test_a_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    from bot.eval.offline import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert not write_plot(str(tmp_path / "pr.png"), {"x": [(0.5, 1.0, 0.5)]}, (1.0, 0.5))
    assert ".[eval]" in capsys.readouterr().err and not (tmp_path / "pr.png").exists()
