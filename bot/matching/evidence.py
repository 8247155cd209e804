"""Evidence an issue names (files, symbols, errors) and evidence a cluster's fix carries.

What a reporter pastes — a traceback, a path, a function name, an error message — is more
specific than any prose, and it can be checked against what the fix PR actually changed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from operator import attrgetter
from typing import NamedTuple

from bot.clusters.models import Cluster
from bot.matching.text import ChunkMemo, is_code_like

SOURCE_EXTENSIONS = (
    "py|pyi|js|jsx|ts|tsx|mjs|cjs|go|rs|rb|java|kt|c|h|cc|cpp|hpp|cs|swift|php|sh|bash|ps1|"
    "toml|yaml|yml|json|cfg|ini|md|sql|html|css|scss|vue|svelte|lua|nix|txt|lock"
)
# A path: optional drive, then segments joined by / or \, ending in a known extension; or a bare
# file name with a known extension. The definition of what is found; ``_path_spans`` finds its
# matches in linear time (the regex engine retries a long run of path characters from each of
# its positions, quadratic on ``a/a/…/a/~.py``).
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.@~+-]+[/\\])*[\w.@+-]+\.(?:" + SOURCE_EXTENSIONS + r")\b")
# Every path match ends in one of these.
_PATH_END = re.compile(r"\.(?:" + SOURCE_EXTENSIONS + r")\b")
# Every character of a path match is one of these: matches lie within runs of them, and only a run
# with a "." before its end can hold one (see extract_issue_evidence).
_PATH_RUN = re.compile(r"[\w.@~+\-/\\:]+")
_SLASHES = ("/", "\\")
_DOUBLE_SLASHES = ("//", "/\\", "\\/", "\\\\")
_PATH_SEPS = ("/", "\\", "~", ":")
_DRIVE_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


# An extension's dot: where it is, where the extension ends, where F starts, whether a slash is
# right before F, where its piece starts.
_Dot = tuple[int, int, int, bool, int]


def _path_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The spans of ``_PATH.finditer(text, start, end)`` over a run of _PATH_RUN's characters,
    found from the extensions instead of from every position, in linear time.

    A match is ``D? (S /)* F .ext``: D a drive ``X:``, S a segment of ``[\\w.@~+-]``, F of
    ``[\\w.@+-]``, so no match holds a ":" but its drive's or an empty segment (``//``): the
    run falls into pieces at those. In a piece, a start ``p`` reaches the dot ``d`` of an
    extension when F (the characters before ``d`` back to the last "/", "\\" or "~") is not
    empty and either starts after a "/" at or after ``p`` (any segments lead there) or starts
    at or before ``p`` (``p`` is inside F). The regex takes the leftmost start that reaches
    one, and from it the longest match (most segments, then the longest F): the last dot it
    reaches. A drive letter, tried before its ":", starts a match when the piece after the ":"
    does from its first character."""
    dots: list[_Dot] = []  # in text order
    prev = start
    f_start = piece = start
    for m in _PATH_END.finditer(text, start, end):
        d = m.start()
        # Each search covers only the text since the previous dot: linear in all.
        sep = max(text.rfind(c, prev, d) for c in _PATH_SEPS)
        if sep >= 0:
            f_start = sep + 1
        cut = max(text.rfind(":", prev, d), *(text.rfind(c, prev, d) for c in _DOUBLE_SLASHES))
        if cut >= 0:
            piece = cut + 1
        prev = d
        if d > f_start:  # F is not empty
            after_slash = f_start > piece and text[f_start - 1] in _SLASHES
            dots.append((d, m.end(), f_start, after_slash, piece))
    spans: list[tuple[int, int]] = []
    pos = start
    i = 0
    while i < len(dots):
        piece = dots[i][4]
        j = i
        while j < len(dots) and dots[j][4] == piece:
            j += 1
        group = dots[i:j]
        i = j
        # The last dot reached from any start before its slash (its F follows a "/").
        last = next((x for x in reversed(group) if x[3]), None)
        drive = piece - 2
        if drive >= pos and text[piece - 1] == ":" and text[drive] in _DRIVE_LETTERS:
            found = _path_from(text, piece, group, last)
            if found is not None:
                spans.append((drive, found))
                pos = found
        k = 0
        while True:
            p = max(pos, piece)
            if p < end and text[p] in _SLASHES:
                p += 1  # a segment is never empty: no match starts at a slash
            if last is not None and p < last[2] - 1:
                spans.append((p, last[1]))
                pos = last[1]
                continue
            while k < len(group) and group[k][0] <= max(p, group[k][2]):
                k += 1  # a dot no start at or after ``p`` reaches inside its F
            if k == len(group):
                break
            f = group[k][2]
            while k + 1 < len(group) and group[k + 1][2] == f:
                k += 1
            spans.append((max(p, f), group[k][1]))
            pos = group[k][1]
            k += 1
    return spans


def _path_from(text: str, c: int, group: list[_Dot], last: _Dot | None) -> int | None:
    """Where a match from exactly ``c`` (its piece's first character) ends, or None."""
    if text[c] in _SLASHES:
        return None
    if last is not None and c < last[2] - 1:
        return last[1]
    ends = [x[1] for x in group if x[2] == c]
    return ends[-1] if ends else None


_DIR_PATH = re.compile(r"(?<![\w/])(?:[a-z_][\w-]*/){1,6}[a-z_][\w-]*/?(?![\w/.])")
# Prefixes that say where something was installed, not which file of the project it is.
_INSTALL_PREFIX = re.compile(
    r"^.*(?:site-packages|dist-packages|node_modules|lib/python\d[\d.]*|\.venv|venv|"
    r"app\.asar(?:\.unpacked)?|resources/app|/src/app)/",
    re.I,
)
_HOME_PREFIX = re.compile(
    r"^(?:[a-z]:)?/*(?:home|users|root|opt|usr|var|tmp|private|mnt|workspace|app|srv)/", re.I
)
_TRACE_IN = re.compile(r"File \"[^\"]+\", line \d+, in ([A-Za-z_][\w.]*)")
_BACKTICK = re.compile(r"`([^`\n]{2,120})`")
_CALL = re.compile(r"\b([A-Za-z_][\w.]*[A-Za-z0-9_])\(")
# _CALL's matches, as group 1 (the same, in linear time). A call's "(" can only be the one
# right after the run of [\w.] its name starts in, so where one start in a run fails every
# later start in it fails too; the second alternative steps over the rest of the run instead of
# trying each of them ("a.a.a.…a.(" was quadratic).
_CALL_SCAN = re.compile(r"\b([A-Za-z_][\w.]*[A-Za-z0-9_])\(|\b[A-Za-z_][\w.]*+")
# ``\b[A-Za-z_]\w*...``: a word boundary before a word character is "no word character before
# it", written as a look-behind after the first character so that the regex engine can skip to the
# next letter or underscore instead of trying the whole pattern at every position.
_IDENT = re.compile(r"[A-Za-z_](?<!\w[A-Za-z_])\w*(?:\.[A-Za-z_]\w*)*\b")
_EXC_TYPE = re.compile(r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Warning|Exit|Interrupt|Timeout))\b")
_EXC_SUFFIXES = ("Error", "Exception", "Warning", "Exit", "Interrupt", "Timeout")
_EXC_LINE = re.compile(
    r"\b([A-Z][A-Za-z0-9]*(?:Error|Exception|Warning))(?::\s*|\s*\(\s*)([^\n]{3,160})"
)
_QUOTED = re.compile(r"'([^'\n]{6,120})'|\"([^\"\n]{6,120})\"|“([^”\n]{6,120})”")
_NOT_MODULES = frozenset({"self", "cls", "this", "os", "sys", "e", "i", "g"})
_SOURCE_EXT_SET = frozenset(SOURCE_EXTENSIONS.split("|"))
_TRACE_FILE = re.compile(r"File \"([^\"]+)\"")
_MODULE = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*){1,5}\b")
_ISSUE_REF = re.compile(r"(?:#|/(?:issues|pull)/)(\d{1,7})\b")
# Pure functions of one identifier or path, called once per occurrence: memoised, since a corpus
# repeats the same names and paths far more often than it introduces new ones.
_CACHE_SIZE = 1 << 17
_HUNK_HEADER = re.compile(r"^@@[^@]*@@\s*(.*)$", re.M)
_DEFINITION = re.compile(
    r"(?:def|class|function|func|fn|interface|type|const|let|var)\s+([A-Za-z_$][\w$]*)"
)
_ASSIGNED = re.compile(r"^[+-]\s*([A-Za-z_][\w]*)\s*[:=]", re.M)

# Files whose change says little about which bug it was.
_WEAK_FILE = re.compile(
    r"(?:^|/)(?:tests?|__tests__|spec|fixtures?|docs?|snapshots?)/|(?:^|/)test_[^/]*$|"
    r"_test\.\w+$|\.test\.\w+$|\.spec\.\w+$|\.(?:png|jpe?g|gif|svg|ico|lock|snap|md|txt)$|"
    r"(?:^|/)(?:package-lock\.json|yarn\.lock|pnpm-lock\.yaml|uv\.lock|poetry\.lock|"
    r"CHANGELOG[^/]*|RELEASE[^/]*)$",
    re.I,
)


@lru_cache(maxsize=_CACHE_SIZE)
def is_symbol(ident: str) -> bool:
    """An identifier that names code, not a product: ``snake_case`` or an identifier of three or
    more CamelCase humps (``ThreadPoolExecutor``). Two-hump names (``WebSocket``, ``DingTalk``,
    ``macOS``) are usually product names and count only when backticked or called."""
    core = ident.strip("_")
    if len(core) < 4:
        return False
    if "_" in core:
        return True
    humps = sum(1 for a, b in itertools.pairwise(core) if a.islower() and b.isupper())
    return humps >= 2


@lru_cache(maxsize=_CACHE_SIZE)
def normalise_path(raw: str) -> str:
    """A path as the project names it: forward slashes, lower-case, no install or home prefix."""
    path = raw.replace("\\", "/").strip().strip("'\"`()[]<>,;")
    path = re.sub(r"^[a-zA-Z]:/", "/", path)
    m = _INSTALL_PREFIX.match(path)
    if m:
        path = path[m.end() :]
    elif _HOME_PREFIX.match(path):
        # /home/user/project/pkg/mod.py: drop the home, the user and the checkout directory so
        # that the suffix match works on what remains.
        parts = [p for p in path.split("/") if p]
        path = "/".join(parts[3:]) if len(parts) > 4 else "/".join(parts[-2:])
    path = re.sub(r"^(?:\./|~/|/)+", "", path)
    return path.lower()


@lru_cache(maxsize=_CACHE_SIZE)
def is_weak_file(path: str) -> bool:
    return bool(_WEAK_FILE.search(path))


def path_suffix_match(issue_path: str, fix_path: str) -> int:
    """How many trailing path components agree (0 = no match). ``config.py`` against
    ``hermes_cli/config.py`` is 1; ``hermes_cli/config.py`` against the same is 2."""
    a = [p for p in issue_path.split("/") if p]
    b = [p for p in fix_path.split("/") if p]
    n = 0
    while n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    if n == 0:
        return 0
    # A partial suffix only counts when it is the whole of the shorter path.
    return n if n == min(len(a), len(b)) else 0


# A path in an error message: ``(?:[\w.~-]*/)+[\w.-]+``. Its matches lie within runs of
# _ERR_PATH_RUN's characters that hold a "/"; in such a run, any prefix ending in a "/" is a
# series of ``[\w.~-]*/`` parts, so a match exists only if one starts at the run's start, and
# it ends after the run's last "/" that a ``[\w.-]`` character follows (greedy): it is the
# run's only match. Matched once from the start (_ERR_PATH), not tried from every position of a
# run that holds none (``"////…"`` took seconds).
_ERR_PATH = re.compile(r"[\w.~/-]*/[\w.-]+")
_ERR_PATH_RUN = re.compile(r"[\w.~\-/]+")
_ERR_URL = re.compile(r"https?://\S+")
_ERR_NUMBER = re.compile(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{8,}\b|\b\d+(?:\.\d+)*\b")
_ERR_PUNCT = re.compile(r"[^\w\s:'-]")


def _blank_paths(run: re.Match[str]) -> str:
    text = run.group(0)
    if "/" not in text:
        return text
    m = _ERR_PATH.match(text)
    return " " + text[m.end() :] if m else text


# Punctuation that prose puts before and after a word: no word character, digit, "-" or "/". No
# path, module or call can start in the first (it has no "." or path character) or end in the
# second (it has no "("), so a chunk that is one ASCII word wrapped in them can only name that
# word: as a symbol or an exception type.
_LEADING = "([{<\"'`*"
_TRAILING = ")]}>,.;:!?\"'`*"


def _error_words(chunk: str) -> tuple[str, ...]:
    """The words a lower-cased chunk leaves once its variable parts are blanked."""
    word = chunk.lstrip(_LEADING).rstrip(_TRAILING)
    if word.isalpha() and (len(word) < 8 or word.strip("abcdef")):
        # A word in punctuation: no URL, path or digit, and not all hexadecimal letters, which is
        # the only id the letters alone could make. Only the punctuation goes.
        return (chunk,) if word is chunk else tuple(_ERR_PUNCT.sub(" ", chunk).split())
    if "http" in chunk:
        chunk = _ERR_URL.sub(" ", chunk)
    if "/" in chunk:
        chunk = _ERR_PATH_RUN.sub(_blank_paths, chunk)
    chunk = _ERR_NUMBER.sub(" ", chunk)
    return tuple(_ERR_PUNCT.sub(" ", chunk).split())


# Error text: issue bodies, and the quoted messages of clusters (about 20,000 chunks in 100,000).
_ERROR_WORDS_MEMO = ChunkMemo(_error_words, 1 << 16)


def normalise_error(message: str) -> str:
    """An error message with its variable parts (numbers, quoted values, paths, ids) blanked."""
    # Every pattern here stays within a chunk and sees whitespace as a text edge, and the result
    # has its whitespace collapsed: the message is blanked chunk by chunk (see ChunkMemo).
    chunks = message.lower().split()
    return " ".join(chain.from_iterable(map(_ERROR_WORDS_MEMO.__getitem__, chunks)))


@dataclass
class IssueEvidence:
    files: list[str] = field(default_factory=list)
    symbols: list[str] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


class _ChunkEvidence(NamedTuple):
    """What one whitespace-separated chunk names. _PATH, _CALL, _IDENT, _MODULE and _EXC_TYPE never
    match whitespace and treat it as a text edge, so a text's matches are its chunks' matches in
    order; chunks repeat across issues and clusters far more than they are new, so they are
    memoised. The patterns that span whitespace (tracebacks, backticks; and, in a cluster's
    text, quotes and error lines) still scan the whole text."""

    files: tuple[str, ...]  # normalised paths
    calls: tuple[str, ...]  # names called: ``name(``
    symbols: tuple[str, ...]  # undotted identifiers that pass is_symbol
    module_files: tuple[str, ...]  # dotted module names as file paths
    error_types: tuple[str, ...]


def _word_evidence(word: str) -> _ChunkEvidence | None:
    if word.islower():
        return None  # no hump, no exception type
    symbols = (word,) if not (word.isupper() or word.istitle()) and is_symbol(word) else ()
    error_types: tuple[str, ...] = ()
    for suffix in _EXC_SUFFIXES:
        if suffix in word:
            error_types = tuple(_EXC_TYPE.findall(word))
            break
    if not (symbols or error_types):
        return None
    return _ChunkEvidence((), (), symbols, (), error_types)


def _chunk_evidence(chunk: str) -> _ChunkEvidence | None:
    """None when the chunk names nothing (most do), so that callers can filter those out fast."""
    word = chunk.lstrip(_LEADING).rstrip(_TRAILING)
    if word.isalpha() and word.isascii():
        return None if word.islower() else _word_evidence(word)
    files: list[str] = []
    module_files: list[str] = []
    if "." in chunk:
        # _PATH is the slowest pattern here; most dotted chunks ("e.g.", "asyncio.wait_for") have
        # no ".<extension>" for it to end in.
        for run in _PATH_RUN.finditer(chunk) if _PATH_END.search(chunk) else ():
            start, end = run.span()
            if "." not in chunk[start : end - 1]:
                continue
            for at, stop in _path_spans(chunk, start, end):
                raw = chunk[at:stop]
                if raw.startswith(("http", "www.")) or "://" in chunk[max(0, at - 3) : at]:
                    continue
                files.append(normalise_path(raw))
        for m in _MODULE.finditer(chunk):
            dotted = m.group(0)
            last = dotted.rsplit(".", 1)[-1]
            first = dotted.split(".", 1)[0]
            if last in _SOURCE_EXT_SET or len(dotted) < 5 or first in _NOT_MODULES:
                continue
            # hermes_cli.config may be hermes_cli/config.py: offer it to the file matcher as well.
            module_files.append(dotted.replace(".", "/") + ".py")
    calls: list[str] = [c for c in _CALL_SCAN.findall(chunk) if c] if "(" in chunk else []
    lower = chunk.islower()
    # is_symbol needs an underscore or a lower-case letter followed by an upper-case one; a chunk
    # all in one case, or capitalised like a title, has neither.
    if "_" in chunk or not (lower or chunk.isupper() or chunk.istitle()):
        symbols = [i for i in _IDENT.findall(chunk) if "." not in i and is_symbol(i)]
    else:
        symbols = []
    error_types: list[str] = []
    if not lower:  # every exception-type suffix starts with a capital
        for suffix in _EXC_SUFFIXES:
            if suffix in chunk:
                error_types = _EXC_TYPE.findall(chunk)
                break
    if not (files or calls or symbols or module_files or error_types):
        return None
    return _ChunkEvidence(
        tuple(files),
        tuple(calls),
        tuple(symbols),
        tuple(module_files),
        tuple(error_types),
    )


_EVIDENCE_MEMO = ChunkMemo(_chunk_evidence)
_EVIDENCE_OF = _EVIDENCE_MEMO.__getitem__
_SYMBOLS = attrgetter("symbols")
_CALLS = attrgetter("calls")


def _text_evidence(text: str) -> list[_ChunkEvidence]:
    """The evidence of the chunks of ``text`` that name anything, in order."""
    return list(filter(None, map(_EVIDENCE_OF, text.split())))


def extract_issue_evidence(text: str) -> IssueEvidence:
    """Files (also from tracebacks and dotted modules), symbols and referenced issue/PR numbers,
    from the raw issue text (before noise removal, since tracebacks and paths live in the parts
    that removal would drop). Error texts are not extracted here: the matcher looks for each
    of the index's error texts in the issue's normalised text."""
    found = _text_evidence(text)
    # Each whole-text pattern below needs a literal (File ", a backtick, # or /issues/ or
    # /pull/): a text without it is not scanned.
    traceback = 'File "' in text
    files = [f for e in found for f in e.files]
    if traceback:
        files.extend(normalise_path(m.group(1)) for m in _TRACE_FILE.finditer(text))

    symbols: list[str] = []
    if traceback:
        symbols.extend(m.group(1).split(".")[-1] for m in _TRACE_IN.finditer(text))
    if "`" in text:
        for m in _BACKTICK.finditer(text):
            inner = m.group(1).strip()
            for ident in _IDENT.findall(inner):
                if is_code_like(ident):
                    symbols.append(ident)
    for e in found:
        symbols.extend(e.calls)
    for e in found:
        symbols.extend(e.symbols)

    files.extend(f for e in found for f in e.module_files)

    numbers = (
        [int(n) for n in _ISSUE_REF.findall(text)]
        if "#" in text or "/issues/" in text or "/pull/" in text
        else []
    )

    clean_symbols = []
    for s in symbols:
        s = s.strip("_.").split(".")[-1] if "." in s and "/" not in s else s.strip("_")
        if len(s) >= 3 and s.lower() not in ("self", "none", "true", "false", "print"):
            clean_symbols.append(s)
    return IssueEvidence(
        files=_dedupe(f for f in files if "." in f.rsplit("/", 1)[-1]),
        symbols=_dedupe(clean_symbols),
        numbers=list(dict.fromkeys(numbers)),
    )


@dataclass
class ClusterEvidence:
    files: list[str] = field(default_factory=list)
    weak_files: set[str] = field(default_factory=set)
    symbols: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    numbers: set[int] = field(default_factory=set)


def _hunk_symbols(hunk: str) -> list[str]:
    found: list[str] = []
    if "@@" in hunk:
        for header in _HUNK_HEADER.findall(hunk):
            found.extend(_DEFINITION.findall(header))
    for line in hunk.splitlines():
        if not line.startswith(("+", "-")) or line.startswith(("+++", "---")):
            continue
        found.extend(_DEFINITION.findall(line))
        # A line holds no line break, so _ASSIGNED (multi-line ^) can only match at its start.
        if "=" in line or ":" in line:
            m = _ASSIGNED.match(line)
            if m:
                found.append(m.group(1))
        found.extend([i for i in _IDENT.findall(line[1:]) if "." not in i and is_symbol(i)])
    return found


def cluster_texts(cluster: Cluster) -> list[str]:
    """The human-written text of a cluster: label, summary, member titles."""
    texts = [cluster.display_label, cluster.summary or ""]
    texts.extend([m.title for m in cluster.members if m.title])
    return texts


def extract_cluster_evidence(cluster: Cluster) -> ClusterEvidence:
    files = list(map(normalise_path, cluster.files_changed))
    weak = set(filter(is_weak_file, files))
    symbols: list[str] = []
    if any(m.fix_hunks for m in cluster.members):
        for member in cluster.fix_prs:
            for fh in member.fix_hunks:
                if is_weak_file(normalise_path(fh.file)):
                    continue
                for hunk in fh.hunks:
                    symbols.extend(_hunk_symbols(hunk))
    errors: list[str] = []
    # A text met again (a title repeated by the fix PR, the label) adds only what it added the
    # first time, which the de-duplication below would drop: each distinct text is read once.
    # Each whole-text pattern below needs a literal (a backtick, a quote, an exception-type
    # suffix): a text without it is not scanned.
    for text in dict.fromkeys(cluster_texts(cluster)):
        if "`" in text:
            for m in _BACKTICK.finditer(text):
                symbols.extend(i for i in _IDENT.findall(m.group(1)) if is_code_like(i))
        found = list(filter(None, map(_EVIDENCE_OF, text.split())))  # _text_evidence, inlined
        if found:
            symbols.extend(chain.from_iterable(map(_SYMBOLS, found)))
            symbols.extend(chain.from_iterable(map(_CALLS, found)))
            errors.extend([t.lower() for e in found for t in e.error_types])
        if "'" in text or '"' in text or "“" in text:
            for groups in _QUOTED.findall(text):
                quoted = next((g for g in groups if g), "")
                if quoted:
                    errors.append(normalise_error(quoted))
        if "Error" in text or "Exception" in text or "Warning" in text:
            for t, msg in _EXC_LINE.findall(text):
                errors.append(normalise_error(f"{t}: {msg}"))
    numbers = {m.number for m in cluster.members}
    if cluster.landed_fix.pr is not None:
        numbers.add(cluster.landed_fix.pr)
    if symbols:
        # Cleaning is a function of the symbol: cleaning each distinct symbol once and
        # de-duplicating again keeps the first occurrences, in order.
        clean = [s.strip("_").split(".")[-1] for s in dict.fromkeys(symbols)]
        symbols = list(dict.fromkeys([s for s in clean if len(s) >= 3]))
    return ClusterEvidence(
        files=list(dict.fromkeys(filter(None, files))) if files else files,
        weak_files=weak,
        symbols=symbols,
        errors=list(dict.fromkeys([e for e in errors if len(e) >= 4])) if errors else errors,
        numbers=numbers,
    )
