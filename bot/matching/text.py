"""Code-aware tokens and noise removal.

Bug reports mix prose with code: ``_handle_reset_command``, ``ThreadPoolExecutor``,
``gateway/run.py``, ``hermes_cli.config``. A code token is kept whole (it is the most specific
thing an issue can say) and also split into its parts, so that ``reset command`` in one text still
meets ``_handle_reset_command`` in another.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from itertools import chain
from typing import TypeVar

# Short English function words plus the words that every issue template and every bug report uses.
# IDF would push most of them down anyway, but on a few hundred clusters IDF is noisy, and these
# words carry no evidence about which bug it is.
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "been",
        "being",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "for",
        "from",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "him",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "me",
        "more",
        "most",
        "my",
        "no",
        "nor",
        "not",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "also",
        "after",
        "before",
        "again",
        "any",
        "all",
        "each",
        "few",
        "both",
        "because",
        "about",
        "above",
        "below",
        "between",
        "during",
        "via",
        "per",
        "etc",
        "eg",
        "ie",
        "get",
        "got",
        "gets",
        "getting",
        "make",
        "makes",
        "made",
        "use",
        "used",
        "uses",
        "using",
        "still",
        "even",
        "ever",
        "now",
        "new",
        "old",
        "like",
        "one",
        "two",
        "three",
        "instead",
        "without",
        "within",
        "whether",
        "however",
        "although",
        "though",
        "may",
        "might",
        "must",
        "shall",
        "let",
        "lets",
        "see",
        "seen",
        "seems",
        "seem",
        "way",
        "thing",
        "things",
        "something",
        "anything",
        "nothing",
        "really",
        "actually",
        "please",
        "thanks",
        "thank",
        "hi",
        "hello",
        "issue",
        "issues",
        "bug",
        "bugs",
        "problem",
        "report",
        "reported",
        "reproduce",
        "reproduced",
        "steps",
        "step",
        "expected",
        "actual",
        "behavior",
        "behaviour",
        "describe",
        "description",
        "additional",
        "context",
        "environment",
        "version",
        "versions",
        "screenshot",
        "screenshots",
        "log",
        "logs",
        "output",
        "fix",
        "fixes",
        "fixed",
        "feat",
        "chore",
    ]
)

# Identifiers: words with letters, digits, underscores; dotted/slashed chains kept as one token.
_CODE_CHAIN = re.compile(r"[A-Za-z_][\w-]*(?:[./\\:][A-Za-z_0-9][\w-]*)+")
# _CODE_CHAIN's matches, as group 1 (the same, in linear time); the second alternative only
# steps over the word where a chain failed to start. Every later start inside that word runs
# to the same word end and fails the same way, so trying them (what findall does with
# _CODE_CHAIN) made a long word with no separator after it quadratic: ``x..aaaa…a.``.
_CHAIN_SCAN = re.compile(r"([A-Za-z_][\w-]*+(?:[./\\:][A-Za-z_0-9][\w-]*+)+)|[A-Za-z_][\w-]*+")
# A digit run preceded by a digit cannot start a word: the start one digit earlier reached the
# same run end and found no letter there. Without the look-behind a long digit run that no
# letter follows was tried from each of its digits (quadratic).
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|(?<![0-9])[0-9]+[A-Za-z][A-Za-z0-9_]*")
# A code chain only holds word characters, "-" and its separators ./\: so it lies within a run of
# those; scanning only the runs that hold a separator (not at their end) finds the same chains
# far faster than trying the chain pattern at every position of the text.
_CHAIN_RUN = re.compile(r"[\w\-./\\:]+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
# Non-Latin scripts (CJK...) are kept as single characters so that such issues still have terms.
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def is_code_like(token: str) -> bool:
    """True for identifiers that look like code rather than prose: snake_case, CamelCase, dotted."""
    if len(token) < 3:
        return False
    if "_" in token.strip("_") or "." in token or "/" in token:
        return True
    inner = token[1:]
    return any(c.isupper() for c in inner) and any(c.islower() for c in token)


def stem(word: str) -> str:
    """A light suffix stripper: plural and verb endings only, so that stems stay readable and
    code identifiers are barely touched."""
    if len(word) <= 3 or word[-1] not in "sgd" or not word.isalpha():
        return word  # every suffix below ends in s, g or d
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
            # "running" -> "runn" -> "run": undouble a final consonant left by -ing/-ed.
            if (
                suffix in ("ing", "ed")
                and len(base) >= 3
                and base[-1] == base[-2]
                and base[-1] not in "lsz"
            ):
                base = base[:-1]
            return base
    return word


def _parts(identifier: str) -> list[str]:
    out: list[str] = []
    for piece in re.split(r"[_\W]+", identifier):
        if not piece:
            continue
        out.extend(m.group(0) for m in _CAMEL.finditer(piece))
    return out


_V = TypeVar("_V")

# Chunks: the whitespace-separated pieces of a text. A corpus repeats its chunks ("the", "error,",
# "`config.yaml`") far more often than it brings new ones, so work that depends on one chunk only
# is memoised per chunk: a text then costs a split and a dictionary lookup per chunk, all in C,
# instead of a regex scan of the text and a call per word. 2**18 holds every distinct chunk of the
# titles and summaries of 100,000 clusters (about 245,000), so an index build never refills it.
CHUNK_MEMO_SIZE = 1 << 18
# A longer chunk (a pasted blob, CJK prose without spaces) is worked out each time: the memo keeps
# its keys alive, and one issue must not fill it with large ones.
MAX_MEMO_CHUNK = 64


class ChunkMemo(dict[str, _V]):
    """``memo[chunk]`` is ``compute(chunk)``, remembered for short chunks.

    A plain dict with ``__missing__`` rather than lru_cache: a hit never leaves C and costs no
    recency bookkeeping. When full it is emptied and fills again from the texts that follow."""

    def __init__(self, compute: Callable[[str], _V], size: int = CHUNK_MEMO_SIZE) -> None:
        super().__init__()
        self._compute = compute
        self._size = size

    def __missing__(self, chunk: str) -> _V:
        value = self._compute(chunk)
        if len(chunk) <= MAX_MEMO_CHUNK:
            if len(self) >= self._size:
                self.clear()
            self[chunk] = value
        return value


def _word_tokens(word: str, keep_stopwords: bool = False) -> tuple[str, ...]:
    if word.isalpha() and (word.islower() or word.isupper() or word[1:].islower()):
        # Most words are prose: not code-like, and one part, the word itself (what _parts finds).
        low = word.lower()
        if len(low) < 2 or (not keep_stopwords and low in STOPWORDS):
            return ()
        return (stem(low),)
    out: list[str] = []
    if is_code_like(word):
        whole = word.lower().strip("_")
        if whole:
            out.append(whole)
    for part in _parts(word):
        low = part.lower()
        if len(low) < 2 or (not keep_stopwords and low in STOPWORDS):
            continue
        if low.isdigit():
            continue
        out.append(stem(low))
    return tuple(out)


# Per-word work (code-likeness, splitting, stemming) depends only on the word, and a corpus has far
# fewer distinct words than word occurrences: it is memoised. The memoised tuples hold one string
# object per distinct token, so every index built from them shares those strings.
# (A one-argument function each: the memo calls it on every miss.)
_WORD_TOKENS = {
    False: ChunkMemo(_word_tokens),
    True: ChunkMemo(lambda word: _word_tokens(word, keep_stopwords=True), 1 << 12),
}


@lru_cache(maxsize=CHUNK_MEMO_SIZE)
def _chain_token(chain: str) -> str:
    whole = chain.rstrip(".:-").replace("\\", "/").lower()
    return whole if len(whole) >= 3 else ""


class _Chained(tuple[str, ...]):
    """The word tokens of a chunk that also holds code chains (``chains``): a text's chains come
    before all of its words. A chunk without chains is memoised as its plain word tokens, most
    often the very tuple of its one word."""

    chains: tuple[str, ...]


# What prose puts around a word: "(see", "done.", "this,", "'quoted'". None of it is a word
# character, so a chunk that is one ASCII word wrapped in it holds that word and nothing else, and
# no code chain (a chain needs a word character before a separator and one after it).
_WRAPPING = "()[]{}<>,.;:!?\"'`*#"
_NO_TOKENS: tuple[str, ...] = ()


def _chunk_tokens(chunk: str, keep_stopwords: bool = False) -> tuple[str, ...]:
    word_tokens = _WORD_TOKENS[keep_stopwords]
    word = chunk.strip(_WRAPPING)
    if word.isascii():
        if word.isalpha():
            return word_tokens[word]
        if word.isdigit():
            return _NO_TOKENS  # a word needs a letter
        if "-" in word and word.replace("-", "").isalpha():
            # "read-aloud": its words, split at the hyphens; "-" is no chain separator.
            parts = [w for w in word.split("-") if w]
            return tuple(chain.from_iterable(map(word_tokens.__getitem__, parts)))
    words = tuple(chain.from_iterable(map(word_tokens.__getitem__, _WORD.findall(chunk))))
    if "." in chunk or "/" in chunk or ":" in chunk or "\\" in chunk:
        chains: list[str] = []
        for run in _CHAIN_RUN.findall(chunk):
            head = run[:-1]
            if "." in head or "/" in head or ":" in head or "\\" in head:
                for match in _CHAIN_SCAN.findall(run):
                    whole = _chain_token(match) if match else ""
                    if whole:
                        chains.append(whole)
        if chains:
            chained = _Chained(words)
            chained.chains = tuple(chains)
            return chained
    return words


# None of the token patterns matches whitespace or looks at a character outside its match, so the
# matches in a text are those in its chunks, chunk after chunk.
_TOKENS_MEMO = ChunkMemo(_chunk_tokens)
_TOKENS_KEEP_MEMO = ChunkMemo(lambda chunk: _chunk_tokens(chunk, keep_stopwords=True), 1 << 12)


def _may_hold_chain(text: str) -> bool:
    """False when no code chain can be in ``text``: a chain needs a separator followed by a word
    character, and prose puts a "." or ":" only before a space or at the end."""
    if "/" in text or "\\" in text:
        return True
    if "." in text and text.count(".") != text.count(". ") + text.endswith("."):
        return True
    return ":" in text and text.count(":") != text.count(": ") + text.endswith(":")


def tokens(text: str, *, keep_stopwords: bool = False) -> list[str]:
    """Lower-cased, lightly stemmed tokens; code identifiers kept whole and split into parts."""
    if not text:
        return []
    memo = _TOKENS_KEEP_MEMO if keep_stopwords else _TOKENS_MEMO
    if ("." in text or "/" in text or ":" in text or "\\" in text) and _may_hold_chain(text):
        parts = list(map(memo.__getitem__, text.split()))
        # Every code chain of the text comes before its words.
        out = [t for p in parts if p.__class__ is _Chained for t in p.chains]
        out.extend(chain.from_iterable(parts))
    else:
        out = list(chain.from_iterable(map(memo.__getitem__, text.split())))
    if not text.isascii():
        out.extend(_CJK.findall(text))
    return out


# --- noise removal -----------------------------------------------------------------------------

_URL = re.compile(r"https?://\S+|www\.\S+")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b|\b[0-9a-f]{12,64}\b")
_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
_VERSION = re.compile(r"\bv?\d+(?:\.\d+){1,3}(?:[-+.]?(?:rc|a|b|dev|post)\d*)?\b", re.I)
_DATE_TIME = re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?(?:\.\d+)?Z?)?\b")
_LINE_NO = re.compile(r"\b[Ll]ine \d+\b|(?<=\w\.\w\w):\d+\b|(?<=\.py):\d+(?::\d+)?")
_CHECKBOX = re.compile(r"^\s*[-*]\s*\[[ xX]\]\s")
_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
_HEADING = re.compile(r"^\s{0,3}(?:#{1,6}\s+|\*\*[^*]{1,60}\*\*:?\s*$)")
# "OS: Ubuntu 22.04", "Python version: 3.11" — key/value lines of environment sections.
# The possessive runs before [-*]? and after it: two greedy \s* around an optional item split
# a line of blanks in every way before failing (cubic on "   …   :"); nothing that follows
# them can start with a blank, so giving one back never made a match.
_KV_LINE = re.compile(r"^\s*+[-*]?\s*+\**+[A-Za-z][\w ./()-]{0,30}\**\s*:\s*\S.{0,60}$")
_ENV_KEYS = re.compile(
    r"^\s*+[-*]?\s*+\**+(os|platform|python|node|version|hermes version|app version|browser|"
    r"operating system|distro|kernel|installation method|install method|model|provider|shell|"
    r"terminal|device|arch|architecture)\b",
    re.I,
)


def strip_comments(text: str) -> str:
    """``text`` with each HTML comment (``<!--`` to the first ``-->`` after it) replaced by a
    space; an unclosed one is left as written. What ``re.sub(r"<!--.*?-->", " ", text, re.S)``
    gives, found with str.find: that regex scans to the end of the text from every ``<!--``
    that has no closer, so ``"<!--" * 16384`` took seconds."""
    start = text.find("<!--")
    if start < 0:
        return text
    out: list[str] = []
    done = 0
    while start >= 0:
        end = text.find("-->", start + 4)
        if end < 0:
            break  # no closer after this opener, hence none after any later one
        out.append(text[done:start])
        out.append(" ")
        done = end + 3
        start = text.find("<!--", done)
    out.append(text[done:])
    return "".join(out)

# Generic issue-form headings and prompts (GitHub's default templates and the common forms). They
# are the same in every repository, so they are stripped whatever the repository's own templates.
GENERIC_BOILERPLATE = (
    "describe the bug",
    "bug description",
    "to reproduce",
    "steps to reproduce",
    "reproduction steps",
    "expected behavior",
    "expected behaviour",
    "actual behavior",
    "actual behaviour",
    "current behavior",
    "screenshots",
    "additional context",
    "additional information",
    "environment",
    "operating system",
    "desktop (please complete the following information)",
    "smartphone (please complete the following information)",
    "is your feature request related to a problem",
    "describe the solution you'd like",
    "describe alternatives you've considered",
    "i have searched the existing issues",
    "i searched existing issues",
    "no response",
    "_no response_",
    "relevant log output",
    "logs",
    "error logs",
    "debug report",
)


_GENERIC_BOILERPLATE = frozenset(GENERIC_BOILERPLATE)

# The noise patterns, in the order they are removed. Each sub goes over the whole body, and a
# body rarely holds more than one or two kinds: the chunks of the body (the patterns never match
# whitespace, except the two named below) say which kinds can be there at all, and only those
# subs run. A chunk's answer is memoised like its tokens.
_NOISE = (_URL, _UUID, _HEX, _DATE_TIME, _LINE_NO, _VERSION)
_LINE_NO_BIT = 1 << _NOISE.index(_LINE_NO)
_HEX_BIT = 1 << _NOISE.index(_HEX)
_URL_BIT = 1 << _NOISE.index(_URL)


def _noise_kinds(chunk: str) -> int:
    """Which noise patterns (bit i for _NOISE[i]) match inside ``chunk`` on its own."""
    word = chunk.strip(_WRAPPING)
    if word.isalpha():
        # No digit, no "-" or "/": only an all-letter hash such as "deadbeefcafe" can match, or
        # "www." when the word ends in www and a full stop follows.
        kinds = _HEX_BIT if len(word) >= 12 and _HEX.search(chunk) else 0
        if "www." in chunk and _URL.search(chunk):
            kinds |= _URL_BIT
        return kinds
    kinds = 0
    for i, pattern in enumerate(_NOISE):
        if pattern.search(chunk):
            kinds |= 1 << i
    return kinds


# Only issue bodies are cleaned, so far fewer chunks come by than in an index build.
_NOISE_MEMO = ChunkMemo(_noise_kinds, 1 << 16)


def _body_noise_kinds(text: str) -> int:
    kinds = 0
    for k in set(map(_NOISE_MEMO.__getitem__, text.split())):
        kinds |= k
    # "line 42" spans a space; a date and its time do too, but the date alone ends its chunk and
    # matches there.
    if "ine " in text:
        kinds |= _LINE_NO_BIT
    return kinds


def clean_body(text: str | None) -> str:
    """Drop what every issue carries regardless of the bug: template headings, checklists,
    environment tables and key/value lines, URLs, hashes, versions, dates and line numbers."""
    if not text:
        return ""
    if "<!--" in text:
        text = strip_comments(text)
    kept: list[str] = []
    # Each line pattern needs its first non-blank character (or a colon): the cheap test first.
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        low = stripped.lower().strip("#*:_ ").strip()
        if low in _GENERIC_BOILERPLATE:
            continue
        first = stripped[0]
        if first in "-*" and _CHECKBOX.match(line):
            continue
        if first == "|" and _TABLE_ROW.match(line):
            continue
        if first in "#*" and _HEADING.match(line) and len(low.split()) <= 6:
            # Short headings are template structure; a long "heading" is usually the reporter's
            # one-line summary and is kept.
            continue
        if ":" in line and _ENV_KEYS.match(line) and _KV_LINE.match(line):
            continue
        kept.append(line)
    out = "\n".join(kept)
    kinds = _body_noise_kinds(out)
    changed = False
    for i, pattern in enumerate(_NOISE):
        # A removal can make a later pattern match where it did not (a new word boundary), so
        # once the text changed every later pattern runs.
        if changed or kinds & (1 << i):
            out, n = pattern.subn(" ", out)
            changed = changed or n > 0
    return out


_TITLE_PREFIX = re.compile(
    r"^\s*(?:\[([^\]]{1,30})\]\s*:?\s*|(?:bug|fix|feat|feature|chore|docs|refactor|perf)"
    r"(?:\(([^)]{0,40})\))?!?\s*:\s*|#+\s*)",
    re.I,
)
# The first characters _TITLE_PREFIX can match (re.I maps no other character to these letters).
_PREFIX_STARTS = frozenset("[#bBfFcCdDrRpP")


def clean_title(title: str | None) -> str:
    """Strip "[Bug]:", "fix(scope):" prefixes; a scope or bracket tag is kept as a plain word
    because it names the subsystem."""
    if not title:
        return ""
    out = title.strip()
    for _ in range(3):
        # ``out`` is stripped, so a prefix starts right at its first character.
        if not out or out[0] not in _PREFIX_STARTS:
            break
        m = _TITLE_PREFIX.match(out)
        if not m or not m.group(0):
            break
        tag = " ".join(g for g in m.groups() if g)
        out = (
            (tag + " " + out[m.end() :]).strip()
            if tag.lower() not in ("bug", "bug report")
            else out[m.end() :].strip()
        )
    return out
