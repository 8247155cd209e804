"""The fast paths of text, evidence and boilerplate extraction give exactly what the plain
whole-text scans they replaced gave.

Two kinds of test. The first checks, over every code point, the facts about Python's regex engine
and str methods that the fast paths rest on (what whitespace is, what re.I folds to ASCII, which
characters can start a title prefix): a Python release that changed one of them would fail here
instead of silently changing what the matcher sees. The second runs each function next to the
plain algorithm it replaced (kept below, verbatim, as the reference) on edge cases and on generated
text, with the chunk memos both cold and warm.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bot.clusters.models import Cluster
from bot.matching import boilerplate as bp_mod
from bot.matching import evidence as ev_mod
from bot.matching import text as text_mod
from bot.matching.boilerplate import Boilerplate, learn_boilerplate, normalise_line
from bot.matching.evidence import (
    IssueEvidence,
    extract_cluster_evidence,
    extract_issue_evidence,
    is_symbol,
    normalise_error,
    normalise_path,
)
from bot.matching.text import (
    GENERIC_BOILERPLATE,
    STOPWORDS,
    ChunkMemo,
    clean_body,
    clean_title,
    is_code_like,
    stem,
    tokens,
)

FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ALL_CHARS = "".join(chr(i) for i in range(sys.maxunicode + 1) if not 0xD800 <= i < 0xE000)
WHITESPACE = "".join(c for c in ALL_CHARS if c.isspace())


# --- the plain algorithms, as they were ---------------------------------------------------------

_REF_IDENT = re.compile(r"\b[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*\b")
# The plain patterns the linear scans replaced (tests/test_hostile_text.py times those scans).
_REF_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF_KV_LINE = re.compile(r"^\s*[-*]?\s*\**[A-Za-z][\w ./()-]{0,30}\**\s*:\s*\S.{0,60}$")
_REF_ENV_KEYS = re.compile(
    r"^\s*[-*]?\s*\**(os|platform|python|node|version|hermes version|app version|browser|"
    r"operating system|distro|kernel|installation method|install method|model|provider|shell|"
    r"terminal|device|arch|architecture)\b",
    re.I,
)
_REF_ERR_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+")


def ref_blank_paths(run: re.Match[str]) -> str:
    text = run.group(0)
    return _REF_ERR_PATH.sub(" ", text) if "/" in text else text


def ref_stem(word: str) -> str:
    if len(word) <= 3 or not word.isalpha():
        return word
    for suffix, repl, min_len in (
        ("ies", "y", 5),
        ("sses", "ss", 5),
        ("ing", "", 6),
        ("ed", "", 5),
        ("es", "", 5),
        ("s", "", 4),
    ):
        if word.endswith(suffix) and len(word) >= min_len:
            if suffix == "s" and word[-2] in "su":
                return word
            if suffix == "es" and word[-3] not in "sxz" and not word.endswith(("ches", "shes")):
                return word[:-1]
            base = word[: len(word) - len(suffix)] + repl
            if (
                suffix in ("ing", "ed")
                and len(base) >= 3
                and base[-1] == base[-2]
                and base[-1] not in "lsz"
            ):
                base = base[:-1]
            return base
    return word


def ref_word_tokens(word: str, keep_stopwords: bool) -> list[str]:
    out: list[str] = []
    if is_code_like(word):
        whole = word.lower().strip("_")
        if whole:
            out.append(whole)
    for part in text_mod._parts(word):
        low = part.lower()
        if len(low) < 2 or (not keep_stopwords and low in STOPWORDS):
            continue
        if low.isdigit():
            continue
        out.append(ref_stem(low))
    return out


def ref_tokens(text: str, keep_stopwords: bool = False) -> list[str]:
    out: list[str] = []
    if not text:
        return out
    if "." in text or "/" in text or ":" in text or "\\" in text:
        for run in text_mod._CHAIN_RUN.findall(text):
            head = run[:-1]
            if "." in head or "/" in head or ":" in head or "\\" in head:
                for found in text_mod._CODE_CHAIN.findall(run):
                    whole = found.rstrip(".:-").replace("\\", "/").lower()
                    if len(whole) >= 3:
                        out.append(whole)
    for word in text_mod._WORD.findall(text):
        out.extend(ref_word_tokens(word, keep_stopwords))
    if not text.isascii():
        out.extend(text_mod._CJK.findall(text))
    return out


def ref_clean_body(text: str | None) -> str:
    t = text_mod
    if not text:
        return ""
    text = _REF_COMMENT.sub(" ", text)
    kept: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        low = stripped.lower().strip("#*:_ ").strip()
        if low in GENERIC_BOILERPLATE:
            continue
        if t._CHECKBOX.match(line) or t._TABLE_ROW.match(line):
            continue
        if t._HEADING.match(line) and len(low.split()) <= 6:
            continue
        if _REF_ENV_KEYS.match(line) and _REF_KV_LINE.match(line):
            continue
        kept.append(line)
    out = "\n".join(kept)
    for pattern in (t._URL, t._UUID, t._HEX, t._DATE_TIME, t._LINE_NO, t._VERSION):
        out = pattern.sub(" ", out)
    return out


def ref_clean_title(title: str | None) -> str:
    if not title:
        return ""
    out = title.strip()
    for _ in range(3):
        m = text_mod._TITLE_PREFIX.match(out)
        if not m or not m.group(0):
            break
        tag = " ".join(g for g in m.groups() if g)
        out = (
            (tag + " " + out[m.end() :]).strip()
            if tag.lower() not in ("bug", "bug report")
            else out[m.end() :].strip()
        )
    return out


def ref_normalise_error(message: str) -> str:
    msg = message.strip().lower()
    msg = re.sub(r"https?://\S+", " ", msg)
    if "/" in msg:
        msg = ev_mod._ERR_PATH_RUN.sub(ref_blank_paths, msg)
    msg = re.sub(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{8,}\b|\b\d+(?:\.\d+)*\b", " ", msg)
    msg = re.sub(r"[^\w\s:'-]", " ", msg)
    return re.sub(r"\s+", " ", msg).strip()


def _ref_dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def ref_issue_evidence(text: str) -> IssueEvidence:
    e = ev_mod
    files: list[str] = []
    for run in e._PATH_RUN.finditer(text):
        start, end = run.span()
        if "." not in text[start : end - 1]:
            continue
        for m in e._PATH.finditer(text, start, end):
            raw = m.group(0)
            if raw.startswith(("http", "www.")) or "://" in text[max(0, m.start() - 3) : m.start()]:
                continue
            files.append(normalise_path(raw))
    for m in e._TRACE_FILE.finditer(text):
        files.append(normalise_path(m.group(1)))
    symbols: list[str] = []
    symbols.extend(m.group(1).split(".")[-1] for m in e._TRACE_IN.finditer(text))
    for m in e._BACKTICK.finditer(text):
        for ident in _REF_IDENT.findall(m.group(1).strip()):
            if is_code_like(ident):
                symbols.append(ident)
    symbols.extend(m.group(1) for m in e._CALL.finditer(text))
    for ident in _REF_IDENT.findall(text):
        if is_symbol(ident) and "." not in ident:
            symbols.append(ident)
    for m in e._MODULE.finditer(text):
        dotted = m.group(0)
        last = dotted.rsplit(".", 1)[-1]
        first = dotted.split(".", 1)[0]
        if last in e._SOURCE_EXT_SET or len(dotted) < 5 or first in e._NOT_MODULES:
            continue
        files.append(dotted.replace(".", "/") + ".py")
    numbers = [int(n) for n in e._ISSUE_REF.findall(text)]
    clean_symbols = []
    for s in symbols:
        s = s.strip("_.").split(".")[-1] if "." in s and "/" not in s else s.strip("_")
        if len(s) >= 3 and s.lower() not in ("self", "none", "true", "false", "print"):
            clean_symbols.append(s)
    return IssueEvidence(
        files=_ref_dedupe(f for f in files if "." in f.rsplit("/", 1)[-1]),
        symbols=_ref_dedupe(clean_symbols),
        numbers=list(dict.fromkeys(numbers)),
    )


def ref_hunk_symbols(hunk: str) -> list[str]:
    e = ev_mod
    found: list[str] = []
    for header in e._HUNK_HEADER.findall(hunk):
        found.extend(e._DEFINITION.findall(header))
    for line in hunk.splitlines():
        if not line.startswith(("+", "-")) or line.startswith(("+++", "---")):
            continue
        found.extend(e._DEFINITION.findall(line))
        found.extend(e._ASSIGNED.findall(line))
        found.extend(i for i in _REF_IDENT.findall(line[1:]) if is_symbol(i) and "." not in i)
    return found


def ref_cluster_evidence(cluster: Cluster) -> tuple[Any, ...]:
    e = ev_mod
    files = [normalise_path(p) for p in cluster.files_changed]
    weak = {f for f in files if e.is_weak_file(f)}
    symbols: list[str] = []
    for member in cluster.fix_prs:
        for fh in member.fix_hunks:
            if e.is_weak_file(normalise_path(fh.file)):
                continue
            for hunk in fh.hunks:
                symbols.extend(ref_hunk_symbols(hunk))
    errors: list[str] = []
    for text in e.cluster_texts(cluster):
        for m in e._BACKTICK.finditer(text):
            symbols.extend(i for i in _REF_IDENT.findall(m.group(1)) if is_code_like(i))
        symbols.extend(i for i in _REF_IDENT.findall(text) if "." not in i and is_symbol(i))
        symbols.extend(m.group(1) for m in e._CALL.finditer(text))
        errors.extend(t.lower() for t in e._EXC_TYPE.findall(text))
        for groups in e._QUOTED.findall(text):
            quoted = next((g for g in groups if g), "")
            if quoted:
                errors.append(ref_normalise_error(quoted))
        for t, msg in e._EXC_LINE.findall(text):
            errors.append(ref_normalise_error(f"{t}: {msg}"))
    numbers = {m.number for m in cluster.members}
    if cluster.landed_fix.pr is not None:
        numbers.add(cluster.landed_fix.pr)
    clean = [s.strip("_").split(".")[-1] for s in symbols]
    return (
        _ref_dedupe(files),
        weak,
        _ref_dedupe(s for s in clean if len(s) >= 3),
        _ref_dedupe(e for e in errors if len(e) >= 4),
        numbers,
    )


def ref_normalise_line(line: str) -> str:
    line = bp_mod._MD_MARKUP.sub("", line)
    line = re.sub(r"<!--.*?-->", " ", line)
    line = re.sub(r"[*_`>#:|\[\]()]+", " ", line)
    return re.sub(r"\s+", " ", line).strip().lower()


def ref_strip(bp: Boilerplate, body: str) -> str:
    if not body or (not bp.lines and not bp.phrases):
        return body
    kept = [line for line in body.splitlines()
            if (norm := ref_normalise_line(line)) and norm not in bp.lines]
    out = "\n".join(kept)
    for phrase in bp.phrases:
        out = re.sub(re.escape(phrase), " ", out, flags=re.I)
    return out


def cluster_evidence_tuple(cluster: Cluster) -> tuple[Any, ...]:
    ev = extract_cluster_evidence(cluster)
    return (ev.files, ev.weak_files, ev.symbols, ev.errors, ev.numbers)


# --- inputs -------------------------------------------------------------------------------------

TRACEBACK = """\
Traceback (most recent call last):
  File "/home/alice/.venv/lib/python3.12/site-packages/widget/render/frame.py", line 88, in draw
    budget = self.compute_frame_budget(fps)
  File "C:\\Users\\bob\\widget\\widget\\render\\timing.py", line 12, in compute_frame_budget
    return 1000 / fps
ZeroDivisionError: division by zero at 0x7f3a2b1c
"""

HUNK = """\
@@ -110,7 +110,12 @@ def render_frame(self, paths):
         paths = self.viking(paths)
-        channel = find_bash(paths)
+        channel: Channel = hermes_cli(paths, timeout=60)
+        _cache_type(channel)
+def FrameScheduler.tick(self):
+class   ThreadPoolExecutor:
+++ b/widget/render/frame.py
--- a/widget/render/frame.py
         return channel"""

EDGE_CASES = [
    "",
    "   \n\t  ",
    "日本語のテキスト、ウィジェットが落ちる",
    "CJK 混在 text: `render_frame()` 壊れた in widget/render/frame.py",
    "Crash at C:\\Users\\bob\\widget\\render\\timing.py and D:\\x\\y.txt;"
    " also \\\\server\\share\\a.md",
    TRACEBACK,
    "Renderer dies\n" + TRACEBACK + "\nCalled `FrameScheduler.tick()` and ``double`` `a b`",
    "see `ThreadPoolExecutor`, `hermes_cli.config`, `_handle_reset_command()` and ``",
    # Very long lines and chunks longer than the memos take.
    "x" * 5000,
    "widget/" * 300 + "frame.py",
    "Error: " + " ".join(f"word{i} snake_case_{i} CamelCaseThing{i}" for i in range(400)),
    "https://example.com/" + "a" * 200 + " www." + "b" * 100 + " http://x.io/a.py:12",
    # Noise that spans a space, and noise that only appears once other noise is removed.
    "error on line 42 and Line 7, at 2024-01-02 03:04:05Z and 2024-01-02T03:04, v1.2.3rc1",
    "see abcdef012345https://x.io/a and deadbeefcafe,",
    "fails on line 42 of the parser",
    "visit (www.) or www, (deadbeefcafebabe: DEADBEEF abcdefab abcdefa fedcbaé Ω",
    "@@-1 +1@@def header_only():\n<!--x-->kept",
    "hash deadbeefcafebabe here\n**Widget build flavour**\n  # Two words",
    "DeprecationWarning: the frobnicator is deprecated since 2.1\n* [ ] I agree\n- OS:Ubuntu 22",
    "see https://github.com/acme/widget/issues/77 for details",
    "fixed by acme/widget/pull/9.",
    "f0e1d2c3-b4a5-9687-7869-5a4b3c2d1e0f and 0xDEADbeef and 3f9a2b1c4d5e6f708192",
    "run.py:12:3 a.bc:9 x.py:1 e.g. i.e. done. Next: steps",
    # Case folding that re.I does and str.lower() does not.
    "İ have read the troubleſhooting guide twice; the K sign; ΟΔΟΣ Σ ς σ; İstanbul",
    # Line breaks other than \n, and whitespace that only str.split() knows.
    "a\u2028b\x1cc\x85d\x0be\x0cf\u3000g\u00a0h",
    "### Steps to Reproduce\n1. open the spline editor\n- [x] I searched existing issues\n"
    "| key | value |\n- OS: Ubuntu 22.04\n**Environment**\n<!-- hidden -->kept <!-- x\ny -->",
    "fix(desktop): `hermes mcp add` (#47837) read-aloud non-MSYS 15s #39286) +x 126. e.g.",
    "KeyError: 'slot_17' at /tmp/x/y.py 0xdeadbeef; ValueError(\"bad value here\") “quoted text”",
    "Same as #4521 and /issues/77 and /pull/9, failing in widget.render.timing; os.path.join",
    "__init__ _a_ a_b_c WebSocket macOS DingTalk HTTPServerError K8sTimeout aÀbÀc",
    "--- +++ @@ -1 +1 @@ def x():\n+ x = 1\n- y: int = 2\n+def\n+ z",
]

PIECES = [
    "a", "the", "Error", "error,", "ValueError:", "'bad thing here'", '"quoted string"', "`x`",
    "`_handle_reset_command()`", "foo.bar", "foo/bar.py", "C:\\Users\\bob\\pkg\\mod.py", "\\",
    "/", ".", ":", "-", "_", "__init__", "ThreadPoolExecutor", "WebSocket", "日本語", "한국어",
    "é", "İ", "ſ", "K", "Σ", "ΟΔΟΣ", "\u00a0", "\t", "\n", "\r\n", "\u2028", "\x1c", "#",
    "### Heading", "**Bold**:", "- [x] ", "| a | b |", "<!--", "-->", "https://x.io/a/b",
    "www.a.com", "0xdeadBEEF", "3f9a2b1c4d5e6f708192", "deadbeefcafe", "v1.2.3rc1", "1.2",
    "2024-01-02", "03:04:05", "line", "Line", "42", "run.py:12:3", "a.bc:9", "(", ")", "f(x)",
    "obj.meth(", 'File "/home/u/p/x/y.py", line 3, in go', "+def new_func(a):", "-class Old:",
    "@@ -1,2 +1,3 @@ def hdr():", "+ x = 1", "- yy: int = 2", "#123", "/issues/45", "/pull/9",
    "node_modules/pkg/index.js", "site-packages/a/b.py", "~/x/y.ts", "./rel/p.md", "tests/t.py",
    "OS: Ubuntu 22.04", "Describe the bug", "_No response_", "x" * 70, "snake_case_name",
    "camelCaseName", "K8sTimeout", "e.g.", "read-aloud", "(salvage", "done.", "x.y.z.w",
    "I have read the troubleshooting guide twice", "Paste the crash dump below this line",
    "line 42", "Line 7:", "at 2024-01-02 03:04", "o/r/issues/77", "o/r/pull/9",
]
texts = st.lists(
    st.tuples(st.sampled_from(PIECES) | st.text(max_size=6),
              st.sampled_from(["", " ", "  ", "\n", ".", "/", ":", "\t"])),
    max_size=30,
).map(lambda parts: "".join(a + b for a, b in parts))

BOILERPLATE = learn_boilerplate([
    """name: Bug
body:
  - type: textarea
    attributes:
      label: What happened?
      description: Tell us what you saw and what you expected instead
  - type: checkboxes
    attributes:
      options:
        - label: I have read the troubleshooting guide twice
""",
    "---\nname: Crash\n---\n**Widget build flavour**\nPaste the crash dump below this line\n",
])


def clear_memos() -> None:
    memos: list[dict[str, Any]] = [
        text_mod._TOKENS_MEMO, text_mod._TOKENS_KEEP_MEMO, text_mod._NOISE_MEMO,
        ev_mod._EVIDENCE_MEMO, ev_mod._ERROR_WORDS_MEMO, *text_mod._WORD_TOKENS.values(),
    ]
    for memo in memos:
        memo.clear()


def check_text(text: str) -> None:
    """Every text function against its reference, with the memos cold and then warm."""
    for _ in range(2):
        assert tokens(text) == ref_tokens(text)
        assert tokens(text, keep_stopwords=True) == ref_tokens(text, keep_stopwords=True)
        assert clean_body(text) == ref_clean_body(text)
        assert clean_title(text) == ref_clean_title(text)
        assert extract_issue_evidence(text) == ref_issue_evidence(text)
        assert normalise_error(text) == ref_normalise_error(text)
        assert ev_mod._hunk_symbols(text) == ref_hunk_symbols(text)
        assert normalise_line(text) == ref_normalise_line(text)
        assert BOILERPLATE.strip(text) == ref_strip(BOILERPLATE, text)
        for word in text.split():
            assert stem(word.lower()) == ref_stem(word.lower())


# --- the facts the fast paths rest on -----------------------------------------------------------


def test_whitespace_is_what_split_splits_and_what_regex_calls_whitespace() -> None:
    # Chunks come from str.split(); the regexes collapse \s. Both must mean the same characters,
    # and none of them may be a word character (a \b on either side of one is a text edge).
    assert set(re.findall(r"\s", ALL_CHARS)) == set(WHITESPACE)
    assert all(len(f"a{c}b".split()) == 2 for c in WHITESPACE)
    assert not re.search(r"\w", WHITESPACE)


@pytest.mark.parametrize("pattern", [
    text_mod._WORD, text_mod._CHAIN_RUN, text_mod._CODE_CHAIN, text_mod._CJK, ev_mod._PATH,
    ev_mod._PATH_RUN, ev_mod._CALL, ev_mod._CALL_SCAN, text_mod._CHAIN_SCAN, ev_mod._IDENT,
    ev_mod._MODULE, ev_mod._EXC_TYPE,
    ev_mod._ERR_PATH_RUN, ev_mod._ERR_NUMBER, text_mod._UUID, text_mod._HEX, text_mod._VERSION,
], ids=lambda p: p.pattern[:30])
def test_chunk_patterns_never_match_whitespace(pattern: re.Pattern[str]) -> None:
    # Each of these is matched chunk by chunk, which is only the same as matching the text when
    # no match can hold a whitespace character.
    for c in WHITESPACE:
        for sample in (f"a{c}b", f"a.b{c}c.py", f"x{c}(", f"0x1{c}2", f"1.2{c}.3", f"a/{c}b.py"):
            assert all(c not in m.group(0) for m in pattern.finditer(sample)), (c, sample)


def test_ascii_fold_is_every_non_ascii_character_that_ignorecase_matches_to_ascii() -> None:
    found = {c: [a for a in map(chr, range(128)) if re.fullmatch(re.escape(a), c, re.I)]
             for c in re.findall(r"[\x00-\x7f]", ALL_CHARS[128:], re.I)}
    assert {c: {a.lower() for a in found[c]} for c in found} == {
        c: {bp_mod._ASCII_FOLD[ord(c)]} for c in map(chr, bp_mod._ASCII_FOLD)
    }
    # Lower-casing keeps positions: one character to one, but for U+0130, which is folded first.
    assert [c for c in ALL_CHARS if len(c.lower()) != 1] == ["\u0130"]
    assert not [c for c in ALL_CHARS[128:] if c not in "\u0130\u212a"
                and any(ord(x) < 128 for x in c.lower())]


def test_title_prefix_can_only_start_with_the_listed_characters() -> None:
    starts = set(re.findall(r"[bfcdrp]", ALL_CHARS, re.I)) | {"[", "#"}
    assert starts <= text_mod._PREFIX_STARTS


def test_fast_identifier_pattern_is_the_word_boundary_pattern() -> None:
    samples = [*EDGE_CASES, ALL_CHARS[:3000], "a.b.c _x x_ 9a a9 é_a aé_ ._a a._ \u0660a"]
    for sample in samples:
        assert ev_mod._IDENT.findall(sample) == _REF_IDENT.findall(sample)


# --- outputs against the plain algorithms -------------------------------------------------------


@pytest.mark.parametrize("text", EDGE_CASES, ids=lambda t: repr(t[:25]))
def test_edge_cases_match_the_plain_algorithms(text: str) -> None:
    clear_memos()
    check_text(text)


@FAST
@given(text=texts)
def test_generated_text_matches_the_plain_algorithms(text: str) -> None:
    check_text(text)


@FAST
@given(words=st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEF_-.:()'", max_size=12),
                      max_size=20))
def test_word_like_chunks_match_the_plain_algorithms(words: list[str]) -> None:
    check_text(" ".join(words))


def make_cluster(label: str, summary: str, titles: list[str],
                 hunks: dict[str, list[str]]) -> Cluster:
    members: list[dict[str, Any]] = [
        {"kind": "issue", "number": 100 + i, "title": t} for i, t in enumerate(titles)
    ]
    members.append({"kind": "pr", "number": 900, "title": titles[0] if titles else None,
                    "merged": True, "is_fix_pr": True, "files_changed": ["docs/x.md", *hunks],
                    "fix_hunks": [{"file": f, "hunks": h} for f, h in hunks.items()]})
    return Cluster.model_validate({"repo": "acme/widget", "public_id": "100",
                                   "display_label": label, "summary": summary,
                                   "landed_fix": {"pr": 900}, "members": members})


@pytest.mark.parametrize("label, summary, titles", [
    ("", "", []),
    ("fix(render): guard zero fps", TRACEBACK, ["[Bug]: `FrameScheduler` hangs", "same title",
                                                "same title"]),
    ("ΟΔΟΣ 日本語", EDGE_CASES[4], [EDGE_CASES[19], EDGE_CASES[20], "x" * 300]),
    ("KeyError in `cfg.load()`", EDGE_CASES[21], [EDGE_CASES[23]]),
])
def test_cluster_evidence_matches_the_plain_algorithm(label: str, summary: str,
                                                      titles: list[str]) -> None:
    cluster = make_cluster(label, summary, titles, {"widget/render/frame.py": [HUNK, HUNK[:60]],
                                                    "tests/test_frame.py": [HUNK]})
    clear_memos()
    for _ in range(2):
        assert cluster_evidence_tuple(cluster) == ref_cluster_evidence(cluster)


@FAST
@given(label=texts, summary=texts, titles=st.lists(texts, max_size=4), hunk=texts)
def test_generated_clusters_match_the_plain_algorithm(label: str, summary: str,
                                                      titles: list[str], hunk: str) -> None:
    cluster = make_cluster(label, summary, titles, {"widget/a.py": [hunk, "+" + hunk]})
    assert cluster_evidence_tuple(cluster) == ref_cluster_evidence(cluster)


# --- the fast paths themselves, by example ------------------------------------------------------


def test_tokens_of_a_text_are_its_chunks_chains_then_words() -> None:
    assert tokens("") == [] and tokens(" \n\t") == []
    assert tokens("(render done. read-aloud 126.") == ["render", "done", "read", "aloud"]
    toks = tokens("Crash in widget/render/frame.py, see FrameScheduler.tick() e.g. here")
    assert toks[:3] == ["widget/render/frame.py", "framescheduler.tick", "e.g"]
    assert tokens("日本語 text") == ["text", "日", "本", "語"]


def test_a_chunk_longer_than_the_memo_takes_is_worked_out_each_time() -> None:
    clear_memos()
    long_chunk = "render_frame." * 10 + "py"
    assert tokens(long_chunk) == ref_tokens(long_chunk)
    assert long_chunk not in text_mod._TOKENS_MEMO
    assert tokens(long_chunk) == ref_tokens(long_chunk)
    assert "render_frame.py" not in text_mod._TOKENS_MEMO
    tokens("render_frame.py")
    assert "render_frame.py" in text_mod._TOKENS_MEMO


def test_a_full_memo_empties_itself_and_keeps_answering() -> None:
    calls: list[str] = []

    def compute(chunk: str) -> int:
        calls.append(chunk)
        return len(chunk)

    memo = ChunkMemo(compute, size=2)
    assert [memo[c] for c in ("a", "bb", "a", "ccc", "a")] == [1, 2, 1, 3, 1]
    assert calls == ["a", "bb", "ccc", "a"]  # the third chunk found it full and emptied it
    assert len(memo) == 2


def test_noise_removal_that_makes_more_noise_is_followed_through() -> None:
    # The URL's removal puts a word boundary after the hash, which only then matches.
    text = "see abcdef012345https://x.io/a now"
    assert clean_body(text) == ref_clean_body(text)
    assert "abcdef012345" not in clean_body(text)
    # "line 42" and a date with its time span a space.
    assert clean_body("fails on line 42 here") == "fails on   here"
    assert clean_body("on line 42 at 2024-01-02 03:04:05 ok").split() == ["on", "at", "ok"]


def test_template_phrase_matched_through_ignorecase_folding_is_removed() -> None:
    body = "İ have read the troubleſhooting guide twice\nThe spline editor crashes."
    assert "troubleſhooting" not in BOILERPLATE.strip(body)
    assert BOILERPLATE.strip(body) == ref_strip(BOILERPLATE, body)


def test_clean_title_without_a_prefix_is_only_stripped() -> None:
    for title in ("  Spline editor hangs ", "日本語", "İstanbul", "`x` crashes", "[Bug]: x",
                  "fix(render): y", "## z", "feat!: a", "Bug: b", "Perf(x): c"):
        assert clean_title(title) == ref_clean_title(title)


def test_evidence_of_words_in_punctuation_by_example() -> None:
    ev = extract_issue_evidence(
        "(ThreadPoolExecutor, fix(desktop): config.yaml, TimeoutError: e.g. [WebSocket]")
    assert ev.symbols == ["fix", "ThreadPoolExecutor"]  # calls first, then identifiers
    assert ev.files == ["config.yaml"]


def test_hunk_assignments_and_definitions_in_line_order() -> None:
    assert ev_mod._hunk_symbols(HUNK) == ref_hunk_symbols(HUNK)
    assert ev_mod._hunk_symbols("+ total_count = 1\n+ x: int\n+no_assignment_here") == [
        "total_count", "total_count", "x", "no_assignment_here"]


def test_repeated_cluster_texts_add_nothing_new() -> None:
    once = make_cluster("Renderer `tick()` fails", "", ["KeyError 'frame_budget'"], {})
    twice = make_cluster("Renderer `tick()` fails", "", ["KeyError 'frame_budget'"] * 3, {})
    assert cluster_evidence_tuple(once)[2:4] == cluster_evidence_tuple(twice)[2:4]
    assert cluster_evidence_tuple(twice) == ref_cluster_evidence(twice)


def test_memos_do_not_change_what_comes_out_in_any_order() -> None:
    samples = [*EDGE_CASES, *itertools.islice(itertools.cycle(PIECES), 200)]
    clear_memos()
    forward = [(tokens(s), extract_issue_evidence(s), normalise_error(s), clean_body(s))
               for s in samples]
    clear_memos()
    backward = [(tokens(s), extract_issue_evidence(s), normalise_error(s), clean_body(s))
                for s in reversed(samples)]
    assert forward == backward[::-1]
