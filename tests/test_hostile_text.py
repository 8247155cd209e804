"""No issue text makes matching slower than linear: every text pass an issue's title and body go
through, fuzzed with hostile text (unclosed markers, long runs of one character, deep brackets,
huge tracebacks, and mixtures of them), runs within a bounded ratio of the same pass on ordinary
prose of the same length, timed in the same run.

Why it matters: ranking runs in a thread, but a regex call holds the GIL until it returns, so
one quadratic pattern on one hostile issue stalled every request of the server (``"<!--" *
16384`` took seconds, ``"/" * 16384`` ten). A linear pass on a bounded text (the index cuts it,
``scoring.MAX_BODY_CHARS``) bounds each call.

Timing: each figure is the least of several runs (a loaded 2-core machine slows a run, never
speeds it up), and the baseline is never below the cost of the whole-body cleaning pass on the
prose (so a pass that costs nothing on prose, such as the trace parser that finds no trace, is
not held to a ratio of a few microseconds). Quadratic passes were hundreds to thousands of times
slower than that baseline at this size; linear ones are within a few tens.
"""

from __future__ import annotations

import gc
import logging
import re
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bench.hostile_text import BOILERPLATE, PASSES, PROSE
from bot.features import commands as commands_mod
from bot.features.commands import parse_commands
from bot.matching import IssueText, Matcher
from bot.matching import evidence as ev_mod
from bot.matching import text as text_mod
from bot.matching.index import ClusterIndex
from bot.matching.scoring import MAX_BODY_CHARS, MAX_TITLE_CHARS
from bot.matching.text import clean_body, strip_comments
from tests.samples import FILLER, LOOKALIKE, MATCH_REPO, TARGET

SIZE = 16384  # characters of each hostile text: large enough that n² shows, small enough to run
RATIO = 100  # linear passes stay under ~40x the baseline here; quadratic ones were 700x and up
REPEATS = 3

# What a hostile text repeats: markers without their closer, brackets, one character, the
# pieces of paths, calls, code chains, tracebacks and citations that the patterns look for.
UNITS = [
    "<!--", "<!-- ", "-->", "```", "```\n", "~~~", "[", "(", "[(", "](", "{", "<", ">", "> ",
    "a", "A", "1", " ", "\n", "\t", "#", "/", "\\", ".", ":", " :", "-", "_", "~", "@", "+", "|",
    "*", "`", '"', "'", "“", "é", "中", "\x1b[", "a.", "a/", "a_", "Aa", "1.", "1-", "0x", "v1.",
    "a.(", "a(", "a:", "a-", "a.b", "a/b/c.py ", "x.py/b~", "C:\\a", "http://", "https://a",
    "www.", "line 1", "line ", "os: ", "- [ ] ", "### Version\n", "version ", 'File "',
    'File "a", line 1, in ', "at ", "at a:1:1\n", "goroutine 1 [", "thread 'a' panicked at ",
    "stack backtrace:\n", "#1 ", "PR ", "issues/", "pull/1", "duplicate of ", "not the same as ",
    "regression from ", "ValueError: ", "Error", "Traceback (most recent call last):\n",
]
HEADS = ["", "x..", "os", " - **os", "Traceback (most recent call last):\n", "<!--", "a", "```"]
TAILS = ["", ":", ".", "~.py", "(", "a", "-->", "_", "\n", "#1", "B", "!"]


def _fill(head: str, unit: str, tail: str) -> str:
    body = unit * (SIZE // max(1, len(unit)) + 1)
    return (head + body)[: SIZE - len(tail)] + tail


def _traceback(frames: int) -> str:
    lines = ["Traceback (most recent call last):"]
    for i in range(frames):
        lines.append(f'  File "/srv/app/widget/mod{i}.py", line {i + 1}, in handler_{i}')
        lines.append(f"    value = compute_{i}(payload)")
    lines.append("ValueError: bad payload")
    return "\n".join(lines)[:SIZE]


def _nested(depth: int, opener: str, closer: str) -> str:
    return (opener * depth + "x" + closer * depth)[:SIZE]


repeated = st.builds(_fill, st.sampled_from(HEADS),
                     st.sampled_from(UNITS) | st.lists(st.sampled_from(UNITS), min_size=2,
                                                       max_size=5).map("".join)
                     | st.text(min_size=1, max_size=6),
                     st.sampled_from(TAILS))
traceback = st.integers(min_value=1000, max_value=5000).map(_traceback)
nested = st.builds(_nested, st.integers(min_value=SIZE // 4, max_value=SIZE // 2),
                   st.sampled_from(["(", "[", "{", "<!--", "```\n"]),
                   st.sampled_from([")", "]", "}", "-->", "\n```"]))
# Mixtures: pieces of several hostile runs after one another.
mixed = st.lists(repeated, min_size=2, max_size=4).map(
    lambda parts: "".join(p[: SIZE // len(parts)] for p in parts))
HOSTILE = repeated | traceback | nested | mixed

# Texts that were quadratic (or worse) before: each is tried first, for every pass.
KNOWN = [
    "<!--" * (SIZE // 4),
    "/" * SIZE,
    " " * (SIZE - 1) + ":",
    "x.." + "a" * (SIZE - 4) + ".",
    "1" * (SIZE - 1) + "-",
    "https://" + "a" * (SIZE - 8),
    ("a/" * SIZE)[: SIZE - 4] + "~.py",
    ("a." * SIZE)[: SIZE - 5] + ";x.py",
    ("x.py/b~" * SIZE)[:SIZE],
    ("a." * SIZE)[: SIZE - 2] + ".(",
    "/dejafix help\n" + "`" * (SIZE - 14),
]


def _best(fn: Callable[[str], object], text: str) -> float:
    best = float("inf")
    collecting = gc.isenabled()
    gc.disable()  # a collection of the whole heap inside one timing is not the pass's cost
    try:
        for _ in range(REPEATS):
            started = time.perf_counter()
            fn(text)
            best = min(best, time.perf_counter() - started)
    finally:
        if collecting:
            gc.enable()
    return best


_BASELINES: dict[str, float] = {}


def _baseline(name: str) -> float:
    """The pass's time on prose of SIZE characters, not below the cleaning pass's time on it;
    measured once per run."""
    if name not in _BASELINES:
        prose = (PROSE * (SIZE // len(PROSE) + 1))[:SIZE]
        floor = _best(clean_body, prose)
        _BASELINES[name] = max(_best(PASSES[name], prose), floor, 1e-6)
    return _BASELINES[name]


def _check(name: str, text: str) -> None:
    base = _baseline(name)
    spent = _best(PASSES[name], text)
    if spent > RATIO * base:
        # A stall once (another process took the core) is not the pass: measure again.
        _BASELINES.pop(name)
        base = _baseline(name)
        spent = _best(PASSES[name], text)
    assert spent <= RATIO * base, (
        f"{name} took {spent * 1e3:.1f} ms on {text[:40]!r}... ({len(text)} characters), "
        f"{spent / base:.0f}x its {base * 1e3:.2f} ms on prose of the same length")


FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


@pytest.mark.parametrize("name", list(PASSES))
def test_known_hostile_texts_are_linear(name: str) -> None:
    for text in KNOWN:
        _check(name, text)


@pytest.mark.parametrize("name", list(PASSES))
@FUZZ
@given(text=HOSTILE)
@example(text=_traceback(5000))
@example(text=_nested(SIZE // 2, "(", ")"))
def test_every_text_pass_is_linear_on_hostile_text(name: str, text: str) -> None:
    _check(name, text)


def _matcher() -> Matcher:
    return Matcher([*FILLER, TARGET, LOOKALIKE])


def test_ranking_an_unclosed_comment_costs_what_a_plain_body_costs() -> None:
    # The reported case, end to end through the matcher: 16,384 unclosed comments took seconds.
    matcher = _matcher()
    hostile = "<!--" * 16384
    plain = (PROSE * (len(hostile) // len(PROSE) + 1))[: len(hostile)]

    def rank(body: str) -> Callable[[str], object]:
        return lambda title: matcher.rank(IssueText(title=title, body=body),
                                          boilerplate=BOILERPLATE)

    title = "Renderer hangs"
    rank(plain)(title)  # warm the chunk memos for the plain body too
    base = _best(rank(plain), title)
    spent = _best(rank(hostile), title)
    assert spent <= 20 * base, f"{spent * 1e3:.0f} ms against {base * 1e3:.1f} ms"


def test_the_index_cuts_what_matching_reads_and_says_so(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    index = ClusterIndex([*FILLER, TARGET, LOOKALIKE])
    body = TARGET.summary + "\n" + "x " * MAX_BODY_CHARS
    title = TARGET.display_label + "!" * MAX_TITLE_CHARS
    with caplog.at_level(logging.INFO, logger="dejafix.matching"):
        long = index.rank(IssueText(number=7, title=title, body=body), [MATCH_REPO])
    cut = IssueText(number=7, title=title[:MAX_TITLE_CHARS], body=body[:MAX_BODY_CHARS])
    assert [(m.public_id, m.score) for m in long] == \
        [(m.public_id, m.score) for m in index.rank(cut, [MATCH_REPO])]
    assert long and long[0].public_id == TARGET.public_id  # what was kept is still read
    lines = [r.getMessage() for r in caplog.records if "matching reads the first" in r.getMessage()]
    assert lines == [f"issue 7: matching reads the first {MAX_TITLE_CHARS} of {len(title)} title"
                     f" and {MAX_BODY_CHARS} of {len(body)} body characters"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dejafix.matching"):
        index.rank(cut, [MATCH_REPO])
    assert not [r for r in caplog.records if "matching reads the first" in r.getMessage()]


# --- the linear scans find what the patterns they replaced found -------------------------------

_OLD_COMMENT = re.compile(r"<!--.*?-->", re.S)
_OLD_ERR_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+")
SAME = settings(max_examples=400, deadline=None, derandomize=True, database=None)
# Small alphabets of the characters each pattern turns on, so that generated text is dense in
# its matches, near-misses and markers.
path_text = st.text(alphabet="aC:/\\~.py-@+é _", max_size=40)


@SAME
@given(text=st.text(alphabet="<!->a\n ", max_size=40))
def test_comments_are_stripped_as_the_lazy_pattern_stripped_them(text: str) -> None:
    assert strip_comments(text) == _OLD_COMMENT.sub(" ", text)


@SAME
@given(text=path_text)
def test_path_spans_are_the_path_pattern_matches(text: str) -> None:
    for run in ev_mod._PATH_RUN.finditer(text):
        start, end = run.span()
        assert ev_mod._path_spans(text, start, end) == \
            [m.span() for m in ev_mod._PATH.finditer(text, start, end)], text[start:end]


@SAME
@given(text=st.text(alphabet="a/~.-_é1", max_size=30))
def test_error_paths_are_blanked_as_before(text: str) -> None:
    for run in ev_mod._ERR_PATH_RUN.finditer(text):
        before = _OLD_ERR_PATH.sub(" ", run.group(0)) if "/" in run.group(0) else run.group(0)
        assert ev_mod._blank_paths(run) == before


@SAME
@given(text=st.text(alphabet="aB1_.(-:/\\é", max_size=30))
def test_call_chain_and_word_scans_find_the_same_matches(text: str) -> None:
    assert [c for c in ev_mod._CALL_SCAN.findall(text) if c] == ev_mod._CALL.findall(text)
    assert [c for c in text_mod._CHAIN_SCAN.findall(text) if c] == \
        text_mod._CODE_CHAIN.findall(text)
    old_word = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+[A-Za-z][A-Za-z0-9_]*")
    assert text_mod._WORD.findall(text) == old_word.findall(text)


@SAME
@given(line=st.text(alphabet=" \t-*os:aX.", max_size=30))
def test_environment_lines_are_told_as_before(line: str) -> None:
    old_kv = re.compile(r"^\s*[-*]?\s*\**[A-Za-z][\w ./()-]{0,30}\**\s*:\s*\S.{0,60}$")
    old_env = re.compile(r"^\s*[-*]?\s*\**(os)\b", re.I)
    assert bool(text_mod._KV_LINE.match(line)) == bool(old_kv.match(line))
    # The keyword list is long; "os" stands for all of it (what precedes it is what changed).
    assert bool(text_mod._ENV_KEYS.match(line)) == bool(old_env.match(line))


def test_the_matcher_cuts_too_when_called_without_the_index() -> None:
    # eval, match and the preview call Matcher.rank directly: the cut must not depend on the
    # caller going through the index.
    matcher = _matcher()
    body = TARGET.summary + "\n" + "x " * MAX_BODY_CHARS
    long = matcher.rank(IssueText(number=8, title=TARGET.display_label, body=body))
    cut = matcher.rank(IssueText(number=8, title=TARGET.display_label,
                                 body=body[:MAX_BODY_CHARS]))
    assert [(m.public_id, m.score) for m in long] == [(m.public_id, m.score) for m in cut]
    whole = matcher.rank(IssueText(number=8, title=TARGET.display_label,
                                   body=body + " " + TARGET.summary * 50))
    assert [(m.public_id, m.score) for m in whole] == [(m.public_id, m.score) for m in cut]


_OLD_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)")
_OLD_FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})[^\n]*\n.*?"
                        r"(?:^ {0,3}(?P=fence)[`~]*[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
command_text = st.text(alphabet="`~a \n\r>", max_size=40).map(
    lambda s: s.replace("a", "/dejafix help", 1) if "a" in s else s)


@SAME
@given(text=st.text(alphabet="`a\n ", max_size=40))
@example(text="`a\nb`")  # a span never crosses a line
@example(text="``a`b``")
def test_code_spans_are_stripped_as_the_span_pattern_stripped_them(text: str) -> None:
    assert commands_mod.strip_code_spans(text) == _OLD_CODE_SPAN.sub("", text)


@SAME
@given(text=st.text(alphabet="`~a \n", max_size=40))
def test_fences_are_stripped_as_before(text: str) -> None:
    assert commands_mod._FENCE.sub("", text) == _OLD_FENCE.sub("", text)


@SAME
@given(text=command_text)
def test_commands_are_found_as_before(text: str) -> None:
    def old(body: str) -> list[str]:
        found = body.replace("\r\n", "\n").replace("\r", "\n")
        found = commands_mod._HTML_COMMENT.sub("", found)
        found = _OLD_FENCE.sub("", found)
        found = commands_mod._QUOTE.sub("", found)
        found = _OLD_CODE_SPAN.sub("", found)
        return [m.group(0) for m in commands_mod._COMMAND.finditer(found)]

    assert [c.raw for c in parse_commands(text)] == \
        [" ".join(["/dejafix", *line.split()[1:]]) for line in old(text)]
