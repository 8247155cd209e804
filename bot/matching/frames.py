"""Stack traces an issue quotes, parsed into frames: which files and functions of the project the
failure went through, and what it said.

A reporter's traceback names the code far more precisely than their prose, but most of its frames
are the interpreter's, the runtime's or a dependency's. Each frame is read with its path and told
apart as the project's own or not, so that the matcher can weigh the few frames that can match a
fix's files. Four formats are read: CPython tracebacks, V8 (Node.js, Chrome) stacks, Rust panics
and backtraces, Go panics.

Pure: text in, values out. Linear by design, because an issue body can be 100 kB of logs: the text
is split into lines once, over-long lines are dropped, every pattern is matched within one line
and can split it in only a bounded number of ways (no nested quantifiers; adjacent ones are
separated by a character only one of them takes), and locations are split with
``str.rpartition`` instead of a backtracking ``(.*):(\\d+)``. Each language is read in its own
pass (they cannot be confused: a bare V8 location is a script, and a Rust ``at`` line is not) and
a pass stops after ``MAX_FRAMES`` frames. Never raises: a line that fits no format is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from bot.matching.evidence import normalise_path

Language = Literal["python", "javascript", "rust", "go"]

# Frames kept from one text, over all its traces: the first MAX_FRAMES in reading order.
MAX_FRAMES = 200
# A text longer than this is read up to here. A GitHub issue body is at most 65,536 characters.
_MAX_TEXT = 1_000_000
# A longer line is no frame (real frame lines are well under this): it is treated as a break.
_MAX_LINE = 2000
# An error message is kept up to this many characters.
_MAX_ERROR = 500
# How far above its first frame a JavaScript trace's error line may be (and a Rust backtrace's
# "Error:" line, a goroutine's panic line); how many lines a Rust panic's message may run to.
_LOOKBACK = 10

# Stands for a line that ends any trace: a code fence, or a line too long to be a frame.
_BREAK = "\x00"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# "> " quotes, nested or not: only the quote marks go, so that indentation after them stays.
_QUOTE = re.compile(r"(?:[ \t]*>)+[ \t]?")
# The "|" margin of Python's exception-group tracebacks (3.11+).
_MARGIN = re.compile(r"[ \t]*\|[ \t]?")
# A code fence, with or without its language. Not a line of Python's ~~~~^^^^ markers.
_FENCE = re.compile(r"(?:`{3,}|~{3,})[ \t]*[\w+#.-]*")

# --- Python ---------------------------------------------------------------------------------
_PY_HEADER = "Traceback (most recent call last)"
# `File "path", line N, in func`; without ", in func" for a SyntaxError's location.
_PY_FRAME = re.compile(r'File "([^"]+)", line (\d{1,9})(?:, in (.+))?')
# The exception line: a (dotted) name, then ": message" or nothing.
_PY_ERROR = re.compile(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(:.*)?")
# Lines at a frame's own indentation that are neither a frame nor the error (source lines of a
# flattened paste, blank lines) before the trace counts as ended.
_PY_SLACK = 3

# --- JavaScript ---------------------------------------------------------------------------
# `TypeError: message`, `Error [ERR_CODE]: message`, `Uncaught TypeError: ...` (browsers),
# `[cause]: Error: ...` (Node's print of error.cause).
_JS_ERROR = re.compile(
    r"(?:Uncaught[ \t]+(?:\(in promise\)[ \t]+)?)?(?:\[cause\]:[ \t]*)?"
    r"((?:[A-Za-z_$][\w$]*\.)*[\w$]*(?:Error|Exception)(?:[ \t]\[[\w.-]+\])?)(?::[ \t]*(.*))?"
)
# Locations V8 prints for frames that have no file.
_JS_NO_FILE = frozenset({"native", "<anonymous>", "unknown location"})
_JS_PROMISE_INDEX = re.compile(r"index \d+")
_JS_EXTENSIONS = frozenset(
    [
        "js", "mjs", "cjs", "jsx", "ts", "mts", "cts", "tsx", "vue", "svelte", "astro",
        "coffee", "html", "htm",
    ]
)

# --- Rust -----------------------------------------------------------------------------------
# `thread 'main' panicked at ...`; newer toolchains add the thread id: `thread 'main' (4242)`.
_RUST_PANIC = re.compile(r"thread '([^'\n]*)'(?: \(\d+\))? panicked at (.*)")
# `  3: crate::module::func` (short) or `  3:     0x55d0c1e5b0c3 - crate::module::func::h0123`.
_RUST_FRAME = re.compile(r"(\d{1,5}):[ \t]+(?:0x[0-9a-fA-F]+[ \t]+-[ \t]+)?(\S.*)")
_RUST_HASH = re.compile(r"::h[0-9a-f]{16}$")

# --- Go ---------------------------------------------------------------------------------------
# `goroutine 1 [running]:`, with `gp=0x.. m=0 mp=0x..` before the bracket under GOTRACEBACK=system.
_GO_HEADER = re.compile(r"goroutine \d+ [^\[\n]*\[[^\]\n]*\]:?")
_GO_CREATED_IN = re.compile(r" in goroutine \d+$")
# Top-level directories of Go's standard library ($GOROOT/src): a file under one of them, at the
# root of a Go installation or at the start of a -trimpath path, is the toolchain's.
_GO_STD = frozenset(
    [
        "archive", "arena", "bufio", "builtin", "bytes", "cmd", "cmp", "compress",
        "container", "context", "crypto", "database", "debug", "embed", "encoding",
        "errors", "expvar", "flag", "fmt", "go", "hash", "html", "image", "index",
        "internal", "io", "iter", "log", "maps", "math", "mime", "net", "os", "path",
        "plugin", "reflect", "regexp", "runtime", "slices", "sort", "strconv", "strings",
        "structs", "sync", "syscall", "testing", "text", "time", "unicode", "unique",
        "unsafe", "vendor", "weak",
    ]
)
_GOROOT = re.compile(r"/(?:go|golang|go-?\d[\d.]*|libexec|\$goroot)/src/([^/]+)/")
_GO_MODULE_VERSION = re.compile(r"@v\d")

# --- Which paths are the project's ---------------------------------------------------------
# Matched against the path between slashes, lower-cased. Every alternative starts at
# a "/", so the search tries only there.
_NOT_PROJECT = re.compile(
    r"/(?:"
    # installed packages and environments
    r"site-packages|dist-packages|node_modules|\.?venv\d*|virtualenvs|\.tox|\.nox|__pypackages__|"
    r"_?vendor|\.yarn|\.pnpm|"
    # the Python standard library: lib/python3.12/ (Unix), Python312/Lib/ (Windows), conda's Lib/
    r"lib/python\d[\d.]*|lib/pypy[\d.]*|python\d*/lib|(?:ana|mini)?conda\d*/lib|miniforge\d*/lib|"
    # Go's module cache
    r"pkg/mod|"
    # Rust's standard library, registry and git checkouts, toolchains
    r"rustc/[0-9a-f]{7,}|\.?cargo/registry|\.?cargo/git|\.rustup|rust/library|"
    # webpack's own runtime in a bundle's source map
    r"webpack/(?:bootstrap|runtime)"
    r")/"
)
# Where a library's own path starts in a non-project path: what follows the last of these.
_LIBRARY_ROOT = re.compile(
    r"/(?:site-packages|dist-packages|node_modules|lib/python\d[\d.]*|python\d*/lib|pkg/mod|"
    r"(?:go|golang|go-?\d[\d.]*|libexec)/src|rustc/[0-9a-f]+/library|registry/src/[^/]+|"
    r"git/checkouts|rust/library|_?vendor)/"
)
# A scheme of two letters or more: "C://Users" (a doubled Windows separator) is no URL.
# Files no repository holds: <frozen ...>, <string>, <anonymous>; the built-in modules of Node
# (node:internal/...), Deno (ext:) and Bun (bun:).
_PSEUDO = ("<", "node:", "ext:", "bun:")
_URL = re.compile(r"[a-z][\w+.-]+://[^/]*", re.I)
_FILE_URL_DRIVE = re.compile(r"/[A-Za-z]:/")
_SLASHES = re.compile(r"/{2,}")


@dataclass(frozen=True)
class Frame:
    """One frame of a trace. ``path`` is as ``normalise_path`` gives it (forward slashes,
    lower-case, no install or home prefix: what the index stores for a fix's files) for the
    project's frames; for the others it is the library's own path (``requests/api.py``,
    ``runtime/panic.go``, ``std/src/panicking.rs``), or a pseudo-file as printed
    (``<frozen importlib._bootstrap>``, ``node:internal/...``), or "" when the frame names none
    (a Rust frame without debug info). ``function`` is the name as printed, without what is not
    part of it (V8's ``async``/``new``/``[as x]``, Rust's symbol hash, Go's arguments)."""

    path: str
    function: str | None
    line: int | None
    project: bool


@dataclass(frozen=True)
class Trace:
    frames: tuple[Frame, ...]  # in the order the trace prints them
    error: str | None  # "KeyError: 'x'", "TypeError: x is not a function", a panic's message
    language: Language


@dataclass
class _Open:
    """A trace being read."""

    start: int  # its first line: traces from the four passes are put back in text order
    language: Language
    frames: list[Frame] = field(default_factory=list)
    error: str | None = None


def parse_traces(text: str) -> list[Trace]:
    """Every stack trace in ``text``, in the order they appear, with at most ``MAX_FRAMES``
    frames in all. A trace is kept only if at least one frame was read from it. Python's
    chained exceptions are one trace each."""
    if not text:
        return []
    text = text[:_MAX_TEXT]
    # Each pass needs a literal its format always prints; a text without it is not read (most
    # issues quote no trace: they are not even split into lines).
    passes = [parse for marked, parse in (
        ("File " in text, _python), ("at " in text, _javascript),
        ("panicked at" in text or "acktrace" in text, _rust), ("goroutine " in text, _go),
    ) if marked]
    if not passes:
        return []
    lines = _lines(text)
    found: list[tuple[int, Trace]] = []
    for parse in passes:
        found.extend(parse(lines))
    found.sort(key=lambda pair: pair[0])
    traces: list[Trace] = []
    left = MAX_FRAMES
    for _, trace in found:
        if left <= 0:
            break
        if len(trace.frames) > left:
            trace = Trace(trace.frames[:left], trace.error, trace.language)
        traces.append(trace)
        left -= len(trace.frames)
    return traces


def project_frames(traces: Iterable[Trace]) -> list[Frame]:
    """The project's frames, innermost first: within each trace the frame where it failed comes
    first (Python prints it last, the others first), and traces keep their order, so a chained
    Python exception's cause comes before the exception raised while handling it.

    Distinct by (path, line, function); a frame that names no function (a Rust panic's location)
    gives way to a frame at the same path and line that does."""
    kept: list[Frame] = []
    seen: set[tuple[str, int | None, str | None]] = set()
    named: set[tuple[str, int | None]] = set()
    unnamed: dict[tuple[str, int | None], int] = {}  # where in ``kept``
    for trace in traces:
        frames = reversed(trace.frames) if trace.language == "python" else trace.frames
        for frame in frames:
            if not frame.project:
                continue
            place = (frame.path, frame.line)
            if frame.function is None:
                if place not in named and place not in unnamed:
                    unnamed[place] = len(kept)
                    kept.append(frame)
                continue
            key = (frame.path, frame.line, frame.function)
            if key in seen:
                continue
            seen.add(key)
            named.add(place)
            at = unnamed.pop(place, None)
            if at is None:
                kept.append(frame)
            else:
                kept[at] = frame
    return kept


# --- Lines ------------------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    """The text's lines with quote marks and exception-group margins taken off (indentation
    after them kept), and fences and over-long lines turned into ``_BREAK``."""
    out: list[str] = []
    for line in text.splitlines():
        if len(line) > _MAX_LINE:
            out.append(_BREAK)
            continue
        if "\x1b" in line:
            line = _ANSI.sub("", line)  # colours of a terminal paste
        lead = line.lstrip()
        if lead.startswith(">"):
            m = _QUOTE.match(line)
            if m:
                line = line[m.end() :]
                lead = line.lstrip()
        if lead.startswith("|"):
            m = _MARGIN.match(line)
            if m:
                line = line[m.end() :]
                lead = line.lstrip()
        fence = lead.startswith(("```", "~~~")) and _FENCE.fullmatch(lead.rstrip())
        out.append(_BREAK if fence else line)
    return out


def _split_location(loc: str) -> tuple[str, int, int | None] | None:
    """``path:line`` or ``path:line:column`` (the path may hold colons: ``C:\\x``, ``node:fs``),
    split from the right without a regex."""
    head, _, tail = loc.rpartition(":")
    if not _is_number(tail):
        return None
    path, _, mid = head.rpartition(":")
    if _is_number(mid):
        return (path, int(mid), int(tail)) if path else None
    return (head, int(tail), None) if head else None


def _is_number(s: str) -> bool:
    # isascii: str.isdigit accepts "²", which int() refuses; nine digits: no line is longer.
    return 0 < len(s) <= 9 and s.isascii() and s.isdigit()


def _clip(error: str) -> str | None:
    error = error.strip()
    return error[:_MAX_ERROR] if error else None


def _close(out: list[tuple[int, Trace]], trace: _Open | None) -> None:
    if trace is not None and trace.frames:
        out.append((trace.start, Trace(tuple(trace.frames), trace.error, trace.language)))


# --- Paths ------------------------------------------------------------------------------------


def _clean(raw: str) -> str:
    """Forward slashes, no URL scheme or host (``file:///``, ``webpack://app/``,
    ``http://localhost:3000``), no query, no doubled separators (a Windows path quoted in a repr
    has ``\\\\``)."""
    path = raw.strip().replace("\\", "/")
    if "://" in path:
        m = _URL.match(path)
        if m:
            path = path[m.end() :]
            if _FILE_URL_DRIVE.match(path):
                path = path[1:]  # file:///C:/x
            path = path.split("?", 1)[0].split("#", 1)[0]
    if "//" in path:
        path = _SLASHES.sub("/", path)
    if path.startswith("~/"):
        # IPython's "~/acme/acme/x.py" is /home/<user>/acme/acme/x.py: normalised alike, so
        # that the checkout directory goes as it does for the absolute path.
        path = "/home/~" + path[1:]
    return path


def _is_project(path: str, language: Language) -> bool:
    """Whether a cleaned, lower-cased path is in the repository. It is not when it is empty or a
    pseudo-file (``<frozen ...>``, ``<string>``, ``<anonymous>``, ``node:``/``ext:``/``bun:``
    modules); when a directory on it says installed code (site-packages, dist-packages,
    node_modules, .venv/venv, virtualenvs, .tox, .nox, __pypackages__, vendor, .yarn, .pnpm), a
    Python standard library (lib/pythonX.Y, PythonXY/Lib, conda's Lib), Go's module cache
    (pkg/mod), Rust's (/rustc/<hash>/, cargo's registry and git checkouts, .rustup,
    rust/library) or webpack's runtime; for JavaScript, Node's old ``internal/...`` modules; for
    Go, a module@version path or the standard library (a top-level standard package under
    go/src, golang/src, go-1.x/src, libexec/src, or first in a -trimpath path). A relative path
    is the project's: that is how Rust, Jest and -trimpath print its files."""
    if not path or path.startswith(_PSEUDO) or path in _JS_NO_FILE:
        return False
    if _NOT_PROJECT.search(f"/{path}/"):  # a trailing "/" too: webpack/bootstrap is a file
        return False
    if language == "javascript":
        # Node before 16 printed its own modules as internal/...; the project's are absolute.
        return not path.startswith("internal/") and not _JS_PROMISE_INDEX.fullmatch(path)
    if language == "go":
        return not _is_go_library(path)
    return True


def _is_go_library(path: str) -> bool:
    if path.startswith("$goroot/") or _GO_MODULE_VERSION.search(path):
        return True  # module@v1.2.3/...: the module cache, or a dependency under -trimpath
    m = _GOROOT.search("/" + path)
    if m and m.group(1) in _GO_STD:
        return True
    # -trimpath prints the standard library as import paths: runtime/panic.go.
    first, slash, _ = path.partition("/")
    return bool(slash) and not path.startswith("/") and ":" not in first and first in _GO_STD


def _frame(raw: str, function: str | None, line: int | None, language: Language) -> Frame:
    path = _clean(raw)
    low = path.lower()
    if _is_project(low, language):
        return Frame(normalise_path(path), function, line, True)
    if not low or low.startswith(_PSEUDO) or low in _JS_NO_FILE:
        return Frame(low, function, line, False)  # kept as printed: no prefix to take off
    root_end = 0
    for m in _LIBRARY_ROOT.finditer("/" + low):
        root_end = m.end() - 1  # "/" was prepended
    return Frame(normalise_path(low[root_end:]), function, line, False)


# --- Python -----------------------------------------------------------------------------------


def _python(lines: list[str]) -> list[tuple[int, Trace]]:
    out: list[tuple[int, Trace]] = []
    cur: _Open | None = None
    indent = 0  # of the trace's frame lines: source lines are deeper, the error line shallower
    slack = 0
    budget = MAX_FRAMES
    for i, line in enumerate(lines):
        if budget <= 0:
            break
        if _PY_HEADER in line:
            _close(out, cur)
            cur, indent, slack = _Open(i, "python"), -1, 0
            continue
        body = line.lstrip()
        depth = len(line) - len(body)
        if body.startswith("File "):
            frame = _python_frame(body.rstrip())
            if frame is not None:
                if cur is None:  # frames quoted without their header
                    cur, indent = _Open(i, "python"), -1
                if indent < 0:
                    indent = depth
                cur.frames.append(frame)
                budget -= 1
                slack = 0
                continue
        if cur is None:
            continue
        if line == _BREAK or (not cur.frames and body):
            _close(out, cur)
            cur = None
            continue
        if body and depth > indent:
            continue  # the source line under a frame, or its ^^^^ markers
        if body.startswith("[Previous line repeated"):
            continue
        if body and _is_python_error(body.rstrip()):
            cur.error = _clip(body)
            _close(out, cur)
            cur = None
        elif depth < indent if body else indent > 0:
            # "During handling of the above exception...", prose, or a blank line, which Python
            # never prints inside a traceback: the trace ended without its exception line.
            _close(out, cur)
            cur = None
        elif cur.frames:
            slack += 1
            if slack > _PY_SLACK:
                _close(out, cur)
                cur = None
    _close(out, cur)
    return out


def _python_frame(body: str) -> Frame | None:
    m = _PY_FRAME.fullmatch(body)
    if m:
        function = m.group(3).strip() if m.group(3) else None
        return _frame(m.group(1), function or None, int(m.group(2)), "python")
    # IPython 8: "File ~/acme/acme/jobs.py:42, in Runner.run(self, job)".
    rest = body[5:]
    at = rest.find(", in ")
    if at < 0:
        return None
    loc = _split_location(rest[:at])
    if loc is None or loc[2] is not None or " " in loc[0].strip():
        return None
    function = rest[at + 5 :].split("(", 1)[0].strip()
    if any(c.isspace() for c in function):
        return None
    return _frame(loc[0], function or None, loc[1], "python")


def _is_python_error(body: str) -> bool:
    m = _PY_ERROR.fullmatch(body)
    if not m:
        return False
    name = m.group(1)
    # A class (KeyError, acme.errors.QuotaExceeded) with or without a message, or a dotted
    # lower-case one with a message (socket.timeout: timed out); not a source line such as
    # "main()" or "x: int", which a flattened paste puts at the frames' indentation.
    return name[0].isupper() or (m.group(2) is not None and "." in body.split(":", 1)[0])


# --- JavaScript -------------------------------------------------------------------------------


def _javascript(lines: list[str]) -> list[tuple[int, Trace]]:
    out: list[tuple[int, Trace]] = []
    cur: _Open | None = None
    floor = 0  # the error-line search stops here: above it is the previous trace
    budget = MAX_FRAMES
    for i, line in enumerate(lines):
        if budget <= 0:
            break
        body = line.strip()
        if body.startswith("at "):
            frame = _js_frame(body[3:])
            if frame is not None:
                if cur is None:
                    cur = _Open(i, "javascript", error=_js_error(lines, i, floor))
                cur.frames.append(frame)
                budget -= 1
                continue
        if cur is None:
            continue
        if body.startswith("..."):
            continue  # "... 4 lines matching cause stack trace ...", "... 7 more"
        _close(out, cur)
        cur = None
        floor = i  # this line may be the next trace's error ("[cause]: TypeError: ...")
    _close(out, cur)
    return out


def _js_frame(rest: str) -> Frame | None:
    """``func (location)``, or a bare ``location``; None for anything else (prose starting with
    "at", a Java or .NET frame, a Rust ``at`` line)."""
    rest = rest.strip().removesuffix(" {")  # Node opens the error's own properties after it
    function: str | None = None
    if rest.endswith(")") and " (" in rest:
        at = rest.index(" (")
        function, loc = rest[:at], rest[at + 2 : -1]
        for keyword in ("async ", "new "):
            if function.startswith(keyword):
                function = function[len(keyword) :]
        alias = function.find(" [as ")
        if alias > 0 and function.endswith("]"):
            function = function[:alias]
        if not function or any(c.isspace() for c in function):
            return None
    else:
        loc = rest[6:] if rest.startswith("async ") else rest
    if function is not None:
        if loc.startswith("eval at "):
            return Frame("<eval>", function, None, False)
        if loc in _JS_NO_FILE or _JS_PROMISE_INDEX.fullmatch(loc):
            return Frame(f"<{loc.strip('<>')}>", function, None, False)
    split = _split_location(loc)
    if split is None:
        return None
    path, line, column = split
    low = path.lower()
    if function is None:
        # V8 prints a bare location as path:line:column, of a script. Rust backtraces have bare
        # "at" lines too, of .rs files and of the C runtime under them.
        if column is None or any(c.isspace() for c in path):
            return None
        script = low.split("?", 1)[0].rsplit(".", 1)[-1] in _JS_EXTENSIONS
        if not (script or low.startswith(_PSEUDO)):
            return None
    elif low.endswith(".rs") or not any(c in path for c in "/\\.:"):
        return None  # "at 10:30 (see log)"
    return _frame(path, function, line, "javascript")


def _js_error(lines: list[str], first: int, floor: int) -> str | None:
    for i in range(first - 1, max(floor, first - _LOOKBACK) - 1, -1):
        m = _JS_ERROR.fullmatch(lines[i].strip())
        if m:
            message = m.group(2)
            return _clip(f"{m.group(1)}: {message}" if message else m.group(1))
    return None


# --- Rust -------------------------------------------------------------------------------------


def _rust(lines: list[str]) -> list[tuple[int, Trace]]:
    out: list[tuple[int, Trace]] = []
    cur: _Open | None = None
    backtrace = False  # past "stack backtrace:"
    wants_message = False  # the new format prints the message on the line after the location
    idle = 0  # lines of the panic's header that were neither note nor backtrace
    after_at = False  # the last line was an "at" line: an unnumbered name is an inlined frame
    budget = MAX_FRAMES
    for i, line in enumerate(lines):
        if budget <= 0:
            break
        body = line.strip()
        m = _RUST_PANIC.fullmatch(body)
        if m:
            _close(out, cur)
            cur, wants_message = _rust_panic(i, m.group(2))
            budget -= len(cur.frames)
            backtrace, idle, after_at = False, 0, False
            continue
        if body.lower() == "stack backtrace:":
            if cur is None or backtrace:
                _close(out, cur)
                # anyhow and std::backtrace print "Error: ..." above a backtrace of their own.
                cur = _Open(i, "rust", error=_rust_error(lines, i))
            backtrace, wants_message, after_at = True, False, False
            continue
        if cur is None:
            continue
        if line == _BREAK:
            _close(out, cur)
            cur = None
            continue
        if not backtrace:
            if not body or body.startswith("note:"):
                continue
            if wants_message:
                cur.error, wants_message = _clip(body), False
                continue
            idle += 1  # a message of several lines, or what follows a panic without backtrace
            if idle > _LOOKBACK:
                _close(out, cur)
                cur = None
            continue
        frame = _RUST_FRAME.fullmatch(body)
        if frame:
            cur.frames.append(Frame("", _RUST_HASH.sub("", frame.group(2).strip()), None, False))
            budget -= 1
            after_at = False
            continue
        if body.startswith("at ") and cur.frames:
            loc = _split_location(body[3:].strip())
            if loc is not None:
                last = cur.frames[-1]
                located = _frame(loc[0], last.function, loc[1], "rust")
                if last.path:  # a second location for one frame: keep both
                    cur.frames.append(located)
                    budget -= 1
                else:
                    cur.frames[-1] = located
                after_at = True
                continue
        if after_at and "::" in body and not body.endswith(":"):
            # gimli prints a frame inlined into the one above as a name without a number.
            cur.frames.append(Frame("", _RUST_HASH.sub("", body), None, False))
            budget -= 1
            after_at = False
            continue
        _close(out, cur)  # "note: Some details are omitted...", a blank line, anything else
        cur, backtrace = None, False
    _close(out, cur)
    return out


def _rust_panic(start: int, rest: str) -> tuple[_Open, bool]:
    """A panic line's trace, with the panic's location as its first frame; and whether its
    message is still to come (the format since Rust 1.73: ``panicked at src/x.rs:12:5:`` and the
    message on the next line; before it: ``panicked at 'msg', src/x.rs:12:5``)."""
    trace = _Open(start, "rust")
    rest = rest.strip()
    wants_message = False
    if rest.startswith("'"):
        quote = rest.rfind("', ")
        if quote > 0:
            trace.error, loc = _clip(rest[1:quote]), rest[quote + 3 :]
        else:
            trace.error, loc = _clip(rest.strip("'")), ""
    else:
        loc = rest[:-1] if rest.endswith(":") else rest
        wants_message = True
    split = _split_location(loc.strip()) if loc else None
    if split is not None:
        trace.frames.append(_frame(split[0], None, split[1], "rust"))
    return trace, wants_message


def _rust_error(lines: list[str], at: int) -> str | None:
    for i in range(at - 1, max(-1, at - _LOOKBACK - 1), -1):
        body = lines[i].strip()
        if body.startswith("Error: "):
            return _clip(body[7:])
    return None


# --- Go ---------------------------------------------------------------------------------------


def _go(lines: list[str]) -> list[tuple[int, Trace]]:
    out: list[tuple[int, Trace]] = []
    cur: _Open | None = None
    panic: str | None = None  # the message, for the first goroutine printed after it
    panic_at = -1
    function: str | None = None  # read, its file line to come
    budget = MAX_FRAMES
    for i, line in enumerate(lines):
        if budget <= 0:
            break
        body = line.strip()
        if _GO_HEADER.fullmatch(body):
            _close(out, cur)
            cur, function = _Open(i, "go"), None
            if panic is not None and i - panic_at <= _LOOKBACK:
                cur.error = panic
            panic = None
            continue
        if body.startswith(("panic: ", "fatal error: ")):
            _close(out, cur)
            cur = None
            # "panic: x [recovered]" is followed by an indented "panic: x": keep the first.
            if panic is None or i - panic_at > _LOOKBACK:
                message = body.split(": ", 1)[1]
                panic, panic_at = _clip(message.removesuffix(" [recovered]")), i
            continue
        if cur is None:
            continue
        if function is not None:
            loc = _go_location(body)
            if loc is not None:
                cur.frames.append(_frame(loc[0], function, loc[1], "go"))
                budget -= 1
                function = None
                continue
            cur.frames.append(Frame("", function, None, False))  # a frame without its file
            budget -= 1
            function = None
        if body.startswith("created by "):
            function = _GO_CREATED_IN.sub("", body[11:].strip()) or None
            continue
        if body.startswith("..."):
            continue  # "...additional frames elided..."
        function = _go_function(body)
        if function is None:
            _close(out, cur)  # a blank line ends a goroutine
            cur = None
    if cur is not None and function is not None:
        cur.frames.append(Frame("", function, None, False))
    _close(out, cur)
    return out


def _go_function(body: str) -> str | None:
    """``pkg/path.(*T).Method(0xc000..., {0x1, 0x2})`` without its arguments; None if the line
    is not a call (Go's arguments hold no parentheses, so the last "(" opens them)."""
    if not body.endswith(")"):
        return None
    name = body[: body.rfind("(")]
    if not name or not (name[0].isalpha() or name[0] == "_"):
        return None
    if "." not in name and name != "panic":  # the builtin's frame: panic({0x4b2a60, 0xc00001})
        return None
    return None if any(c.isspace() for c in name) else name


def _go_location(body: str) -> tuple[str, int] | None:
    """``/path/file.go:123 +0x1d`` (and ``fp=0x.. sp=0x..`` after it under GOTRACEBACK=system)."""
    loc = body.split(" +0x", 1)[0]
    if " fp=" in loc:
        loc = loc.split(" fp=", 1)[0]
    split = _split_location(loc.rstrip())
    if split is None or split[2] is not None:
        return None
    return split[0], split[1]

