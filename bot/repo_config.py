"""Per-repository settings: ``.github/dejafix.yml`` on the default branch, deep-merged onto the
defaults below and validated strictly. An invalid file is never silently replaced by defaults: the
repository is skipped and the log says which key is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CONFIG_PATH = ".github/dejafix.yml"


class ConfigProblem(NamedTuple):
    """One error in a config file: the 1-based line (None when it cannot be placed), the key
    path (``threshold``, ``skip_labels.1``; empty for the file as a whole) and the message."""

    line: int | None
    key_path: str
    message: str
    source: str = CONFIG_PATH

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        key = f"{self.key_path}: " if self.key_path else ""
        return f"{where}: {key}{self.message}"


class RepoConfigError(Exception):
    """The repository's config file cannot be used; ``str()`` names the file, line and key path
    of each problem (``.github/dejafix.yml:3: threshold: Input should be ...``)."""

    def __init__(self, problems: str | Sequence[ConfigProblem], *,
                 source: str = CONFIG_PATH) -> None:
        if isinstance(problems, str):
            problems = [ConfigProblem(None, "", problems, source)]
        self.problems: list[ConfigProblem] = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    @property
    def errors(self) -> list[tuple[int | None, str, str]]:
        """``(line, key_path, message)`` per problem."""
        return [(p.line, p.key_path, p.message) for p in self.problems]

    def lines(self) -> list[str]:
        """One ``file:line: key: message`` line per problem, as a compiler prints them."""
        return [str(p) for p in self.problems]


class RepoConfig(BaseModel):
    """Keys of ``.github/dejafix.yml``. Every key is optional; these are the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Answer new issues in this repository.")
    mode: Literal["comment", "shadow", "auto"] | None = Field(
        default=None,
        description=(
            "`comment` posts the suggestions; `shadow` matches and records what it would have "
            "posted (the comment, its score and evidence) and posts nothing, no label either; "
            "`auto` is shadow until this repository's backfill is done and its own backtest "
            "reaches the deployment's `auto_precision`, then comment. "
            "Unset: the deployment's `default_mode` (`config/bot.yml`)."
        ),
    )
    backfill: bool = Field(
        default=True,
        description=(
            "Learn this repository's history by itself (its merged fixes and duplicate-closed "
            "issues) after the App is installed; `false` leaves it to what is learned live."
        ),
    )
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
    regressions: Literal["comment", "label", "off"] = Field(
        default="label",
        description=(
            "What to do when the matched bug looks like a regression of its fix (the issue says "
            "the fix caused it, or the reporter's version already contains the fix): `label` "
            "adds `regression_label` and posts nothing; `comment` posts a \"possibly a "
            "regression\" comment instead of \"already fixed\" and adds the label; `off` does "
            "nothing. Never the \"already fixed\" comment."
        ),
    )
    regression_label: str = Field(
        default="possible-regression",
        min_length=1,
        max_length=50,
        description="Label added to a possible regression (`regressions: label` or `comment`).",
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
            "of a fork or of a downstream package. One is used only when the App's installation "
            "here can see it (one of its repositories, or public) and it is no more private than "
            "this repository; the config check names the others."
        ),
    )
    include_stale: bool = Field(
        default=False, description="Also offer clusters whose fix is marked stale."
    )
    clusters: list[str] = Field(
        default_factory=list,
        max_length=50,
        description=(
            "This repository's own known bugs: cluster files or folders (`.json`, `.jsonl`, "
            "markdown reports in the seed format) relative to the repository root, or feed "
            "URLs (JSON Lines). The GitHub Action reads files from the checkout, the App from "
            "the default branch (again after a push touching them); only clusters of this "
            "repository are kept."
        ),
    )
    max_comments_per_day: int = Field(
        default=20,
        ge=0,
        le=10000,
        description=(
            "At most this many new comments in this repository in any 24 hours (edits of "
            "existing comments do not count); 0 stops new comments."
        ),
    )
    pause_window: int = Field(
        default=20,
        ge=1,
        le=1000,
        description=(
            "How many of the latest suggestions the dismissal rate is measured over. Nothing "
            "pauses before there are this many since the last resume: one early dismissal is "
            "not a trend."
        ),
    )
    pause_dismissal_rate: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description=(
            "Pause new comments when more than this share of the latest `pause_window` "
            "suggestions was dismissed with `/dejafix not-this`. 0.3: at the default threshold "
            "about 7 to 9 comments in 100 were wrong in cross-validation on the development set "
            "(expect more on a new repository), so over three times that means this repository "
            "is not what the matcher was fitted on; 7 of 20 dismissed happens by bad luck at a "
            "7% error rate about 3 times in 10,000, and at 9% about 1 time in 1,000."
        ),
    )
    pause_issue: bool = Field(
        default=True,
        description=(
            "When Dejafix pauses itself, open one issue saying so; `/dejafix resume` there (or "
            "a change to any setting in this file) lifts the pause."
        ),
    )

    @field_validator("regressions", mode="before")
    @classmethod
    def _off_is_false_in_yaml(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare ``off`` as false; that is what the owner wrote.
        return "off" if value is False else value

    @field_validator("clusters")
    @classmethod
    def _inside_repository(cls, value: list[str]) -> list[str]:
        return [_cluster_entry(entry) for entry in value]

    @field_validator("upstreams")
    @classmethod
    def _repo_names(cls, value: list[str]) -> list[str]:
        for name in value:
            owner, sep, repo = name.partition("/")
            if not sep or not owner or not repo or "/" in repo:
                raise ValueError(f"{name!r} is not owner/name")
        return value


def _cluster_entry(entry: str) -> str:
    """A ``clusters:`` entry as read: a feed URL (http/https with a host and a valid port), or
    a path inside the repository, normalised (``./bugs/`` is ``bugs``) so that a push touching
    it is recognised. Refused: anything that could name another file once it reaches an API
    URL or a checkout (``..``, absolute, ``%``-escapes, ``?``, ``#``, backslashes, control
    characters)."""
    if entry.startswith(("https://", "http://")):
        try:
            parts = urlsplit(entry)
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            parts = None
        if parts is None or not parts.hostname or any(c.isspace() for c in entry):
            # Not echoed: a feed's URL may carry a tracker's token.
            raise ValueError("a feed URL needs a host, a numeric port if any, and no spaces")
        return entry
    segments = [s for s in entry.split("/") if s not in ("", ".")]
    bad = (not segments or entry.startswith(("/", "~")) or ".." in segments
           or ":" in segments[0] or any(c in entry for c in "%?#\\")
           or any(ord(c) < 32 or ord(c) == 127 for c in entry))
    if bad:
        raise ValueError(f"{entry!r} is not a path inside the repository nor an http(s) "
                         "feed URL")
    return "/".join(segments)


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


EXTENDS_KEY = "_extends"


@dataclass(frozen=True)
class ConfigFile:
    """One parsed and validated config file, before ``_extends`` is resolved."""

    source: str
    # The file's own keys (``_extends`` removed), for merging over a base file.
    raw: dict[str, Any]
    config: RepoConfig
    # ``_extends`` as written (``repo`` or ``owner/repo``) and its line.
    extends: str | None = None
    extends_line: int | None = None


def _node_line(node: yaml.Node | None) -> int | None:
    return None if node is None else node.start_mark.line + 1


def _locate(root: yaml.Node | None, loc: Sequence[Any], *, key_itself: bool) -> int | None:
    """The line of the node a pydantic ``loc`` points at (the deepest one found). With
    ``key_itself`` the last step's key is wanted (an unknown key), not its value."""
    node, line = root, _node_line(root)
    for depth, step in enumerate(loc):
        last = depth == len(loc) - 1
        if isinstance(node, yaml.MappingNode):
            found = None
            for key_node, value_node in node.value:  # the last duplicate wins, as in PyYAML
                if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(step):
                    found = (key_node, value_node)
            if found is None:
                return line
            node = found[0] if last and key_itself else found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) \
                and 0 <= step < len(node.value):
            node = node.value[step]
        else:
            return line
        line = _node_line(node)
    return line


def _load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # its reader already refuses unprintable characters
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
        return data, node
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise plain ValueError for "2024-13-01" or "!!float x".
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = f"not valid YAML ({getattr(exc, 'problem', None) or exc})"
        raise RepoConfigError([ConfigProblem(line, "", problem, source)]) from exc
    finally:
        if loader is not None:
            loader.dispose()


def read_config_file(text: str, *, source: str = CONFIG_PATH) -> ConfigFile:
    """Parse and validate one file on its own; ``_extends`` is checked for form only.
    Raises RepoConfigError listing every problem with its line."""
    raw, root = _load_yaml(text, source)
    if raw is None:
        return ConfigFile(source, {}, RepoConfig())
    if not isinstance(raw, dict):
        raise RepoConfigError([ConfigProblem(
            _node_line(root), "", f"expected a mapping of keys, got {type(raw).__name__}",
            source)])
    raw = dict(raw)
    problems: list[ConfigProblem] = []
    extends: str | None = None
    extends_line: int | None = None
    if EXTENDS_KEY in raw:
        value = raw.pop(EXTENDS_KEY)
        extends_line = _locate(root, [EXTENDS_KEY], key_itself=False)
        if isinstance(value, str) and _valid_extends(value):
            extends = value.strip()
        else:
            problems.append(ConfigProblem(
                extends_line, EXTENDS_KEY,
                f"expected a repository name (repo or owner/repo), got {value!r}", source))
    try:
        config = RepoConfig.model_validate(deep_merge(DEFAULTS, raw))
    except ValidationError as exc:
        for err in exc.errors():
            loc = err["loc"]
            line = _locate(root, loc, key_itself=err["type"] == "extra_forbidden")
            path = ".".join(str(p) for p in loc) or "(top)"
            problems.append(ConfigProblem(line, path, err["msg"], source))
        problems.sort(key=lambda p: (p.line is None, p.line or 0))
        raise RepoConfigError(problems) from exc
    if problems:
        raise RepoConfigError(problems)
    return ConfigFile(source, raw, config, extends, extends_line)


def _valid_extends(value: str) -> bool:
    parts = value.strip().split("/")
    return len(parts) in (1, 2) and all(p and p == p.strip() and ":" not in p for p in parts)


def extends_target(value: str, owner: str) -> str:
    """``repo`` means a repository of the same owner; ``owner/repo`` is taken as written."""
    return value if "/" in value else f"{owner}/{value}"


def merge_config_files(base: ConfigFile, own: ConfigFile) -> RepoConfig:
    """``own``'s keys over ``base``'s over the defaults (both were validated on their own)."""
    return RepoConfig.model_validate(deep_merge(deep_merge(DEFAULTS, base.raw), own.raw))


def parse_repo_config(text: str | None, *, source: str = CONFIG_PATH) -> RepoConfig:
    """``None`` (the file does not exist) means defaults; anything else must be valid.
    ``_extends`` is not followed here (see ``bot.features.context``)."""
    if text is None:
        return RepoConfig()
    return read_config_file(text, source=source).config


def reference_markdown() -> str:
    """The configuration reference for the README, generated from the model so it cannot drift."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for name, field in RepoConfig.model_fields.items():
        default = DEFAULTS[name]
        shown = "unset" if default is None else yaml.safe_dump(default).strip().removesuffix("...")
        lines.append(f"| `{name}` | `{shown.strip()}` | {field.description} |")
    return "\n".join(lines)
