"""Per-repository settings: ``.github/dejafix.yml`` on the default branch, deep-merged onto the
defaults below and validated strictly. An invalid file is never silently replaced by defaults: the
repository is skipped and the log says which key is wrong."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CONFIG_PATH = ".github/dejafix.yml"


class RepoConfigError(Exception):
    """The repository's config file cannot be used; ``str()`` names the file, line or key path."""


class RepoConfig(BaseModel):
    """Keys of ``.github/dejafix.yml``. Every key is optional; these are the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Answer new issues in this repository.")
    threshold: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Minimum match score for a comment; unset uses the service default.",
    )
    label: str | None = Field(
        default=None,
        max_length=50,
        description="Label added to an issue when Dejafix comments (none when unset).",
    )
    skip_labels: list[str] = Field(
        default_factory=list, description="Issues carrying any of these labels are left alone."
    )
    skip_authors: list[str] = Field(
        default_factory=list, description="Issues opened by these logins are left alone."
    )
    upstreams: list[str] = Field(
        default_factory=list,
        description=(
            "Other repositories (owner/name) whose clusters also apply here, e.g. the upstream "
            "of a fork or of a downstream package."
        ),
    )
    include_stale: bool = Field(
        default=False, description="Also offer clusters whose fix is marked stale."
    )

    @field_validator("upstreams")
    @classmethod
    def _repo_names(cls, value: list[str]) -> list[str]:
        for name in value:
            owner, sep, repo = name.partition("/")
            if not sep or not owner or not repo or "/" in repo:
                raise ValueError(f"{name!r} is not owner/name")
        return value


DEFAULTS: dict[str, Any] = RepoConfig().model_dump()


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else in ``override`` replaces the base value."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_repo_config(text: str | None, *, source: str = CONFIG_PATH) -> RepoConfig:
    """``None`` (the file does not exist) means defaults; anything else must be valid."""
    if text is None:
        return RepoConfig()
    try:
        raw: Any = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise plain ValueError for "2024-13-01" or "!!float x".
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise RepoConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from exc
    if raw is None:
        return RepoConfig()
    if not isinstance(raw, dict):
        raise RepoConfigError(f"{source}: expected a mapping of keys, got {type(raw).__name__}")
    try:
        return RepoConfig.model_validate(deep_merge(DEFAULTS, raw))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise RepoConfigError(f"{source}: {problems}") from exc


def reference_markdown() -> str:
    """The configuration reference for the README, generated from the model so it cannot drift."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for name, field in RepoConfig.model_fields.items():
        default = DEFAULTS[name]
        shown = "unset" if default is None else yaml.safe_dump(default).strip().removesuffix("...")
        lines.append(f"| `{name}` | `{shown.strip()}` | {field.description} |")
    return "\n".join(lines)
