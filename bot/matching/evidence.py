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

from bot.clusters.models import Cluster
from bot.matching.text import is_code_like

SOURCE_EXTENSIONS = (
    "py|pyi|js|jsx|ts|tsx|mjs|cjs|go|rs|rb|java|kt|c|h|cc|cpp|hpp|cs|swift|php|sh|bash|ps1|"
    "toml|yaml|yml|json|cfg|ini|md|sql|html|css|scss|vue|svelte|lua|nix|txt|lock"
)
# A path: optional drive, then segments joined by / or \, ending in a known extension; or a bare
# file name with a known extension.
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.@~+-]+[/\\])*[\w.@+-]+\.(?:" + SOURCE_EXTENSIONS + r")\b")
# Every character of a path match is one of these: matches lie within runs of them, and only a run
# with a "." before its end can hold one (see extract_issue_evidence).
_PATH_RUN = re.compile(r"[\w.@~+\-/\\:]+")
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
_IDENT = re.compile(r"\b[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*\b")
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


_ERR_PATH = re.compile(r"(?:[\w.~-]*/)+[\w.-]+")
# The characters of an _ERR_PATH match: matches lie within runs of them that hold a "/".
_ERR_PATH_RUN = re.compile(r"[\w.~\-/]+")


def _blank_paths(run: re.Match[str]) -> str:
    text = run.group(0)
    return _ERR_PATH.sub(" ", text) if "/" in text else text


def normalise_error(message: str) -> str:
    """An error message with its variable parts (numbers, quoted values, paths, ids) blanked."""
    msg = message.strip().lower()
    msg = re.sub(r"https?://\S+", " ", msg)
    if "/" in msg:
        msg = _ERR_PATH_RUN.sub(_blank_paths, msg)
    msg = re.sub(r"\b0x[0-9a-f]+\b|\b[0-9a-f]{8,}\b|\b\d+(?:\.\d+)*\b", " ", msg)
    msg = re.sub(r"[^\w\s:'-]", " ", msg)
    return re.sub(r"\s+", " ", msg).strip()


@dataclass
class IssueEvidence:
    files: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    symbols: list[str] = field(default_factory=list)
    error_types: list[str] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def extract_issue_evidence(text: str) -> IssueEvidence:
    """Files (also from tracebacks and dotted modules), symbols, exception types, error messages
    and referenced issue/PR numbers, from the raw issue text (before noise removal, since
    tracebacks and paths live in the parts that removal would drop)."""
    files: list[str] = []
    for run in _PATH_RUN.finditer(text):
        start, end = run.span()
        if "." not in text[start : end - 1]:
            continue
        for m in _PATH.finditer(text, start, end):
            raw = m.group(0)
            if raw.startswith(("http", "www.")) or "://" in text[max(0, m.start() - 3) : m.start()]:
                continue
            files.append(normalise_path(raw))
    for m in _TRACE_FILE.finditer(text):
        files.append(normalise_path(m.group(1)))

    symbols: list[str] = []
    symbols.extend(m.group(1).split(".")[-1] for m in _TRACE_IN.finditer(text))
    for m in _BACKTICK.finditer(text):
        inner = m.group(1).strip()
        for ident in _IDENT.findall(inner):
            if is_code_like(ident):
                symbols.append(ident)
    symbols.extend(m.group(1) for m in _CALL.finditer(text))
    for ident in _IDENT.findall(text):
        if is_symbol(ident) and "." not in ident:
            symbols.append(ident)

    modules: list[str] = []
    for m in _MODULE.finditer(text):
        dotted = m.group(0)
        last = dotted.rsplit(".", 1)[-1]
        first = dotted.split(".", 1)[0]
        if last in _SOURCE_EXT_SET or len(dotted) < 5 or first in _NOT_MODULES:
            continue
        modules.append(dotted)
        # hermes_cli.config may be hermes_cli/config.py: offer it to the file matcher as well.
        files.append(dotted.replace(".", "/") + ".py")

    error_types = _EXC_TYPE.findall(text)
    messages = [normalise_error(f"{t}: {msg}") for t, msg in _EXC_LINE.findall(text)]
    for groups in _QUOTED.findall(text):
        quoted = next((g for g in groups if g), "")
        if quoted and not quoted.startswith(("http", "/")) and "\\" not in quoted:
            messages.append(normalise_error(quoted))

    numbers = [int(n) for n in _ISSUE_REF.findall(text)]

    clean_symbols = []
    for s in symbols:
        s = s.strip("_.").split(".")[-1] if "." in s and "/" not in s else s.strip("_")
        if len(s) >= 3 and s.lower() not in ("self", "none", "true", "false", "print"):
            clean_symbols.append(s)
    return IssueEvidence(
        files=_dedupe(f for f in files if "." in f.rsplit("/", 1)[-1]),
        modules=_dedupe(modules),
        symbols=_dedupe(clean_symbols),
        error_types=_dedupe(error_types),
        error_messages=_dedupe(m for m in messages if len(m) >= 6),
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
    for header in _HUNK_HEADER.findall(hunk):
        found.extend(_DEFINITION.findall(header))
    for line in hunk.splitlines():
        if not line.startswith(("+", "-")) or line.startswith(("+++", "---")):
            continue
        found.extend(_DEFINITION.findall(line))
        found.extend(_ASSIGNED.findall(line))
        found.extend(i for i in _IDENT.findall(line[1:]) if is_symbol(i) and "." not in i)
    return found


def cluster_texts(cluster: Cluster) -> list[str]:
    """The human-written text of a cluster: label, summary, member titles."""
    texts = [cluster.display_label, cluster.summary or ""]
    texts.extend(m.title for m in cluster.members if m.title)
    return texts


def extract_cluster_evidence(cluster: Cluster) -> ClusterEvidence:
    files = [normalise_path(p) for p in cluster.files_changed]
    weak = {f for f in files if is_weak_file(f)}
    symbols: list[str] = []
    for member in cluster.fix_prs:
        for fh in member.fix_hunks:
            if is_weak_file(normalise_path(fh.file)):
                continue
            for hunk in fh.hunks:
                symbols.extend(_hunk_symbols(hunk))
    errors: list[str] = []
    # Each pattern below needs a literal (a backtick, a parenthesis, a quote, an exception-type
    # suffix): a text without it is not scanned.
    for text in cluster_texts(cluster):
        if "`" in text:
            for m in _BACKTICK.finditer(text):
                symbols.extend(i for i in _IDENT.findall(m.group(1)) if is_code_like(i))
        symbols.extend(i for i in _IDENT.findall(text) if "." not in i and is_symbol(i))
        if "(" in text:
            symbols.extend(m.group(1) for m in _CALL.finditer(text))
        if any(suffix in text for suffix in _EXC_SUFFIXES):
            errors.extend(t.lower() for t in _EXC_TYPE.findall(text))
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
    clean = [s.strip("_").split(".")[-1] for s in symbols]
    return ClusterEvidence(
        files=_dedupe(files),
        weak_files=weak,
        symbols=_dedupe(s for s in clean if len(s) >= 3),
        errors=_dedupe(e for e in errors if len(e) >= 4),
        numbers=numbers,
    )
