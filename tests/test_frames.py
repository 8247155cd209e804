"""Stack traces into frames (bot/matching/frames.py), on small hand-written traces of the four
formats: what each frame says, which frames are the project's, and that no input makes the
parser slow or raise."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bot.matching.evidence import normalise_path, path_suffix_match
from bot.matching.frames import MAX_FRAMES, Frame, Trace, parse_traces, project_frames


def _only(text: str) -> Trace:
    traces = parse_traces(text)
    assert len(traces) == 1, traces
    return traces[0]


def _places(trace: Trace) -> list[tuple[str, str | None, int | None, bool]]:
    return [(f.path, f.function, f.line, f.project) for f in trace.frames]


def _project(path: str, language: str) -> bool:
    """Whether one frame at ``path`` is the project's, read from a minimal trace."""
    if language == "python":
        text = f'Traceback (most recent call last):\n  File "{path}", line 3, in run\nOops: x\n'
    elif language == "javascript":
        text = f"Error: x\n    at run ({path}:3:7)\n"
    elif language == "rust":
        text = f"stack backtrace:\n   0: acme::run\n             at {path}:3:7\n"
    else:
        text = f"panic: x\n\ngoroutine 1 [running]:\nmain.run()\n\t{path}:3 +0x1d\n"
    (frame,) = _only(text).frames
    return frame.project


# --- Python -----------------------------------------------------------------------------------

PYTHON = """\
Traceback (most recent call last):
  File "/home/dev/acme/acme/server/handlers.py", line 42, in handle
    return self.users[key]
           ~~~~~~~~~~^^^^^
  File "/home/dev/acme/.venv/lib/python3.12/site-packages/httpx/_client.py", line 901, in send
    response = self._send_handling_auth(request)
  File "/usr/lib/python3.12/asyncio/base_events.py", line 653, in run_until_complete
    return future.result()
  File "<frozen importlib._bootstrap>", line 1204, in _gcd_import
KeyError: 'session'
"""


def test_python_traceback_gives_frames_in_printed_order_and_the_error() -> None:
    trace = _only(PYTHON)
    assert trace.language == "python"
    assert trace.error == "KeyError: 'session'"
    assert _places(trace) == [
        ("acme/server/handlers.py", "handle", 42, True),
        ("httpx/_client.py", "send", 901, False),
        ("asyncio/base_events.py", "run_until_complete", 653, False),
        ("<frozen importlib._bootstrap>", "_gcd_import", 1204, False),
    ]


CHAINED = """\
Traceback (most recent call last):
  File "/home/dev/acme/acme/store/cache.py", line 18, in get
    return self._items[key]
KeyError: 'k'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/home/dev/acme/acme/store/cache.py", line 21, in get
    raise CacheMiss(key)
acme.store.errors.CacheMiss: k

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/home/dev/acme/acme/cli.py", line 9, in main
    run()
  File "/home/dev/acme/acme/jobs.py", line 30, in run
    raise JobFailed("sync") from exc
acme.jobs.JobFailed: sync
"""


def test_python_chained_exceptions_are_one_trace_each() -> None:
    traces = parse_traces(CHAINED)
    assert [t.error for t in traces] == [
        "KeyError: 'k'",
        "acme.store.errors.CacheMiss: k",
        "acme.jobs.JobFailed: sync",
    ]
    assert [[f.line for f in t.frames] for t in traces] == [[18], [21], [9, 30]]


def test_python_trace_in_a_code_fence_within_prose() -> None:
    text = f"It crashes on start:\n\n```python\n{PYTHON}```\n\nThanks!\n"
    assert _only(text) == _only(PYTHON)


def test_python_trace_quoted_with_greater_than_signs() -> None:
    quoted = "".join(f"> {line}\n" for line in PYTHON.splitlines())
    nested = "".join(f"> > {line}\n" for line in PYTHON.splitlines())
    assert _only(quoted) == _only(PYTHON)
    assert _only(nested) == _only(PYTHON)


def test_python_windows_paths_single_and_doubled_backslashes() -> None:
    text = r"""Traceback (most recent call last):
  File "C:\Users\dev\acme\acme\server\handlers.py", line 42, in handle
  File "C:\\Users\\dev\\acme\\acme\\server\\routes.py", line 7, in route
  File "C:\Users\dev\acme\.venv\Lib\site-packages\requests\api.py", line 59, in request
  File "C:\Users\dev\AppData\Local\Programs\Python\Python312\Lib\json\decoder.py", line 3, in x
OSError: [WinError 10061] refused
"""
    assert _places(_only(text)) == [
        ("acme/server/handlers.py", "handle", 42, True),
        ("acme/server/routes.py", "route", 7, True),
        ("requests/api.py", "request", 59, False),
        ("json/decoder.py", "x", 3, False),
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/usr/lib/python3.11/json/decoder.py",
        "/home/dev/.pyenv/versions/3.12.1/lib/python3.12/asyncio/runners.py",
        "/usr/lib/python3/dist-packages/yaml/constructor.py",
        "/opt/conda/lib/python3.10/site-packages/numpy/core/fromnumeric.py",
        "/home/dev/acme/.venv/lib/python3.12/site-packages/httpx/_client.py",
        "/home/dev/acme/venv/lib64/acme_plugin/loader.py",
        "/home/dev/acme/.tox/py311/lib/acme_plugin/loader.py",
        "C:\\Python311\\Lib\\asyncio\\base_events.py",
        "C:\\Users\\dev\\miniconda3\\Lib\\functools.py",
        "<frozen importlib._bootstrap>",
        "<string>",
        "<stdin>",
    ],
)
def test_python_library_frames_are_not_the_project(path: str) -> None:
    assert not _project(path, "python")


@pytest.mark.parametrize(
    "path",
    [
        "/home/dev/acme/acme/server/handlers.py",
        "/app/acme/server/handlers.py",
        "acme/server/handlers.py",
        "./scripts/migrate.py",
        "/Users/dev/src/acme/acme/lib/config.py",
    ],
)
def test_python_repository_frames_are_the_project(path: str) -> None:
    assert _project(path, "python")


def test_python_syntax_error_location_has_no_function() -> None:
    text = """\
Traceback (most recent call last):
  File "/home/dev/acme/acme/cli.py", line 3, in <module>
    from acme import config
  File "/home/dev/acme/acme/config.py", line 12
    def load(:
             ^
SyntaxError: invalid syntax
"""
    trace = _only(text)
    assert _places(trace)[1] == ("acme/config.py", None, 12, True)
    assert trace.error == "SyntaxError: invalid syntax"


def test_python_repeated_line_note_does_not_end_the_trace() -> None:
    text = """\
Traceback (most recent call last):
  File "/home/dev/acme/acme/tree.py", line 5, in walk
    return walk(node.parent)
  [Previous line repeated 996 more times]
  File "/home/dev/acme/acme/tree.py", line 4, in walk
    if node.parent is None:
RecursionError: maximum recursion depth exceeded
"""
    trace = _only(text)
    assert [f.line for f in trace.frames] == [5, 4]
    assert trace.error == "RecursionError: maximum recursion depth exceeded"


def test_python_exception_group_margins() -> None:
    text = """\
  + Exception Group Traceback (most recent call last):
  |   File "/home/dev/acme/acme/fanout.py", line 14, in gather
  |     raise ExceptionGroup("jobs", errors)
  | ExceptionGroup: jobs (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "/home/dev/acme/acme/worker.py", line 8, in run
    |     raise ValueError(job)
    | ValueError: 7
    +------------------------------------
"""
    traces = parse_traces(text)
    assert [(t.error, [f.path for f in t.frames]) for t in traces] == [
        ("ExceptionGroup: jobs (1 sub-exception)", ["acme/fanout.py"]),
        ("ValueError: 7", ["acme/worker.py"]),
    ]


def test_python_frames_quoted_without_their_header() -> None:
    text = """\
The relevant part:
    File "/home/dev/acme/acme/server/handlers.py", line 42, in handle
      return self.users[key]
  KeyError: 'session'
"""
    trace = _only(text)
    assert _places(trace) == [("acme/server/handlers.py", "handle", 42, True)]
    assert trace.error == "KeyError: 'session'"


def test_python_trace_without_exception_line_ends_at_the_blank_line() -> None:
    text = """\
  File "/home/dev/acme/acme/server/handlers.py", line 42, in handle
    return self.users[key]

Environment: Linux
"""
    assert _only(text).error is None


def test_python_flattened_paste_keeps_every_frame() -> None:
    text = """\
Traceback (most recent call last):
File "/home/dev/acme/acme/cli.py", line 9, in main
run()
File "/home/dev/acme/acme/jobs.py", line 30, in run
raise JobFailed("sync")
acme.jobs.JobFailed: sync
"""
    trace = _only(text)
    assert [f.path for f in trace.frames] == ["acme/cli.py", "acme/jobs.py"]
    assert trace.error == "acme.jobs.JobFailed: sync"


def test_ipython_frame_format() -> None:
    text = """\
KeyError                                  Traceback (most recent call last)
Cell In[3], line 1
----> 1 report.build()

File ~/acme/acme/report.py:42, in Report.build(self)
     40 def build(self):
---> 42     return self.rows["total"]

KeyError: 'total'
"""
    (frame,) = _only(text).frames
    assert (frame.path, frame.function, frame.line, frame.project) == (
        "acme/report.py",
        "Report.build",
        42,
        True,
    )


# --- JavaScript -------------------------------------------------------------------------------

EXPRESS = "/home/dev/acme/node_modules/express/lib/router/layer.js"
NODE = f"""\
/home/dev/acme/src/users.js:12
    return user.name;
                ^

TypeError: Cannot read properties of undefined (reading 'name')
    at getName (/home/dev/acme/src/users.js:12:17)
    at async Promise.all (index 0)
    at new Session (file:///home/dev/acme/src/session.mjs:3:9)
    at Layer.handle [as handle_request] ({EXPRESS}:95:5)
    at Module._compile (node:internal/modules/cjs/loader:1256:14)
    at /home/dev/acme/src/index.js:5:1

Node.js v20.11.0
"""


def test_javascript_frames_error_and_name_decorations() -> None:
    trace = _only(NODE)
    assert trace.language == "javascript"
    assert trace.error == "TypeError: Cannot read properties of undefined (reading 'name')"
    assert _places(trace) == [
        ("src/users.js", "getName", 12, True),
        ("<index 0>", "Promise.all", None, False),
        ("src/session.mjs", "Session", 3, True),
        ("express/lib/router/layer.js", "Layer.handle", 95, False),
        ("node:internal/modules/cjs/loader", "Module._compile", 1256, False),
        ("src/index.js", None, 5, True),
    ]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("Error [ERR_MODULE_NOT_FOUND]: Cannot find package 'zod'",
         "Error [ERR_MODULE_NOT_FOUND]: Cannot find package 'zod'"),
        ("Uncaught TypeError: render is not a function", "TypeError: render is not a function"),
        ("  [cause]: RangeError: Invalid time value", "RangeError: Invalid time value"),
        ("Error", "Error"),
    ],
)
def test_javascript_error_line_forms(line: str, error: str) -> None:
    text = f"{line}\n    at render (/home/dev/acme/src/view.js:4:11)\n"
    assert _only(text).error == error


def test_javascript_cause_is_a_trace_of_its_own() -> None:
    text = """\
Error: sync failed
    at sync (/home/dev/acme/src/sync.js:20:11) {
  [cause]: TypeError: fetch failed
      at fetchAll (/home/dev/acme/src/net.js:8:3)
}
"""
    traces = parse_traces(text)
    assert [(t.error, t.frames[0].path) for t in traces] == [
        ("Error: sync failed", "src/sync.js"),
        ("TypeError: fetch failed", "src/net.js"),
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/home/dev/acme/node_modules/express/lib/router/index.js",
        "C:\\Users\\dev\\acme\\node_modules\\react-dom\\cjs\\react-dom.development.js",
        "/home/dev/acme/node_modules/.pnpm/zod@3.22.4/node_modules/zod/lib/types.js",
        "/home/dev/acme/.yarn/cache/lodash-npm-4.17.21.zip/node_modules/lodash/lodash.js",
        "node:internal/process/task_queues",
        "node:events",
        "internal/modules/cjs/loader.js",
        "webpack:///webpack/bootstrap",
        "ext:core/01_core.js",
    ],
)
def test_javascript_library_frames_are_not_the_project(path: str) -> None:
    assert not _project(path, "javascript")


@pytest.mark.parametrize(
    ("location", "path"),
    [
        ("/home/dev/acme/src/server.ts", "src/server.ts"),
        ("file:///home/dev/acme/src/server.mjs", "src/server.mjs"),
        ("file:///C:/Users/dev/acme/src/server.mjs", "src/server.mjs"),
        ("webpack:///./src/components/Cart.tsx", "src/components/cart.tsx"),
        ("webpack://acme-shop/./src/components/Cart.tsx", "src/components/cart.tsx"),
        ("http://localhost:3000/static/js/main.chunk.js?v=3", "static/js/main.chunk.js"),
        ("C:\\Users\\dev\\acme\\src\\server.js", "src/server.js"),
    ],
)
def test_javascript_repository_frames_and_their_paths(location: str, path: str) -> None:
    (frame,) = _only(f"Error: x\n    at run ({location}:3:7)\n").frames
    assert (frame.path, frame.project) == (path, True)


@pytest.mark.parametrize(
    "location", ["<anonymous>", "native", "index 2", "eval at run (/home/dev/acme/x.js:1:1)"]
)
def test_javascript_frames_without_a_file_are_not_the_project(location: str) -> None:
    (frame,) = _only(f"Error: x\n    at run ({location})\n").frames
    assert (frame.function, frame.line, frame.project) == ("run", None, False)


@pytest.mark.parametrize(
    "line",
    [
        "    at com.acme.shop.Cart.total(Cart.java:42)",  # Java
        "   at Acme.Shop.Cart.Total() in C:\\src\\Cart.cs:line 42",  # .NET
        "at the moment (see the log above) it fails",
        "at 10:30:15",
        "at least twice a day",
    ],
)
def test_lines_starting_with_at_that_are_no_javascript_frame(line: str) -> None:
    assert parse_traces(f"Error: x\n{line}\n") == []


# --- Rust -------------------------------------------------------------------------------------

RUSTC = "/rustc/90c541806f23a127002de5b4038be731ba1458ca"
CARGO = "/home/dev/.cargo/registry/src/index.crates.io-6f17d22bba15001f"
RUST = f"""\
thread 'main' panicked at src/config.rs:12:5:
called `Option::unwrap()` on a `None` value
stack backtrace:
   0: rust_begin_unwind
             at {RUSTC}/library/std/src/panicking.rs:645:5
   1: core::panicking::panic_fmt
   2: acme::config::load
             at ./src/config.rs:12:5
   3: tokio::runtime::park::CachedParkThread::block_on
             at {CARGO}/tokio-1.32.0/src/runtime/park.rs:282:5
   4: acme::main
             at ./src/main.rs:4:5
note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.
"""


def test_rust_panic_new_format_with_backtrace() -> None:
    trace = _only(RUST)
    assert trace.language == "rust"
    assert trace.error == "called `Option::unwrap()` on a `None` value"
    assert _places(trace) == [
        ("src/config.rs", None, 12, True),  # the panic's location
        ("std/src/panicking.rs", "rust_begin_unwind", 645, False),
        ("", "core::panicking::panic_fmt", None, False),  # no location: not known to be ours
        ("src/config.rs", "acme::config::load", 12, True),
        ("tokio-1.32.0/src/runtime/park.rs", "tokio::runtime::park::CachedParkThread::block_on",
         282, False),
        ("src/main.rs", "acme::main", 4, True),
    ]


def test_rust_panic_old_format_without_backtrace() -> None:
    text = (
        "thread 'worker-2' panicked at 'index out of bounds: the len is 3 but the index is 7',"
        " src/queue.rs:40:9\nnote: run with `RUST_BACKTRACE=1` environment variable\n"
    )
    trace = _only(text)
    assert trace.error == "index out of bounds: the len is 3 but the index is 7"
    assert _places(trace) == [("src/queue.rs", None, 40, True)]


def test_rust_panic_with_thread_id_and_message_quoting_commas() -> None:
    text = "thread 'main' (4242) panicked at 'bad value: 'a', 'b'', src/parse.rs:7:1\n"
    trace = _only(text)
    assert trace.error == "bad value: 'a', 'b'"
    assert trace.frames[0].path == "src/parse.rs"


def test_rust_full_backtrace_addresses_hashes_and_inlined_frames() -> None:
    text = f"""\
thread 'main' panicked at src/main.rs:9:18:
boom
stack backtrace:
   0:     0x55d5c1e5b0c3 - std::backtrace_rs::backtrace::libunwind::trace::h5a5b8284f2d0c266
                               at {RUSTC}/library/std/src/../../backtrace/src/libunwind.rs:104:5
  12:     0x55d5c1e4a2b7 - acme::parse::line::h0123456789abcdef
                               at /home/dev/acme/src/parse.rs:30:9
                           acme::main
                               at /home/dev/acme/src/main.rs:9:18
"""
    trace = _only(text)
    assert _places(trace)[1:] == [
        ("std/src/../../backtrace/src/libunwind.rs",
         "std::backtrace_rs::backtrace::libunwind::trace", 104, False),
        ("src/parse.rs", "acme::parse::line", 30, True),
        ("src/main.rs", "acme::main", 9, True),
    ]


def test_rust_anyhow_backtrace_takes_the_error_line_above() -> None:
    text = """\
Error: failed to read acme.toml

Caused by:
    No such file or directory (os error 2)

Stack backtrace:
   0: acme::config::read
             at ./src/config.rs:20:9
"""
    trace = _only(text)
    assert trace.error == "failed to read acme.toml"
    assert _places(trace) == [("src/config.rs", "acme::config::read", 20, True)]


@pytest.mark.parametrize(
    "path",
    [
        "/rustc/90c541806f23a127002de5b4038be731ba1458ca/library/core/src/option.rs",
        "/home/dev/.cargo/registry/src/index.crates.io-6f17d22bba15001f/serde-1.0.190/src/de.rs",
        "/usr/local/cargo/registry/src/index.crates.io-6f17d22bba15001f/hyper-1.0.0/src/a.rs",
        "/home/dev/.cargo/git/checkouts/tower-6a1e0f2c3b/7d2c/src/lib.rs",
        "/home/dev/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/lib/rustlib/src/rust/"
        "library/std/src/rt.rs",
        "/home/dev/acme/vendor/zstd/src/lib.rs",
    ],
)
def test_rust_library_frames_are_not_the_project(path: str) -> None:
    assert not _project(path, "rust")


@pytest.mark.parametrize("path", ["./src/config.rs", "/home/dev/acme/crates/core/src/lib.rs"])
def test_rust_repository_frames_are_the_project(path: str) -> None:
    assert _project(path, "rust")


def test_rust_location_lines_are_not_read_as_javascript() -> None:
    text = """\
stack backtrace:
   0: acme::run
             at ./src/run.rs:3:5
   1: __libc_start_main
             at /build/glibc-SzIz7B/glibc-2.31/csu/../csu/libc-start.c:308:16
"""
    assert [t.language for t in parse_traces(text)] == ["rust"]


# --- Go ---------------------------------------------------------------------------------------

GO = """\
panic: runtime error: invalid memory address or nil pointer dereference
[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x48f1a2]

goroutine 1 [running]:
github.com/acme/shop/server.(*Server).handle(0x0, {0x4c3f20, 0x5})
	/home/dev/acme/server/server.go:42 +0x22
panic({0x4b2a60?, 0xc000012345?})
	/usr/local/go/src/runtime/panic.go:914 +0x21f
github.com/lib/pq.(*conn).query(...)
	/go/pkg/mod/github.com/lib/pq@v1.10.9/conn.go:12 +0x1d
main.main()
	/home/dev/acme/main.go:12 +0x3a
created by main.start in goroutine 1
	/home/dev/acme/start.go:20 +0x3a
exit status 2
"""


def test_go_panic_frames_arguments_dropped_and_created_by() -> None:
    trace = _only(GO)
    assert trace.language == "go"
    assert trace.error == "runtime error: invalid memory address or nil pointer dereference"
    assert _places(trace) == [
        ("server/server.go", "github.com/acme/shop/server.(*Server).handle", 42, True),
        ("runtime/panic.go", "panic", 914, False),
        ("github.com/lib/pq@v1.10.9/conn.go", "github.com/lib/pq.(*conn).query", 12, False),
        ("acme/main.go", "main.main", 12, True),
        ("acme/start.go", "main.start", 20, True),
    ]


def test_go_recovered_panic_and_other_goroutines() -> None:
    text = """\
--- FAIL: TestCheckout (0.00s)
panic: cart is empty [recovered]
	panic: cart is empty

goroutine 7 [running]:
testing.tRunner.func1.2({0x5c2f00, 0x6b1e30})
	/usr/local/go/src/testing/testing.go:1545 +0x238
github.com/acme/shop/cart.(*Cart).Checkout(...)
	/home/dev/acme/cart/cart.go:88 +0x65

goroutine 1 [chan receive]:
testing.(*T).Run(0xc000007ba0, {0x5a3c3e?, 0x5b1d20?}, 0x5c7a10)
	/usr/local/go/src/testing/testing.go:1649 +0x3c8
"""
    traces = parse_traces(text)
    assert [t.error for t in traces] == ["cart is empty", None]
    assert [f.project for f in traces[0].frames] == [False, True]


def test_go_fatal_error() -> None:
    text = """\
fatal error: concurrent map writes

goroutine 12 gp=0xc000102380 m=4 mp=0xc000080008 [running]:
github.com/acme/shop/cache.(*Cache).Put(...)
	/home/dev/acme/cache/cache.go:31 +0x44 fp=0xc00004ff58 sp=0xc00004ff30 pc=0x4a2b64
"""
    trace = _only(text)
    assert trace.error == "concurrent map writes"
    assert _places(trace) == [
        ("cache/cache.go", "github.com/acme/shop/cache.(*Cache).Put", 31, True)
    ]


@pytest.mark.parametrize(
    "path",
    [
        "/usr/local/go/src/runtime/panic.go",
        "/usr/lib/go-1.21/src/net/http/server.go",
        "/usr/lib/golang/src/reflect/value.go",
        "C:/Program Files/Go/src/runtime/proc.go",
        "/go/pkg/mod/github.com/lib/pq@v1.10.9/conn.go",
        "/home/dev/go/pkg/mod/golang.org/x/sync@v0.5.0/errgroup/errgroup.go",
        "github.com/spf13/cobra@v1.8.0/command.go",  # a dependency under -trimpath
        "runtime/panic.go",  # the standard library under -trimpath
        "<autogenerated>",
        "/home/dev/acme/vendor/github.com/lib/pq/conn.go",
    ],
)
def test_go_library_frames_are_not_the_project(path: str) -> None:
    assert not _project(path, "go")


@pytest.mark.parametrize(
    "path",
    [
        "/home/dev/acme/server/server.go",
        "/go/src/app/main.go",  # GOPATH-style Docker build: "app" is no standard package
        "/home/dev/go/src/github.com/acme/shop/main.go",
        "github.com/acme/shop/server/server.go",  # the main module under -trimpath
    ],
)
def test_go_repository_frames_are_the_project(path: str) -> None:
    assert _project(path, "go")


# --- Several traces, project frames -------------------------------------------------------


def test_an_issue_with_two_traces_of_two_languages_in_text_order() -> None:
    text = f"The worker says:\n\n```\n{GO}```\n\nand then the CLI:\n\n```\n{PYTHON}```\n"
    assert [t.language for t in parse_traces(text)] == ["go", "python"]
    text = f"{NODE}\n\nAfter restarting:\n\n{NODE}"
    assert len(parse_traces(text)) == 2


def test_project_frames_innermost_first_and_deduplicated() -> None:
    traces = parse_traces(CHAINED) + parse_traces(RUST) + parse_traces(CHAINED)
    assert [(f.path, f.function, f.line) for f in project_frames(traces)] == [
        # Python prints the innermost frame last; traces keep their order (the cause first).
        ("acme/store/cache.py", "get", 18),
        ("acme/store/cache.py", "get", 21),
        ("acme/jobs.py", "run", 30),
        ("acme/cli.py", "main", 9),
        # The panic's location gives way to the backtrace frame at the same place.
        ("src/config.rs", "acme::config::load", 12),
        ("src/main.rs", "acme::main", 4),
    ]


def test_project_frames_keep_a_location_no_frame_names() -> None:
    text = "thread 'main' panicked at src/queue.rs:40:9:\nfull\n"
    assert project_frames(parse_traces(text)) == [Frame("src/queue.rs", None, 40, True)]


def test_project_paths_are_what_the_index_stores_for_fix_files() -> None:
    # The index keeps a fix's files through normalise_path (bot/matching/evidence.py).
    fix_files = [normalise_path(p) for p in ("acme/server/Handlers.py", "src/Session.mjs")]
    text = PYTHON.replace("handlers.py", "Handlers.py") + "\n" + NODE.replace("session", "Session")
    frames = project_frames(parse_traces(text))
    for fix in fix_files:
        assert any(path_suffix_match(f.path, fix) for f in frames), fix


# --- Robustness -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no trace here at all",
        "Traceback (most recent call last):\n",
        "Traceback (most recent call last):\nKeyError: 'x'\n",
        "goroutine 1 [running]:\n\n",
        "thread 'main' panicked at\n",
        "stack backtrace:\n   0: \n",
        '  File "", line 99999999999999999999, in f\n',
        "    at f (x.js:1:²)\n",
        "    at f (:1:1)\n",
    ],
)
def test_fragments_give_no_trace(text: str) -> None:
    assert parse_traces(text) == []


_PIECES = [
    "Traceback (most recent call last):", '  File "a/b.py", line 3, in f', "    x()", "E: m",
    "    at f (/a/b.js:1:2)", "    at ", "thread 'm' panicked at ", "'x', ", "src/a.rs:1:2",
    "stack backtrace:", "   0: a::b", "             at ./src/a.rs:1:1", "goroutine 1 [running]:",
    "main.f()", "\t/a/b.go:3 +0x1", "panic: x", "created by ", "```", "> ", "| ", ":", "(", ")",
    "\\", "\x1b[31m", "\t", " ", "\n", "\r\n", "é", "²", "\u3000",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=12)), max_size=40))
def test_garbage_never_raises(pieces: list[str]) -> None:
    traces = parse_traces("".join(pieces))
    assert sum(len(t.frames) for t in traces) <= MAX_FRAMES
    assert all(t.frames for t in traces)
    project_frames(traces)


def test_frames_are_capped() -> None:
    frame = '  File "/home/dev/acme/acme/loop.py", line {}, in step\n'
    text = "Traceback (most recent call last):\n" + "".join(frame.format(i) for i in range(5000))
    text += "\n" + NODE * 100
    traces = parse_traces(text)
    assert sum(len(t.frames) for t in traces) == MAX_FRAMES
    assert [f.line for f in traces[0].frames[:3]] == [0, 1, 2]


def test_an_over_long_line_is_no_frame() -> None:
    path = "/home/dev/acme/" + "a" * 3000 + ".py"
    text = f'Traceback (most recent call last):\n  File "{path}", line 1, in f\n'
    assert parse_traces(text) == []


# Bodies of 200 kB built to make a backtracking pattern try every split: long runs of what a
# pattern repeats, without what it needs after them. Each must be read in well under a second.
_ADVERSARIAL = {
    "file-lines": '  File "' + "a/" * 900 + '", line 1, in f\n',  # long paths to normalise
    "quotes": "> " * 100_000,
    "colons": ("at f (" + "a:1" * 600 + ")\n") * 110,
    "digits-colons": ("    at " + "1:" * 900 + "x\n") * 110,
    "rust-quotes": ("thread 'main' panicked at '" + "', " * 600 + "\n") * 110,
    "goroutine-digits": ("goroutine " + "1" * 1900 + "\n") * 105,
    "dotted-error": ("  File \"x.py\", line 1, in f\n" + "a." * 900 + "a b\n") * 110,
    "js-error-names": ("A." * 900 + "Error!\n    at f (/a/b.js:1:2)\n") * 110,
    "frames": ("    at f (/home/dev/acme/src/" + "d/" * 400 + "x.js:1:2)\n") * 240,
    "one-line": "at " + "(x:1:2 " * 30_000,
    "spaces": " " * 200_000,
    "fences": "```\n~~~~~~~~^^^^\n" * 13_000,
    "unclosed-file-quote": '  File "' + "a" * 1900 + "\n",
    "ipython-many-in": "File " + "x:1, in " * 240 + "\n",
    "short-at-lines": "at x\n",
    "backtrace-headers": "stack backtrace:\n",
    "deep-source-lines": '  File "x.py", line 1, in f\n' + "        x = 1\n" * 5000,
}


@pytest.mark.parametrize("name", sorted(_ADVERSARIAL))
def test_adversarial_bodies_are_read_fast(name: str) -> None:
    body = _ADVERSARIAL[name]
    body = (body * (200_000 // len(body) + 1))[:200_000]
    started = time.perf_counter()
    parse_traces(body)
    assert time.perf_counter() - started < 2.0
