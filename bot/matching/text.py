"""Code-aware tokens and noise removal.

Bug reports mix prose with code: ``_handle_reset_command``, ``ThreadPoolExecutor``,
``gateway/run.py``, ``hermes_cli.config``. A code token is kept whole (it is the most specific
thing an issue can say) and also split into its parts, so that ``reset command`` in one text still
meets ``_handle_reset_command`` in another.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from itertools import chain, repeat

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
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+[A-Za-z][A-Za-z0-9_]*")
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


# Per-word work (code-likeness, splitting, stemming) depends only on the word, and a corpus has far
# fewer distinct words than word occurrences: it is memoised. The cached tuples hold one string
# object per distinct token, so every index built from them shares those strings.
_WORD_CACHE_SIZE = 1 << 18


@lru_cache(maxsize=_WORD_CACHE_SIZE)
def _word_tokens(word: str, keep_stopwords: bool) -> tuple[str, ...]:
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


@lru_cache(maxsize=_WORD_CACHE_SIZE)
def _chain_token(chain: str) -> str:
    whole = chain.rstrip(".:-").replace("\\", "/").lower()
    return whole if len(whole) >= 3 else ""


def tokens(text: str, *, keep_stopwords: bool = False) -> list[str]:
    """Lower-cased, lightly stemmed tokens; code identifiers kept whole and split into parts."""
    out: list[str] = []
    if not text:
        return out
    if "." in text or "/" in text or ":" in text or "\\" in text:
        for run in _CHAIN_RUN.findall(text):
            head = run[:-1]
            if "." in head or "/" in head or ":" in head or "\\" in head:
                for found in _CODE_CHAIN.findall(run):
                    whole = _chain_token(found)
                    if whole:
                        out.append(whole)
    out.extend(chain.from_iterable(map(_word_tokens, _WORD.findall(text), repeat(keep_stopwords))))
    if not text.isascii():
        out.extend(_CJK.findall(text))
    return out


def token_set(texts: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for text in texts:
        found.update(tokens(text))
    return found


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
_KV_LINE = re.compile(r"^\s*[-*]?\s*\**[A-Za-z][\w ./()-]{0,30}\**\s*:\s*\S.{0,60}$")
_ENV_KEYS = re.compile(
    r"^\s*[-*]?\s*\**(os|platform|python|node|version|hermes version|app version|browser|"
    r"operating system|distro|kernel|installation method|install method|model|provider|shell|"
    r"terminal|device|arch|architecture)\b",
    re.I,
)
_COMMENT = re.compile(r"<!--.*?-->", re.S)

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


def clean_body(text: str | None) -> str:
    """Drop what every issue carries regardless of the bug: template headings, checklists,
    environment tables and key/value lines, URLs, hashes, versions, dates and line numbers."""
    if not text:
        return ""
    text = _COMMENT.sub(" ", text)
    kept: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        low = stripped.lower().strip("#*:_ ").strip()
        if low in GENERIC_BOILERPLATE:
            continue
        if _CHECKBOX.match(line) or _TABLE_ROW.match(line):
            continue
        if _HEADING.match(line) and len(low.split()) <= 6:
            # Short headings are template structure; a long "heading" is usually the reporter's
            # one-line summary and is kept.
            continue
        if _ENV_KEYS.match(line) and _KV_LINE.match(line):
            continue
        kept.append(line)
    out = "\n".join(kept)
    for pattern in (_URL, _UUID, _HEX, _DATE_TIME, _LINE_NO, _VERSION):
        out = pattern.sub(" ", out)
    return out


_TITLE_PREFIX = re.compile(
    r"^\s*(?:\[([^\]]{1,30})\]\s*:?\s*|(?:bug|fix|feat|feature|chore|docs|refactor|perf)"
    r"(?:\(([^)]{0,40})\))?!?\s*:\s*|#+\s*)",
    re.I,
)


def clean_title(title: str | None) -> str:
    """Strip "[Bug]:", "fix(scope):" prefixes; a scope or bracket tag is kept as a plain word
    because it names the subsystem."""
    if not title:
        return ""
    out = title.strip()
    for _ in range(3):
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
