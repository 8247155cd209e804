from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bot.settings import PrivateKey, ServiceConfig, Settings, SettingsError, load_service_config


def test_settings_from_env_reads_every_name(key_pair: tuple[str, str], tmp_path: Path) -> None:
    pem_path = tmp_path / "app.pem"
    pem_path.write_text(key_pair[0])
    s = Settings.from_env({
        "DEJAFIX_APP_ID": "123", "DEJAFIX_PRIVATE_KEY_PATH": str(pem_path),
        "DEJAFIX_WEBHOOK_SECRET": "s", "DEJAFIX_GITHUB_URL": "http://127.0.0.1:9/api/",
        "DEJAFIX_DATA_DIR": str(tmp_path / "d"), "PORT": "8123",
    })
    assert s.app_id == "123" and s.has_app_credentials
    assert s.github_url == "http://127.0.0.1:9/api"
    assert s.data_dir == tmp_path / "d" and s.port == 8123
    assert s.webhook_secret is not None and s.webhook_secret.get_secret_value() == "s"


def test_defaults_when_nothing_is_set() -> None:
    s = Settings.from_env({})
    assert s.github_url == "https://api.github.com" and s.port == 8000
    assert s.data_dir == Path("./data") and not s.has_app_credentials


def test_inline_pem_with_escaped_newlines(key_pair: tuple[str, str]) -> None:
    escaped = key_pair[0].replace("\n", "\\n")
    s = Settings.from_env({"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY": escaped})
    assert s.private_key is not None and s.private_key.reveal() == key_pair[0]


def test_key_never_prints_itself(key_pair: tuple[str, str]) -> None:
    key = PrivateKey(key_pair[0], source="test")
    for text in (str(key), repr(key), repr(Settings(app_id="1", private_key=key))):
        assert "PRIVATE KEY" not in text
    assert key.fingerprint.startswith("SHA256:")


@pytest.mark.parametrize("env, message", [
    ({"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY": "not a key"}, "DEJAFIX_PRIVATE_KEY is not"),
    ({"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY_PATH": "/nonexistent.pem"}, "cannot read"),
    ({"DEJAFIX_APP_ID": "1"}, "DEJAFIX_PRIVATE_KEY"),
    ({"DEJAFIX_APP_ID": "abc"}, "numeric"),
    ({"PORT": "eighty"}, "PORT"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_secret_value_not_in_errors() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"DEJAFIX_APP_ID": "1", "DEJAFIX_PRIVATE_KEY": "hunter2-secret"})
    assert "hunter2" not in str(info.value)


def test_service_config_file(tmp_path: Path) -> None:
    path = tmp_path / "bot.yml"
    path.write_text("workers: 2\nmatching:\n  threshold: 0.8\n")
    cfg = load_service_config(path)
    assert cfg.workers == 2 and cfg.matching.threshold == 0.8
    path.write_text("workerz: 2\n")
    with pytest.raises(SettingsError, match=r"bot.yml: workerz"):
        load_service_config(path)
    path.write_text("workers: [\n")
    with pytest.raises(SettingsError, match=r"bot.yml:\d+: not valid YAML"):
        load_service_config(path)


def test_the_removed_semantic_key_is_ignored_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A deployment's file from before the semantic signal was removed still loads: the key
    is dropped, and said so once, rather than refused as an unknown key."""
    path = tmp_path / "bot.yml"
    path.write_text("matching:\n  threshold: 0.8\n  semantic: true\n")
    with caplog.at_level(logging.WARNING, logger="dejafix.settings"):
        cfg = load_service_config(path)
    assert cfg.matching.threshold == 0.8
    assert "semantic" not in cfg.matching.model_dump()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "matching.semantic is ignored" in warnings[0] and "removed" in warnings[0]
    assert str(path) in warnings[0]
    caplog.clear()
    # Without the key, nothing is said; any other unknown key under matching is still refused.
    path.write_text("matching:\n  threshold: 0.8\n")
    with caplog.at_level(logging.WARNING, logger="dejafix.settings"):
        load_service_config(path)
    assert not caplog.records
    path.write_text("matching:\n  semantik: true\n")
    with pytest.raises(SettingsError, match=r"matching.semantik"):
        load_service_config(path)


def test_shipped_service_config_loads() -> None:
    cfg = load_service_config()
    assert isinstance(cfg, ServiceConfig)
    assert all(p.exists() for p in cfg.resolved_cluster_paths())


def test_the_pages_settings_are_read(tmp_path: Path) -> None:
    s = Settings.from_env({
        "DEJAFIX_OAUTH_CLIENT_ID": "Iv1.abc", "DEJAFIX_OAUTH_CLIENT_SECRET": "shh",
        "DEJAFIX_SESSION_SECRET": "cookie-key", "DEJAFIX_PUBLIC_URL": "https://bot.example/",
        "DEJAFIX_GITHUB_WEB_URL": "https://ghe.example/", "DEJAFIX_DATA_DIR": str(tmp_path),
    })
    assert s.has_oauth and s.oauth_client_id == "Iv1.abc"
    assert s.oauth_client_secret is not None and s.oauth_client_secret.get_secret_value() == "shh"
    assert s.public_url == "https://bot.example" and s.github_web_url == "https://ghe.example"
    assert not Settings.from_env({"DEJAFIX_DATA_DIR": str(tmp_path)}).has_oauth


@pytest.mark.parametrize(("env", "message"), [
    ({"DEJAFIX_OAUTH_CLIENT_ID": "Iv1.abc"}, "DEJAFIX_OAUTH_CLIENT_SECRET is not set"),
    ({"DEJAFIX_OAUTH_CLIENT_SECRET": "shh"}, "DEJAFIX_OAUTH_CLIENT_ID is not set"),
    ({"DEJAFIX_PUBLIC_URL": "bot.example"}, "DEJAFIX_PUBLIC_URL must start with http"),
])
def test_half_a_sign_in_or_a_bare_public_url_is_an_error(env: dict[str, str], message: str,
                                                          tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=message) as caught:
        Settings.from_env({**env, "DEJAFIX_DATA_DIR": str(tmp_path)})
    assert "shh" not in str(caught.value)


def test_a_broken_stored_app_names_its_file(tmp_path: Path) -> None:
    folder = tmp_path / "github-app"
    folder.mkdir()
    (folder / "app.json").write_text("not json")
    with pytest.raises(SettingsError, match=r"app\.json"):
        Settings.from_env({"DEJAFIX_DATA_DIR": str(tmp_path)})
    (folder / "app.json").write_text('{"id": 5}')
    with pytest.raises(SettingsError, match=r"private-key\.pem is missing"):
        Settings.from_env({"DEJAFIX_DATA_DIR": str(tmp_path)})


def test_the_environment_wins_over_a_stored_app(key_pair: tuple[str, str],
                                                tmp_path: Path) -> None:
    folder = tmp_path / "github-app"
    folder.mkdir()
    (folder / "app.json").write_text('{"id": 5, "client_id": "Iv1.stored"}')
    (folder / "private-key.pem").write_text(key_pair[0])
    (folder / "webhook-secret").write_text("stored-secret")
    (folder / "client-secret").write_text("stored-client-secret")
    stored = Settings.from_env({"DEJAFIX_DATA_DIR": str(tmp_path)})
    assert stored.app_id == "5" and stored.oauth_client_id == "Iv1.stored" and stored.has_oauth
    assert stored.webhook_secret is not None
    assert stored.webhook_secret.get_secret_value() == "stored-secret"
    assert stored.credentials_source == str(folder)
    pem = tmp_path / "env.pem"
    pem.write_text(key_pair[0])
    env = Settings.from_env({"DEJAFIX_DATA_DIR": str(tmp_path), "DEJAFIX_APP_ID": "9",
                             "DEJAFIX_PRIVATE_KEY_PATH": str(pem)})
    assert env.app_id == "9" and env.credentials_source == "environment" and not env.has_oauth
