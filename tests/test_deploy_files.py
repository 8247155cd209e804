"""The deployment files start the same command the Procfile does, with the settings contract."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.fault_support import free_port


def test_systemd_unit_runs_the_server_with_its_settings() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((ROOT / "deploy" / "dejafix.service").read_text())
    service = unit["Service"]
    assert service["ExecStart"].endswith("python -m bot serve")
    assert service["EnvironmentFile"] == "/etc/dejafix.env"
    assert "DEJAFIX_DATA_DIR=" in service["Environment"]
    assert service["KillSignal"] == "SIGTERM"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_container_image_runs_the_server_unprivileged_with_a_data_volume() -> None:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    assert 'CMD ["python", "-m", "bot", "serve", "--host", "0.0.0.0"]' in text
    assert "DEJAFIX_DATA_DIR=/data" in text and 'VOLUME ["/data"]' in text
    assert re.search(r"^USER [1-9]\d*:", text, re.M) and "/healthz" in text
    # Everything the image copies exists (the build would fail otherwise).
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source


def test_deploy_guide_is_linked_from_the_readme() -> None:
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()


# The image as `docker run -p 8000:8000 -v dejafix-data:/data --env-file .env dejafix` starts
# it, with .env copied from .env.example: the image's ENV, then the env file over it (Docker's
# rules: `#` lines and blank lines skipped, `KEY=VALUE` taken verbatim, a bare `KEY` passed from
# the caller's environment), running as the image's USER in a WORKDIR that belongs to root.

def _containerfile() -> str:
    return (ROOT / "deploy" / "Containerfile").read_text()


def _instructions(text: str, name: str) -> list[str]:
    """The arguments of each ``name`` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(None, 1)[1] for line in joined.splitlines()
            if line.split(None, 1)[:1] == [name]]


def _image_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _instructions(text, "ENV"):
        env.update(re.findall(r"(\w+)=(\S+)", args))
    return env


def _env_file(text: str, environ: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if sep:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
    return env


def _container_env() -> dict[str, str]:
    env = _image_env(_containerfile())
    env.update(_env_file((ROOT / ".env.example").read_text(), environ={}))
    return env


def _volume() -> str:
    (volumes,) = _instructions(_containerfile(), "VOLUME")
    (volume,) = json.loads(volumes)
    return str(volume)


def _image_user() -> tuple[int, int]:
    (user,) = _instructions(_containerfile(), "USER")
    match = re.fullmatch(r"(\d+):(\d+)", user.strip())
    assert match, f"USER {user}: expected a numeric uid:gid (Kubernetes' runAsNonRoot needs it)"
    return int(match[1]), int(match[2])


def _volume_setup() -> tuple[tuple[int, int], int]:
    """The owner and mode the image's RUN gives the volume directory (`chown U:G`, `chmod MODE`)."""
    volume = re.escape(_volume())
    run = " && ".join(_instructions(_containerfile(), "RUN"))
    owner = re.search(rf"\bchown (\d+):(\d+) {volume}(?!\S)", run)
    mode = re.search(rf"\bchmod (0?[0-7]{{3}}) {volume}(?!\S)", run)
    assert owner and mode, f"the image's RUN sets no numeric owner and mode on {_volume()}"
    return (int(owner[1]), int(owner[2])), int(mode[1], 8)


def test_the_env_example_leaves_the_data_dir_on_the_image_volume() -> None:
    """A `.env` from `.env.example` given to `docker run --env-file` replaces the image's ENV:
    a DEJAFIX_DATA_DIR there (even empty: the bot's default ./data) would move the store into
    /app, which the image's user cannot write."""
    from bot.settings import Settings

    env = _container_env()
    assert env.get("DEJAFIX_DATA_DIR") == _volume() == "/data", env.get("DEJAFIX_DATA_DIR")
    settings = Settings.from_env(env)
    assert settings.data_dir == Path(_volume())
    assert settings.private_key is None and settings.database_url is None
    (exposed,) = _instructions(_containerfile(), "EXPOSE")
    assert settings.port == int(exposed)  # the image's PORT is left as it is


def test_the_image_user_owns_a_group_0_writable_volume() -> None:
    """The image's uid owns the volume, and any uid (`--user 12345`, OpenShift), which runs in
    group 0, can write it too."""
    uid, gid = _image_user()
    assert uid != 0 and gid == 0
    (owner, mode) = _volume_setup()
    assert owner == (uid, gid)
    assert mode & 0o770 == 0o770, oct(mode)
    run = " ".join(_instructions(_containerfile(), "RUN"))
    assert re.search(rf"useradd [^&]*--uid {uid} --gid {gid} ", run), run


def _as(user: tuple[int, int], argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``argv`` run as ``user``, no supplementary groups. setpriv (util-linux) where there is
    one: it keeps root's capabilities until the exec, so an interpreter under a directory only
    root can search (a pyenv in /root) still starts; the process runs without them."""
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *argv], {}
    return argv, {"user": user[0], "group": user[1], "extra_groups": []}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="switching to the image's uids needs root")
@pytest.mark.parametrize("who", ["the image's user", "--user 12345"])
def test_the_documented_run_serves_as_a_non_root_user(who: str) -> None:
    """The documented run, without a container: the bot started as the image's user (or as an
    arbitrary uid in group 0) in a root-owned working directory, with the image's ENV and
    .env.example over it, and a directory owned and moded as the image's /data mounted there.
    It answers /healthz and its store is on the volume."""
    user = _image_user() if who == "the image's user" else (12345, 0)
    base = Path(tempfile.mkdtemp(prefix="dejafix-image-"))
    try:
        base.chmod(0o755)
        app = base / "app"  # WORKDIR /app: root's, not writable by the bot
        app.mkdir(mode=0o755)
        volume = base / "data"
        volume.mkdir()
        (owner, mode) = _volume_setup()
        os.chown(volume, *owner)
        volume.chmod(mode)

        env = _container_env()
        if env.get("DEJAFIX_DATA_DIR") == _volume():
            env["DEJAFIX_DATA_DIR"] = str(volume)  # the mount
        port = free_port()
        env.update(PORT=str(port), PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME="/")

        # The stand-in holds only if the uid can run the bot and cannot write root's files.
        argv, kwargs = _as(user, [sys.executable, "-c", "import bot.web.app\ntry:\n"
                                  " open('x', 'w')\nexcept PermissionError:\n raise SystemExit(0)\n"
                                  "raise SystemExit(3)"])
        try:
            probe = subprocess.run(argv, cwd=app, env=env, capture_output=True, text=True,
                                   timeout=60, **kwargs)
        except PermissionError as exc:
            pytest.skip(f"uid {user[0]} cannot run {sys.executable}: {exc}")
        if probe.returncode not in (0, 3):
            pytest.skip(f"the interpreter or the repository is not readable by uid {user[0]}: "
                        f"{probe.stderr.strip()[-200:]}")
        assert probe.returncode == 0, f"uid {user[0]} could write a root-owned directory"

        log = base / "bot.log"
        with log.open("wb") as out:
            argv, kwargs = _as(user, [sys.executable, "-m", "bot", "serve", "--dry-run"])
            proc = subprocess.Popen(argv, cwd=app, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, **kwargs)
        try:
            health = None
            deadline = time.monotonic() + 30
            while health is None and time.monotonic() < deadline:
                assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                                timeout=2) as resp:
                        health = json.loads(resp.read())
                except OSError:
                    time.sleep(0.1)
            assert health is not None, f"no /healthz in 30 s:\n{log.read_text()}"
            assert health["ok"] and health["store"] == "sqlite", health
            store = volume / "dejafix.sqlite3"
            assert store.exists() and store.stat().st_uid == user[0], sorted(volume.iterdir())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()
    finally:
        shutil.rmtree(base, ignore_errors=True)
