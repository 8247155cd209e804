from __future__ import annotations

import pytest

from bot.repo_config import RepoConfig, RepoConfigError, deep_merge, parse_repo_config


@pytest.mark.parametrize("text, expected", [
    (None, RepoConfig()),
    ("", RepoConfig()),
    ("enabled: false", RepoConfig(enabled=False)),
    ("threshold: 0.8\nlabel: known-fix", RepoConfig(threshold=0.8, label="known-fix")),
    ("skip_labels: [question]\nskip_authors: [bot1]",
     RepoConfig(skip_labels=["question"], skip_authors=["bot1"])),
    ("upstreams: [up/stream]", RepoConfig(upstreams=["up/stream"])),
])
def test_valid_files(text: str | None, expected: RepoConfig) -> None:
    assert parse_repo_config(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("treshold: 0.5", "treshold: Extra inputs are not permitted"),
    ("threshold: 1.5", "threshold: Input should be less than or equal to 1"),
    ("enabled: maybe", "enabled:"),
    ("upstreams: [notarepo]", "upstreams:"),
    ("- a\n- b", "expected a mapping"),
    ("label: [unclosed", ".github/dejafix.yml:1: not valid YAML"),
])
def test_invalid_files_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(RepoConfigError) as info:
        parse_repo_config(text)
    assert fragment in str(info.value)


def test_deep_merge_keeps_nested_defaults() -> None:
    merged = deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4})
    assert merged == {"a": {"x": 1, "y": 3}, "b": 1, "c": 4}
