"""bot.github.payloads.parse_json: pydantic-core's speed, the standard library's answers. Whatever
``json.loads`` reads, it reads the same; whatever ``json.loads`` refuses, it refuses with the same
kind of error, which is what the receiver turns into its 400."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.github.payloads import parse_json

PAYLOADS = Path(__file__).resolve().parents[2] / "shared" / "github-payloads"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_reads_what_the_standard_library_reads(value: Any, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=False)
    data = text.encode() if as_bytes else text
    assert parse_json(data) == json.loads(data)


@pytest.mark.parametrize("text", [
    '{"id": 123456789012345678901234567890}',  # beyond 64 bits: still an exact int
    '{"x": -18446744073709551617}',
    '[NaN, Infinity, -Infinity]',  # not JSON, but json.loads reads them
    '{"s": "\\ud800"}',  # a lone surrogate escape: pydantic-core refuses it
    "[" * 500 + "]" * 500,  # deeper than pydantic-core's limit, within the stdlib's
    '{"a": 1, "a": 2}',  # the last duplicate wins in both
    "1.5e400",
])
def test_what_the_fast_parser_refuses_but_json_reads_is_read_the_same(text: str) -> None:
    got, want = parse_json(text.encode()), json.loads(text)
    if isinstance(want, list) and want and isinstance(want[0], float):
        assert [math.isnan(v) for v in got] == [math.isnan(v) for v in want]
        assert [v for v in got if not math.isnan(v)] == [v for v in want if not math.isnan(v)]
    else:
        assert got == want


@pytest.mark.parametrize("data", [
    b"", b"{", b'{"a": 1,}', b"\xff\xfe{}", b'{"a": "\xc3"}', b"[" * 1100 + b"]" * 1100,
])
def test_refuses_with_the_standard_librarys_errors(data: bytes) -> None:
    with pytest.raises(Exception) as want:
        json.loads(data)
    with pytest.raises(Exception) as got:
        parse_json(data)
    assert type(got.value) is type(want.value)


def test_utf16_bytes_are_read_as_the_standard_library_reads_them() -> None:
    data = json.dumps({"title": "caf\u00e9"}).encode("utf-16")
    assert parse_json(data) == json.loads(data) == {"title": "caf\u00e9"}


def test_real_deliveries_parse_the_same() -> None:
    files = sorted(PAYLOADS.rglob("*.json")) if PAYLOADS.is_dir() else []
    if not files:
        pytest.skip("../shared/github-payloads is not here")
    for path in files:
        data = path.read_bytes()
        assert parse_json(data) == json.loads(data), path.name
