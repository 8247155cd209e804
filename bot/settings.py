"""Settings from the environment and service config from ``config/bot.yml``.

The environment names are a contract with checks outside the project; keep them.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from bot.matching.types import MatchPolicy

PROJECT_ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("dejafix.settings")


def project_path(relative: str | Path) -> Path:
    """A relative path from config: found in the working directory (a deployment's own checkout
    or a non-editable install run from its folder) or else in the source tree."""
    path = Path(relative)
    if path.is_absolute():
        return path
    here = Path.cwd() / path
    return here if here.exists() else PROJECT_ROOT / path


DEFAULT_CONFIG_PATH = Path("config") / "bot.yml"


class SettingsError(Exception):
    """A setting is missing or unusable. The message names the variable, never its value."""


class PrivateKey:
    """The App's PEM key. It refuses to print itself: only the fingerprint reaches logs."""

    __slots__ = ("_loaded", "_pem", "fingerprint")

    def __init__(self, pem: str, *, source: str) -> None:
        from cryptography.hazmat.primitives import serialization

        try:
            key = serialization.load_pem_private_key(pem.encode(), password=None)
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"{source} is not a PEM private key without a passphrase") from exc
        der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self._pem = pem
        # Kept loaded: parsing the PEM for every JWT cost about 40 ms of CPU each time.
        self._loaded = key
        # The same form GitHub shows on the App's settings page, so operators can compare.
        self.fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(der).digest()).decode()

    def reveal(self) -> str:
        return self._pem

    def signing_key(self) -> Any:
        """The loaded key, for PyJWT (which would otherwise parse the PEM on every call)."""
        return self._loaded

    def __repr__(self) -> str:
        return f"PrivateKey({self.fingerprint})"

    __str__ = __repr__


class Settings(BaseModel):
    """Process settings, read once at startup from ``DEJAFIX_*`` variables and ``PORT``."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    app_id: str | None = None
    private_key: PrivateKey | None = None
    webhook_secret: SecretStr | None = None
    github_url: str = "https://api.github.com"
    data_dir: Path = Path("./data")
    # PostgreSQL instead of the SQLite file under data_dir; a secret, since it may carry a
    # password (logs show it redacted).
    database_url: SecretStr | None = None
    port: int = 8000
    # The web page's sign-in with GitHub: the App's OAuth client (user-to-server tokens).
    oauth_client_id: str | None = None
    oauth_client_secret: SecretStr | None = None
    # Signs and encrypts the page's session cookie; without it, derived from the OAuth secret
    # (so every instance of one deployment accepts the same cookies).
    session_secret: SecretStr | None = None
    # GitHub's web side (OAuth pages, the new-App form), beside the API's github_url.
    github_web_url: str = "https://github.com"
    # This deployment's public URL, for the manifest's webhook and callback URLs; without it,
    # the URL the request for /setup came to.
    public_url: str | None = None
    # Where the App's credentials came from: "environment", the data directory's
    # ``github-app/`` (written by /setup), or None.
    credentials_source: str | None = None

    @property
    def has_app_credentials(self) -> bool:
        return self.app_id is not None and self.private_key is not None

    @property
    def has_oauth(self) -> bool:
        return self.oauth_client_id is not None and self.oauth_client_secret is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        key: PrivateKey | None = None
        pem = get("DEJAFIX_PRIVATE_KEY")
        key_path = get("DEJAFIX_PRIVATE_KEY_PATH")
        if pem is not None:
            # Platforms that cannot hold newlines in a variable store them as "\n".
            key = PrivateKey(pem.replace("\\n", "\n"), source="DEJAFIX_PRIVATE_KEY")
        elif key_path is not None:
            try:
                text = Path(key_path).read_text()
            except OSError as exc:
                raise SettingsError(
                    f"DEJAFIX_PRIVATE_KEY_PATH: cannot read {key_path}: {exc.strerror}"
                ) from exc
            key = PrivateKey(text, source=f"DEJAFIX_PRIVATE_KEY_PATH ({key_path})")

        port_text = get("PORT") or "8000"
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise SettingsError(f"PORT must be a TCP port number, got {port_text!r}")
        secret = get("DEJAFIX_WEBHOOK_SECRET")
        app_id = get("DEJAFIX_APP_ID")
        if app_id is not None and not app_id.isdigit():
            raise SettingsError("DEJAFIX_APP_ID must be the App's numeric id")
        if (app_id is None) != (key is None):
            missing = "DEJAFIX_APP_ID" if app_id is None else "DEJAFIX_PRIVATE_KEY(_PATH)"
            raise SettingsError(f"{missing} is not set: App credentials need both id and key")
        data_dir = Path(get("DEJAFIX_DATA_DIR") or "./data")
        client_id = get("DEJAFIX_OAUTH_CLIENT_ID")
        client_secret = get("DEJAFIX_OAUTH_CLIENT_SECRET")
        source = "environment" if app_id is not None else None
        stored = stored_app(data_dir) if app_id is None else None
        if stored is not None:
            # Registered through /setup: the environment still wins for anything it sets.
            app_id, key = stored.app_id, stored.private_key
            secret = secret or stored.webhook_secret
            client_id = client_id or stored.client_id
            client_secret = client_secret or stored.client_secret
            source = str(app_dir(data_dir))
        if (client_id is None) != (client_secret is None):
            missing = "DEJAFIX_OAUTH_CLIENT_ID" if client_id is None else \
                "DEJAFIX_OAUTH_CLIENT_SECRET"
            raise SettingsError(f"{missing} is not set: sign-in needs both the client id and "
                                "secret")
        public_url = get("DEJAFIX_PUBLIC_URL")
        if public_url is not None and not public_url.startswith(("http://", "https://")):
            raise SettingsError("DEJAFIX_PUBLIC_URL must start with http:// or https://")
        session_secret = get("DEJAFIX_SESSION_SECRET")
        return cls(
            app_id=app_id,
            private_key=key,
            webhook_secret=SecretStr(secret) if secret else None,
            github_url=(get("DEJAFIX_GITHUB_URL") or "https://api.github.com").rstrip("/"),
            data_dir=data_dir,
            database_url=_database_url(get("DEJAFIX_DATABASE_URL") or get("DATABASE_URL")),
            port=int(port_text),
            oauth_client_id=client_id,
            oauth_client_secret=SecretStr(client_secret) if client_secret else None,
            session_secret=SecretStr(session_secret) if session_secret else None,
            github_web_url=(get("DEJAFIX_GITHUB_WEB_URL") or "https://github.com").rstrip("/"),
            public_url=public_url.rstrip("/") if public_url else None,
            credentials_source=source,
        )


def app_dir(data_dir: Path) -> Path:
    """Where /setup stores the App it registered: one file per credential, mode 0600."""
    return data_dir / "github-app"


class StoredApp(BaseModel):
    """The App credentials /setup wrote under the data directory."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    app_id: str
    slug: str | None = None
    html_url: str | None = None
    private_key: PrivateKey
    webhook_secret: str | None = None
    client_id: str | None = None
    client_secret: str | None = None


def stored_app(data_dir: Path) -> StoredApp | None:
    """The App /setup registered, or None when there is none. A directory that is there but
    unreadable or incomplete is an error naming the file, never silently no App."""
    folder = app_dir(data_dir)
    meta_path = folder / "app.json"
    if not meta_path.exists():
        return None

    def read(name: str, required: bool = True) -> str | None:
        path = folder / name
        try:
            return path.read_text().strip() or None
        except FileNotFoundError:
            if required:
                raise SettingsError(f"{path} is missing (written by /setup with app.json)") \
                    from None
            return None
        except OSError as exc:
            raise SettingsError(f"{path}: cannot read it: {exc.strerror}") from exc

    import json

    try:
        meta = json.loads(read("app.json") or "{}")
        app_id = str(meta["id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SettingsError(f"{meta_path}: not the App's record (an object with \"id\")") \
            from exc
    if not app_id.isdigit():
        raise SettingsError(f"{meta_path}: key id must be the App's numeric id")
    pem = read("private-key.pem") or ""
    return StoredApp(
        app_id=app_id, slug=meta.get("slug"), html_url=meta.get("html_url"),
        private_key=PrivateKey(pem, source=str(folder / "private-key.pem")),
        webhook_secret=read("webhook-secret", False), client_id=meta.get("client_id"),
        client_secret=read("client-secret", False),
    )


def _database_url(url: str | None) -> SecretStr | None:
    if url is None:
        return None
    if not url.startswith(("postgres://", "postgresql://")):
        raise SettingsError("DATABASE_URL (or DEJAFIX_DATABASE_URL) must be a postgresql:// URL")
    return SecretStr(url)


class ClusterFeed(BaseModel):
    """A cluster feed: an HTTP(S) URL serving JSON Lines in the seed schema, polled with
    If-None-Match every ``interval`` seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://\S+$", description="The feed's http(s) URL.")

    @model_validator(mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value
    interval: float = Field(default=300.0, ge=5.0, description="Seconds between polls.")


class ServiceConfig(BaseModel):
    """``config/bot.yml``: how this Dejafix deployment runs. Per-repository behaviour is in
    ``.github/dejafix.yml`` (see ``bot.repo_config``)."""

    model_config = ConfigDict(extra="forbid")

    cluster_paths: list[str] = Field(
        default_factory=lambda: ["config/clusters"],
        description="Cluster files or folders (.json, .jsonl, .md), relative to the project root.",
    )
    cluster_feeds: list[ClusterFeed] = Field(
        default_factory=list,
        description="Cluster feeds (a URL, or {url, interval}): JSON Lines in the seed schema, "
                    "polled with If-None-Match, kept in the store.")
    repo_feeds_private: bool = Field(
        default=False,
        description="Let a repository's `clusters:` name feeds on plain http or on a private "
        "address (loopback, the LAN, a cloud metadata service). Off: a repository's config "
        "cannot make this server fetch its own network; set it only when every installation "
        "is trusted (an intranet tracker).",
    )
    cluster_reload: float = Field(
        default=30.0,
        ge=0,
        description="Seconds between checks of the cluster files for changes (0: never); a "
        "changed set is re-indexed in a thread and swapped in whole.",
    )
    index_memory_mb: float = Field(
        default=1024.0, gt=0,
        description="Memory (MB) the per-repository indexes of learned clusters may hold; "
        "past it the least recently used repository's is dropped, and built again on its next "
        "issue.")
    default_mode: Literal["comment", "shadow", "auto"] = Field(
        default="comment",
        description="What a repository whose .github/dejafix.yml sets no `mode` does: "
        "`comment`, `shadow` (record what would be posted, post nothing), so that a new "
        "installation can be watched before it speaks, or `auto` (shadow until the "
        "repository's backfill is done and its own backtest clears `auto_precision`, then "
        "comment).",
    )
    backfill: Literal["auto", "off"] = Field(
        default="off",
        description="`auto` (as the shipped config/bot.yml sets it): learn a repository's "
        "history by itself when the App is installed on it (and for a repository seen with "
        "nothing learned), as queued jobs, one repository of an installation at a time; "
        "`off` (a config without the key): only `python -m bot backfill` does. A repository "
        "can turn it off with `backfill: false` in its own file.",
    )
    auto_precision: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="`mode: auto`: the precision the repository's own backtest must reach "
        "before it comments.")
    auto_min_cases: int = Field(
        default=10, ge=1,
        description="`mode: auto`: the least number of comments the backtest would have made "
        "for its precision to count; fewer and the repository stays in shadow.")
    matching: MatchPolicy = Field(
        default_factory=MatchPolicy, description="Default decision policy for every repository."
    )
    max_body_bytes: int = Field(
        default=2 * 1024 * 1024, gt=0, description="Largest webhook body accepted (413 above)."
    )
    workers: int = Field(
        default=8, ge=1, le=64, description="Deliveries one process works on at once.")
    repo_workers: int = Field(
        default=2, ge=0, le=64,
        description="At most this many deliveries of one repository run at once, over every "
        "process (0: no bound), so that a repository whose GitHub calls hang leaves the "
        "other workers to the others.")
    lease_seconds: float = Field(
        default=300.0, gt=0,
        description="How long a worker that is alive but stuck keeps a delivery; a worker "
        "that died loses it at once (PostgreSQL: its session ends; SQLite: at restart). A "
        "delivery is cut off at half of it.")
    github_timeout: float = Field(
        default=20.0, gt=0, description="Seconds one GitHub API call may take before it fails."
    )
    retry_base: float = Field(
        default=5.0,
        ge=0,
        description="First delay (seconds) before a failed delivery is retried; it triples "
        "with each attempt, up to ten minutes.",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=50, description="Attempts before a delivery is kept as failed."
    )
    drain_seconds: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM, how long deliveries in progress may take to finish; the rest "
        "go back to the queue. New deliveries are accepted meanwhile.",
    )
    stop_grace: float = Field(
        default=2.0,
        ge=0,
        description="On SIGTERM, keep accepting deliveries for at least this long after "
        "/healthz turns 503, so that a load balancer sends them elsewhere before the port "
        "closes (set it above the balancer's health-check interval).",
    )
    repo_config_ttl: float = Field(
        default=300.0, ge=0, description="Seconds a repository's .github/dejafix.yml is cached."
    )
    docs_url: str | None = Field(
        default=None,
        description="Link at the foot of each comment explaining how to read it (none when unset).",
    )
    app_slug: str | None = Field(
        default=None,
        description="The App's slug, to ignore its own events; read from GET /app when unset.",
    )

    def resolved_cluster_paths(self) -> list[Path]:
        return [project_path(p) for p in self.cluster_paths]


def load_service_config(path: Path | None = None) -> ServiceConfig:
    """Read ``config/bot.yml``; a missing file means defaults, a bad one is an error naming keys."""
    path = path or project_path(DEFAULT_CONFIG_PATH)
    if not path.exists():
        return ServiceConfig()
    try:
        raw: Any = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise SettingsError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(raw, dict):
        raise SettingsError(f"{path}: expected a mapping at the top level")
    _drop_removed_keys(raw, path)
    try:
        return ServiceConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"{path}: {problems}") from exc


def _drop_removed_keys(raw: dict[str, Any], path: Path) -> None:
    """Keys an earlier version read and this one ignores: a deployment's file that still sets
    one loads, with a warning, rather than refusing to start as an unknown key would."""
    matching = raw.get("matching")
    if isinstance(matching, dict) and "semantic" in matching:
        del matching["semantic"]
        log.warning("%s: matching.semantic is ignored: the optional semantic (sentence-embedding)"
                    " signal was removed (it did not lift precision at the same recall)", path)
